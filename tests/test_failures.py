"""Failures on the modeled clock (dsgd_cli/emulation/failures.py, docs/failures.md): the
spec section, the seeded schedule, the restart arithmetic driven by known step times, the
refusals, and one `dsgd run` launch (two experiments) checked on its recorded values."""

from __future__ import annotations

import math
import statistics

import pytest

from conftest import dsgd, write_spec
from dsgd_cli.emulation.failures import (
    RestartTimeline, check_failures, first_failures, node_of, parse_failures)
from dsgd_cli.errors import SpecError
from dsgd_cli.results.store import Store
from dsgd_cli.spec import registry
from dsgd_cli.spec.experiments import load_spec
from dsgd_cli.units import parse_duration

PATH = "experiments[0].failures"


def _options(**raw):
    return parse_failures({"restart": "120s", **raw}, PATH)


# -- the spec section -----------------------------------------------------------------------

def test_durations_take_units_and_bare_seconds():
    assert parse_duration("2h", "x") == 7200
    assert parse_duration("30min", "x") == 1800
    assert parse_duration("120s", "x") == 120
    assert parse_duration("500ms", "x") == 0.5
    assert parse_duration(7, "x") == 7.0
    for bad in ("2 parsecs", "-1s", math.nan, True, None, "h"):
        with pytest.raises(SpecError, match="expected a duration"):
            parse_duration(bad, "x")


def test_section_parsed_to_seconds():
    assert _options(mtbf="2h", checkpoint_every=50, checkpoint_seconds="5s",
                    at=[{"node": 1, "time": "300s"}]) == {
        "restart": 120.0, "mtbf": 7200.0, "checkpoint_every": 50, "checkpoint_seconds": 5.0,
        "seed": 0, "at": [{"node": 1, "time": 300.0}]}


@pytest.mark.parametrize("raw, path, message", [
    ({"mtbf": "2h"}, "restart", "required"),
    ({"restart": "1s"}, "mtbf", "no failure would ever happen"),
    ({"restart": "1s", "mtbf": "0s"}, "mtbf", "> 0"),
    ({"restart": "1s", "mtbf": "soon"}, "mtbf", "expected a duration"),
    ({"restart": "1s", "mtbf": 9, "checkpoint_every": 0}, "checkpoint_every", ">= 1"),
    ({"restart": "1s", "mtbf": 9, "checkpoint_seconds": 2}, "checkpoint_seconds",
     "needs checkpoint_every"),
    ({"restart": "1s", "at": [{"node": -1, "time": 1}]}, "at[0].node", ">= 0"),
    ({"restart": "1s", "at": [{"node": 0, "time": "later"}]}, "at[0].time", "expected a duration"),
    ({"restart": "1s", "at": [{"node": 0}]}, "at[0].time", "required"),
    ({"restart": "1s", "at": [5]}, "at[0]", "expected a mapping"),
    ({"restart": "1s", "mtbf": 9, "mtbF": 1}, "mtbF", "unknown key"),
])
def test_bad_section_refused_with_its_key_path(raw, path, message):
    with pytest.raises(SpecError, match=message) as error:
        parse_failures(raw, PATH)
    assert error.value.path == f"{PATH}.{path}"


def _spec(tmp_path, failures: str, aggregator: str = "{name: allreduce}", extra: str = ""):
    return write_spec(tmp_path, f"""
        defaults: {{task: {{name: logreg}}, workers: 4}}
        experiments:
          - name: e
            aggregator: {aggregator}
            failures: {failures}
            {extra}
    """)


def test_spec_stores_the_section_and_leaves_other_runs_unchanged(tmp_path):
    (experiment,) = load_spec(_spec(tmp_path, "{restart: 1min, mtbf: 1h, seed: 3}"))
    assert experiment.config["failures"]["mtbf"] == 3600.0
    assert experiment.config["failures"]["restart"] == 60.0
    plain = write_spec(tmp_path, """
        defaults: {task: {name: logreg}, workers: 2}
        experiments: [{name: e}]
    """, name="plain.yaml")
    assert "failures" not in load_spec(plain)[0].config


def test_fixed_failure_of_a_node_the_run_lacks_refused(tmp_path):
    with pytest.raises(SpecError, match="between 0 and 3") as error:
        load_spec(_spec(tmp_path, "{restart: 1s, at: [{node: 4, time: 1s}]}"))
    assert error.value.path == f"{PATH}.at[0].node"


@pytest.mark.parametrize("aggregator, why", [
    ("{name: backup, backups: 1}", "do not run in step"),
    ("{name: adpsgd}", "do not run in step"),
    ("{name: wagma, group_size: 2}", "do not run in step"),
])
def test_aggregators_that_cannot_restart_refused(tmp_path, aggregator, why):
    with pytest.raises(SpecError, match=f"cannot run under failures: .*{why}") as error:
        load_spec(_spec(tmp_path, "{restart: 1s, mtbf: 1h}", aggregator))
    assert error.value.path == PATH


def test_failure_mode_declared_by_a_plugin_is_obeyed():
    allreduce = registry.load("aggregator", "allreduce")
    config = {"workers": 2, "failures": _options(mtbf=10)}
    check_failures(config, allreduce, PATH)  # the default, restart: accepted

    class Fragile(allreduce):
        failure_mode = None
        failure_refusal = "its state lives outside the process"

    class Continuing(allreduce):
        failure_mode = "continue"

    with pytest.raises(SpecError, match="its state lives outside the process"):
        check_failures(config, Fragile, PATH)
    with pytest.raises(SpecError, match="does not emulate yet"):
        check_failures(config, Continuing, PATH)


def test_samples_budget_refused():
    allreduce = registry.load("aggregator", "allreduce")
    config = {"workers": 2, "failures": _options(mtbf=10),
              "budget": {"samples": 100, "seconds": None}}
    with pytest.raises(SpecError, match="samples budget") as error:
        check_failures(config, allreduce, PATH)
    assert error.value.path == PATH


# -- the schedule ---------------------------------------------------------------------------

def test_same_seed_same_times_other_seed_other_times():
    options = _options(mtbf=100, seed=7)
    assert first_failures(options, 4, 50) == first_failures(dict(options), 4, 50)
    assert first_failures(options, 4, 50) != first_failures(_options(mtbf=100, seed=8), 4, 50)


def test_times_sorted_and_every_node_fails():
    times = first_failures(_options(mtbf=100), 4, 400)
    assert [t for t, _ in times] == sorted(t for t, _ in times)
    assert {node for _, node in times} == {0, 1, 2, 3}


def test_mean_gap_per_node_is_mtbf():
    # Exponential gaps of mean 100: over n = 4,000 gaps of one node the sample mean's standard
    # error is 100 / sqrt(n) = 1.6; 5 standard errors is a bound a correct draw (seeded) meets.
    events = first_failures(_options(mtbf=100, seed=1), 3, 13_000)
    node_2 = [t for t, node in events if node == 2][:4000]
    gaps = [b - a for a, b in zip([0.0] + node_2, node_2)]
    assert len(gaps) == 4000
    assert abs(statistics.fmean(gaps) - 100) < 5 * 100 / math.sqrt(4000)
    # The cluster of 3 nodes fails 3 times as often: a mean gap of 33.3 (standard error 0.3).
    cluster_gap = events[11_999][0] / 12_000
    assert abs(cluster_gap - 100 / 3) < 5 * (100 / 3) / math.sqrt(12_000)


def test_node_times_do_not_depend_on_the_node_count():
    two = [t for t, node in first_failures(_options(mtbf=50), 2, 100) if node == 1]
    eight = [t for t, node in first_failures(_options(mtbf=50), 8, 400) if node == 1]
    assert two[:10] == eight[:10]


def test_fixed_failures_merged_in_time_order():
    options = _options(mtbf=1000, at=[{"node": 1, "time": 5.0}, {"node": 0, "time": 2.0}])
    times = first_failures(options, 2, 3)
    assert times[:2] == [(2.0, 0), (5.0, 1)]
    assert first_failures(_options(at=[{"node": 1, "time": 300}]), 2, 1) == [(300.0, 1)]


def test_workers_map_to_nodes_in_blocks():
    assert [node_of(rank, 8, 2) for rank in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [node_of(rank, 4, 4) for rank in range(4)] == [0, 1, 2, 3]


# -- the restart arithmetic, on known step times ----------------------------------------------

def _drive(options: dict, steps: int, step_seconds: float, nodes: int = 2):
    """The runtime's loop around RestartTimeline with every step lasting `step_seconds`
    modeled: returns the modeled wall time, the timeline and the steps executed."""
    timeline, now, step, executed = RestartTimeline(options, nodes), 0.0, 0, 0
    while step < steps:
        now += step_seconds
        step += 1
        executed += 1
        decision = timeline.after_step(step, now)
        now += decision.skip_seconds
        if decision.rollback_to is not None:
            step = decision.rollback_to
    return now, timeline, executed


def test_one_failure_costs_restart_lost_steps_and_checkpoint_writes_exactly():
    # Steps of s = 0.25 s; checkpoints every C = 8 steps cost 2 s; one failure at T = 13.1 s,
    # restart R = 120 s. With the writes, steps 8, 16 and 24 end at 2, 6 and 10 s, their
    # checkpoints at 4, 8 and 12 s; steps 25..29 end at 12.25..13.25: the failure takes
    # effect at step 29's boundary, and the 5 steps since the checkpoint of step 24 are lost.
    s, every, write, restart, steps = 0.25, 8, 2.0, 120.0, 40
    options = _options(restart=restart, checkpoint_every=every, checkpoint_seconds=write,
                       at=[{"node": 1, "time": 13.1}])
    wall, timeline, executed = _drive(options, steps, s)
    free_wall = steps * s
    writes = steps // every
    assert (timeline.failures, timeline.lost_steps, timeline.checkpoints) == (1, 5, writes)
    assert executed == steps + 5
    expected_lost = restart + 5 * s + writes * write
    assert wall == pytest.approx(free_wall + expected_lost, rel=1e-12)
    assert timeline.lost_seconds == pytest.approx(expected_lost, rel=1e-12)
    assert timeline.lost_seconds == pytest.approx(wall - free_wall, rel=1e-12)


def test_failure_during_a_restart_is_part_of_it():
    options = _options(restart=10, at=[{"node": 0, "time": 1.0}, {"node": 1, "time": 5.0},
                                       {"node": 1, "time": 30.0}])
    wall, timeline, _ = _drive(options, 20, 1.0)
    # 1.0: the first step lost, down until 11; 5.0 struck while down; 30.0: the second.
    assert timeline.failures == 2


def test_checkpoints_bound_what_a_failure_loses():
    def lost_steps(every):
        options = _options(restart=1, checkpoint_every=every, checkpoint_seconds=0,
                           at=[{"node": 0, "time": 9.5}])
        return _drive(options, 20, 1.0)[1].lost_steps
    assert lost_steps(100) == 10  # back to the start
    assert lost_steps(4) == 2     # back to step 8


# -- a launched run ---------------------------------------------------------------------------

RESTART = 7.0
WRITE = 0.5


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """Two experiments in one `dsgd run`: allreduce with momentum, checkpoints every 4 steps
    of 0.02 modeled seconds that cost 0.5 s; one without a failure within the run, one with a
    failure at 0.3 s, during the first checkpoint's write (steps 1-4 end by 0.15 s even on a
    loaded machine; the write ends after 0.5 s): it takes effect at step 5's boundary."""
    tmp = tmp_path_factory.mktemp("failures")
    spec = write_spec(tmp, f"""
        defaults:
          task: {{name: logreg}}
          workers: 2
          epochs: 1
          steps_per_epoch: 12
          batch_size: 16
          log_interval: 1
          optimizer: {{name: sgd, lr: 0.2, momentum: 0.9}}
          compute: {{step_seconds: 0.02, time_scale: 2}}
          aggregator: {{name: allreduce}}
        experiments:
          - name: free
            failures: {{restart: {RESTART}s, checkpoint_every: 4, checkpoint_seconds: {WRITE}s,
                        at: [{{node: 1, time: 1h}}]}}
          - name: failed
            failures: {{restart: {RESTART}s, checkpoint_every: 4, checkpoint_seconds: {WRITE}s,
                        at: [{{node: 1, time: 0.3}}]}}
    """)
    db = tmp / "results.db"
    result = dsgd("run", str(spec), "--db", str(db), timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    store = Store(str(db))
    return store, {run.experiment: run for run in store.runs()}


def _summaries(run) -> dict[str, float]:
    return {s.name: s.final for s in run.summaries}


def test_launched_failure_costs_restart_lost_step_and_writes(launched):
    _, runs = launched
    free, failed = _summaries(runs["free"]), _summaries(runs["failed"])
    workers, writes = 2, 3  # checkpoints after steps 4, 8 and 12
    assert (free["failures"], free["lost_steps"]) == (0, 0)
    assert free["lost_seconds"] == pytest.approx(workers * writes * WRITE, rel=1e-9)
    assert (failed["failures"], failed["lost_steps"]) == (1, 1)
    lost_work = failed["lost_seconds"] / workers - RESTART - writes * WRITE  # step 5, redone
    assert 0.02 <= lost_work < 0.1
    # The run's modeled time grows by what the failure cost (real-time jitter of 12 steps
    # aside); the goodput is the counted fraction of it.
    grew = failed["wall_seconds"] - free["wall_seconds"]
    assert grew == pytest.approx(RESTART + lost_work, abs=0.1)
    for run in (free, failed):
        assert run["goodput"] == pytest.approx(
            1 - run["lost_seconds"] / (workers * run["wall_seconds"]), rel=0.01)


def test_launched_rollback_is_exact_and_recorded_per_step(launched):
    store, runs = launched
    free, failed = _summaries(runs["free"]), _summaries(runs["failed"])
    # The model, momentum and data order are restored: the same final model as without it.
    assert failed["train_loss"] == free["train_loss"]
    assert failed["test_loss"] == free["test_loss"]
    up = [(r.step, r.value) for r in store.metric_history(runs["failed"].id, "up") if r.rank == 0]
    assert up == [(1, 1.0), (2, 1.0), (3, 1.0), (4, 1.0), (5, 0.0)] + [
        (step, 1.0) for step in range(5, 13)]
    assert all(r.value == 1.0 for r in store.metric_history(runs["free"].id, "up"))


# -- the runtime's emulation, in process ------------------------------------------------------

class _Comm:
    """One worker alone: the all-reduce of the clocks is its own clock."""

    def untracked(self):
        import contextlib
        return contextlib.nullcontext()

    def all_reduce(self, tensor, op):
        assert op == "max"


class _Interval:
    def __init__(self):
        self.values = []

    def log(self, name, value):
        self.values.append((name, value))


def _worker(failures: dict):
    import types

    import torch
    from torch import nn

    from dsgd_cli.emulation.clock import Clock

    real = [0.0]
    clock = Clock(1.0, now=lambda: real[0], sleep=lambda seconds: None)
    model = nn.Linear(2, 1, bias=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    stateless = types.SimpleNamespace(state_dict=dict, load_state_dict=lambda state: None)
    worker = types.SimpleNamespace(
        config={"workers": 1, "failures": failures}, model=model, optimizer=optimizer,
        aggregator=stateless, device=torch.device("cpu"), comm=_Comm(), interval=_Interval(),
        ctx=types.SimpleNamespace(clock=clock, compressor=stateless),
        evaluation=types.SimpleNamespace(reached_at=None))
    return worker, real


def _train_step(worker, real, seconds=1.0):
    import torch

    worker.optimizer.zero_grad()
    worker.model(torch.ones(1, 2)).sum().backward()
    worker.optimizer.step()
    real[0] += seconds


def test_emulation_rolls_model_and_momentum_back_and_forgets_a_lost_target():
    import torch

    from dsgd_cli.emulation.failures import FailureEmulation

    worker, real = _worker(_options(restart=30, checkpoint_every=2, checkpoint_seconds=5,
                                    at=[{"node": 0, "time": 7.5}]))
    emulation = FailureEmulation(worker, start=0.0)
    for step in (1, 2):
        _train_step(worker, real)
        assert emulation.after_step(step, samples=10 * step) is None
    saved_model = worker.model.weight.detach().clone()
    saved_momentum = worker.optimizer.state_dict()["state"][0]["momentum_buffer"].clone()
    assert worker.ctx.clock.elapsed() == 7.0  # two steps and a checkpoint write
    _train_step(worker, real)  # step 3 ends at 8.0, after the failure at 7.5
    worker.evaluation.reached_at = 7.9  # met by the lost step
    assert emulation.after_step(3, samples=30) == (2, 20)
    assert torch.equal(worker.model.weight, saved_model)
    assert torch.equal(worker.optimizer.state_dict()["state"][0]["momentum_buffer"], saved_momentum)
    assert worker.evaluation.reached_at is None
    assert worker.ctx.clock.elapsed() == 38.0  # the restart skipped
    assert [value for name, value in worker.interval.values if name == "up"] == [1.0, 1.0, 0.0]
    assert emulation.totals() == {"failures": 1, "lost_seconds": 5 + 1 + 30, "lost_steps": 1,
                                  "checkpoints": 1}
