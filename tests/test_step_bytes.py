"""Every byte a worker sends is in the `bytes_sent` of one of its steps: per rank, the steps'
bytes add up to what the run's `total_bytes_sent` counts, for every built-in aggregator,
those that communicate on background threads or in `finish()` (wagma, adpsgd, osgp, backup)
included. One `dsgd run` of 4 workers runs them all."""

from __future__ import annotations

from collections import defaultdict

import pytest

from conftest import dsgd_in_process, write_spec
from dsgd_cli.results.store import Store
from dsgd_cli.spec import registry

# The default suite checks the same on a cluster of two nodes (tests/test_level_bytes.py: each
# run's bytes per level equal its steps' bytes per level and add up to total_bytes_sent).
pytestmark = pytest.mark.slow

STEPS, LOG_INTERVAL = 3, 2  # records after steps 2 and 3: intervals of 2 steps and 1


def builtin_aggregators() -> list[str]:
    return sorted(name for name, entry in registry.discover("aggregator").items()
                  if entry.distribution == "dsgd")


# Aggregators that refuse the default optimizer (plain SGD): desloc averages Adam's moments.
OPTIMIZERS = {"desloc": "adamw"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("step_bytes")
    names = builtin_aggregators()
    extra = "".join(f"\n          - {{name: bytes-{name}, aggregator: {name}, optimizer: {optimizer}}}"
                    for name, optimizer in OPTIMIZERS.items())
    spec = write_spec(tmp, f"""
        defaults:
          task: {{name: logreg}}
          workers: 4
          steps_per_epoch: {STEPS}
          log_interval: {LOG_INTERVAL}
        experiments:
          - name: bytes
            grid: {{aggregator.name: [{", ".join(n for n in names if n not in OPTIMIZERS)}]}}{extra}
    """)
    db = tmp / "results.db"
    result = dsgd_in_process("run", str(spec), "--db", str(db))
    assert result.returncode == 0, result.stdout + result.stderr
    store = Store(str(db))
    return {run.config["aggregator"]["name"]: run for run in store.runs()}, store, names


def steps_bytes(store: Store, run) -> float:
    """The per-step `bytes_sent` over the run, all ranks: each record is the mean over the
    steps since the rank's previous record."""
    total, previous = 0.0, defaultdict(int)
    for record in sorted(store.metric_history(run.id, "bytes_sent"),
                         key=lambda m: (m.rank, m.step)):
        total += record.value * (record.step - previous[record.rank])
        previous[record.rank] = record.step
    return total


def test_every_builtin_aggregator_puts_each_byte_in_a_step(runs):
    by_name, store, names = runs
    assert sorted(by_name) == names
    missed = {}
    for name, run in by_name.items():
        (total,) = [s.final for s in run.summaries if s.name == "total_bytes_sent"]
        in_steps = steps_bytes(store, run)
        if in_steps != total:
            missed[name] = (in_steps, total)
    assert missed == {}  # aggregator: (bytes in the steps, total_bytes_sent)
