"""`dsgd advise`: which algorithm and how many workers reach a target soonest, predicted from
runs already recorded, in the manner of Hemingway (Pan, Venkataraman et al., "Hemingway:
Modeling Distributed Optimization Algorithms", 2017).

For each group of runs (an algorithm with its options) two models are fitted across the worker
counts n its runs were recorded at:

* the system model, seconds per step against n, with the features of Ernest (Venkataraman et
  al., NSDI 2016): t(n) = θ0 + θ1/n + θ2·log n + θ3·n, θ ≥ 0. A fixed cost, work that splits
  over the workers, tree-shaped communication, and costs that grow with every worker
  (all-to-one traffic, more processes than cores). Fitted from each run's recorded
  `step_seconds`;
* the convergence model, steps to the target against n:
  S(n) = β0 + β1/n + β2·log n, β ≥ 0. β0 + β1/n is the large-batch law of McCandlish et al.
  ("An Empirical Model of Large-Batch Training", 2018): S = S_min·(1 + B_noise/B) with the
  global batch B growing as n × the per-worker batch, so steps fall as 1/n while gradient
  noise dominates and level off beyond the critical batch. β2·log n lets steps grow again
  with n, as they do for decentralized algorithms whose models drift further apart on larger
  graphs. Fitted from each run's history of the target metric, where a run that never
  reached the target still counts: it says "more than the steps it ran" (a censored
  observation, below).

The time to target at n is then t(n)·S(n). Both fits are non-negative least squares on
relative errors (each run's row divided by its own value), so that a run of 10 ms steps and
one of 1 s steps weigh the same. A 90% interval comes from refitting on runs drawn with
replacement (a bootstrap over the group's runs); the fit error is each run's time to target
predicted from the group's other runs (leave one run out), against what it recorded.

Everything here is numpy and plain Python over plain SQL reads: no torch, no SQLAlchemy.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Iterable

import numpy as np

from dsgd_cli.errors import DsgdError
from dsgd_cli.results.analysis import Target
from dsgd_cli.results.query import flat_config, run_value
from dsgd_cli.results.reader import Results, RunRecord, higher_is_better

# Configuration keys that say how long or how a run was bookkept, not which algorithm it ran:
# the default grouping ignores them even where they differ (`workers` is the model's variable,
# `seed` makes replicates).
NOT_ALGORITHM = {"name", "workers", "seed", "epochs", "steps_per_epoch", "log_interval", "timeout",
                 "target_accuracy", "save_dir", "checkpoint_every", "nnodes", "checkpoint_dir",
                 "resume_step", "run_id", "aggregator.name", "compressor.name", "config_version"}
NOT_ALGORITHM_PREFIXES = ("budget.",)
DEFAULT_MAX_WORKERS = 64
BOOTSTRAP_SAMPLES = 200
INTERVAL = (5.0, 95.0)  # percentiles of the bootstrap: a 90% interval
MIN_COUNTS = 3          # worker counts a group needs before it is given a number


# -- non-negative least squares ------------------------------------------------------------------

def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The x ≥ 0 that minimises ‖a·x − b‖₂: the active-set method of Lawson and Hanson
    ("Solving Least Squares Problems", 1974, ch. 23), for the few columns of these models.

    `passive` holds the coordinates free to be positive; the others are pinned at 0. Each
    outer pass frees the pinned coordinate whose gradient most wants it to grow; the inner
    loop solves the unconstrained problem on the free ones and, where that solution would
    make some coordinate negative, moves only part of the way there (to where the first one
    reaches 0) and pins it again."""
    rows, cols = a.shape
    x = np.zeros(cols)
    passive = np.zeros(cols, dtype=bool)
    # Tolerance on the gradient, as scipy's nnls sets it: rounding in a·x makes tiny positive
    # gradients that would otherwise free a coordinate forever.
    tolerance = 10 * np.finfo(float).eps * max(rows, cols) * max(1.0, np.abs(a).sum(axis=0).max())
    gradient = a.T @ (b - a @ x)  # −½ of the gradient of ‖a·x − b‖²
    for _ in range(3 * cols + 10):
        candidates = np.where(~passive & (gradient > tolerance))[0]
        if candidates.size == 0:
            break  # Kuhn–Tucker conditions hold: optimal
        passive[candidates[np.argmax(gradient[candidates])]] = True
        while True:
            z = np.zeros(cols)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            # Step from x toward z only as far as keeps every coordinate ≥ 0.
            blocking = passive & (z <= 0)
            step = np.min(x[blocking] / (x[blocking] - z[blocking]))
            x = x + step * (z - x)
            passive &= x > tolerance
            x[~passive] = 0.0
            if not passive.any():
                break
        gradient = a.T @ (b - a @ x)
    return x


# -- the two models ------------------------------------------------------------------------------

SYSTEM_PARAMETERS = 4       # θ0..θ3 below
CONVERGENCE_PARAMETERS = 3  # β0..β2


def system_features(workers: Iterable[float]) -> np.ndarray:
    """Ernest's features of a cluster of n workers: 1, 1/n, log n, n."""
    n = np.asarray(list(workers), dtype=float)
    return np.column_stack([np.ones_like(n), 1.0 / n, np.log(n), n])


def convergence_features(workers: Iterable[float]) -> np.ndarray:
    """Features of steps to target: 1, 1/n, log n (module docstring)."""
    n = np.asarray(list(workers), dtype=float)
    return np.column_stack([np.ones_like(n), 1.0 / n, np.log(n)])


def fit_relative(features: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Non-negative coefficients θ minimising Σ ((features_i·θ − v_i) / v_i)²: least squares
    on relative errors, each row divided by its own value."""
    return nnls(features / values[:, None], np.ones(len(values)))


def fit_system(workers: list[int], seconds_per_step: list[float]) -> np.ndarray:
    """θ of t(n) = θ0 + θ1/n + θ2·log n + θ3·n from one observation per run."""
    return fit_relative(system_features(workers), np.asarray(seconds_per_step, dtype=float))


def fit_convergence(workers: list[int], steps: list[float], reached: list[bool]) -> np.ndarray:
    """β of S(n) = β0 + β1/n + β2·log n, where run i reached the target at `steps[i]` or, when
    it did not (`reached[i]` false), ran `steps[i]` steps without reaching it: S > steps[i].

    A censored run costs nothing while the model predicts more steps than it ran, and the
    squared relative shortfall when the model predicts fewer (a one-sided, squared-hinge
    loss). The objective, Σ_reached (p_i/s_i − 1)² + Σ_censored max(0, 1 − p_i/s_i)² over
    β ≥ 0, is convex and once differentiable. It is minimised by alternating: fit the
    reached runs plus the censored runs the current β violates (as if they had reached at
    their last step), see which censored runs the new β violates, and repeat. When the set
    stops changing, the gradient of the objective equals that of the least-squares problem
    just solved, whose optimality conditions then hold for the objective too: the global
    minimum. Should the sets cycle instead, the best β seen is kept."""
    x = convergence_features(workers)
    s = np.asarray(steps, dtype=float)
    reached_mask = np.asarray(reached, dtype=bool)
    rows, ones = x / s[:, None], np.ones(len(s))

    def objective(beta: np.ndarray) -> float:
        ratio = rows @ beta
        return float(np.sum((ratio[reached_mask] - 1) ** 2)
                     + np.sum(np.maximum(0.0, 1 - ratio[~reached_mask]) ** 2))

    active = reached_mask.copy()
    best, best_value = None, math.inf
    for _ in range(2 * len(s) + 2):
        beta = nnls(rows[active], ones[active])
        value = objective(beta)
        if value < best_value:
            best, best_value = beta, value
        violated = reached_mask | (rows @ beta < 1)
        if (violated == active).all():
            return beta
        active = violated
    return best


def predict(features: np.ndarray, coefficients: np.ndarray) -> np.ndarray:
    return features @ coefficients


# -- what a run contributes ----------------------------------------------------------------------

@dataclass(frozen=True)
class Observation:
    """What one run says to the models. `seconds_per_step`: its mean recorded step time (None:
    it recorded none). `steps`: the step at which it first reached the target or, when it did
    not (`reached` false), the last step it recorded the target metric at (None: never
    recorded it). `best`: the best value of the target metric it recorded."""

    run_id: int
    workers: int
    seconds_per_step: float | None
    steps: int | None
    reached: bool
    best: float | None

    @property
    def time_to_target(self) -> float | None:
        """The run's time in training steps until it reached the target: its mean seconds
        per step × its steps, what the models predict. Not the recorded clock time, which
        also holds evaluations, logging and, on shared cores, other processes' turns: those
        are no part of the models, and would make every fit look wrong by the same factor."""
        if not self.reached or self.seconds_per_step is None:
            return None
        return self.seconds_per_step * self.steps


def observe(store: Results, runs: list[RunRecord], target: Target) -> list[Observation]:
    """Each run's observation, read in plain SQL: its `step_seconds` and the target metric's
    curve (the mean over the ranks that recorded a step, as `compare --target` reads it)."""
    ids = [run.id for run in runs]
    curves = store.step_curves(ids, target.metric)
    if not curves:
        recorded = store.metric_names(ids)
        if target.metric in recorded:
            raise DsgdError(f"--target: metric {target.metric!r} is recorded once per run, not "
                            f"over steps: it has no steps to a target")
        known = f" (recorded: {', '.join(recorded)})" if recorded else ""
        raise DsgdError(f"--target: no selected run recorded metric {target.metric!r}{known}")
    times = store.step_curves(ids, "step_seconds")
    better = max if higher_is_better(target.metric) else min
    observations = []
    for run in runs:
        # A value recorded before the first step (step 0) says nothing of steps to target.
        curve = [point for point in curves.get(run.id, []) if point[0] >= 1]
        first = next((point for point in curve if target.reached_by(point[1])), None)
        steps = first[0] if first else (curve[-1][0] if curve else None)
        observations.append(Observation(
            run.id, run.workers, mean_step_seconds(times.get(run.id, [])), steps,
            first is not None,
            better(value for _, value, _ in curve) if curve else None))
    return observations


def mean_step_seconds(points: list[tuple[int, float, float | None]]) -> float | None:
    """A run's mean seconds per step from its `step_seconds` records: each is the mean over a
    log interval (mean over the ranks too), recorded at the interval's last step, so they are
    weighted by the interval's length in steps. The first interval is left out where three
    or more were recorded: it carries one-time costs (lazy initialisation, first touches of
    memory) that later steps do not pay."""
    weights, values, previous = [], [], 0
    for step, value, _ in points:
        weights.append(step - previous)
        values.append(value)
        previous = step
    if len(values) >= 3:
        weights, values = weights[1:], values[1:]
    if not values or sum(weights) <= 0:
        return None
    mean = float(np.dot(weights, values) / sum(weights))
    return mean if mean > 0 else None  # a zero step time has no relative error to fit


# -- one group: fit, predict, check --------------------------------------------------------------

@dataclass
class Prediction:
    workers: int
    seconds_per_step: float
    steps_to_target: float
    time_to_target: float
    time_low: float | None
    time_high: float | None
    extrapolated: bool
    warnings: list[str] = field(default_factory=list)  # why this number is less sure than it looks


@dataclass
class GroupAdvice:
    """A group's predictions at each worker count asked for, and its fit error; or, when
    its runs cannot support a number, `advice` on what to run next."""

    label: tuple
    predictions: list[Prediction] = field(default_factory=list)
    fit_error: float | None = None
    advice: str | None = None
    workers: list[int] = field(default_factory=list)  # the counts asked for


class Fit:
    """Both models fitted on a set of observations."""

    def __init__(self, observations: list[Observation]):
        timed = [o for o in observations if o.seconds_per_step is not None]
        curves = [o for o in observations if o.steps is not None]
        self.system = fit_system([o.workers for o in timed], [o.seconds_per_step for o in timed])
        self.convergence = fit_convergence([o.workers for o in curves], [o.steps for o in curves],
                                           [o.reached for o in curves])
        # The counts both models saw: a prediction outside them extrapolates.
        self.low = max(min(o.workers for o in timed), min(o.workers for o in curves))
        self.high = min(max(o.workers for o in timed), max(o.workers for o in curves))

    def seconds_per_step(self, workers: list[int]) -> np.ndarray:
        return predict(system_features(workers), self.system)

    def steps(self, workers: list[int]) -> np.ndarray:
        return predict(convergence_features(workers), self.convergence)

    def time(self, workers: list[int]) -> np.ndarray:
        return self.seconds_per_step(workers) * self.steps(workers)

    @staticmethod
    def possible(observations: list[Observation], counts: int = 2) -> bool:
        """Whether the models can be fitted at all: step times and metric histories at
        `counts` worker counts or more, and at least one run that reached the target."""
        timed = {o.workers for o in observations if o.seconds_per_step is not None}
        curves = {o.workers for o in observations if o.steps is not None}
        return (len(timed) >= counts and len(curves) >= counts
                and any(o.reached for o in observations))


def refusal(observations: list[Observation], target: Target) -> str | None:
    """What to run next when the group's runs cannot support a prediction, else None."""
    timed = sorted({o.workers for o in observations if o.seconds_per_step is not None})
    curves = sorted({o.workers for o in observations if o.steps is not None})
    counts = sorted(set(timed) & set(curves))
    if len(counts) < MIN_COUNTS:
        needed = next_counts(counts, MIN_COUNTS - len(counts))
        have = f"runs at n = {join(counts)} only" if counts else "no run with step times and a history of the metric"
        return f"{have}: run at n = {join(needed)}"
    reached = sorted({o.workers for o in observations if o.reached})
    if not reached:
        bests = [o.best for o in observations if o.best is not None]
        better = max if higher_is_better(target.metric) else min
        best = better(bests) if bests else None
        shown = f" (best {best:.4g})" if best is not None else ""
        return (f"no run reached {target.metric}={target.value:g}{shown}: run longer "
                f"(more epochs or a larger budget) or set a target the runs approach")
    if len(reached) < 2:
        others = [n for n in counts if n not in reached]
        return (f"only the runs at n = {join(reached)} reached {target.metric}={target.value:g}: "
                f"run those at n = {join(others)} longer")
    return None


def next_counts(recorded: list[int], how_many: int) -> list[int]:
    """The cheapest worker counts to add to `recorded`: the smallest powers of two from 2 that
    it lacks (a run costs about n times its time, so the small counts are the cheap ones:
    with runs at 8 only, 2 and 4 rather than 16 and 32)."""
    counts, n = [], 2
    while len(counts) < how_many:
        if n not in recorded:
            counts.append(n)
        n *= 2
    return counts


def join(numbers: list[int]) -> str:
    words = [str(n) for n in numbers]
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]


def advise_group(label: tuple, observations: list[Observation], workers: list[int],
                 target: Target, seed: int = 0) -> GroupAdvice:
    advice = refusal(observations, target)
    if advice is not None:
        return GroupAdvice(label, advice=advice, workers=workers)
    fit = Fit(observations)
    points = fit.time(workers)
    low, high = bootstrap_interval(observations, workers, seed)
    fit_error = leave_one_out_error(observations)
    group_warnings = fit_warnings(observations, fit_error)
    predictions = []
    for index, n in enumerate(workers):
        time = float(points[index])
        if not (math.isfinite(time) and time > 0):
            continue  # no coefficient survived: nothing to say at this n
        time_low = None if low is None else float(low[index])
        time_high = None if high is None else float(high[index])
        warnings = list(group_warnings)
        if time_low is None:
            warnings.append("no interval: too few resamples could be fitted")
        elif not (time_low < time * (1 - EDGE) and time * (1 + EDGE) < time_high):
            # The interval is the bootstrap's, never widened to hold the estimate: an estimate
            # on or outside its edge says the fit hangs on a few runs.
            warnings.append("estimate not inside its interval")
        predictions.append(Prediction(
            n, float(fit.seconds_per_step([n])[0]), float(fit.steps([n])[0]), time,
            time_low, time_high, not fit.low <= n <= fit.high, warnings))
    return GroupAdvice(label, predictions, fit_error)


MAX_FIT_ERROR = 0.25  # a leave-one-out error above this is flagged
EDGE = 1e-6  # an estimate within this relative distance of its interval's edge is on it


def fit_warnings(observations: list[Observation], fit_error: float | None) -> list[str]:
    """What makes every number of a group unsure: fewer runs than a model has parameters
    (its interval then comes from fits that interpolate their runs exactly), or a large
    leave-one-out error."""
    warnings = []
    timed = sum(o.seconds_per_step is not None for o in observations)
    curves = sum(o.steps is not None for o in observations)
    for name, runs, parameters in (("step-time", timed, SYSTEM_PARAMETERS),
                                   ("convergence", curves, CONVERGENCE_PARAMETERS)):
        if runs < parameters:
            warnings.append(f"{runs} runs for the {parameters}-parameter {name} model")
    if fit_error is not None and fit_error > MAX_FIT_ERROR:
        warnings.append(f"fit error {fit_error:.0%}")
    return warnings


def bootstrap_interval(observations: list[Observation], workers: list[int],
                       seed: int) -> tuple[np.ndarray | None, np.ndarray | None]:
    """A 90% interval of the time to target at each n: both models refitted on the group's
    runs drawn with replacement, BOOTSTRAP_SAMPLES times, and the 5th and 95th percentiles of
    their predictions. A draw that lacks what a fit needs (two worker counts, a run that
    reached the target) is skipped. With one run per count many draws lose a count, and the
    interval widens, as it should: a handful of runs do not pin the curves down. The draws
    come from a fixed seed, so the same runs give the same interval."""
    rng = np.random.default_rng(seed)
    samples = []
    # A draw is a multiset of runs, and few runs have few of them (3 runs: 10), so each
    # distinct one is fitted once; its predictions still count as often as it is drawn.
    fitted: dict[tuple[int, ...], np.ndarray | None] = {}
    for _ in range(BOOTSTRAP_SAMPLES):
        key = tuple(sorted(rng.integers(0, len(observations), len(observations)).tolist()))
        if key not in fitted:
            drawn = [observations[i] for i in key]
            times = Fit(drawn).time(workers) if Fit.possible(drawn) else None
            usable = times is not None and np.all(np.isfinite(times)) and np.all(times > 0)
            fitted[key] = times if usable else None
        if fitted[key] is not None:
            samples.append(fitted[key])
    if len(samples) < BOOTSTRAP_SAMPLES // 4:
        return None, None
    low, high = np.percentile(np.array(samples), INTERVAL, axis=0)
    return low, high


def leave_one_out_errors(observations: list[Observation]) -> dict[int, float]:
    """By run id, the relative error |predicted − recorded| / recorded of the time to target
    of each run that reached it (`Observation.time_to_target`), predicted by the models
    fitted on the group's other runs only. A run whose removal leaves too little to fit is
    left out."""
    errors = {}
    for held in observations:
        actual = held.time_to_target
        if not actual:
            continue
        rest = [o for o in observations if o is not held]
        if not Fit.possible(rest):
            continue
        predicted = float(Fit(rest).time([held.workers])[0])
        if math.isfinite(predicted):
            errors[held.run_id] = abs(predicted - actual) / actual
    return errors


def leave_one_out_error(observations: list[Observation]) -> float | None:
    """The group's fit error: the mean of `leave_one_out_errors` (None when there are none)."""
    errors = leave_one_out_errors(observations)
    return float(np.mean(list(errors.values()))) if errors else None


# -- groups, worker counts, ranking --------------------------------------------------------------

def default_keys(runs: list[RunRecord]) -> list[str]:
    """The keys that tell the runs' algorithms apart: `aggregator` and `compressor`, the
    aggregator's `topology` where a run has one, and every other configuration key whose value
    differs between runs of the same aggregator and compressor (an option only sgp has is
    no news next to allreduce), except those of run length and bookkeeping (NOT_ALGORITHM)."""
    keys = ["aggregator", "compressor"]
    families: dict[tuple[str, str], list[RunRecord]] = {}
    for run in runs:
        families.setdefault((run.aggregator, run.compressor), []).append(run)
    candidates: dict[str, None] = {}  # in order of first appearance
    for run in runs:
        candidates.update(dict.fromkeys(flat_config(run)))

    def differs(key: str) -> bool:
        return any(len({comparable(flat_config(run).get(key)) for run in family}) > 1
                   for family in families.values())

    differing = [key for key in candidates
                 if key not in NOT_ALGORITHM and not key.startswith(NOT_ALGORITHM_PREFIXES)
                 and (key == "aggregator.topology" or differs(key))]
    order = {"aggregator": 0, "compressor": 1}
    differing.sort(key=lambda key: (order.get(key.split(".")[0], 2), key))
    return keys + differing


def comparable(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def label_value(value: Any) -> Any:
    """A group key's value as shown: tags joined, lists and mappings as JSON."""
    if isinstance(value, set):
        return ",".join(sorted(value))
    if isinstance(value, (list, dict)):
        return json.dumps(value, sort_keys=True)
    return value


def group_runs(runs: list[RunRecord], keys: list[str]) -> dict[tuple, list[RunRecord]]:
    groups: dict[tuple, list[RunRecord]] = {}
    for run in runs:
        label = tuple(label_value(run_value(run, key)) for key in keys)
        groups.setdefault(label, []).append(run)
    return groups


def default_workers(recorded: Iterable[int]) -> list[int]:
    """The recorded worker counts and, beyond the largest, its doublings up to 64."""
    counts = sorted(set(recorded))
    n = counts[-1] if counts else 1
    while n * 2 <= DEFAULT_MAX_WORKERS:
        n *= 2
        counts.append(n)
    return counts


def parse_workers(text: str) -> list[int]:
    """`2,4,8,16` → [2, 4, 8, 16] (exit 2 for anything but positive integers)."""
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        counts = []
    if not counts or any(n < 1 for n in counts):
        raise DsgdError(f"--workers {text!r}: expected positive worker counts separated by "
                        f"commas, e.g. 2,4,8,16")
    return sorted(set(counts))


ROW_COLUMNS = ["workers", "seconds_per_step", "steps_to_target", "time_to_target", "time_low",
               "time_high", "extrapolated", "rank", "best", "fit_error", "clock", "warning",
               "advice"]


def advice_rows(groups: list[GroupAdvice], keys: list[str]) -> list[dict[str, Any]]:
    """One row per (group, n) with a prediction, ordered by n and, within each n, fastest
    first: `rank` among the groups at that n, `best` "overall" for the soonest of all and "at
    n" for the soonest at its n, each only where it is clearly ahead (its interval below the
    runner-up's), and `warning` for what makes the number unsure; then, for each group that
    gets no number, one row per n with only `workers` and `advice`."""
    rows = []
    for group in groups:
        for p in group.predictions:
            rows.append({**dict(zip(keys, group.label)), "workers": p.workers,
                         "seconds_per_step": p.seconds_per_step,
                         "steps_to_target": p.steps_to_target, "time_to_target": p.time_to_target,
                         "time_low": p.time_low, "time_high": p.time_high,
                         "extrapolated": p.extrapolated, "rank": None, "best": None,
                         "fit_error": group.fit_error, "warning": list(p.warnings), "advice": None})
    rows.sort(key=lambda row: (row["workers"], row["time_to_target"]))
    for n in sorted({row["workers"] for row in rows}):
        at_n = [row for row in rows if row["workers"] == n]
        for rank, row in enumerate(at_n, start=1):
            row["rank"] = rank
        _claim_best(at_n, "at n", keys)
    _claim_best(sorted(rows, key=lambda row: row["time_to_target"]), "overall", keys)
    for row in rows:
        row["warning"] = "; ".join(row["warning"]) or None
    for group in groups:
        if group.advice is not None:
            rows.extend({**dict(zip(keys, group.label)), **{c: None for c in ROW_COLUMNS},
                         "workers": n, "advice": group.advice} for n in group.workers)
    return rows


def _claim_best(ranked: list[dict[str, Any]], claim: str, keys: list[str]) -> None:
    """Mark the first of `ranked` (fastest first) best with `claim` where nothing is close
    behind: alone, or with its whole interval below the runner-up's. Otherwise say which
    runner-up it cannot be told apart from."""
    if not ranked:
        return
    first = ranked[0]
    if len(ranked) == 1:
        first["best"] = claim
        return
    second = ranked[1]
    apart = (first["time_high"] is not None and second["time_low"] is not None
             and first["time_high"] < second["time_low"])
    if apart:
        first["best"] = claim
    else:
        who = ", ".join(f"{second[k]}" for k in keys) or "the runner-up"
        first["warning"].append(f"no clear best {claim}: intervals overlap {who} at n = {second['workers']}")


def advise(store: Results, runs: list[RunRecord], target: Target, keys: list[str],
           workers: list[int] | None) -> list[dict[str, Any]]:
    """The advice table for `runs`, grouped by `keys`, at `workers` (default_workers when
    None)."""
    observations = {o.run_id: o for o in observe(store, runs, target)}
    groups = group_runs(runs, keys)
    counts = workers or default_workers(run.workers for run in runs)
    advice = [advise_group(label, [observations[run.id] for run in members], counts, target)
              for label, members in groups.items()]
    rows = advice_rows(advice, keys)
    # Which clock a group's seconds are on: modeled (an emulated cluster) or measured.
    clocks = {label: ",".join(sorted({run.clock for run in members}))
              for label, members in groups.items()}
    failing = {label for label, members in groups.items()
               if any(run.config.get("failures") for run in members)}
    for row in rows:
        label = tuple(row[key] for key in keys)
        row["clock"] = clocks[label]
        if label in failing and row["time_to_target"] is not None:
            row["warning"] = "; ".join(filter(None, [row["warning"], FAILURES_WARNING]))
    return rows


# The models know steps and their times, not failures (docs/failures.md): a group with runs
# under `failures` is told so on every number.
FAILURES_WARNING = ("runs under failures: not modeled (restarts, rolled-back and down steps); "
                    "see their goodput")
