"""`choco`: CHOCO-SGD (Koloskova, Stich, Jaggi, ICML 2019; non-convex analysis, Koloskova, Lin,
Stich, Jaggi, ICLR 2020), decentralized SGD with compressed messages.

Every worker i keeps its model x_i and a public copy x̂_i of it that its neighbours hold too
(all x̂ start at 0). Per step, on worker i:

    x_i ← x_i − η ∇F_i(x_i)                      the local optimizer step
    q_i = Q(x_i − x̂_i)                           sent to every neighbour
    x̂_j ← x̂_j + q_j  for j = i and each neighbour j
    x_i ← x_i + γ Σ_j w_ij (x̂_j − x̂_i)            the consensus step, γ = `gamma`

Q must be contractive, E‖Q(x) − x‖² ≤ (1 − δ)‖x‖² (the compressor's `guarantee`), and W
symmetric and doubly stochastic. Only the difference between a model and its public copy is
compressed, and that difference shrinks as the workers converge, so the error of Q shrinks
with it; DCD-PSGD compresses the model's change and needs a small step size instead.

Memory: instead of a copy x̂_j per neighbour, worker i keeps x̂_i and s_i = Σ_j w_ij x̂_j (j
over i and its neighbours). Σ_j w_ij (x̂_j − x̂_i) = s_i − x̂_i because the row sums to 1, and
receiving q_j changes s_i by w_ij q_j. The sender adds to x̂_i exactly the q_i its neighbours
decode (the same random draw), so everyone's view of x̂_i agrees.

With Q = identity and γ = 1, x̂_i = x_i after the local step and the consensus step gives
x ← W(x − η∇F(x)): exact gossip in CHOCO's order (dsgd's `dpsgd` mixes first).

`gamma: auto` picks γ by running CHOCO's consensus alone on random vectors with the run's
graph and compressor (`tune_gamma`), as the authors tune it: at validation, so that the run's
configuration records it (`resolve_options`), or, for a Choco built with `gamma="auto"`
outside `dsgd run`, on rank 0 in `setup`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from dsgd_cli.api import AggregatorOptions, Compressor, WorkerContext, option

from plugins.aggregators.gossip.compressed import (CompressedGossip, check_contractive,
                                                   check_fixed_symmetric)
from plugins.aggregators.gossip.graph import MixingName, TopologyName
from plugins.aggregators.gossip.vector import ModelVector


@dataclass
class ChocoOptions(AggregatorOptions):
    gamma: float | Literal["auto"] = option(
        "auto", help="consensus step size γ in (0, 1], or auto: tuned on random vectors")
    topology: TopologyName = option("ring", help="communication graph (undirected, fixed)")
    mixing: MixingName = option("uniform", help="mixing weights: uniform 1/(deg+1) or metropolis")

    def __post_init__(self):
        if self.gamma != "auto" and not 0 < self.gamma <= 1:
            raise ValueError(f"gamma: expected a consensus step size in (0, 1] or 'auto', "
                             f"got {self.gamma!r}")
        if self.error_feedback:
            raise ValueError("error_feedback: choco compresses x_i − x̂_i, which already "
                             "carries what earlier messages left out; leave it false")


class Choco(CompressedGossip):
    Options = ChocoOptions
    name = "choco"

    @classmethod
    def check_compressor(cls, options, compressor):
        check_contractive(compressor, cls.name)

    @classmethod
    def resolve_options(cls, options, compressor, task, world_size, seed):
        """`gamma: auto` becomes the γ `tune_gamma` picks, so the run's configuration records
        it: the same computation as rank 0's in `setup` (the run's seed and graph, the
        model's length), done once, before launching."""
        if options.gamma != "auto":
            return options
        w = check_fixed_symmetric(cls.make_topology(options, world_size, seed), options.mixing,
                                  cls.name)
        with torch.random.fork_rng():  # the caller's random state stays as it was
            torch.manual_seed(seed)
            model = task.build_model()
        ctx = WorkerContext(rank=0, world_size=world_size, device=torch.device("cpu"),
                            model=model, optimizer=None, comm=None, metrics=_Discard(),
                            seed=seed, compressor=compressor, config={})
        numel = ModelVector(ctx, options.sync_buffers).numel
        return dataclasses.replace(options, gamma=tune_gamma(ctx, w, numel))

    def setup(self, ctx):
        super().setup(ctx)
        self.public = torch.zeros_like(self.vector.read())  # x̂_i
        self.mixed = torch.zeros_like(self.public)          # s_i = Σ_j w_ij x̂_j
        if self.options.gamma == "auto":
            self.gamma = self._tuned_gamma()
        else:
            self.gamma = float(self.options.gamma)

    def _tuned_gamma(self) -> float:
        """`tune_gamma` on rank 0, broadcast: every worker must step with the same γ (the
        consensus step keeps the average only then), and the others need not repeat it."""
        ctx = self.ctx
        gamma = tune_gamma(ctx, self.w, self.vector.numel) if self.rank == 0 else 0.0
        if ctx.world_size > 1:
            chosen = torch.tensor([gamma], dtype=torch.float64, device=ctx.comm.device)
            ctx.comm.broadcast(chosen, src=0)
            gamma = float(chosen[0])
        return gamma

    def after_step(self, step):
        x = self.vector.read()  # after the local optimizer step
        own, theirs = self.exchange.round(x - self.public, step)
        self.public += own  # exactly the q_i the neighbours add to their view of x̂_i
        self.add_round(self.mixed, own, theirs)
        x.add_(self.mixed - self.public, alpha=self.gamma)  # γ Σ_j w_ij (x̂_j − x̂_i)
        self.vector.write(x)
        self.ctx.metrics.log("choco_gamma", self.gamma)


# -- gamma: auto -------------------------------------------------------------------------------

GAMMA_GRID = [10 ** (-k / 4) for k in range(13)]  # 1 down to 0.001, four per decade
TUNING_STEPS = 100
TUNING_DIMENSION_CAP = 1 << 16  # the simulated vectors' length at most (δ, ω depend on d)


class _Discard:
    def log(self, name, value):
        pass


def tune_gamma(ctx: WorkerContext, w: np.ndarray, numel: int,
               grid: list[float] = GAMMA_GRID, steps: int = TUNING_STEPS) -> float:
    """The γ of `grid` for which CHOCO's consensus alone (no gradients) brings n random
    vectors closest to their average within `steps` steps, with the run's mixing matrix `w`
    and compressor, on vectors of the model's length (at most TUNING_DIMENSION_CAP).

    All n workers are simulated here, each with its own compressor instance (its rank's
    random draws), from the run's seed: the result depends on nothing else. A γ whose
    consensus diverges is never chosen; ties go to the larger γ."""
    n = w.shape[0]
    d = max(1, min(numel, TUNING_DIMENSION_CAP))
    # The result depends on these only: validating specs that share them (a grid's points, a
    # spec read again) tunes once per process.
    key = (type(ctx.compressor), repr(ctx.compressor.options), w.tobytes(), n, d, ctx.seed,
           tuple(grid), steps)
    if key in _TUNED:
        return _TUNED[key]
    compressors = [_simulated_compressor(ctx, rank) for rank in range(n)]
    start = torch.randn(n, d, generator=torch.Generator().manual_seed(ctx.seed))
    mixing = torch.tensor(w, dtype=torch.float32)
    best, best_error = grid[0], math.inf
    for gamma in sorted(grid, reverse=True):
        error = consensus_error(compressors, mixing, start, gamma, steps)
        if error < best_error:
            best, best_error = gamma, error
    if len(_TUNED) >= 256:
        _TUNED.clear()
    _TUNED[key] = best
    return best


_TUNED: dict = {}  # tune_gamma's results in this process


def consensus_error(compressors: list[Compressor], mixing: torch.Tensor, start: torch.Tensor,
                    gamma: float, steps: int) -> float:
    """‖X − X̄‖² / ‖X₀ − X̄₀‖² after `steps` of CHOCO's consensus from the rows X₀ = `start`
    (inf if it blew up). The whole matrix W stands in for each worker's memory s_i."""
    x = start.clone()
    public = torch.zeros_like(x)
    initial = float((x - x.mean(0)).square().sum())
    for step in range(steps):
        for rank, compressor in enumerate(compressors):
            difference = x[rank] - public[rank]
            payload = compressor.compress(difference, "gamma-auto", step)
            public[rank] += compressor.decompress(payload, difference)
        x += gamma * (mixing @ public - public)
        if not torch.isfinite(x).all():
            return math.inf
    error = float((x - x.mean(0)).square().sum()) / max(initial, 1e-30)
    return error if math.isfinite(error) else math.inf


def _simulated_compressor(ctx: WorkerContext, rank: int) -> Compressor:
    """A fresh instance of the run's compressor, set up as worker `rank`'s (its random
    draws), logging nothing."""
    compressor = ctx.compressor
    twin = type(compressor)(compressor.options)
    twin.plugin_name = compressor.plugin_name
    twin.setup(dataclasses.replace(ctx, rank=rank, metrics=_Discard()))
    return twin
