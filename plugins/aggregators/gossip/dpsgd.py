"""`dpsgd`: decentralized parallel SGD (Lian et al., NeurIPS 2017).

    x_i <- Σ_j W_ij x_j - η g_i(x_i)

W is the doubly stochastic mixing matrix of the topology at this step (`mixing_matrix`). The
gradient and the neighbours' models are both taken at the same x (the models at the start of
the step), so the exchange runs during forward and backward: every worker posts its receives
and sends without blocking in `before_forward`, and waits for them in `after_backward`, where it
mixes; the optimizer step then applies the gradient to the mixed model. Non-blocking sends and
receives posted all at once cannot deadlock, whatever the order of peers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsgd_cli.api import Aggregator, AggregatorOptions, option
from dsgd_cli.topology import Topology, mixing_matrix

from plugins.aggregators.gossip import graph
from plugins.aggregators.gossip.graph import MixingName, TopologyName
from plugins.aggregators.gossip.vector import ModelVector, to_wire, weighted_sum


@dataclass
class DPSGDOptions(AggregatorOptions):
    topology: TopologyName = option("ring", help="communication graph (undirected variant)")
    mixing: MixingName = option("uniform", help="mixing weights: uniform 1/(deg+1) or metropolis")
    peers_per_step: int = option(1, min=1, help="peers per step (time_varying_exponential and "
                                                "the SGP reference's graphs)")


class DPSGD(Aggregator):
    Options = DPSGDOptions
    models_identical = False
    uses_numba_kernels = True  # its mix: vector.weighted_sum

    @classmethod
    def make_topology(cls, options: DPSGDOptions, world_size: int, seed: int = 0) -> Topology:
        return graph.build(options.topology, world_size, peers_per_step=options.peers_per_step,
                           seed=seed, undirected=True)

    @classmethod
    def check_world(cls, options, world_size, seed=0):
        graph.check_doubly_stochastic(cls.make_topology(options, world_size, seed), options.mixing)

    def setup(self, ctx):
        super().setup(ctx)
        self.rank, n = ctx.rank, ctx.world_size
        self.topology = self.make_topology(self.options, n, ctx.seed)
        self.vector = ModelVector(ctx, self.options.sync_buffers)
        self.group = ctx.comm.new_group(range(n), backend="gloo") if n > 1 else None
        self.weights = [mixing_matrix(self.topology, step, self.options.mixing)[self.rank]
                        for step in range(self.topology.period)]
        self.inbox: dict[int, torch.Tensor] = {}
        self.sent: torch.Tensor | None = None
        self.handles = []

    def before_forward(self, step):
        if self.group is None:
            return
        comm, rank = self.ctx.comm, self.rank
        self.sent = self.vector.read()
        wire = to_wire(self.sent)
        self.handles = []
        for peer in self.topology.in_peers(rank, step):
            buffer = self.inbox.setdefault(peer, torch.empty_like(wire))
            self.handles.append(comm.irecv(buffer, peer, self.group))
        self.handles += [comm.isend(wire, peer, self.group)
                         for peer in self.topology.out_peers(rank, step)]

    def after_backward(self, step):
        if self.group is None:
            return
        for handle in self.handles:
            handle.wait()
        weights = self.weights[step % self.topology.period]
        peers = self.topology.in_peers(self.rank, step)
        mixed = weighted_sum([self.sent] + [self.inbox[p].to(self.sent.device) for p in peers],
                             [float(weights[self.rank])] + [float(weights[p]) for p in peers])
        # Forward may have changed the buffers since they were sent (batch-norm statistics):
        # keep that change on top of the mix. For parameters the difference is exactly zero.
        mixed.add_(self.vector.read() - self.sent)
        self.vector.write(mixed)
        self.sent = None

