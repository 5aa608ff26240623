"""A failure at the run's start is the run's: one at modeled time 0 strikes during the first
step, under `restart` and under `continue`; only a resumed run skips the failures before its
start (dsgd_cli/emulation/failures.py, the training loop's start in worker/training.py)."""

from __future__ import annotations

import contextlib
import types

import pytest
import torch

from conftest import dsgd_in_process, write_spec
from dsgd_cli.emulation.clock import Clock
from dsgd_cli.emulation.failures import ContinueEmulation, RestartTimeline
from dsgd_cli.spec.failures_spec import parse_failures
from dsgd_cli.results.store import Store


def _options(restart: float, at: list[tuple[int, float]]) -> dict:
    """A `failures` section of fixed failures, (node, time) each."""
    return parse_failures({"restart": restart,
                           "at": [{"node": node, "time": time} for node, time in at]},
                          "experiments[0].failures")


# -- restart ----------------------------------------------------------------------------------

def test_a_failure_at_time_0_strikes_the_first_step():
    timeline = RestartTimeline(_options(restart=1, at=[(0, 0.0)]), nodes=2, start=0.0)
    decision = timeline.after_step(1, now=0.25)
    assert decision.rollback_to == 0 and decision.struck == (0.0, 0)
    assert (timeline.failures, timeline.lost_steps) == (1, 1)
    assert timeline.lost_seconds == pytest.approx(0.25 + 1)


def test_a_resumed_run_skips_only_the_failures_before_its_start():
    # Resumed at 5 s after step 10: the failures at 0 and 3 s are behind it; the one at its
    # start (5 s) and the one at 7 s are the resumed run's, one restart each.
    options = _options(restart=1, at=[(0, 0.0), (1, 3.0), (0, 5.0), (1, 7.0)])
    timeline = RestartTimeline(options, nodes=2, start=5.0, start_step=10)
    assert timeline.next_failure() == (5.0, 0)
    first = timeline.after_step(11, now=5.5)
    assert (first.rollback_to, first.struck) == (10, (5.0, 0))
    second = timeline.after_step(11, now=7.5)  # 5.5 + 1 s of restart, then the step again
    assert (second.rollback_to, second.struck) == (10, (7.0, 1))
    assert timeline.failures == 2


# -- continue ---------------------------------------------------------------------------------

class _Aggregator:
    """In step, under `continue`; ignores who leaves and rejoins."""

    asynchronous = steps_may_differ = decides_stop = False
    failure_mode = "continue"

    def worker_left(self, rank, step):
        pass

    def worker_rejoined(self, rank, step, source):
        pass


class _AloneComm:
    """One worker's view of the agreed time: the all-reduce of the clocks is its own clock."""

    def untracked(self):
        return contextlib.nullcontext()

    def all_reduce(self, tensor, op):
        pass


def _continuing(options: dict, rank: int, start: float):
    """ContinueEmulation for `rank` of 2 workers, on a clock at `start` modeled seconds that
    moves only when the test moves `real[0]`."""
    real = [0.0]
    clock = Clock(1.0, now=lambda: real[0], sleep=lambda seconds: None)
    clock.start(start)
    worker = types.SimpleNamespace(
        experiment=types.SimpleNamespace(workers=2, failures=options, cluster=None),
        rank=rank, aggregator=_Aggregator(),
        device=torch.device("cpu"), comm=_AloneComm(),
        interval=types.SimpleNamespace(log=lambda name, value: None),
        ctx=types.SimpleNamespace(clock=clock, up=True))
    return ContinueEmulation(worker, start), real


def _ups(emulation, real, steps: int) -> list[bool]:
    """Whether the worker is up for each of `steps` steps of 1 modeled second."""
    ups = []
    for step in range(steps):
        ups.append(emulation.before_step(step))
        real[0] += 1.0
    return ups


def test_continue_outage_at_time_0_happens_and_counts():
    emulation, real = _continuing(_options(restart=2, at=[(1, 0.0)]), rank=1, start=0.0)
    assert _ups(emulation, real, 4) == [False, False, True, True]
    assert emulation.totals()["node_failures"] == 1


def test_continue_resumed_run_counts_no_outage_that_began_before_it():
    # Resumed at 5 s: the failure at 0 is over; the one at 4 s is down until 7 s, so the
    # resumed run's first two steps are down, but that outage began before it.
    options = _options(restart=3, at=[(1, 0.0), (1, 4.0)])
    emulation, real = _continuing(options, rank=1, start=5.0)
    assert _ups(emulation, real, 4) == [False, False, True, True]
    assert emulation.totals()["node_failures"] == 0


# -- a launched run ---------------------------------------------------------------------------

def test_launched_failure_at_time_0_restarts_or_downs_the_node(tmp_path):
    """Both failure modes, one launch: allreduce restarts (one failure, its first step lost,
    the restart's second on both workers), diloco goes on without node 0 for a while."""
    spec = write_spec(tmp_path, """
        defaults:
          task: {name: logreg}
          workers: 2
          epochs: 1
          steps_per_epoch: 2
          failures: {restart: 1s, at: [{node: 0, time: 0}]}
        experiments:
          - {name: restarting, aggregator: {name: allreduce}}
          - {name: continuing, aggregator: {name: diloco}}
    """)
    db = tmp_path / "results.db"
    result = dsgd_in_process("run", str(spec), "--db", str(db))
    assert result.returncode == 0, result.stdout + result.stderr
    runs = {run.experiment: {s.name: s.final for s in run.summaries}
            for run in Store(str(db)).runs()}
    restarting, continuing = runs["restarting"], runs["continuing"]
    assert (restarting["failures"], restarting["lost_steps"]) == (1, 1)
    assert restarting["lost_seconds"] >= 2 * 1.0  # the restart, on each of the 2 workers
    assert restarting["goodput"] < 1
    assert continuing["failures"] == 1
    assert continuing["lost_seconds"] > 0
