"""Answers from recorded runs' final values: one row per run, groups of runs summarised as
mean, std and confidence interval, and ratios against a baseline. When a run reached a target, worked out from its
metric history, is `dsgd_cli.results.history`."""

from __future__ import annotations

import json
import math
import re
import statistics
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from dsgd_cli.errors import DsgdError
from dsgd_cli.results.query import flat_config, names, run_value
from dsgd_cli.results.reader import Results, RunRecord, higher_is_better

TARGET_COLUMNS = ("time_to_target", "steps_to_target", "bytes_to_target")
# Baseline columns: (name, metric, how the run's value is set against the baseline's)
BASELINE_COLUMNS = (
    ("speedup", "samples_per_second", lambda run, base: run / base),
    ("wall_ratio", "wall_seconds", lambda run, base: run / base),
    ("bytes_ratio", "total_bytes_sent", lambda run, base: run / base),
    ("accuracy_diff", "test_accuracy", lambda run, base: run - base),
)


# -- targets ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Target:
    metric: str
    value: float

    def reached_by(self, value: float) -> bool:
        return value >= self.value if higher_is_better(self.metric) else value <= self.value


def parse_target(text: str) -> Target:
    match = re.fullmatch(r"\s*([A-Za-z_]\w*)\s*=\s*(\S+)\s*", text)
    try:
        value = float(match.group(2)) if match else math.nan
    except ValueError:
        value = math.nan
    if not match or not math.isfinite(value):
        raise DsgdError(f"--target {text!r}: expected METRIC=NUMBER, e.g. test_accuracy=0.9")
    return Target(match.group(1), value)


@dataclass(frozen=True)
class Reached:
    """When a run first reached a target: seconds since its workers started training, the
    step, and the bytes all workers had sent in their first `step` steps."""

    seconds: float
    step: int | None
    bytes: float | None


# -- rows: one per run or one per group -----------------------------------------------------------

def run_rows(runs: list[RunRecord], finals: dict[int, dict[str, float]], metrics: list[str],
             reached: dict[int, Reached] | None) -> list[dict[str, Any]]:
    """One row per run: its columns, the final value of each of `metrics` (from
    `Results.finals`) and, with `reached`, when it reached a target."""
    rows = []
    for run in runs:
        aggregator = run.aggregator if run.compressor == "none" else f"{run.aggregator}+{run.compressor}"
        row = {"id": run.id, "experiment": run.experiment, "aggregator": aggregator,
               "optimizer": run.optimizer, "task": run.task, "workers": run.workers,
               "clock": run.clock, "timing": run.timing, "status": run.status}
        row.update({name: finals.get(run.id, {}).get(name) for name in metrics})
        if reached is not None:
            when = reached.get(run.id)
            row.update(time_to_target=when and when.seconds, steps_to_target=when and when.step,
                       bytes_to_target=when and when.bytes)
        rows.append(row)
    return rows


# The metrics a comparison shows of every run, before any asked for (`compare --metric`).
DEFAULT_METRICS = ["test_accuracy", "test_loss", "train_loss", "wall_seconds",
                   "samples_per_second", "total_bytes_sent"]


def metric_columns(extra: list[str] | None) -> list[str]:
    """The default metrics, then those of `extra` not among them."""
    return DEFAULT_METRICS + [m for m in extra or [] if m not in DEFAULT_METRICS]


def compare_rows(store: Results, runs: list[RunRecord],
                 extra_metrics: list[str] | None = None) -> list[dict[str, Any]]:
    """The plain table of `dsgd compare`, which `dsgd run` prints when its runs end: one row
    per run with the default metrics and `extra_metrics`."""
    return run_rows(runs, store.finals([run.id for run in runs]), metric_columns(extra_metrics),
                    None)


# -- which runs are alike -------------------------------------------------------------------------

# Configuration keys that say how a run was named or bookkept, not what it measured.
BOOKKEEPING = {"name", "config_version", "log_interval", "timeout", "target_accuracy", "save_dir",
               "checkpoint_every", "checkpoint_dir", "resume_step", "run_id", "nnodes"}
# What makes runs replicates of one setting: only the seed differs between them.
REPLICATE_KEYS = {"seed"}


def poolable(key: str) -> bool:
    """Whether runs may differ in `key` and still be replicates of one setting."""
    return key in REPLICATE_KEYS or key in BOOKKEEPING


def algorithm_key(key: str) -> bool:
    """Whether `key` is part of the algorithm a baseline is compared with (`aggregator.period`,
    `compressor.name`)."""
    return key.split(".")[0] in ("aggregator", "compressor")


def setting(run: RunRecord, ignored: Callable[[str], bool]) -> dict[str, str]:
    """The run's configuration by dotted key, each value as comparable text, without the keys
    `ignored` says."""
    return {key: json.dumps(value, sort_keys=True, default=str)
            for key, value in flat_config(run).items() if not ignored(key)}


def differences(mine: dict[str, str], theirs: dict[str, str]) -> list[str]:
    """The keys in which two settings differ (a key only one has differs too)."""
    return [key for key in dict.fromkeys([*mine, *theirs]) if mine.get(key) != theirs.get(key)]


def split_keys(runs: list[RunRecord], keys: list[str]) -> list[str]:
    """The configuration keys, beyond `keys`, in which runs that `keys` put in one group differ
    other than by seed or bookkeeping: a group must hold replicates, so these split it. Where a
    plugin differs (`aggregator.name`), its options count only where they differ between runs
    of the same plugin."""
    split = _differing_in_groups(runs, keys)
    plugins = [key for key in split if key.endswith(".name")]
    if not plugins:
        return split
    options = _differing_in_groups(runs, keys + plugins)
    return [key for key in split if key in plugins or key in options]


def _differing_in_groups(runs: list[RunRecord], keys: list[str]) -> list[str]:
    """The keys, other than `keys` and poolable ones, in which runs with the same values of
    `keys` differ, in order of first appearance."""
    def ignored(key: str) -> bool:
        return poolable(key) or key in keys

    groups: dict[tuple, list[dict[str, str]]] = {}
    for run in runs:
        label = tuple(_label(run_value(run, key)) for key in keys)
        groups.setdefault(label, []).append(setting(run, ignored))
    differing: dict[str, None] = {}
    for settings in groups.values():
        for other in settings[1:]:
            differing.update(dict.fromkeys(differences(settings[0], other)))
    return list(differing)


def group_rows(runs: list[RunRecord], rows: list[dict[str, Any]], keys: list[str],
               values: list[str]) -> tuple[list[dict[str, Any]], list[list[RunRecord]]]:
    """One row per distinct combination of `keys`, in order of first appearance: the keys, the
    number of runs, and for each of `values` the mean (`name`), the sample standard deviation
    (`name_std`), the 95% confidence interval of the mean (`name_ci_low`, `name_ci_high`) and
    the number of runs behind them (`name_n`), over the runs that have it. With one run there
    is no spread and no interval (None). Also each group's runs, in the order of the rows."""
    groups: dict[tuple, list[tuple[RunRecord, dict]]] = {}
    for run, row in zip(runs, rows):
        label = tuple(_label(run_value(run, key)) for key in keys)
        groups.setdefault(label, []).append((run, row))
    result = []
    for label, pairs in groups.items():
        members = [row for _, row in pairs]
        group = dict(zip(keys, label))
        group["runs"] = len(members)
        for name in values:
            present = [row[name] for row in members if row.get(name) is not None]
            group[name] = statistics.fmean(present) if present else None
            group[f"{name}_std"] = statistics.stdev(present) if len(present) > 1 else None
            group[f"{name}_n"] = len(present)
            group[f"{name}_ci_low"], group[f"{name}_ci_high"] = mean_interval(present)
        if "time_to_target" in values:
            reached = sum(row.get("time_to_target") is not None for row in members)
            group["reached"] = f"{reached}/{len(members)}"
        result.append(group)
    return result, [[run for run, _ in pairs] for pairs in groups.values()]


def mean_interval(values: list[float], level: float = 0.95) -> tuple[float | None, float | None]:
    """The Student-t confidence interval of the mean of `values` (independent runs, such as
    seeds): mean ± t(level, n − 1) · s / √n. None, None for fewer than two values, where the
    sample says nothing about its spread."""
    n = len(values)
    if n < 2:
        return None, None
    from scipy.stats import t  # scipy comes with scikit-learn; loaded only for groups

    half = float(t.ppf(0.5 + level / 2, n - 1)) * statistics.stdev(values) / math.sqrt(n)
    mean = statistics.fmean(values)
    return mean - half, mean + half


def _label(value: Any) -> Any:
    """A group key's value as a label: tags joined, lists and mappings as JSON."""
    if isinstance(value, set):
        return ",".join(sorted(value))
    if isinstance(value, (list, dict)):
        return json.dumps(value, sort_keys=True)
    return value


# -- baselines -------------------------------------------------------------------------------

def baseline_runs(runs: Iterable[RunRecord], spec: str) -> list[RunRecord]:
    """The runs `--baseline` names: a run id, or an experiment (all its runs, or all points of
    a grid of that base name)."""
    chosen = [run for run in runs if names(run, spec)]
    if not chosen:
        raise DsgdError(f"--baseline {spec!r}: no recorded run has this id or experiment name")
    return chosen


def _not_matched(key: str) -> bool:
    """Keys a run and its baseline may differ in: the algorithm compared, seeds, bookkeeping."""
    return poolable(key) or algorithm_key(key)


def alike_baseline(run: RunRecord, base: list[RunRecord]) -> tuple[list[RunRecord], str]:
    """The baseline runs set up as `run` is but for their algorithm (aggregator and compressor
    with their options), seed and bookkeeping: the same task, worker count, clock, optimizer,
    length and every other key. With them, their ids; with none, why: the keys in which the
    closest baseline run differs (`clock` for all of its `compute` section)."""
    mine = setting(run, _not_matched)
    alike, closest, closest_run = [], None, None
    for candidate in base:
        differ = differences(mine, setting(candidate, _not_matched))
        if not differ:
            alike.append(candidate)
        elif closest is None or len(differ) < len(closest):
            closest, closest_run = differ, candidate
    if alike:
        return alike, ",".join(str(candidate.id) for candidate in alike)
    if closest_run.clock != run.clock:
        closest = ["clock"] + [key for key in closest if key.split(".")[0] != "compute"]
    shown = ", ".join(closest[:3]) + (f" and {len(closest) - 3} more" if len(closest) > 3 else "")
    return [], f"none alike: differs in {shown}"


def add_baseline(rows: list[dict[str, Any]], row_runs: list[RunRecord], base: list[RunRecord],
                 finals: dict[int, dict[str, float]]) -> None:
    """Each row's speed-up, wall-time and byte ratios and accuracy difference against the mean
    of the baseline runs alike to `row_runs` (the row's run, or the first of its group's, whose
    other runs differ from it only by seed): `baseline` names them, or says why there are none
    and the comparisons stay blank. Blank too where either side lacks the metric or a ratio
    would divide by zero; for a group row where both sides have several runs, the 95% interval
    of each (`COLUMN_ci_low`, `COLUMN_ci_high`, from `comparison_interval`)."""
    for row, run in zip(rows, row_runs):
        alike, row["baseline"] = alike_baseline(run, base)
        for column, metric, compare in BASELINE_COLUMNS:
            theirs = [finals[b.id][metric] for b in alike if metric in finals.get(b.id, {})]
            mine = row.get(metric)
            theirs_mean = statistics.fmean(theirs) if theirs else None
            usable = mine is not None and theirs_mean is not None and (
                column == "accuracy_diff" or theirs_mean != 0)
            row[column] = compare(mine, theirs_mean) if usable else None
            row[f"{column}_ci_low"], row[f"{column}_ci_high"] = (
                comparison_interval(row, metric, theirs, ratio=column != "accuracy_diff")
                if usable else (None, None))


def comparison_interval(row: dict[str, Any], metric: str, base: list[float],
                        ratio: bool) -> tuple[float | None, float | None]:
    """The 95% interval of a group's mean against the baseline's: of the difference of the
    means (Welch's t), or of their ratio by the delta method (relative variances, Welch's
    degrees of freedom). None, None unless both sides have two runs or more."""
    n_a, s_a, a = row.get(f"{metric}_n"), row.get(f"{metric}_std"), row.get(metric)
    n_b = len(base)
    if not n_a or n_a < 2 or n_b < 2 or s_a is None:
        return None, None
    b, s_b = statistics.fmean(base), statistics.stdev(base)
    if ratio:
        if a == 0 or b == 0:
            return None, None
        estimate = a / b
        v_a, v_b = s_a ** 2 / (n_a * a ** 2), s_b ** 2 / (n_b * b ** 2)
        scale = abs(estimate)
    else:
        estimate = a - b
        v_a, v_b = s_a ** 2 / n_a, s_b ** 2 / n_b
        scale = 1.0
    if v_a + v_b == 0:
        return estimate, estimate
    dof = (v_a + v_b) ** 2 / (v_a ** 2 / (n_a - 1) + v_b ** 2 / (n_b - 1))
    from scipy.stats import t

    half = float(t.ppf(0.975, dof)) * scale * math.sqrt(v_a + v_b)
    return estimate - half, estimate + half


def sort_rows(rows: list[dict[str, Any]], column: str) -> list[dict[str, Any]]:
    """By `column` (a leading `-`: descending); rows without a value last either way."""
    descending = column.startswith("-")
    column = column.lstrip("-")
    if rows and all(column not in row for row in rows):
        raise DsgdError(f"--sort: no column {column!r} (columns: {', '.join(rows[0])})")
    present = [row for row in rows if row.get(column) is not None]
    missing = [row for row in rows if row.get(column) is None]
    try:
        present.sort(key=lambda row: row[column], reverse=descending)
    except TypeError:  # numbers and words in one column: order by text
        present.sort(key=lambda row: str(row[column]), reverse=descending)
    return present + missing
