"""`comm_overrun`: the fraction of communication operations with a modeled duration whose
real transfer took longer than the model allows (by more than 5%). Their recorded time is
then the machine's, not the modeled network's: a researcher must see it, as `overrun_steps`
shows it for compute."""

from __future__ import annotations

import time

from conftest import dsgd, write_spec
from dsgd_cli.comm.communicator import Comm, Handle
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


class _Transfer:
    """A backend's work that completes at a given time on the real clock."""

    def __init__(self, done_at: float):
        self.done_at = done_at

    def is_completed(self) -> bool:
        return time.perf_counter() >= self.done_at

    def wait(self) -> None:
        time.sleep(max(0.0, self.done_at - time.perf_counter()))


def _overran(transfer_s: float, waited_after_s: float, modeled_s: float = 0.4) -> int:
    """Whether a send of `modeled_s` modeled seconds, whose real transfer takes `transfer_s`
    and which its caller waits for `waited_after_s` after issuing it, is counted as overrun."""
    comm = Comm(0, 1)
    issued_at = time.perf_counter()
    handle = Handle(comm, [_Transfer(issued_at + transfer_s)], issued_at, modeled_s)
    time.sleep(waited_after_s)
    handle.wait()
    assert comm.modeled_operations == 1
    return comm.overran_operations


def test_a_transfer_done_before_its_late_wait_did_not_overrun():
    # Waited for after its modeled end, the transfer long done: the caller waited no longer
    # than the model says (not at all), so the recorded time is the model's.
    assert _overran(transfer_s=0.05, waited_after_s=0.6) == 0


def test_a_transfer_that_holds_up_its_caller_past_the_modeled_end_overran():
    assert _overran(transfer_s=0.9, waited_after_s=0.0) == 1  # waited for at once
    assert _overran(transfer_s=0.9, waited_after_s=0.6) == 1  # waited for late, still running
    assert _overran(transfer_s=0.1, waited_after_s=0.0) == 0  # within the model
