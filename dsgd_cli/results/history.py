"""Questions a run's metric history answers, worked out by the database: when a run first
reached a target, a metric's curve over steps, epochs or seconds, and the bytes sent up to a
step. The queries are built with SQLAlchemy, loaded only by the commands that ask them
(`compare --target`, `plot`)."""

from __future__ import annotations

import bisect
from collections import defaultdict
from itertools import groupby
from operator import itemgetter

from sqlalchemy import and_, case, func, select
from sqlalchemy.orm import aliased

from dsgd_cli.results.analysis import Reached, Target
from dsgd_cli.results.reader import Record, ResultsReader, higher_is_better
from dsgd_cli.results.store import Metric


def reach_times(store: ResultsReader, run_ids: list[int], target: Target) -> dict[int, Reached]:
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
    with store.connect() as connection:
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


def load_history(store: ResultsReader, run_ids: list[int],
                 names: list[str]) -> dict[tuple[int, str], list[Record]]:
    """The records of metrics `names` of the runs, by (run id, name), in recording order."""
    by_run: dict[tuple[int, str], list[Record]] = defaultdict(list)
    if not run_ids:
        return by_run
    query = (select(Metric.run_id, Metric.name, Metric.step, Metric.epoch, Metric.rank,
                    Metric.seconds, Metric.value)
             .where(Metric.run_id.in_(run_ids), Metric.name.in_(names)).order_by(Metric.id))
    with store.connect() as connection:
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
