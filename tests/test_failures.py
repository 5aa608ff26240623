"""Failures on the modeled clock (dsgd_cli/spec/failures_spec.py,
dsgd_cli/emulation/failures.py, docs/failures.md): the spec section, the seeded schedule, the restart arithmetic driven by known step times, the
refusals, and one `dsgd run` launch (two experiments) checked on its recorded values."""

from __future__ import annotations

import math
import statistics

import pytest

from conftest import dsgd, write_spec
from dsgd_cli.emulation.failures import RestartTimeline, first_failures
from dsgd_cli.spec.failures_spec import FailureDomains, check_failures, node_of, parse_failures
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
    ("{name: adpsgd}", "do not run in step"),
    ("{name: wagma, group_size: 2}", "do not run in step"),
])
def test_aggregators_that_cannot_restart_refused(tmp_path, aggregator, why):
    with pytest.raises(SpecError, match=f"cannot run under failures: .*{why}") as error:
        load_spec(_spec(tmp_path, "{restart: 1s, mtbf: 1h}", aggregator))
    assert error.value.path == PATH


def _check(config, aggregator_cls):
    """`check_failures` of a small configuration without a cluster or a compute model."""
    budget = config.get("budget") or {}
    check_failures(config["failures"], aggregator_cls, PATH,
                   domains=FailureDomains(config["workers"], on_cluster=False),
                   samples_budget=budget.get("samples") is not None, step_seconds=None)


def test_failure_mode_declared_by_a_plugin_is_obeyed():
    allreduce = registry.load("aggregator", "allreduce")
    config = {"workers": 2, "failures": _options(mtbf=10)}
    _check(config, allreduce)  # the default, restart: accepted

    class Fragile(allreduce):
        failure_mode = None
        failure_refusal = "its state lives outside the process"

    class Continuing(allreduce):
        failure_mode = "continue"

    class Unknown(allreduce):
        failure_mode = "pause"

    with pytest.raises(SpecError, match="its state lives outside the process"):
        _check(config, Fragile)
    _check(config, Continuing)  # accepted: it goes on without the failed
    with pytest.raises(SpecError, match="unknown failure_mode 'pause'"):
        _check(config, Unknown)


def test_samples_budget_refused():
    allreduce = registry.load("aggregator", "allreduce")
    config = {"workers": 2, "failures": _options(mtbf=10),
              "budget": {"samples": 100, "seconds": None}}
    with pytest.raises(SpecError, match="samples budget") as error:
        _check(config, allreduce)
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


# The same experiment twice (twice-a, twice-b): allreduce on 2 workers, 12 steps of 0.05
# modeled seconds, node 1 failing at 0.025 s (fixed) and at 0.591 s (mtbf 3 s, seed 7; the
# next failure, 5.98 s, is long past the run's end). Both strike in the middle of a step
# (the first, and the first after the restart), so that both runs decide them at the same
# step even with 40 ms of real time beyond the model per step (the clock is real time /
# time_scale): each loses that step and restarts (0.5 s); 3 checkpoints are written (0.02 s).
TWICE = """
            compute: {step_seconds: 0.05, time_scale: 2}
            optimizer: {name: sgd, lr: 0.1}
            failures: {restart: 0.5s, mtbf: 3s, seed: 7, checkpoint_every: 4,
                       checkpoint_seconds: 0.02s, at: [{node: 1, time: 0.025s}]}"""


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """Four experiments in one `dsgd run`: TWICE's two, and two of allreduce with momentum,
    checkpoints every 4 steps of 0.02 modeled seconds that cost 0.5 s; one without a
    failure within the run, one with a failure at 0.3 s, during the first checkpoint's
    write (steps 1-4 end by 0.15 s even on a loaded machine; the write ends after 0.5 s):
    it takes effect at step 5's boundary."""
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
          - name: twice-a{TWICE}
          - name: twice-b{TWICE}
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
        experiment=types.SimpleNamespace(workers=1, failures=failures, cluster=None),
        model=model, optimizer=optimizer,
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


# -- continue -------------------------------------------------------------------------------

def test_outage_lasts_restart_and_a_failure_while_down_is_part_of_it():
    from dsgd_cli.emulation.failures import OutageSchedule

    schedule = OutageSchedule(_options(restart=10, at=[
        {"node": 1, "time": 5}, {"node": 1, "time": 8}, {"node": 0, "time": 12},
        {"node": 1, "time": 15}]), nodes=2)
    down = []
    for now in (0, 4.9, 5, 12, 14.9, 15, 22, 25):
        schedule.advance(now)
        down.append(sorted(schedule.down_nodes(now)))
    # A node that fails at T is down from T until T + restart, the end excluded.
    assert down == [[], [], [1], [0, 1], [0, 1], [0, 1], [1], []]
    assert schedule.outages == [1, 2]  # node 1's failure at 8 was part of its first outage
    schedule = OutageSchedule(_options(restart=10, at=[{"node": 0, "time": 12},
                                                       {"node": 1, "time": 15}]), nodes=2)
    schedule.advance(20)
    assert schedule.next_recovery(20) == 22


class _Recorder:
    """An aggregator in step that records the failure hooks it is told."""

    asynchronous = steps_may_differ = decides_stop = False
    failure_mode = "continue"

    def __init__(self):
        self.calls = []

    def worker_left(self, rank, step):
        self.calls.append(("left", rank, step))

    def worker_rejoined(self, rank, step, source):
        self.calls.append(("rejoined", rank, step, source))


def _continuing(failures: dict, workers: int, rank: int):
    from dsgd_cli.emulation.failures import ContinueEmulation, emulate_failures

    worker, real = _worker(failures)
    worker.experiment.workers, worker.rank = workers, rank
    worker.aggregator = _Recorder()
    emulation = emulate_failures(worker, start=0.0)
    assert isinstance(emulation, ContinueEmulation)
    return worker, real, emulation


def _run_steps(worker, real, emulation, steps: int) -> list[bool]:
    """Steps of 1 modeled second, up or down (a down worker's clock follows its peers')."""
    ups = []
    for step in range(steps):
        ups.append(emulation.before_step(step))
        assert worker.ctx.up == ups[-1]
        real[0] += 1.0
        assert emulation.after_step(step + 1, 0) is None  # nothing is rolled back
    return ups


def test_continue_downs_the_failed_node_for_restart_seconds_then_it_rejoins():
    # Node 1 fails at 2.5 s for 3 s: the steps that start at 3, 4 and 5 s are down.
    worker, real, emulation = _continuing(
        _options(restart=3, at=[{"node": 1, "time": 2.5}]), workers=2, rank=1)
    assert _run_steps(worker, real, emulation, 8) == [True] * 3 + [False] * 3 + [True] * 2
    assert [value for name, value in worker.interval.values if name == "up"] == [
        1.0] * 3 + [0.0] * 3 + [1.0] * 2
    # Told before the first down step and before the first step back, from rank 0.
    assert worker.aggregator.calls == [("left", 1, 3), ("rejoined", 1, 6, 0)]
    assert emulation.totals() == {"node_failures": 1, "lost_seconds": 3.0, "down_steps": 3}


def test_continue_live_worker_sees_the_other_leave_and_counts_no_loss():
    worker, real, emulation = _continuing(
        _options(restart=3, at=[{"node": 1, "time": 2.5}]), workers=2, rank=0)
    assert _run_steps(worker, real, emulation, 8) == [True] * 8
    assert worker.aggregator.calls == [("left", 1, 3), ("rejoined", 1, 6, 0)]
    # Node 1's outage is counted by node 1's first rank, not here (the run sums them).
    assert emulation.totals() == {"node_failures": 0, "lost_seconds": 0.0, "down_steps": 0}


def test_continue_rejoiner_takes_the_state_of_a_worker_failing_at_that_boundary():
    # Node 1 is down for the steps starting at 1-3 s and back at 4 s, where node 0 goes
    # down: nobody stays up, so rank 1 takes rank 0's state, before rank 0 leaves.
    worker, real, emulation = _continuing(
        _options(restart=3, at=[{"node": 1, "time": 0.5}, {"node": 0, "time": 3.2}]),
        workers=2, rank=0)
    assert _run_steps(worker, real, emulation, 5) == [True] * 4 + [False]
    assert worker.aggregator.calls == [("left", 1, 1), ("rejoined", 1, 4, 0), ("left", 0, 4)]


def test_continue_with_every_node_down_the_clock_skips_to_the_first_recovery():
    worker, real, emulation = _continuing(
        _options(restart=3, at=[{"node": 0, "time": 1.5}]), workers=1, rank=0)
    assert _run_steps(worker, real, emulation, 4) == [True] * 4
    assert worker.ctx.clock.elapsed() == 4.0 + 2.5  # 4 steps, and 2 to 4.5 s skipped
    assert emulation.totals()["lost_seconds"] == 2.5


def _diloco_with_rank2_down_at_step2(rank, n):
    """DiLoCo, 3 workers, rounds of 2 steps, outer plain SGD (lr 0.7): rank 2 is down at
    step 2 and back at step 3, so it misses round 2 (steps 2-3) though it trains at step 3.
    Returns θ_global after round 1, each worker's model before round 2's outer step, and
    every worker's model after it."""
    import torch
    from torch import nn

    from dsgd_cli.api import Comm, WorkerContext, flatten
    from plugins.aggregators.diloco import DiLoCo

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Linear(3, 1).to(torch.float64)
    ctx = WorkerContext(rank=rank, world_size=n, device=torch.device("cpu"), model=model,
                        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                        comm=Comm(rank, n), metrics=_Interval(), seed=0, compressor=None,
                        config={"failures": {"restart": 1.0}})
    outer = {"name": "sgd", "lr": 0.7}
    aggregator = DiLoCo(DiLoCo.Options(period=2, outer_optimizer=outer))
    aggregator.setup(ctx)
    flat = lambda: flatten([p.detach() for p in model.parameters()]).clone()  # noqa: E731
    result = {}
    for step in range(4):
        ctx.up = not (rank == 2 and step == 2)
        if step == 2:
            aggregator.worker_left(2, step)
        if step == 3:
            aggregator.worker_rejoined(2, step, 0)
        _forward_backward_step(ctx, aggregator, model, rank, step)
        if step == 3:
            result["before"] = flat()
        aggregator.after_step(step)
        if step == 1:
            result["global_1"] = flatten(aggregator.outer.globals).clone()
    result["after"] = flat()
    return result


def test_diloco_round_averages_only_the_workers_up_all_round():
    from distributed import run_workers

    results = run_workers(_diloco_with_rank2_down_at_step2, 3, preloaded=True)
    global_1 = results[0]["global_1"]
    live_deltas = [global_1 - results[rank]["before"] for rank in (0, 1)]
    expected = global_1 - 0.7 * (live_deltas[0] + live_deltas[1]) / 2
    # Rank 2 trained at step 3 (its Δ is not zero) but was down at step 2: not counted.
    assert not torch_equal(results[2]["before"], global_1)
    for rank in range(3):
        assert torch_allclose(results[rank]["after"], expected), rank


def torch_equal(a, b) -> bool:
    import torch
    return torch.equal(a, b)


def _forward_backward_step(ctx, aggregator, model, rank: int, step: int) -> None:
    """A training step up to the optimizer's, in the runtime's order, with a made-up gradient;
    a down worker computes nothing (the aggregator's `after_step` is the caller's)."""
    ctx.optimizer.zero_grad(set_to_none=True)
    aggregator.before_forward(step)
    if ctx.up:
        for p in model.parameters():
            p.grad = p.detach() * (1 + rank) + step
    aggregator.after_backward(step)
    if ctx.up:
        ctx.optimizer.step()


def torch_allclose(a, b) -> bool:
    import torch
    return torch.allclose(a, b, rtol=0, atol=1e-12)


STEP, SLOWDOWN, FAIL_AT, OUTAGE = 0.02, 2, 0.3, 0.4


@pytest.fixture(scope="module")
def backup_outage(tmp_path_factory):
    """Backup workers, 4 workers and b = 1, modeled steps of 0.02 s with rank 2 twice as slow:
    the first 3 gradients of each update are those of ranks 0, 1 and 3 (an update per 0.02
    s), until node 3 is down from 0.3 s for 0.4 s: then ranks 0-2, the slow one included,
    make each update (one per 0.04 s). Time scale 10: at 5 the rate counts flaked under load
    (13 updates before the failure against 15 ± 1)."""
    tmp = tmp_path_factory.mktemp("backup_failures")
    spec = write_spec(tmp, f"""
        defaults:
          task: {{name: logreg}}
          workers: 4
          epochs: 1
          steps_per_epoch: 60
          batch_size: 16
          log_interval: 1
          optimizer: {{name: sgd, lr: 0.1}}
          compute: {{step_seconds: {STEP}, time_scale: 10}}
          stragglers: {{ranks: [2], slowdown: {SLOWDOWN}}}
          aggregator: {{name: backup, backups: 1}}
        experiments:
          - name: backup
            failures: {{restart: {OUTAGE}s, at: [{{node: 3, time: {FAIL_AT}s}}]}}
    """)
    db = tmp / "results.db"
    result = dsgd("run", str(spec), "--db", str(db), timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    store = Store(str(db))
    (run,) = store.runs()
    return store, run


# A launch of 12 s at time scale 10 (5 flaked): slow (CI runs -m slow). The continue mode's
# rules are tested in process above (test_continue_*), and restart's launch runs by default.
@pytest.mark.slow
def test_backup_update_rate_during_the_outage_is_the_remaining_workers(backup_outage):
    store, run = backup_outage
    updates = [r.seconds for r in store.metric_history(run.id, "updates_applied")
               if r.rank == 0]  # rank 0 applies every update, one per step
    # The typical time between updates (a median: a step that overran its modeled time on a
    # loaded machine stretches one gap, not the rate).
    gaps = list(zip(updates, updates[1:]))
    before = statistics.median(b - a for a, b in gaps if b <= FAIL_AT)
    during = statistics.median(b - a for a, b in gaps
                               if FAIL_AT + SLOWDOWN * STEP < a and b <= FAIL_AT + OUTAGE)
    assert before == pytest.approx(STEP, rel=0.1)  # the 3 fastest of 4
    assert during == pytest.approx(SLOWDOWN * STEP, rel=0.1)  # ranks 0-2: the slow one
    down = [r.step for r in store.metric_history(run.id, "up") if r.rank == 3 and r.value == 0]
    assert len(down) == pytest.approx(OUTAGE / during, abs=1)
    assert down == list(range(down[0], down[0] + len(down)))  # one outage
    assert all(r.value == 1.0 for r in store.metric_history(run.id, "up") if r.rank != 3)
    # A down worker sends no gradient: its own is dropped at each of its down steps.
    dropped = {r.step: r.value for r in store.metric_history(run.id, "dropped_own")
               if r.rank == 3}
    assert all(dropped[step] == 1.0 for step in down)
    # ...and computes nothing: no forward or backward (it waits for the updates).
    compute = {r.step: r.value for r in store.metric_history(run.id, "compute_seconds")
               if r.rank == 3}
    assert all(compute[step] < STEP / 4 for step in down)
    assert all(seconds > STEP / 2 for step, seconds in compute.items() if step not in down)


@pytest.mark.slow  # the same launch as above
def test_backup_outage_costs_the_down_worker_seconds(backup_outage):
    _, run = backup_outage
    summary = _summaries(run)
    assert summary["failures"] == 1
    assert "lost_steps" not in summary  # nothing is rolled back under continue
    # The down steps span the outage, both ends quantized to rank 3's step boundaries
    # (a step each while it is down: it waits for the updates of the slow rank 2).
    assert summary["lost_seconds"] == pytest.approx(OUTAGE, abs=SLOWDOWN * STEP)
    # (the goodput divides by the workers' own modeled times, which differ a little)
    assert summary["goodput"] == pytest.approx(
        1 - summary["lost_seconds"] / (4 * summary["wall_seconds"]), rel=0.01)


def _sgp_with_rank2_down(rank, n):
    """SGP, 4 workers with different initial models and no training (lr 0), so that only
    push-sum moves the pairs: rank 2 is down for steps 1-3 and rejoins at step 4 from rank 0.
    Returns each step's (x, w) after its round, and the models right after the rejoin."""
    import torch
    from torch import nn

    from dsgd_cli.api import Comm, WorkerContext, flatten
    from plugins.aggregators.gossip.sgp import SGP

    torch.set_num_threads(1)
    torch.manual_seed(rank)  # the workers start apart
    model = nn.Linear(3, 1).to(torch.float64)
    ctx = WorkerContext(rank=rank, world_size=n, device=torch.device("cpu"), model=model,
                        optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
                        comm=Comm(rank, n), metrics=_Interval(), seed=0, compressor=None,
                        config={"failures": {"restart": 1.0}})
    aggregator = SGP(SGP.Options())
    aggregator.setup(ctx)
    flat = lambda: flatten([p.detach() for p in model.parameters()]).clone()  # noqa: E731
    result = {"pairs": []}
    for step in range(8):
        if step == 1:
            aggregator.worker_left(2, step)
        if step == 4:
            aggregator.worker_rejoined(2, step, 0)
            result["rejoined_model"] = flat()
            result["rejoined_weight"] = aggregator.state.weight
        ctx.up = not (rank == 2 and 1 <= step <= 3)
        ctx.optimizer.zero_grad(set_to_none=True)
        aggregator.before_forward(step)
        if ctx.up:
            for p in model.parameters():
                p.grad = torch.ones_like(p)
        aggregator.after_backward(step)
        if ctx.up:
            ctx.optimizer.step()
        aggregator.after_step(step)
        result["pairs"].append((aggregator.state.numerator.clone(), aggregator.state.weight))
    return result


def test_sgp_loses_the_failed_mass_and_conserves_the_live_mass():
    from distributed import run_workers

    results = run_workers(_sgp_with_rank2_down, 4, preloaded=True)

    def total(step, ranks):
        return (sum(results[r]["pairs"][step][0] for r in ranks),
                sum(results[r]["pairs"][step][1] for r in ranks))

    everyone, live = range(4), (0, 1, 3)
    x_start, w_start = total(0, everyone)
    assert w_start == pytest.approx(4.0, abs=1e-12)
    lost_x, lost_w = results[2]["pairs"][0]  # what rank 2 held when it failed
    assert 0 < lost_w < 4
    for step in (1, 2, 3):  # down: rank 2 holds nothing, the live mass is conserved
        assert results[2]["pairs"][step][1] == 0.0
        assert not results[2]["pairs"][step][0].any()
        x_live, w_live = total(step, live)
        assert w_live == pytest.approx(w_start - lost_w, abs=1e-12)
        assert torch_allclose(x_live, x_start - lost_x)
    # The rejoiner starts from rank 0's de-biased model; the total mass is unchanged by it
    # and conserved after it.
    assert torch_allclose(results[2]["rejoined_model"], results[0]["rejoined_model"])
    assert results[2]["rejoined_weight"] == results[0]["rejoined_weight"] > 0  # half each
    for step in (4, 5, 6, 7):
        x_all, w_all = total(step, everyone)
        assert w_all == pytest.approx(w_start - lost_w, abs=1e-12)
        assert torch_allclose(x_all, x_start - lost_x)
    # The de-biased models reach the average of the mass that survived (not the first
    # average: rank 2 failed before the workers agreed).
    target = (x_start - lost_x) / (w_start - lost_w)
    assert not torch_allclose(target, x_start / w_start)
    for rank in everyone:
        x, w = results[rank]["pairs"][7]
        assert torch_allclose(x / w, target), rank


@pytest.mark.slow
def test_launched_sgp_and_diloco_go_on_through_two_outages(tmp_path):
    """The real training loop under `continue`: nodes 2 then 0 down for 0.2 s each (overlapping,
    so rank 2 rejoins from rank 1), 4 workers; nothing deadlocks and the records add up."""
    spec = write_spec(tmp_path, """
        defaults:
          task: {name: logreg}
          workers: 4
          epochs: 1
          steps_per_epoch: 30
          batch_size: 16
          log_interval: 1
          optimizer: {name: sgd, lr: 0.1}
          compute: {step_seconds: 0.02, time_scale: 4}
          failures: {restart: 0.2s, at: [{node: 2, time: 0.1s}, {node: 0, time: 0.25s}]}
        experiments:
          - name: sgp
            aggregator: {name: sgp}
          - name: diloco
            aggregator: {name: diloco, period: 5}
    """)
    db = tmp_path / "results.db"
    result = dsgd("run", str(spec), "--db", str(db), timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    store = Store(str(db))
    for run in store.runs():
        summary = _summaries(run)
        assert summary["failures"] == 2
        assert summary["lost_seconds"] == pytest.approx(2 * 0.2, abs=2 * 2 * 0.02)
        up = store.metric_history(run.id, "up")
        for rank in range(4):
            pattern = "".join(str(int(r.value)) for r in up if r.rank == rank)
            assert len(pattern) == 30
            if rank in (0, 2):  # one outage each, about 0.2 s of 0.02 s steps
                assert pattern.count("0") == pytest.approx(10, abs=2)
                assert pattern.strip("1") == "0" * pattern.count("0")
            else:
                assert pattern == "1" * 30


def _streaming_with_rank2_down_at_step4(rank, n):
    """Streaming DiLoCo, 3 workers, H = 4 in F = 2 fragments (T = 2, no delay), outer plain
    SGD (lr 0.7): fragment 0 is averaged after steps 1 and 5, fragment 1 after 3 and 7. Rank
    2 is down at step 4 only: it misses fragment 0's round of steps 2-5 (and fragment 1's of
    4-7) but not fragment 1's of steps 0-3."""
    import torch
    from torch import nn

    from dsgd_cli.api import Comm, WorkerContext, flatten
    from plugins.aggregators.streaming_diloco import StreamingDiLoCo

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 1)).to(torch.float64)
    ctx = WorkerContext(rank=rank, world_size=n, device=torch.device("cpu"), model=model,
                        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                        comm=Comm(rank, n), metrics=_Interval(), seed=0, compressor=None,
                        config={"failures": {"restart": 1.0}})
    aggregator = StreamingDiLoCo(StreamingDiLoCo.Options(
        period=4, fragments=2, outer_optimizer={"name": "sgd", "lr": 0.7}))
    aggregator.setup(ctx)
    fragment = lambda f, what: flatten(  # noqa: E731
        [t.detach() for t in getattr(aggregator.outer[f], what)]).clone()
    result = {"global1_start": fragment(1, "globals")}
    for step in range(8):
        ctx.up = not (rank == 2 and step == 4)
        if step == 4:
            aggregator.worker_left(2, step)
        if step == 5:
            aggregator.worker_rejoined(2, step, 0)
        _forward_backward_step(ctx, aggregator, model, rank, step)
        for f, applied_at in ((0, 5), (1, 3)):
            if step == applied_at:
                result[f"local{f}"] = fragment(f, "params")
        aggregator.after_step(step)
        for f, applied_at in ((0, 1), (0, 5), (1, 3)):
            if step == applied_at:
                result[f"global{f}_{step}"] = fragment(f, "globals")
    return result


def test_streaming_diloco_fragment_round_averages_only_the_workers_up_all_round():
    from distributed import run_workers

    results = run_workers(_streaming_with_rank2_down_at_step4, 3, preloaded=True)
    # Fragment 0 after step 5: ranks 0 and 1 only (rank 2 was down at step 4).
    before = results[0]["global0_1"]
    deltas = [before - results[rank]["local0"] for rank in (0, 1)]
    assert torch_allclose(results[0]["global0_5"], before - 0.7 * (deltas[0] + deltas[1]) / 2)
    # Fragment 1 after step 3: every worker's (rank 2 was up for all of steps 0-3).
    start = results[0]["global1_start"]
    deltas = [start - results[rank]["local1"] for rank in range(3)]
    assert torch_allclose(results[0]["global1_3"], start - 0.7 * sum(deltas) / 3)
    for rank in range(3):  # the same θ_global everywhere
        assert torch_allclose(results[rank]["global0_5"], results[0]["global0_5"])
        assert torch_allclose(results[rank]["global1_3"], results[0]["global1_3"])


# -- determinism --------------------------------------------------------------------------------

class _CostlyComm(_Comm):
    """One worker alone, whose untracked all-reduce takes `cost` real seconds."""

    def __init__(self, real: list[float], cost: float):
        self.real, self.cost = real, cost

    def all_reduce(self, tensor, op):
        super().all_reduce(tensor, op)
        self.real[0] += self.cost


def test_restart_bookkeeping_stays_off_the_modeled_clock():
    # Steps of 1 s, a checkpoint after step 2 that costs 5 s; agreeing on each boundary's
    # time takes 0.25 real seconds, which the modeled cluster never spends: the clock reads
    # the steps and the write only, and the failure at 7.1 s is decided at step 3's end.
    from dsgd_cli.emulation.failures import FailureEmulation

    worker, real = _worker(_options(restart=30, checkpoint_every=2, checkpoint_seconds=5,
                                    at=[{"node": 0, "time": 7.1}]))
    worker.comm = _CostlyComm(real, cost=0.25)
    emulation = FailureEmulation(worker, start=0.0)
    for step in (1, 2):
        _train_step(worker, real)
        assert emulation.after_step(step, samples=0) is None
    assert worker.ctx.clock.elapsed() == 7.0
    _train_step(worker, real)
    assert emulation.after_step(3, samples=0) == (2, 0)
    assert worker.ctx.clock.elapsed() == 8.0 + 30
    assert emulation.totals()["lost_seconds"] == 5 + 1 + 30


def test_continue_bookkeeping_stays_off_the_modeled_clock():
    # The agreement (0.25 s) and the hooks (a rejoiner's state transfer, 0.5 s) are free.
    worker, real, emulation = _continuing(
        _options(restart=3, at=[{"node": 1, "time": 2.5}]), workers=2, rank=1)
    worker.comm = _CostlyComm(real, cost=0.25)
    calls = worker.aggregator.calls

    class _SlowHooks(_Recorder):
        def worker_left(self, rank, step):
            real[0] += 0.5
            calls.append(("left", rank, step))

        def worker_rejoined(self, rank, step, source):
            real[0] += 0.5
            calls.append(("rejoined", rank, step, source))

    worker.aggregator = _SlowHooks()
    assert _run_steps(worker, real, emulation, 8) == [True] * 3 + [False] * 3 + [True] * 2
    assert calls == [("left", 1, 3), ("rejoined", 1, 6, 0)]
    assert worker.ctx.clock.elapsed() == 8.0
    assert emulation.totals()["lost_seconds"] == 3.0


# Node 1 fails at 3.01 s: rank 0's own clock reaches 3.0 at its third boundary, rank 1's
# (steps of 1.03 s) 3.09: only the agreed time (their maximum) makes both decide it there.
# Seeded failures of node 0 (8.79 s and 11.6 s) come on top.
AGREED = {"restart": "2s", "mtbf": "6s", "seed": 6, "at": [{"node": 1, "time": 3.01}]}


def _two_workers_twice(rank, n):
    """The same failures twice, on 2 workers whose modeled steps last 1 s (rank 0) and 1.03 s
    (rank 1), under `restart` and under `continue`: what each emulation decided, step by
    step, and its totals."""
    from dsgd_cli.api import Comm
    from dsgd_cli.emulation.failures import ContinueEmulation, FailureEmulation

    def worker_of(failures):
        worker, real = _worker(parse_failures(failures, PATH))
        worker.experiment.workers, worker.rank, worker.comm = n, rank, Comm(rank, n)
        return worker, real

    runs = []
    for _ in range(2):
        worker, real = worker_of({**AGREED, "checkpoint_every": 3, "checkpoint_seconds": "0.5s"})
        restart, step, restart_ups = FailureEmulation(worker, start=0.0), 0, []
        while step < 12:
            _train_step(worker, real, seconds=1.0 + 0.03 * rank)
            back_to = restart.after_step(step + 1, samples=0)
            restart_ups.append(back_to is None)
            step = step + 1 if back_to is None else back_to[0]
        worker, real = worker_of(AGREED)
        worker.aggregator = _Recorder()
        continuing, continue_ups = ContinueEmulation(worker, start=0.0), []
        for step in range(12):
            continue_ups.append(continuing.before_step(step))
            real[0] += 1.0 + 0.03 * rank
        runs.append({"restart_ups": restart_ups, "restart": restart.totals(),
                     "continue_ups": continue_ups, "continue": continuing.totals(),
                     "hooks": worker.aggregator.calls})
    return runs


def test_same_failures_same_decisions_on_every_worker_and_in_every_run():
    from distributed import run_workers

    results = run_workers(_two_workers_twice, 2, preloaded=True)
    for runs in results:
        assert runs[0] == runs[1]  # the same run twice: the same decisions and totals
    rank0, rank1 = results[0][0], results[1][0]
    # restart: every worker takes the same decisions and counts the same loss, bit for bit
    assert rank0["restart_ups"] == rank1["restart_ups"]
    assert rank0["restart"] == rank1["restart"]
    assert rank0["restart_ups"][2] is False  # 3.01 s: at the third boundary (3.09 s)
    assert rank0["restart"]["failures"] >= 2  # the fixed failure and seeded ones
    # continue: every worker is told the same departures and returns at the same steps
    assert rank0["hooks"] == rank1["hooks"] == [
        ("left", 1, 3), ("rejoined", 1, 5, 0), ("left", 0, 9), ("rejoined", 0, 11, 1)]
    assert [step for step, up in enumerate(rank1["continue_ups"]) if not up] == [3, 4]
    assert [step for step, up in enumerate(rank0["continue_ups"]) if not up] == [9, 10]


def test_launched_same_experiment_twice_same_failures_and_costs(launched):
    """`twice-a` and `twice-b`, the same experiment in the module's `dsgd run` (see
    TWICE): the same decisions at the same steps, and the same costs."""
    store, runs = launched
    first, again = _summaries(runs["twice-a"]), _summaries(runs["twice-b"])
    assert (first["failures"], first["lost_steps"]) == (2, 2)
    assert (again["failures"], again["lost_steps"]) == (2, 2)

    def ups(run):
        records = store.metric_history(run.id, "up")  # per rank in the order recorded
        return [(r.rank, r.step, r.value) for r in sorted(records, key=lambda r: r.rank)]
    assert ups(runs["twice-a"]) == ups(runs["twice-b"])
    assert [value for rank, _, value in ups(runs["twice-a"]) if rank == 0] == (
        [0.0, 0.0] + [1.0] * 12)
    # The costs: restarts and checkpoint writes exactly the same, the lost steps' time (the
    # clock is real time / time_scale) to within the jitter of the machine's real time,
    # well within one step (0.05 s) of each worker.
    assert again["lost_seconds"] == pytest.approx(first["lost_seconds"], abs=0.05)
    assert first["lost_seconds"] >= 2 * (2 * 0.5 + 3 * 0.02 + 2 * 0.05)
    assert again["goodput"] == pytest.approx(first["goodput"], abs=0.01)


# -- slowmo under `continue` ------------------------------------------------------------------

def _slowmo_with_rank2_down(rank, n, base):
    """SlowMo, 3 workers, τ = 4 (slow steps after steps 3 and 7), β = 0.5, α = 0.5, inner
    SGD with momentum at lr 0.1, over `base`: rank 2 is down for steps 2-6 and rejoins at 7
    from rank 0 (which has trained a step since the base's last average). Records the
    models (or push-sum pairs) around the slow step of step 3, the base's step 5, and the
    rejoin."""
    import torch
    from torch import nn

    from dsgd_cli.api import Comm, WorkerContext, flatten
    from plugins.aggregators.slowmo import SlowMo

    torch.set_num_threads(1)
    torch.manual_seed(0)  # the same initial model everywhere
    model = nn.Linear(3, 1).to(torch.float64)
    ctx = WorkerContext(rank=rank, world_size=n, device=torch.device("cpu"), model=model,
                        optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                        comm=Comm(rank, n), metrics=_Interval(), seed=0, compressor=None,
                        config={"failures": {"restart": 1.0}})
    aggregator = SlowMo(SlowMo.Options(period=4, slow_momentum=0.5, slow_lr=0.5, base=base))
    aggregator.setup(ctx)
    flat = lambda: flatten([p.detach() for p in model.parameters()]).clone()  # noqa: E731
    push_sum = aggregator.push_sum()
    pair = lambda: (push_sum.numerator.clone(), push_sum.weight)  # noqa: E731
    result = {"start": flat()}
    for step in range(8):
        if step == 2:
            aggregator.worker_left(2, step)
        if step == 7:
            aggregator.worker_rejoined(2, step, 0)
            result["rejoined"] = flat()
            result["inner_state"] = len(ctx.optimizer.state)
            result["slow_state"] = (aggregator.start.clone(), aggregator.velocity.clone())
        ctx.up = not (rank == 2 and 2 <= step <= 6)
        _forward_backward_step(ctx, aggregator, model, rank, step)
        if step in (3, 5):
            result[f"before{step}"] = flat()
            if push_sum is not None:
                push_sum.apply_update(aggregator.base.vector.read() - aggregator.base.before)
                aggregator.base.before = aggregator.base.vector.read()
                result[f"pair{step}"] = pair()
        aggregator.after_step(step)
        if step in (3, 5):
            result[f"after{step}"] = flat()
            if push_sum is not None:
                result[f"pair_after{step}"] = pair()
        if step == 3:
            result["velocity3"] = aggregator.velocity.clone()
    return result


def _slow_update(start, x_avg, lr=0.1, beta=0.5, alpha=0.5, velocity=0.0):
    velocity = beta * velocity + (start - x_avg) / lr
    return start - alpha * lr * velocity, velocity


def test_slowmo_over_local_sgd_averages_the_live_workers_and_the_rejoiner_takes_a_peers():
    from distributed import run_workers

    results = run_workers(_slowmo_with_rank2_down, 3,
                          {"name": "local_sgd", "period": 2}, preloaded=True)
    start = results[0]["start"]
    # The slow step after step 3 averages ranks 0 and 1 (rank 2 is down, its model stale).
    x_avg = (results[0]["before3"] + results[1]["before3"]) / 2
    expected, velocity = _slow_update(start, x_avg)
    for rank in range(3):
        assert torch_allclose(results[rank]["after3"], expected), rank
        assert torch_allclose(results[rank]["velocity3"], velocity), rank
    # The base's average after step 5: ranks 0 and 1 again.
    live5 = (results[0]["before5"] + results[1]["before5"]) / 2
    for rank in (0, 1):
        assert torch_allclose(results[rank]["after5"], live5), rank
    # The rejoiner takes rank 0's model, holds the same slow momentum state, and starts its
    # inner optimizer afresh.
    assert torch_equal(results[2]["rejoined"], results[0]["rejoined"])
    for got, want in zip(results[2]["slow_state"], results[0]["slow_state"]):
        assert torch_equal(got, want)
    assert results[2]["inner_state"] == 0 and results[0]["inner_state"] > 0


def test_slowmo_over_sgp_averages_the_surviving_mass():
    from distributed import run_workers

    base = {"name": "sgp", "topology": "time_varying_exponential", "peers_per_step": 1}
    results = run_workers(_slowmo_with_rank2_down, 3, base, preloaded=True)
    # Before the slow step of step 3 rank 2 holds no mass; x_avg is Σ x / Σ w of the rest.
    assert results[2]["pair3"][1] == 0.0 and not results[2]["pair3"][0].any()
    x_sum = sum(results[rank]["pair3"][0] for rank in range(3))
    w_sum = sum(results[rank]["pair3"][1] for rank in range(3))
    assert 0 < w_sum < 3
    expected, _ = _slow_update(results[0]["start"], x_sum / w_sum)
    for rank in (0, 1):  # push-sum restarts from the new model, weight 1, on the live workers
        numerator, weight = results[rank]["pair_after3"]
        assert weight == 1.0
        assert torch_allclose(numerator, expected), rank
    assert results[2]["pair_after3"][1] == 0.0  # the down worker stays massless
    # The rejoiner takes half of rank 0's (x, w): rank 0's de-biased model.
    assert torch_allclose(results[2]["rejoined"], results[0]["rejoined"])


# -- evaluation while workers are down --------------------------------------------------------

class _Classifier:
    """A task for `evaluate`: cross-entropy, correct when the arg-max is the label."""

    reports_perplexity = False

    def loss(self, output, target):
        import torch.nn.functional as F
        return F.cross_entropy(output, target)

    def count_correct(self, output, target):
        return int((output.argmax(1) == target).sum())


def _test_set():
    import torch
    generator = torch.Generator().manual_seed(0)
    return (torch.randn(30, 2, generator=generator, dtype=torch.float64),
            torch.randint(0, 2, (30,), generator=generator))


def _evaluate_with_rank2_down(rank, n):
    """3 workers with different models, rank 2 down for the step just done, evaluate the
    average model as the runtime does between steps. Returns each model and rank 0's
    recorded metrics."""
    import types

    import torch
    from torch import nn

    from dsgd_cli.api import Comm
    from dsgd_cli.worker.evaluation import WorkerEvaluation

    torch.manual_seed(rank)  # the workers' models differ
    model = nn.Linear(2, 2).to(torch.float64)
    aggregator = types.SimpleNamespace(
        asynchronous=False, models_identical=False, evaluation_model=lambda: model,
        ctx=types.SimpleNamespace(up=rank != 2))
    recorded = {}
    events = types.SimpleNamespace(
        metric=lambda name, value, **where: recorded.__setitem__(name, value))
    experiment = types.SimpleNamespace(target_accuracy=None, failures={"restart": 1.0},
                                       budget=None)
    evaluation = WorkerEvaluation(experiment, _Classifier(), aggregator, Comm(rank, n),
                                  *_test_set(), events, None, None)
    evaluation._evaluate(step=4, epoch=0)
    # Under a budget: the background evaluation of the same snapshot.
    from dsgd_cli.worker.model_evaluation import BackgroundEvaluation
    background_metrics = {}
    background = BackgroundEvaluation(
        Comm(rank, n), _Classifier(), model, *_test_set(),
        lambda values, step, epoch: background_metrics.update(values), None, live_only=True)
    background.snapshot(model, 4, 0, 1.0, evaluation._live())
    background.close()
    return {"model": {k: v.clone() for k, v in model.state_dict().items()},
            "metrics": recorded, "background": background_metrics}


def test_a_down_workers_stale_model_stays_out_of_the_average_model():
    import torch
    from torch import nn

    from dsgd_cli.worker.model_evaluation import evaluate
    from distributed import run_workers

    results = run_workers(_evaluate_with_rank2_down, 3, preloaded=True)
    metrics = results[0]["metrics"]
    x, y = _test_set()

    def model_of(state):
        model = nn.Linear(2, 2).to(torch.float64)
        model.load_state_dict(state)
        return model
    live = [results[rank]["model"] for rank in (0, 1)]
    average = model_of({k: (live[0][k] + live[1][k]) / 2 for k in live[0]})
    loss, correct, count = evaluate(_Classifier(), average, x, y)
    assert metrics["test_loss"] == pytest.approx(loss / count, rel=1e-12)
    assert metrics["test_accuracy"] == correct / count
    background = results[0]["background"]
    assert background["test_loss"] == pytest.approx(loss / count, rel=1e-12)
    own = [evaluate(_Classifier(), model_of(state), x, y) for state in live]
    assert metrics["test_loss_workers"] == pytest.approx(
        (own[0][0] + own[1][0]) / (2 * count), rel=1e-12)
    flat = lambda state: torch.cat([state["weight"].flatten(), state["bias"]])  # noqa: E731
    distances = [float((flat(state) - flat(average.state_dict())).norm()) for state in live]
    assert metrics["consensus_distance"] == pytest.approx(sum(distances) / 2, rel=1e-9)


# -- advise ------------------------------------------------------------------------------------

def _recorded_runs(db) -> None:
    """Synthetic runs, written through the store: allreduce under failures (goodput 0.8) and
    local SGD without, at 2, 4 and 8 workers; steps of 0.01 s; test accuracy 0.5, then 0.9
    from step 200 + 1600 / n."""
    from dsgd_cli.results.store import MetricRow

    store = Store(str(db))
    for aggregator, failures in (("allreduce", {"restart": 1.0, "mtbf": 10.0}),
                                 ("local_sgd", None)):
        for workers in (2, 4, 8):
            config = {"name": f"{aggregator}-{workers}", "workers": workers, "seed": 0,
                      "epochs": 1, "batch_size": 32, "task": {"name": "logreg"},
                      "optimizer": {"name": "sgd", "lr": 0.05},
                      "aggregator": {"name": aggregator}, "compressor": {"name": "none"},
                      "failures": failures}
            run_id = store.create_run(config["name"], config, None, [])
            target_step = 200 + 1600 // workers
            rows = [row for step in range(10, target_step + 101, 10) for row in (
                MetricRow("step_seconds", 0.01, step=step, epoch=0, rank=0,
                          seconds=step * 0.01),
                MetricRow("test_accuracy", 0.9 if step >= target_step else 0.5, step=step,
                          epoch=0, seconds=step * 0.01))]
            if failures:
                rows.append(MetricRow("goodput", 0.8))
            store.add_metrics(run_id, rows)
            store.finish_run(run_id, "completed")


def test_advise_flags_every_number_of_a_group_run_under_failures(tmp_path):
    import json

    from conftest import dsgd_in_process
    from dsgd_cli.results.advice import FAILURES_WARNING

    _recorded_runs(tmp_path / "r.db")
    result = dsgd_in_process("advise", "--db", str(tmp_path / "r.db"), "--target",
                             "test_accuracy=0.85", "--by", "aggregator", "--format", "json")
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    flagged = {row["aggregator"] for row in rows if FAILURES_WARNING in (row["warning"] or "")}
    assert flagged == {"allreduce"}
    assert all(FAILURES_WARNING in row["warning"] for row in rows
               if row["aggregator"] == "allreduce" and row["time_to_target"] is not None)


def test_failures_plot_draws_goodput_and_time_to_target(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    _recorded_runs(tmp_path / "r.db")
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "failures.py"
    output = tmp_path / "failures.png"
    result = subprocess.run([sys.executable, str(script), "--plot", str(tmp_path / "r.db"),
                             "--target", "test_accuracy=0.85", "-o", str(output)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert output.read_bytes()[:4] == b"\x89PNG"
    lines = result.stdout.splitlines()
    # allreduce-2 reaches 0.9 at step 1000, 10 s of 0.01 s steps; local SGD has no failures
    assert "allreduce-2  goodput 0.800  test_accuracy=0.85: 10.00 s" in lines[0]
    assert "local_sgd-2  goodput 1.000" in lines[3]
