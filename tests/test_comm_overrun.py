"""`comm_overrun`: the fraction of communication operations with a modeled duration whose
real transfer took longer than the model allows (by more than 5%). Their recorded time is
then the machine's, not the modeled network's: a researcher must see it, as `overrun_steps`
shows it for compute."""

from __future__ import annotations

from conftest import dsgd, write_spec
from dsgd_cli.results.store import Store

SPEC = """
defaults:
  task: {name: logreg, samples: 256}
  workers: 2
  epochs: 1
  steps_per_epoch: 4
  log_interval: 2
experiments:
  # A link of a nanosecond: no real transfer is that fast.
  - {name: instant, network: {latency: 1ns}}
  # 100 ms per message: every real transfer on this machine is faster.
  - {name: slow, network: {latency: 100ms}}
  - {name: unmodeled}
"""


def test_runs_report_how_often_real_transfers_overran_their_modeled_time(tmp_path):
    spec = write_spec(tmp_path, SPEC)
    db = tmp_path / "r.db"
    result = dsgd("run", str(spec), "--db", str(db))
    assert result.returncode == 0, result.stderr
    store = Store(str(db))
    overrun = {run.experiment: {m.value for m in store.metric_history(run.id, "comm_overrun")}
               for run in store.runs()}
    assert overrun == {"instant": {1.0}, "slow": {0.0}, "unmodeled": set()}
