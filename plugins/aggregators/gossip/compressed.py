"""What `choco` and `dcd` share: a fixed symmetric mixing matrix, checks of the compressor, and
one round of compressed messages with the neighbours.

Both algorithms send each neighbour the payload of one compressed vector per step and keep a
running weighted sum of what everyone sent, s_i = Σ_j w_ij y_j (y_j: the public copy x̂_j in
CHOCO-SGD, the exact replica x_j in DCD-PSGD), instead of a copy per neighbour: a received
q_j changes y_j by q_j, so s_i changes by w_ij q_j. That needs the same weights w_ij at every
step, hence a fixed graph.
"""

from __future__ import annotations

import numpy as np
import torch

from dsgd_cli.api import Aggregator, Compressor, Payload, WorkerContext, bucket_layout
from dsgd_cli.topology import Topology, mixing_matrix

from plugins.aggregators.gossip import graph
from plugins.aggregators.gossip.vector import ModelVector, to_wire


def check_fixed_symmetric(topology: Topology, scheme: str, name: str) -> np.ndarray:
    """The mixing matrix W, after checking what `name` relies on: one graph for every step,
    undirected, with symmetric doubly stochastic weights and consensus. Raises ValueError."""
    n = topology.world_size
    adjacency = graph.union_adjacency(topology)
    if (adjacency != adjacency.T).any():
        raise ValueError(f"topology {topology.name!r} is directed; {name} needs an undirected "
                         f"graph with symmetric mixing weights (W = Wᵀ)")
    if topology.period != 1:
        raise ValueError(f"topology {topology.name!r} changes every step; {name} keeps "
                         f"s_i = Σ_j w_ij x_j over fixed weights, so it needs a fixed graph")
    graph.check_doubly_stochastic(topology, scheme)
    w = mixing_matrix(topology, 0, scheme)
    if not np.allclose(w, w.T):
        raise ValueError(f"mixing {scheme!r} on topology {topology.name!r} with {n} workers is "
                         f"not symmetric; {name} needs W = Wᵀ")
    return w


# How to turn a compressor that is only unbiased into a contractive one, by plugin name.
_CONTRACTIVE_HINTS = {"qsgd": "set rescale: true (Q/(1 + ω), contractive with δ = 1/(1 + ω))",
                      "randomk": "set unbiased: false (biased random-k, δ = k/d)"}
CONTRACTIVE_BUILT_INS = "none, topk, randomk with unbiased: false, qsgd with rescale: true, " \
                        "ef_sign, onebit, fp16 or bf16"


def check_contractive(compressor: Compressor, name: str) -> None:
    """Refuse a compressor that does not declare E‖Q(x) − x‖² ≤ (1 − δ)‖x‖²."""
    plugin = getattr(compressor, "plugin_name", "") or type(compressor).__name__
    guarantee = compressor.guarantee(1000)
    if guarantee is None:
        if plugin == "sign":
            raise ValueError("compressor 'sign' sends sign(x) without a scale, so ‖Q(x) − x‖ "
                             f"is not bounded by ‖x‖ and {name} would not converge; use ef_sign, "
                             "the scaled sign (‖x‖₁/d)·sign(x)")
        raise ValueError(f"compressor {plugin!r} declares no bound on ‖Q(x) − x‖ "
                         f"(Compressor.guarantee); {name} needs a contractive one: "
                         f"{CONTRACTIVE_BUILT_INS}")
    if not guarantee.contractive:
        hint = _CONTRACTIVE_HINTS.get(plugin, f"use a contractive one: {CONTRACTIVE_BUILT_INS}")
        raise ValueError(f"compressor {plugin!r} is unbiased, not contractive "
                         f"(E‖Q(x) − x‖² ≤ (1 − δ)‖x‖²), which {name} needs: {hint}")


def check_declared(compressor: Compressor, name: str) -> None:
    """Refuse a compressor that declares no bound at all (unbiased or contractive)."""
    if compressor.guarantee(1000) is None:
        plugin = getattr(compressor, "plugin_name", "") or type(compressor).__name__
        raise ValueError(f"compressor {plugin!r} declares no bound on ‖Q(x) − x‖ "
                         f"(Compressor.guarantee), which {name} needs")


class CompressedExchange:
    """One worker's side of a round of compressed messages: compress a vector, send its
    payload to every neighbour, decode the neighbours' payloads.

    Payloads travel with `Comm.isend_tensors` on a gloo group, one message per neighbour
    holding exactly the payload's tensors. Compression runs on float32 (the kernels' type;
    models are float32); `none` sends the vector in its own dtype. A received payload is
    decoded with this worker's own payload's `context`, which must not depend on the data
    (random-k's indices: drawn from a seed all workers share).

    The vector is compressed as one bucket of one segment (`Compressor.compress_bucket`), the
    path `allreduce` takes: the model is one tensor here, as CHOCO-SGD and DCD-PSGD define the
    compression (one QSGD norm per bucket of the vector, one ef_sign scale for all of it)."""

    KEY = "model"  # the compressor's name for the vector (it seeds random draws)

    def __init__(self, ctx: WorkerContext, topology: Topology, group):
        self.ctx, self.topology, self.group = ctx, topology, group
        self.compressor = ctx.compressor
        self.rank = ctx.rank
        self.neighbours = sorted(set(topology.in_peers(self.rank, 0))
                                 | set(topology.out_peers(self.rank, 0)))

    def round(self, vector: torch.Tensor, step: int) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """(q_i, {j: q_j}): the decoded payload this worker sent, exactly what its neighbours
        decode from it, and the decoded payload of each neighbour j."""
        pending = self.start(vector, step)
        return pending.own, pending.wait()

    def start(self, vector: torch.Tensor, step: int) -> "PendingRound":
        """Compress `vector` and post the round's sends and receives without waiting for
        them: the round goes on while the caller computes (its emulated network time too)."""
        compressor, comm = self.compressor, self.ctx.comm
        dtype = vector.dtype
        compressed_dtype = dtype if compressor.identity else torch.float32
        source = vector.to(compressed_dtype).reshape(-1)
        layout = bucket_layout([self.KEY], [source])
        payload = compressor.compress_bucket(source, layout, step)
        own = compressor.decompress_bucket(payload, layout).view(vector.shape).to(dtype)
        if self.group is None or not self.neighbours:
            return PendingRound(own, {}, [], lambda tensors: tensors)
        wire = [to_wire(t) for t in payload.tensors]
        uniform = compressor.uniform_payload
        receives = {peer: comm.irecv_tensors(wire, peer, self.group, uniform=uniform)
                    for peer in self.neighbours}
        sends = [comm.isend_tensors(wire, peer, self.group, uniform=uniform)
                 for peer in self.neighbours]

        def decode(tensors: list[torch.Tensor]) -> torch.Tensor:
            tensors = [t.to(vector.device) for t in tensors]
            theirs = compressor.decompress_bucket(Payload(tensors, payload.context), layout)
            return theirs.view(vector.shape).to(dtype)

        return PendingRound(own, receives, sends, decode)


class PendingRound:
    """A round of `CompressedExchange` in flight: this worker's decoded q_i at once, the
    neighbours' q_j from `wait()`."""

    def __init__(self, own: torch.Tensor, receives: dict, sends: list, decode):
        self.own = own
        self._receives, self._sends, self._decode = receives, sends, decode

    def wait(self) -> dict[int, torch.Tensor]:
        """{j: q_j} for each neighbour j, once every message of the round has arrived and
        every send has completed."""
        theirs = {peer: self._decode(handle.wait()) for peer, handle in self._receives.items()}
        for handle in self._sends:
            handle.wait()
        return theirs


class CompressedGossip(Aggregator):
    """Base of `choco` and `dcd`: options `topology` and `mixing`, checked at validation to
    give a fixed symmetric doubly stochastic W; `setup` builds W's row, the model vector and
    the exchange. Subclasses implement the step."""

    models_identical = False
    supports_compression = True
    name = ""  # in error messages

    @classmethod
    def make_topology(cls, options, world_size: int, seed: int = 0) -> Topology:
        return graph.build(options.topology, world_size, seed=seed, undirected=True)

    @classmethod
    def check_world(cls, options, world_size, seed=0):
        check_fixed_symmetric(cls.make_topology(options, world_size, seed), options.mixing,
                              cls.name)

    def setup(self, ctx):
        super().setup(ctx)
        self.rank, n = ctx.rank, ctx.world_size
        topology = self.make_topology(self.options, n, ctx.seed)
        self.w = check_fixed_symmetric(topology, self.options.mixing, self.name)
        self.vector = ModelVector(ctx, self.options.sync_buffers)
        group = ctx.comm.new_group(range(n), backend="gloo") if n > 1 else None
        self.exchange = CompressedExchange(ctx, topology, group)

    def add_round(self, memory: torch.Tensor, own: torch.Tensor,
                  theirs: dict[int, torch.Tensor]) -> None:
        """s_i += Σ_j w_ij q_j over this worker (its own q_i) and its neighbours."""
        memory.add_(own, alpha=float(self.w[self.rank, self.rank]))
        for peer, q in theirs.items():
            memory.add_(q, alpha=float(self.w[self.rank, peer]))
            self.received(peer, q)

    def received(self, peer: int, q: torch.Tensor) -> None:
        """Called with each neighbour's decoded q_j, in the order they are added (tests keep
        copies of the neighbours' vectors with it)."""
