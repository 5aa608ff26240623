"""Answers from recorded runs: when a run reached a target (from its metric history), groups
of runs summarised as mean ± std, and ratios against a baseline."""

from __future__ import annotations

import bisect
import math
import re
import statistics
from collections import defaultdict
from dataclasses import dataclass
from itertools import groupby
from operator import itemgetter
from typing import Any, Iterable, NamedTuple

from sqlalchemy import and_, case, func, select
from sqlalchemy.orm import aliased

from dsgd_cli.errors import DsgdError
from dsgd_cli.query import names, run_value
from dsgd_cli.store import Metric, Run, Store, higher_is_better

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


def reach_times(store: Store, run_ids: list[int], target: Target) -> dict[int, Reached]:
    """For each run that reached `target` in its recorded history, when it did: the first
    point of its curve (`curve_points`) that reaches it, found by the database (one row per
    run comes back, not the history), with the `bytes_sent` records up to that step for its
    bytes."""
    if not run_ids:
        return {}
    value = func.avg(Metric.value)
    reaching = value >= target.value if higher_is_better(target.metric) else value <= target.value
    sent = aliased(Metric)
    points = (select(Metric.run_id, Metric.step,
                     func.coalesce(func.max(Metric.seconds), 0.0).label("seconds"),
                     func.row_number().over(partition_by=Metric.run_id,
                                            order_by=Metric.step).label("nth"))
              .where(Metric.run_id.in_(run_ids), Metric.name == target.metric,
                     Metric.step.is_not(None))
              .group_by(Metric.run_id, Metric.step).having(reaching).subquery())
    # Whether the run recorded bytes_sent at all: one that did only after reaching the
    # target had sent 0 bytes by then (as far as recorded); one that never did, no number.
    recorded = (select(sent.id).where(sent.run_id == points.c.run_id, sent.name == "bytes_sent")
                .exists())
    firsts = (select(points.c.run_id, points.c.step, points.c.seconds,
                     case((recorded, 1), else_=0).label("recorded"))
              .where(points.c.nth == 1).cte("firsts"))
    query = (select(firsts.c.run_id, firsts.c.step, firsts.c.seconds, firsts.c.recorded,
                    Metric.rank, Metric.step, Metric.value)
             .select_from(firsts.outerjoin(Metric, and_(
                 Metric.run_id == firsts.c.run_id, Metric.name == "bytes_sent",
                 Metric.step.is_not(None), Metric.step <= firsts.c.step)))
             .order_by(firsts.c.run_id, Metric.rank, Metric.step, Metric.id))
    reached: dict[int, Reached] = {}
    with store.engine.connect() as connection:
        # The driver's rows as they are: thousands of them, and no type needs converting.
        rows = connection.execute(query).cursor.fetchall()
    # Each run's rows: its bytes_sent records up to the step it reached the target, rank by
    # rank in the order of BytesSent (by step, then as recorded), summed as BytesSent does.
    for run_id, group in groupby(rows, key=itemgetter(0)):
        by_rank: dict[int | None, float] = {}
        for _, step, seconds, recorded, rank, sent_step, value in group:
            if sent_step is None:
                continue
            if rank not in by_rank:
                by_rank[rank], previous = 0.0, 0
            by_rank[rank] += value * (sent_step - previous)
            previous = sent_step
        total = 0.0
        for rank in sorted(by_rank, key=_rank_order):
            total += by_rank[rank]
        reached[run_id] = Reached(seconds, step, total if recorded else None)
    return reached


def _rank_order(rank: int | None) -> tuple[bool, int]:
    """Ranks in order, a run-wide record (no rank) first."""
    return rank is not None, rank or 0


# A curve's x at each point, as the database works it out over the records of a run and step.
CURVE_X = {
    "step": lambda: Metric.step,
    "epoch": lambda: func.min(Metric.epoch),
    "seconds": lambda: func.coalesce(func.max(Metric.seconds), 0.0),
}


def curve_points(run_ids: list[int], metric: str, x: str = "step"):
    """The query for a metric's course over each run: (run id, x, value), one row per step in
    order of run and step, worked out by the database. The value: a per-run metric
    (test_accuracy) as recorded, a per-rank metric (train_loss) the mean over the ranks that
    recorded the step. x: the `step`, the `epoch` (the lowest recorded at the step; steps
    without one are left out) or the `seconds` (when the last rank recorded it)."""
    query = (select(Metric.run_id, CURVE_X[x](), func.avg(Metric.value))
             .where(Metric.run_id.in_(run_ids), Metric.name == metric, Metric.step.is_not(None))
             .group_by(Metric.run_id, Metric.step).order_by(Metric.run_id, Metric.step))
    return query.having(func.min(Metric.epoch).is_not(None)) if x == "epoch" else query


class Record(NamedTuple):  # a tuple: hundreds of thousands may be read at once
    """One recorded metric value (a row of the metrics table)."""

    step: int | None
    epoch: int | None
    rank: int | None
    seconds: float | None
    value: float


def load_history(store: Store, run_ids: list[int],
                 names: list[str]) -> dict[tuple[int, str], list[Record]]:
    """The records of metrics `names` of the runs, by (run id, name), in recording order."""
    by_run: dict[tuple[int, str], list[Record]] = defaultdict(list)
    if not run_ids:
        return by_run
    query = (select(Metric.run_id, Metric.name, Metric.step, Metric.epoch, Metric.rank,
                    Metric.seconds, Metric.value)
             .where(Metric.run_id.in_(run_ids), Metric.name.in_(names)).order_by(Metric.id))
    with store.engine.connect() as connection:
        for run_id, name, *fields in connection.execute(query).all():
            by_run[(run_id, name)].append(Record(*fields))
    return by_run


class BytesSent:
    """Cumulative bytes sent by all workers, from the `bytes_sent` records: each is a rank's
    mean per step over a log interval, recorded at the interval's last step, so the
    interval's bytes are that mean times its length in steps."""

    def __init__(self, records: list[Record]):
        self._by_rank: dict[int | None, tuple[list[int], list[float]]] = {}
        # Ranks in order (the sum over them then never depends on which ranks recorded what).
        for rank in sorted({r.rank for r in records}, key=_rank_order):
            steps, totals, total, previous = [], [], 0.0, 0
            for record in sorted((r for r in records if r.rank == rank and r.step is not None),
                                 key=lambda r: r.step):
                total += record.value * (record.step - previous)
                previous = record.step
                steps.append(record.step)
                totals.append(total)
            self._by_rank[rank] = steps, totals

    def by_step(self, step: int) -> float:
        """What all workers had sent in their first `step` steps (as far as recorded)."""
        total = 0.0
        for steps, totals in self._by_rank.values():
            index = bisect.bisect_right(steps, step)
            total += totals[index - 1] if index else 0.0
        return total


# -- rows: one per run or one per group -----------------------------------------------------------

def run_rows(runs: list[Run], finals: dict[int, dict[str, float]], metrics: list[str],
             reached: dict[int, Reached] | None) -> list[dict[str, Any]]:
    """One row per run: its columns, the final value of each of `metrics` (from
    `Store.finals`) and, with `reached`, when it reached a target."""
    rows = []
    for run in runs:
        aggregator = run.aggregator if run.compressor == "none" else f"{run.aggregator}+{run.compressor}"
        row = {"id": run.id, "experiment": run.experiment, "aggregator": aggregator,
               "optimizer": run.optimizer, "task": run.task, "workers": run.workers,
               "status": run.status}
        row.update({name: finals.get(run.id, {}).get(name) for name in metrics})
        if reached is not None:
            when = reached.get(run.id)
            row.update(time_to_target=when and when.seconds, steps_to_target=when and when.step,
                       bytes_to_target=when and when.bytes)
        rows.append(row)
    return rows


def group_rows(runs: list[Run], rows: list[dict[str, Any]], keys: list[str],
               values: list[str]) -> list[dict[str, Any]]:
    """One row per distinct combination of `keys`, in order of first appearance: the keys, the
    number of runs, and for each of `values` the mean (`name`) and the sample standard
    deviation (`name_std`, none for a single value) over the runs that have it."""
    groups: dict[tuple, list[dict]] = {}
    for run, row in zip(runs, rows):
        label = tuple(_label(run_value(run, key)) for key in keys)
        groups.setdefault(label, []).append(row)
    result = []
    for label, members in groups.items():
        group = dict(zip(keys, label))
        group["runs"] = len(members)
        for name in values:
            present = [row[name] for row in members if row.get(name) is not None]
            group[name] = statistics.fmean(present) if present else None
            group[f"{name}_std"] = statistics.stdev(present) if len(present) > 1 else None
        if "time_to_target" in values:
            reached = sum(row.get("time_to_target") is not None for row in members)
            group["reached"] = f"{reached}/{len(members)}"
        result.append(group)
    return result


def _label(value: Any) -> Any:
    if isinstance(value, set):
        return ",".join(sorted(value))
    return value


# -- baselines -------------------------------------------------------------------------------

def baseline_values(store: Store, runs: Iterable[Run], spec: str) -> dict[str, float]:
    """The mean final value of each baseline metric over the baseline: a run id, or an
    experiment (all its runs, or all points of a grid of that base name)."""
    chosen = [run.id for run in runs if names(run, spec)]
    if not chosen:
        raise DsgdError(f"--baseline {spec!r}: no recorded run has this id or experiment name")
    finals = store.finals(chosen)
    means = {}
    for _, metric, _ in BASELINE_COLUMNS:
        values = [finals[run_id][metric] for run_id in chosen if metric in finals[run_id]]
        if values:
            means[metric] = statistics.fmean(values)
    return means


def add_baseline(rows: list[dict[str, Any]], base: dict[str, float]) -> None:
    """Each row's speed-up, wall-time and byte ratios and accuracy difference against `base`
    (blank where either side lacks the metric or a ratio would divide by zero)."""
    for row in rows:
        for column, metric, compare in BASELINE_COLUMNS:
            mine, theirs = row.get(metric), base.get(metric)
            usable = mine is not None and theirs is not None and (
                column == "accuracy_diff" or theirs != 0)
            row[column] = compare(mine, theirs) if usable else None


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
