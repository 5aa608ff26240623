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

    class Unknown(allreduce):
        failure_mode = "pause"

    with pytest.raises(SpecError, match="its state lives outside the process"):
        check_failures(config, Fragile, PATH)
    check_failures(config, Continuing, PATH)  # accepted: it goes on without the failed
    with pytest.raises(SpecError, match="unknown failure_mode 'pause'"):
        check_failures(config, Unknown, PATH)


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
    worker.config["workers"], worker.rank = workers, rank
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
        ctx.optimizer.zero_grad(set_to_none=True)
        aggregator.before_forward(step)
        if ctx.up:  # the runtime's order; a down step computes nothing
            for p in model.parameters():
                p.grad = p.detach() * (1 + rank) + step
        aggregator.after_backward(step)
        if ctx.up:
            ctx.optimizer.step()
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


def torch_allclose(a, b) -> bool:
    import torch
    return torch.allclose(a, b, rtol=0, atol=1e-12)


STEP, SLOWDOWN, FAIL_AT, OUTAGE = 0.02, 2, 0.3, 0.4


@pytest.fixture(scope="module")
def backup_outage(tmp_path_factory):
    """Backup workers, 4 workers and b = 1, modeled steps of 0.02 s with rank 2 twice as slow:
    the first 3 gradients of each update are those of ranks 0, 1 and 3 (an update per 0.02
    s), until node 3 is down from 0.3 s for 0.4 s: then ranks 0-2, the slow one included,
    make each update (one per 0.04 s)."""
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
          compute: {{step_seconds: {STEP}, time_scale: 5}}
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


def test_backup_update_rate_during_the_outage_is_the_remaining_workers(backup_outage):
    store, run = backup_outage
    updates = [r.seconds for r in store.metric_history(run.id, "updates_applied")
               if r.rank == 0]  # rank 0 applies every update, one per step
    before = sum(1 for seconds in updates if seconds <= FAIL_AT)
    during = sum(1 for seconds in updates if FAIL_AT < seconds <= FAIL_AT + OUTAGE)
    assert before == pytest.approx(FAIL_AT / STEP, abs=1)  # the 3 fastest of 4
    assert during == pytest.approx(OUTAGE / (SLOWDOWN * STEP), abs=1)  # ranks 0-2: the slow one
    down = [r.step for r in store.metric_history(run.id, "up") if r.rank == 3 and r.value == 0]
    assert len(down) == pytest.approx(OUTAGE / (SLOWDOWN * STEP), abs=1)
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
        ctx.optimizer.zero_grad(set_to_none=True)
        aggregator.before_forward(step)
        if ctx.up:
            for p in model.parameters():
                p.grad = p.detach() * (1 + rank) + step
        aggregator.after_backward(step)
        if ctx.up:
            ctx.optimizer.step()
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
