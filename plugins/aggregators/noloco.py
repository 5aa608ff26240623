"""`noloco`: NoLoCo (Kolehmainen et al., "NoLoCo: No-all-reduce Low Communication Training
Method for Large Models", 2025, arXiv 2506.10911).

DiLoCo's rounds (plugins/aggregators/diloco.py: `period` (H) inner steps with the experiment's
optimizer, the round after hook step s with (s + 1) % H == 0) without the all-reduce: at each
outer step every worker averages with one peer. Worker i keeps its outer weights φ_i (θ_global
of DiLoCo, but its own) and an outer momentum m_i; with θ_i its model after the H inner steps
and G = {i, j} this round's pair (the paper's update, as the authors' code computes it):

    m_i ← α m_i − β (1/|G|) Σ_{k∈G} (φ_k − θ_k) − γ (φ_i − (1/|G|) Σ_{k∈G} φ_k)
    φ_i ← φ_i + m_i
    θ_i ← φ_i

α is `outer_momentum`, β `outer_lr`, γ `consensus_lr` (the authors' code uses β for both).
The pairs of round r come from a permutation of the ranks drawn from (seed, r): every worker
draws the same one, so the schedule is reproducible and needs no communication; consecutive
entries pair up (with an odd number of workers the last one is alone and its group is itself).
Each worker sends its peer [φ_i − θ_i, φ_i] in one point-to-point message (two models).

Under `failures` (failure_mode "continue"): a worker down at any step of a round contributes
nothing to its pair's means (a weight 0 travels with the message); the means are over the live
members, its own values when neither is live. Every worker, down or not, exchanges with its
peer and applies the update, so a down worker follows its peer; when it rejoins it takes φ_i
as its model and starts its inner optimizer afresh (diloco's rule).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from dsgd_cli.api import AggregatorOptions, flatten, option

from plugins.aggregators.diloco import DiLoCo, average_buffers, split_like

# The outer step is NoLoCo's own (below): the optimizer diloco builds over φ is never stepped.
_UNUSED_OUTER = {"name": "sgd", "lr": 1.0}


@dataclass
class NoLoCoOptions(AggregatorOptions):
    period: int = option(50, min=1, help="inner steps per round (H; the authors' configs: 50)")
    outer_lr: float = option(0.7, min=0.0, help="β: the step along the pair's mean "
                                                "pseudo-gradient")
    outer_momentum: float = option(0.5, min=0.0, max=1.0,
                                   help="α: the outer momentum (the authors' configs: 0.5)")
    consensus_lr: float | None = option(None, min=0.0,
                                        help="γ: the pull towards the pair's mean outer "
                                             "weights; default: outer_lr, as the authors' code")
    sync_buffers: bool = option(False, help="average buffers with the peer at each round; "
                                            "false keeps them local, as diloco")


def pairs(world_size: int, seed: int, round_: int) -> list[tuple[int, ...]]:
    """The groups of round `round_`: a permutation of the ranks drawn from (seed, round),
    consecutive entries paired; every worker computes the same."""
    order = list(range(world_size))
    random.Random(f"noloco:{seed}:{round_}").shuffle(order)
    return [tuple(order[k: k + 2]) for k in range(0, world_size, 2)]


def peer_of(rank: int, world_size: int, seed: int, round_: int) -> int | None:
    """This round's peer of `rank`, or None when it is alone (an odd number of workers)."""
    for group in pairs(world_size, seed, round_):
        if rank in group:
            others = [k for k in group if k != rank]
            return others[0] if others else None
    raise AssertionError(rank)


class NoLoCo(DiLoCo):
    Options = NoLoCoOptions
    supports_compression = False

    def setup(self, ctx):
        super().setup(ctx)
        self.momentum = [torch.zeros_like(g) for g in self.outer.globals]
        self.group = ctx.comm.new_group(range(ctx.world_size), backend="gloo") \
            if ctx.world_size > 1 else None

    def outer_optimizer_section(self) -> dict:
        return _UNUSED_OUTER

    def round(self, step: int) -> None:
        opts = self.options
        live = 0.0 if (self.under_failures and self.missed_round) else 1.0
        self.missed_round = False
        phis = self.outer.globals
        deltas = self.outer.pseudo_gradients()  # φ_i − θ_i
        own = flatten([*deltas, *phis])
        peer = peer_of(self.ctx.rank, self.ctx.world_size, self.ctx.seed, self.rounds)
        total, weight = own * live, live
        if peer is not None:
            theirs = torch.empty(own.numel() + 1, dtype=own.dtype)
            message = torch.cat([own.to("cpu"), torch.tensor([live], dtype=own.dtype)])
            comm = self.ctx.comm
            handles = [comm.irecv(theirs, peer, self.group), comm.isend(message, peer, self.group)]
            for handle in handles:
                handle.wait()
            peer_weight = float(theirs[-1])
            total = total + theirs[:-1].to(own.device) * peer_weight
            weight += peer_weight
        mean = total / weight if weight > 0 else own
        numel = own.numel() // 2
        mean_delta = split_like(mean[:numel], deltas)
        mean_phi = split_like(mean[numel:], phis)
        beta = opts.outer_lr
        gamma = beta if opts.consensus_lr is None else opts.consensus_lr
        with torch.no_grad():
            for m, phi, d, p in zip(self.momentum, phis, mean_delta, mean_phi):
                m.mul_(opts.outer_momentum).sub_(beta * d).sub_(gamma * (phi - p))
                phi.add_(m)
        self.outer.set_model()
        if opts.sync_buffers and peer is not None:
            self._average_buffers_with(peer)
        elif opts.sync_buffers and peer is None and self.ctx.world_size == 1:
            average_buffers(self.ctx)
        self.rounds += 1
        self.ctx.metrics.log("outer_rounds", self.rounds)
        self.ctx.metrics.log("noloco_peer", -1 if peer is None else peer)

    def _average_buffers_with(self, peer: int) -> None:
        buffers = self.ctx.buffers()
        if not buffers:
            return
        own = flatten([b.detach() for b in buffers]).to("cpu")
        theirs = torch.empty_like(own)
        comm = self.ctx.comm
        for handle in [comm.irecv(theirs, peer, self.group), comm.isend(own, peer, self.group)]:
            handle.wait()
        for buffer, value in zip(buffers, split_like((own + theirs) / 2, buffers)):
            buffer.copy_(value.to(buffer.device))
