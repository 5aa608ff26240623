"""`choco`: CHOCO-SGD (Koloskova, Stich, Jaggi, ICML 2019; non-convex analysis, Koloskova, Lin,
Stich, Jaggi, ICLR 2020), decentralized SGD with compressed messages.

Every worker i keeps its model x_i and a public copy x̂_i of it that its neighbours hold too
(all x̂ start at 0). Two orders of the same steps are published; `order` picks one.

`mix_first` (the default): the order of Algorithm 1 of the ICLR 2020 paper and of the authors'
code (epfml/ChocoSGD). Per step, on worker i, with the gradient taken at the mixed model:

    x_i ← x_i − η ∇F_i(x_i)                      the local optimizer step
    x_i ← x_i + γ Σ_j w_ij (x̂_j − x̂_i)            the consensus step with the estimates as they
                                                   were before this step's messages, γ = `gamma`
    q_i = Q(x_i − x̂_i)                           sent to every neighbour
    x̂_j ← x̂_j + q_j  for j = i and each neighbour j

The next gradient does not depend on q, so the messages travel while the next step computes:
`after_step` posts them and the next `after_step` waits for them, just before it mixes (the
emulated network time of a round hides behind a step's computation, as in `dpsgd`). With
Q = identity and γ = 1, x̂ = x after each exchange and the step is x ← Wx − η∇F(x): D-PSGD
(Lian et al., 2017), dsgd's `dpsgd` (from equal starting models, as in a `dsgd run`).

The paper's iteration lists the same steps from the mix on (mix, send, gradient); a dsgd step,
like the authors' code, starts at the gradient. With x̂ starting at 0 the only difference is
the paper's first message, Q(x⁰), sent before any gradient, which dsgd and the authors'
deep-learning code do not send (their convex code starts x̂ at the common initial model).

`step_first`: Algorithm 2 of the ICML 2019 paper as printed: the local step, then
q_i = Q(x_i − x̂_i), the update of the x̂_j, and the consensus step with the new estimates. q
depends on the step's gradient, so the round runs, blocking, at the end of the step. With
Q = identity and γ = 1 the step is x ← W(x − η∇F(x)).

Q must be contractive, E‖Q(x) − x‖² ≤ (1 − δ)‖x‖² (the compressor's `guarantee`), and W
symmetric and doubly stochastic. Only the difference between a model and its public copy is
compressed, and that difference shrinks as the workers converge, so the error of Q shrinks
with it; DCD-PSGD compresses the model's change and needs a small step size instead.

Memory: instead of a copy x̂_j per neighbour, worker i keeps x̂_i and s_i = Σ_j w_ij x̂_j (j
over i and its neighbours). Σ_j w_ij (x̂_j − x̂_i) = s_i − x̂_i because the row sums to 1, and
receiving q_j changes s_i by w_ij q_j. The sender adds to x̂_i exactly the q_i its neighbours
decode (the same random draw), so everyone's view of x̂_i agrees.

`gamma: auto` picks γ by running CHOCO's consensus alone on random vectors with the run's
graph, compressor and order (`tune_gamma`), as the authors tune it: at validation, so that the
run's configuration records it (`resolve_options`), or, for a Choco built with `gamma="auto"`
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

from plugins.aggregators.gossip.compressed import (CompressedGossip, PendingRound,
                                                   check_contractive, check_fixed_symmetric)
from plugins.aggregators.gossip.graph import MixingName, TopologyName
from plugins.aggregators.gossip.vector import ModelVector


Order = Literal["mix_first", "step_first"]


@dataclass
class ChocoOptions(AggregatorOptions):
    gamma: float | Literal["auto"] = option(
        "auto", help="consensus step size γ in (0, 1], or auto: tuned on random vectors")
    topology: TopologyName = option("ring", help="communication graph (undirected, fixed)")
    mixing: MixingName = option("uniform", help="mixing weights: uniform 1/(deg+1) or metropolis")
    order: Order = option(
        "mix_first",
        help="mix_first: mix with the old estimates, send, then the gradient at the mixed model "
             "(Koloskova, Lin, Stich, Jaggi, ICLR 2020, Algorithm 1; the authors' code); "
             "step_first: gradient step, send, mix with the new estimates (Koloskova, Stich, "
             "Jaggi, ICML 2019, Algorithm 2)")

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
        return dataclasses.replace(options, gamma=tune_gamma(ctx, w, numel, options.order))

    def setup(self, ctx):
        super().setup(ctx)
        self.public = torch.zeros_like(self.vector.read())  # x̂_i
        self.mixed = torch.zeros_like(self.public)          # s_i = Σ_j w_ij x̂_j
        self.in_flight: PendingRound | None = None          # mix_first: the last step's round
        if self.options.gamma == "auto":
            self.gamma = self._tuned_gamma()
        else:
            self.gamma = float(self.options.gamma)

    def _tuned_gamma(self) -> float:
        """`tune_gamma` on rank 0, broadcast: every worker must step with the same γ (the
        consensus step keeps the average only then), and the others need not repeat it."""
        ctx = self.ctx
        gamma = (tune_gamma(ctx, self.w, self.vector.numel, self.options.order)
                 if self.rank == 0 else 0.0)
        if ctx.world_size > 1:
            chosen = torch.tensor([gamma], dtype=torch.float64, device=ctx.comm.device)
            ctx.comm.broadcast(chosen, src=0)
            gamma = float(chosen[0])
        return gamma

    def after_step(self, step):
        if self.options.order == "mix_first":
            self._mix_then_send(step)
        else:
            self._send_then_mix(step)
        self.ctx.metrics.log("choco_gamma", self.gamma)

    def _mix_then_send(self, step):
        """After the gradient step: the consensus step with the estimates that include the
        previous step's messages and no later ones, then this step's q_i, posted. Its round
        completes in the next step's `after_step` (or `finish`, or a checkpoint)."""
        self._complete_round()
        x = self.vector.read()
        x.add_(self.mixed - self.public, alpha=self.gamma)  # γ Σ_j w_ij (x̂_j − x̂_i)
        self.vector.write(x)
        self.in_flight = self.exchange.start(x - self.public, step)

    def _send_then_mix(self, step):
        """After the gradient step: q_i, one blocking round, then the consensus step with the
        estimates this round updated."""
        x = self.vector.read()
        own, theirs = self.exchange.round(x - self.public, step)
        self._add_to_estimates(own, theirs)
        x.add_(self.mixed - self.public, alpha=self.gamma)
        self.vector.write(x)

    def _complete_round(self) -> None:
        """Wait for the round in flight, if any, and add its q's to x̂_i and s_i."""
        if self.in_flight is None:
            return
        pending, self.in_flight = self.in_flight, None
        self._add_to_estimates(pending.own, pending.wait())

    def _add_to_estimates(self, own, theirs) -> None:
        self.public += own  # exactly the q_i the neighbours add to their view of x̂_i
        self.add_round(self.mixed, own, theirs)

    def finish(self):
        self._complete_round()  # every message of the last step is received

    def state_dict(self) -> dict:
        """x̂_i and s_i with the last step's messages in: a resumed run mixes with the
        estimates the uninterrupted run would have (every worker checkpoints after the same
        step, so the round completes everywhere)."""
        self._complete_round()
        return super().state_dict()


# -- gamma: auto -------------------------------------------------------------------------------

GAMMA_GRID = [10 ** (-k / 4) for k in range(13)]  # 1 down to 0.001, four per decade
TUNING_STEPS = 100
TUNING_DIMENSION_CAP = 1 << 16  # the simulated vectors' length at most (δ, ω depend on d)


class _Discard:
    def log(self, name, value):
        pass


# Consensus errors below this are float32 rounding, not a difference between step sizes: they
# tie (and the larger γ wins). Without it, a machine whose BLAS rounds 3.6e-16 to 0.0 picked
# another γ than one that did not.
ROUNDING_FLOOR = 1e-10


def tune_gamma(ctx: WorkerContext, w: np.ndarray, numel: int, order: Order = "mix_first",
               grid: list[float] = GAMMA_GRID, steps: int = TUNING_STEPS) -> float:
    """The γ of `grid` whose CHOCO consensus alone (no gradients), in `order`, leaves n random
    vectors with the smallest ‖X − X̄‖² + ‖X − X̂‖² after `steps` steps (`consensus_error`,
    the quantity the authors' tuner minimises), with the run's mixing matrix `w` and
    compressor, on vectors of the model's length (at most TUNING_DIMENSION_CAP).

    All n workers are simulated here, each with its own compressor instance (its rank's
    random draws), from the run's seed: the result depends on nothing else. A γ whose
    consensus diverges is never chosen; ties go to the larger γ."""
    n = w.shape[0]
    d = max(1, min(numel, TUNING_DIMENSION_CAP))
    # The result depends on these only: validating specs that share them (a grid's points, a
    # spec read again) tunes once per process.
    key = (type(ctx.compressor), repr(ctx.compressor.options), w.tobytes(), n, d, ctx.seed,
           order, tuple(grid), steps)
    if key in _TUNED:
        return _TUNED[key]
    compressors = [_simulated_compressor(ctx, rank) for rank in range(n)]
    start = torch.randn(n, d, generator=torch.Generator().manual_seed(ctx.seed))
    mixing = torch.tensor(w, dtype=torch.float32)
    best, best_error = grid[0], math.inf
    for gamma in sorted(grid, reverse=True):
        error = max(consensus_error(compressors, mixing, start, gamma, steps, order),
                    ROUNDING_FLOOR)
        if error < best_error:
            best, best_error = gamma, error
    if len(_TUNED) >= 256:
        _TUNED.clear()
    _TUNED[key] = best
    return best


_TUNED: dict = {}  # tune_gamma's results in this process


def consensus_error(compressors: list[Compressor], mixing: torch.Tensor, start: torch.Tensor,
                    gamma: float, steps: int, order: Order = "mix_first") -> float:
    """(‖X − X̄‖² + ‖X − X̂‖²) / (the same at the start) after `steps` steps of CHOCO's
    consensus in `order` from the rows X₀ = `start`, X̂₀ = 0 (inf if it blew up): how far the
    models are from their average and from their public copies. The whole matrix W stands in
    for each worker's memory s_i."""
    x = start.clone()
    public = torch.zeros_like(x)
    initial = _disagreement(x, public)
    for step in range(steps):
        if order == "mix_first":
            x += gamma * (mixing @ public - public)
        for rank, compressor in enumerate(compressors):
            difference = x[rank] - public[rank]
            payload = compressor.compress(difference, "gamma-auto", step)
            public[rank] += compressor.decompress(payload, difference)
        if order == "step_first":
            x += gamma * (mixing @ public - public)
        if not torch.isfinite(x).all():
            return math.inf
    error = _disagreement(x, public) / max(initial, 1e-30)
    return error if math.isfinite(error) else math.inf


def _disagreement(x: torch.Tensor, public: torch.Tensor) -> float:
    """‖X − X̄‖² + ‖X − X̂‖², X̄ the rows' average."""
    return float((x - x.mean(0)).square().sum() + (x - public).square().sum())


def _simulated_compressor(ctx: WorkerContext, rank: int) -> Compressor:
    """A fresh instance of the run's compressor, set up as worker `rank`'s (its random
    draws), logging nothing."""
    compressor = ctx.compressor
    twin = type(compressor)(compressor.options)
    twin.plugin_name = compressor.plugin_name
    twin.setup(dataclasses.replace(ctx, rank=rank, metrics=_Discard()))
    return twin
