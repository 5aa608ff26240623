"""`dcd`: DCD-PSGD (Tang, Gan, Zhang, Zhang, Liu, NeurIPS 2018), decentralized SGD that sends
the compressed change of each model; the baseline CHOCO-SGD improves on.

Every worker knows its neighbours' models exactly (replicas). Per step, on worker i:

    x_i^{t+½} = Σ_j w_ij x_j^t − η ∇F_i(x_i^t)    the D-PSGD step (gradient at x_i^t)
    q_i = C(x_i^{t+½} − x_i^t)                     sent to every neighbour
    x_i^{t+1} = x_i^t + q_i,   x_j^{t+1} = x_j^t + q_j on every neighbour's replica

Everyone applies the same q_j to x_j, so replicas stay exact copies. With C = identity it is
D-PSGD, `dpsgd` (the same order: mix the models of the step's start, subtract the gradient
taken there). The compression error is not corrected later, so the models themselves carry
it; Tang et al. need an unbiased C of small variance and, in practice, small step sizes.

Memory: worker i keeps s_i = Σ_j w_ij x_j^t (j over i and its neighbours) instead of one
replica per neighbour; receiving q_j changes it by w_ij q_j. The models start equal in a
`dsgd run` (the run's seed); `setup` still exchanges them once, uncompressed, so that s_i is
exact whatever they are (a resumed run takes s_i from its checkpoint instead).

The local optimizer runs on x_i^t; its change Δ (plain SGD: −η∇F_i(x_i^t)) stands for the
gradient term: x_i^{t+½} = s_i + Δ.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsgd_cli.api import AggregatorOptions, option

from plugins.aggregators.gossip.compressed import CompressedGossip, check_declared
from plugins.aggregators.gossip.graph import MixingName, TopologyName


@dataclass
class DCDOptions(AggregatorOptions):
    topology: TopologyName = option("ring", help="communication graph (undirected, fixed)")
    mixing: MixingName = option("uniform", help="mixing weights: uniform 1/(deg+1) or metropolis")

    def __post_init__(self):
        if self.error_feedback:
            raise ValueError("error_feedback: dcd applies the compressed change of each model "
                             "as it is (DCD-PSGD); leave it false")


class DCD(CompressedGossip):
    Options = DCDOptions
    name = "dcd"

    @classmethod
    def check_compressor(cls, options, compressor):
        check_declared(compressor, cls.name)

    def setup(self, ctx):
        super().setup(ctx)
        # s_i = Σ_j w_ij x_j. A resumed run restores it from the checkpoint (load_state_dict
        # runs after setup): exchanging the models again would send and count them twice.
        self.mixed = None if ctx.run.resuming else self._exchange_models(self.vector.read())
        self.start: torch.Tensor | None = None

    def _exchange_models(self, x: torch.Tensor) -> torch.Tensor:
        """Σ_j w_ij x_j, from one uncompressed exchange of the models with the neighbours."""
        comm, exchange = self.ctx.comm, self.exchange
        mixed = x * float(self.w[self.rank, self.rank])
        if exchange.group is None:
            return mixed
        wire = x.cpu()
        buffers = {peer: torch.empty_like(wire) for peer in exchange.neighbours}
        handles = [comm.irecv(buffers[peer], peer, exchange.group) for peer in buffers]
        handles += [comm.isend(wire, peer, exchange.group) for peer in exchange.neighbours]
        for handle in handles:
            handle.wait()
        for peer, model in buffers.items():
            mixed.add_(model.to(x.device), alpha=float(self.w[self.rank, peer]))
        return mixed

    def before_forward(self, step):
        self.start = self.vector.read()  # x_i^t, where the gradient is taken

    def after_step(self, step):
        start = self.start
        change = self.mixed + (self.vector.read() - start) - start  # x^{t+½} − x^t
        own, theirs = self.exchange.round(change, step)
        self.add_round(self.mixed, own, theirs)  # the replicas x_j^{t+1} = x_j^t + q_j
        self.vector.write(start + own)
        self.start = None
