"""On a cluster, every byte is counted on one link level: for every built-in aggregator, each
step's `bytes_sent_{intra_node,inter_node,inter_region}` sum to its `bytes_sent`, and the run's
`total_bytes_sent_{level}` sum to its `total_bytes_sent` and to the steps' bytes per level.
One `dsgd run` of 4 workers on 2 nodes of 2 runs them all (tests/test_step_bytes.py checks
the same without a cluster)."""

from __future__ import annotations

from collections import defaultdict

import pytest

from conftest import compare_json, dsgd_in_process, write_spec
from dsgd_cli.comm.cluster import LEVELS
from dsgd_cli.results.store import Store
from test_step_bytes import LOG_INTERVAL, OPTIMIZERS, STEPS, builtin_aggregators

PER_STEP = [f"bytes_sent_{level}" for level in LEVELS]
PER_RUN = [f"total_bytes_sent_{level}" for level in LEVELS]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("level_bytes")
    names = builtin_aggregators()
    extra = "".join(f"\n          - {{name: levels-{name}, aggregator: {name}, optimizer: {optimizer}}}"
                    for name, optimizer in OPTIMIZERS.items())
    spec = write_spec(tmp, f"""
        defaults:
          task: {{name: logreg}}
          workers: 4
          steps_per_epoch: {STEPS}
          log_interval: {LOG_INTERVAL}
          cluster:
            nodes: 2
            links: {{intra_node: {{bandwidth: 10GB/s}}, inter_node: {{bandwidth: 1Gbit}}}}
        experiments:
          - name: levels
            grid: {{aggregator.name: [{", ".join(n for n in names if n not in OPTIMIZERS)}]}}{extra}
    """)
    db = tmp / "results.db"
    result = dsgd_in_process("run", str(spec), "--db", str(db))
    assert result.returncode == 0, result.stdout + result.stderr
    store = Store(str(db))
    return {run.config["aggregator"]["name"]: run for run in store.runs()}, store, names, db


def _records(store: Store, run, metric: str) -> dict[tuple[int, int], float]:
    return {(m.rank, m.step): m.value for m in store.metric_history(run.id, metric)}


def steps_bytes(store: Store, run, metric: str) -> float:
    """A per-step metric summed over the run, all ranks: each record is the mean over the
    steps since the rank's previous record."""
    total, previous = 0.0, defaultdict(int)
    for record in sorted(store.metric_history(run.id, metric), key=lambda m: (m.rank, m.step)):
        total += record.value * (record.step - previous[record.rank])
        previous[record.rank] = record.step
    return total


def _final(run, metric: str) -> float:
    (value,) = [s.final for s in run.summaries if s.name == metric]
    return value


def test_every_builtin_aggregators_steps_split_their_bytes_over_the_levels(runs):
    by_name, store, names, _ = runs
    assert sorted(by_name) == names
    unsplit = {}
    for name, run in by_name.items():
        sent = _records(store, run, "bytes_sent")
        levels = [_records(store, run, metric) for metric in PER_STEP]
        assert sent and all(level.keys() == sent.keys() for level in levels), name
        for key, value in sent.items():
            split = [level[key] for level in levels]
            if sum(split) != pytest.approx(value):
                unsplit[name, key] = (split, value)
    assert unsplit == {}  # (aggregator, (rank, step)): (bytes per level, bytes_sent)


def test_every_builtin_aggregators_run_totals_split_its_bytes_over_the_levels(runs):
    by_name, store, _, _ = runs
    unsplit = {}
    for name, run in by_name.items():
        totals = [_final(run, metric) for metric in PER_RUN]
        in_steps = [steps_bytes(store, run, metric) for metric in PER_STEP]
        if sum(totals) != _final(run, "total_bytes_sent") or totals != in_steps:
            unsplit[name] = (totals, in_steps, _final(run, "total_bytes_sent"))
    assert unsplit == {}  # aggregator: (run totals per level, steps' per level, total)
    # Two nodes, no regions: the ring and gossip crossed the nodes, nothing crossed a region
    # (the periodic averagers may not have averaged within these few steps).
    assert all(_final(by_name[name], "total_bytes_sent_inter_node") > 0
               for name in ("allreduce", "sgp", "wagma"))
    assert all(_final(run, "total_bytes_sent_inter_region") == 0 for run in by_name.values())


def test_compare_shows_the_run_totals_per_level_as_metrics(runs):
    by_name, _, _, db = runs
    rows = compare_json(db, *[arg for metric in PER_RUN for arg in ("--metric", metric)])
    by_aggregator = {row["aggregator"]: row for row in rows}
    run = by_name["allreduce"]
    assert {metric: by_aggregator["allreduce"][metric] for metric in PER_RUN} == {
        metric: _final(run, metric) for metric in PER_RUN}
