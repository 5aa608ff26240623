"""The emulated cluster (`compute`): modeled step times, the time scale, the overrun measure,
and the arithmetic a cluster of identical devices must obey.

Assertions are on recorded values (modeled seconds, samples per second, step counts). Runs use
a time scale large enough that the real work of a few workers fits on a loaded 2-core machine;
steps where it did not fit are recorded as overrun and left out where a test compares times.
"""

from __future__ import annotations

import math
import re
import shutil
import sqlite3
import time
from pathlib import Path

import pytest

from conftest import dsgd, dsgd_in_process, write_spec
from dsgd_cli.spec.compute_model import (PaddedCompute, mean_factor, overrun_advice,
                                    variation_factor)
from dsgd_cli.errors import SpecError
from dsgd_cli.worker import checkpoint
from dsgd_cli.spec.experiments import load_spec
from dsgd_cli.results.store import Store


# -- the spec -----------------------------------------------------------------------------------

@pytest.mark.parametrize("section,message", [
    ("{step_seconds: 0}", "compute.step_seconds: expected a number > 0 and <= 86400, got 0"),
    ("{step_seconds: -0.5}", "compute.step_seconds: expected a number > 0 and <= 86400, got -0.5"),
    ("{step_seconds: fast}", "compute.step_seconds: expected a number > 0 and <= 86400, got 'fast'"),
    ("{time_scale: 4}", "compute.step_seconds: required: the modeled seconds of one step"),
    ("{step_seconds: 0.1, time_scale: 0.5}",
     "compute.time_scale: expected a number >= 1 and <= 100000, got 0.5"),
    ("{step_seconds: 0.1, variation: {distribution: pareto, alpha: 2}}",
     "compute.variation.distribution: expected one of lognormal, shifted_exponential, got 'pareto'"),
    ("{step_seconds: 0.1, variation: {distribution: [lognormal], sigma: 1}}",
     "compute.variation.distribution: expected one of lognormal, shifted_exponential, got ['lognormal']"),
    ("{step_seconds: 0.1, variation: {distribution: lognormal}}",
     "compute.variation.sigma: required for lognormal"),
    ("{step_seconds: 0.1, variation: {distribution: lognormal, sigma: -1}}",
     "compute.variation.sigma: expected a number >= 0 and <= 5, got -1"),
    ("{step_seconds: 0.1, variation: {distribution: shifted_exponential, sigma: 1}}",
     "compute.variation.sigma: unknown key"),
    ("{step_seconds: 0.1, slots: 3}", "compute.slots: unknown key"),
    # An integer beyond the floats (the fuzz tests found it crashing with OverflowError)
    ("{step_seconds: 0.1, time_scale: 1" + "0" * 400 + "}",
     "compute.time_scale: expected a number >= 1 and <= 100000, got 1000000000000000000000"),
    ("0.1", "compute: expected a mapping with keys step_seconds, variation, time_scale"),
    ("{step_seconds: 10, time_scale: 100}",
     "compute: a step lasts 1000 real seconds (step_seconds × time_scale × slowdown), not "
     "less than the timeout (600 s)"),
])
def test_compute_is_validated(tmp_path, section, message):
    spec = write_spec(tmp_path, f"""
        experiments:
          - {{name: a, task: logreg, compute: {section}}}
    """)
    with pytest.raises(SpecError) as error:
        load_spec(spec)
    assert str(error.value).startswith(f"{spec}: experiments[0].{message}")


def test_a_bad_compute_section_is_one_line_exit_2_and_nothing_recorded(tmp_path):
    spec = write_spec(tmp_path, """
        defaults: {task: logreg, compute: {step_seconds: 0.05, time_scale: 0}}
        experiments:
          - {name: a}
    """)
    result = dsgd_in_process("run", str(spec), "--db", str(tmp_path / "r.db"))
    assert result.returncode == 2
    assert result.stderr.strip() == (f"dsgd: error: {spec}: defaults.compute.time_scale: "
                                     "expected a number >= 1 and <= 100000, got 0")
    assert not (tmp_path / "r.db").exists()


def test_compute_is_recorded_in_the_config(tmp_path):
    spec = write_spec(tmp_path, """
        experiments:
          - name: a
            task: logreg
            compute: {step_seconds: 0.05, variation: {distribution: shifted_exponential, tail: 0.5}}
    """)
    (experiment,) = load_spec(spec)
    assert experiment.config["compute"] == {
        "step_seconds": 0.05, "time_scale": 1.0, "ring_max": 64,
        "variation": {"distribution": "shifted_exponential", "tail": 0.5}}


# -- the model ---------------------------------------------------------------------------------

@pytest.mark.parametrize("variation", [{"distribution": "lognormal", "sigma": 0.5},
                                       {"distribution": "shifted_exponential", "tail": 0.4}])
def test_variation_draws_follow_seed_rank_step_and_have_the_documented_mean(variation):
    draws = [variation_factor(variation, 7, 3, step) for step in range(20_000)]
    assert draws[:50] == [variation_factor(variation, 7, 3, step) for step in range(50)]
    assert draws[:50] != [variation_factor(variation, 8, 3, step) for step in range(50)]
    assert draws[:50] != [variation_factor(variation, 7, 4, step) for step in range(50)]
    assert sum(draws) / len(draws) == pytest.approx(mean_factor(variation), rel=0.03)
    if variation["distribution"] == "shifted_exponential":
        assert min(draws) >= 1.0  # step_seconds is the fastest a step can be
    else:
        assert sorted(draws)[len(draws) // 2] == pytest.approx(1.0, rel=0.03)  # the median


def _padded(step_seconds: float, scale: float) -> PaddedCompute:
    compute = {"step_seconds": step_seconds, "variation": None, "time_scale": scale}
    return PaddedCompute(compute, seed=0, rank=0, blocked=lambda: 0.0)


def test_a_window_lasts_its_modeled_time_times_the_scale():
    padding = _padded(0.01, 3)
    for step in range(4):
        opened = time.perf_counter()
        padding.start(step, slowdown=2)
        overrun = padding.finish()
        assert time.perf_counter() - opened >= 0.01 * 3 * 2  # sleeps never end early
        assert overrun < 0.25  # a sleep may wake up late on a loaded machine, not much
    assert padding.steps == 4


def test_real_work_beyond_the_modeled_time_is_measured_as_overrun():
    padding = _padded(0.001, 1)
    padding.start(0)
    time.sleep(0.02)  # 20 times the modeled step: at least 19 budgets beyond it
    assert padding.finish() >= 19
    assert (padding.steps, padding.overran_steps) == (1, 1)


def test_blocked_communication_in_the_window_is_not_compute():
    blocked = [0.0]
    compute = {"step_seconds": 0.01, "variation": None, "time_scale": 1}
    padding = PaddedCompute(compute, seed=0, rank=0, blocked=lambda: blocked[0])
    padding.start(0)
    waited = time.perf_counter()
    time.sleep(0.05)  # 5 budgets: an overrun of 4 if it counted as compute
    # All of it, as long as the sleep lasted on a loaded machine, was spent waiting for a peer.
    blocked[0] += time.perf_counter() - waited
    assert padding.finish() == 0


class _Run:
    def __init__(self, overrun_steps, config):
        self.config = config
        self.summaries = [] if overrun_steps is None else [
            type("S", (), {"name": "overrun_steps", "final": overrun_steps})()]


def test_the_advice_names_the_time_scale_only_past_the_threshold():
    config = {"compute": {"step_seconds": 0.05, "variation": None, "time_scale": 4}}
    assert overrun_advice(_Run(None, {})) is None
    assert overrun_advice(_Run(0.05, config)) is None
    assert overrun_advice(_Run(0.12, config)) == (
        "12% of steps overran their modeled time by more than 5%, so its times are not the "
        "modeled cluster's: raise compute.time_scale (now 4)")


# -- real runs: the timeline -------------------------------------------------------------------

STEPS = 10
STEP_SECONDS = 0.03
LOGNORMAL = {"distribution": "lognormal", "sigma": 0.5}


@pytest.fixture(scope="module")
def timeline(tmp_path_factory):
    """One `dsgd run`: three runs with a lognormal step time (two with seed 0, one with seed 1)
    whose workers never communicate, allreduce at time scales 4 and 8 over an emulated
    link, a seconds budget, and a run whose every step overruns (checkpointed at steps 4 and
    8). Returns the runs by name, the store, `dsgd run`'s stderr, the database and the
    checkpoint directory."""
    tmp = tmp_path_factory.mktemp("emulation")
    spec = write_spec(tmp, f"""
        defaults:
          task: {{name: logreg}}
          workers: 2
          epochs: 1
          batch_size: 16
          log_interval: 1
          steps_per_epoch: {STEPS}
          aggregator: {{name: local_sgd, period: 1000}}
        experiments:
          - name: seed0-a
            compute: &varied {{step_seconds: {STEP_SECONDS}, time_scale: 4,
                               variation: {{distribution: lognormal, sigma: 0.5}}}}
          - {{name: seed0-b, compute: *varied}}
          - {{name: seed1, seed: 1, compute: *varied}}
          - name: scale4
            steps_per_epoch: 30
            log_interval: 10
            aggregator: {{name: allreduce}}
            network: {{latency: 5ms}}
            compute: {{step_seconds: 0.02, time_scale: 4}}
          - name: scale8
            steps_per_epoch: 30
            log_interval: 10
            aggregator: {{name: allreduce}}
            network: {{latency: 5ms}}
            compute: {{step_seconds: 0.02, time_scale: 8}}
          - name: budget  # 0.3 modeled seconds: 1.2 real ones at time scale 4
            budget: {{seconds: 0.3, evaluations: 2}}
            compute: {{step_seconds: 0.03, time_scale: 4}}
          - name: overrun  # 10 microseconds: no real forward and backward is that fast
            compute: {{step_seconds: 0.00001}}
            checkpoint_every: 4
    """)
    db, checkpoints = tmp / "results.db", tmp / "ck"
    # In this process: the launch and its workers are real processes; the command's own
    # start-up (importing torch) is saved.
    result = dsgd_in_process("run", str(spec), "--db", str(db), "--checkpoint-dir",
                             str(checkpoints))
    assert result.returncode == 0, result.stdout + result.stderr
    store = Store(str(db))
    return {run.experiment: run for run in store.runs()}, store, result.stderr, db, checkpoints


def _per_step(store, run, metric) -> dict[tuple[int, int], float]:
    return {(m.rank, m.step): m.value for m in store.metric_history(run.id, metric)}


def test_the_same_seed_gives_the_same_modeled_step_times(timeline):
    runs, store, _, _, _ = timeline
    fitted = 0
    recorded = {name: _per_step(store, runs[name], "step_seconds")
                for name in ("seed0-a", "seed0-b", "seed1")}
    overrun = {name: _per_step(store, runs[name], "emulation_overrun")
               for name in ("seed0-a", "seed0-b")}
    assert len(recorded["seed0-a"]) == 2 * STEPS
    differ = 0
    for (rank, step), seconds in recorded["seed0-a"].items():
        modeled = STEP_SECONDS * variation_factor(LOGNORMAL, 0, rank, step - 1)
        other_seed = STEP_SECONDS * variation_factor(LOGNORMAL, 1, rank, step - 1)
        differ += not math.isclose(recorded["seed1"][rank, step], modeled, rel_tol=0.1)
        if overrun["seed0-a"][rank, step] or overrun["seed0-b"][rank, step]:
            continue  # the real work did not fit: that step's time is not the model's
        fitted += 1
        # The modeled compute, plus the real time of the rest of the step over the time scale.
        assert seconds == pytest.approx(modeled, rel=0.1, abs=0.002)
        assert recorded["seed0-b"][rank, step] == pytest.approx(seconds, rel=0.1, abs=0.002)
        if not math.isclose(modeled, other_seed, rel_tol=0.25):
            assert not math.isclose(seconds, other_seed, rel_tol=0.1)
    assert fitted >= STEPS  # at least half of the steps fit on a loaded machine
    assert differ >= STEPS  # another seed, another timeline


def test_time_scales_record_the_same_modeled_rate_and_stretch_real_time(timeline):
    runs, _, _, _, _ = timeline
    rates, real = {}, {}
    for name in ("scale4", "scale8"):
        run = runs[name]
        (final,) = [s.final for s in run.summaries if s.name == "samples_per_second"]
        rates[name] = final
        real[name] = (run.ended_at - run.started_at).total_seconds()
    # A step: 0.02 s of compute, then a ring all-reduce of 2 workers: 2 messages of 5 ms.
    expected_rate = 2 * 16 / (0.02 + 2 * 0.005)
    assert rates["scale4"] == pytest.approx(expected_rate, rel=0.1)
    assert rates["scale8"] == pytest.approx(rates["scale4"], rel=0.1)
    # 30 steps of 0.03 modeled seconds: 3.6 real seconds at scale 4, 7.2 at scale 8.
    assert 0.6 * 3.6 < real["scale8"] - real["scale4"] < 1.6 * 3.6
    assert real["scale8"] > 1.3 * real["scale4"]


# -- real runs: a cluster's arithmetic at 8 workers ----------------------------------------------

N, BATCH, T, STEPS_8 = 8, 16, 0.05, 12
MLP_PARAMETERS = 40 * 100 + 100 + 100 * 100 + 100 + 100 * 10 + 10  # mnist1d_mlp, hidden 100
BANDWIDTH, LATENCY = 10e6 / 8, 0.001  # 10 Mbit/s in bytes per second, 1 ms


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """One `dsgd run` of 8 workers without and with a straggler, and over an emulated link."""
    tmp = tmp_path_factory.mktemp("cluster")
    spec = write_spec(tmp, f"""
        defaults:
          task: {{name: logreg}}
          workers: {N}
          epochs: 1
          batch_size: {BATCH}
          steps_per_epoch: {STEPS_8}
          log_interval: 4
          compute: {{step_seconds: {T}, time_scale: 8}}
        experiments:
          - {{name: allreduce, aggregator: allreduce}}
          - name: allreduce-straggler
            aggregator: allreduce
            stragglers: {{ranks: [3], slowdown: 2}}
          - name: backup-straggler
            aggregator: {{name: backup, backups: 1}}
            stragglers: {{ranks: [3], slowdown: 2}}
          - name: allreduce-network
            task: {{name: mnist1d_mlp}}
            aggregator: allreduce
            network: {{bandwidth: 10Mbit, latency: 1ms}}
    """)
    return _run_by_name(spec, tmp / "results.db")


def _run_by_name(spec, db) -> tuple[dict, Store]:
    """`dsgd run SPEC` into DB, run in this process: its runs by experiment name, and the
    store."""
    result = dsgd_in_process("run", str(spec), "--db", str(db))
    assert result.returncode == 0, result.stdout + result.stderr
    store = Store(str(db))
    return {run.experiment: run for run in store.runs()}, store


def _final(run, metric: str) -> float:
    (value,) = [s.final for s in run.summaries if s.name == metric]
    return value


# Slow (40 s): the 8-worker launch. The default suite checks the same arithmetic on 4 nodes ×
# 2 workers in tests/test_cluster.py (ring all-reduce, stragglers under backup, speeds).
@pytest.mark.slow
def test_cluster_arithmetic_at_8_workers(cluster):
    runs, store = cluster
    for run in runs.values():  # the real work fit: the times below are the model's
        assert _final(run, "overrun_steps") <= 0.05, run.experiment
    full = N * BATCH / T
    assert _final(runs["allreduce"], "samples_per_second") == pytest.approx(full, rel=0.05)
    # Every step waits for the straggler's 2T.
    assert _final(runs["allreduce-straggler"], "samples_per_second") == pytest.approx(
        full / 2, rel=0.05)
    # Backup: the 7 others make every update at T and never wait for the straggler, which
    # adds a batch every 2T (dropped, but computed: samples count every worker's batches)
    # and ends the run when its last step, begun before the last update, is done.
    backup = runs["backup-straggler"]
    steps = {m.rank: m.step for m in store.metric_history(backup.id, "step_seconds")}
    assert [steps[rank] for rank in range(N) if rank != 3] == [STEPS_8] * (N - 1)
    assert steps[3] <= STEPS_8 // 2 + 1
    duration = max(STEPS_8 * T, steps[3] * 2 * T)
    assert _final(backup, "samples_per_second") == pytest.approx(
        sum(steps.values()) * BATCH / duration, rel=0.05)
    # T, then one ring all-reduce of the gradient (one bucket): 2(n-1) messages, each worker
    # sending 2(n-1)/n of the buffer (docs/results.md, "Metrics").
    ring = 2 * (N - 1) * LATENCY + 2 * (N - 1) / N * MLP_PARAMETERS * 4 / BANDWIDTH
    steps = [m.value for m in store.metric_history(runs["allreduce-network"].id, "step_seconds")]
    assert sum(steps) / len(steps) == pytest.approx(T + ring, rel=0.1)


def _plugin_clocks(tmp, time_scale: int) -> tuple[dict, Store]:
    """wagma waiting for a straggler, osgp waiting for a slow link, at one time scale: one
    `dsgd run`."""
    spec = write_spec(tmp, f"""
        defaults:
          task: {{name: logreg}}
          workers: 4
          batch_size: {BATCH}
          steps_per_epoch: 10
          log_interval: 1
          compute: {{step_seconds: 0.02, time_scale: {time_scale}}}
        experiments:
          - name: wagma
            aggregator: {{name: wagma, group_size: 2, tau: 1}}
            stragglers: {{ranks: [3], slowdown: 3}}
          - name: osgp
            task: {{name: mnist1d_mlp}}
            aggregator: {{name: osgp, tau: 1}}
            network: {{bandwidth: 10Mbit, latency: 1ms}}
    """)
    return _run_by_name(spec, tmp / "results.db")


@pytest.fixture(scope="module")
def plugin_clocks(tmp_path_factory):
    """`_plugin_clocks` at time scale 4."""
    return _plugin_clocks(tmp_path_factory.mktemp("plugin_clocks"), 4)


def _mean_after_first_step(store, run, metric: str, rank: int) -> float:
    values = [m.value for m in store.metric_history(run.id, metric) if m.rank == rank and m.step > 1]
    assert len(values) == 9, values
    return sum(values) / len(values)


def _plugin_waits(runs: dict, store: Store) -> tuple[float, float]:
    """Rank 0's mean wagma `wait_seconds` and osgp `gossip_wait_seconds` after the first step,
    once every run is known to have fit its modeled time."""
    for run in runs.values():
        assert _final(run, "overrun_steps") <= 0.05, run.experiment
    return (_mean_after_first_step(store, runs["wagma"], "wait_seconds", rank=0),
            _mean_after_first_step(store, runs["osgp"], "gossip_wait_seconds", rank=0))


def test_plugins_record_their_waits_in_modeled_seconds(plugin_clocks):
    """A plugin's own clock (wagma's `wait_seconds`, osgp's `gossip_wait_seconds`) is modeled
    time: at time scale 4 a clock in real seconds would read 4 times the values below. With
    tau 1 every wagma round is global and synchronous, so rank 0 waits for the straggler's
    extra 2T each step; an osgp round of a 15,210-parameter model over 10 Mbit/s (50 ms)
    hides only 20 ms of it behind a step."""
    wagma, osgp = _plugin_waits(*plugin_clocks)
    assert wagma == pytest.approx(2 * 0.02, rel=0.25)
    link = LATENCY + MLP_PARAMETERS * 4 / BANDWIDTH  # 50 ms
    assert osgp == pytest.approx(link - 0.02, rel=0.35), (wagma, osgp)


# Slow (10 s of time stretched 8 times): the default suite checks the same division by the
# time scale at scale 4 (test_plugins_record_their_waits_in_modeled_seconds, whose values
# would be 4 times larger in real seconds), and the runtime's at scales 4 and 8
# (test_time_scales_record_the_same_modeled_rate_and_stretch_real_time).
@pytest.mark.slow
def test_plugins_record_the_same_waits_at_time_scales_4_and_8(plugin_clocks, tmp_path):
    wagma4, osgp4 = _plugin_waits(*plugin_clocks)
    wagma8, osgp8 = _plugin_waits(*_plugin_clocks(tmp_path, 8))
    assert wagma8 == pytest.approx(wagma4, rel=0.2), (wagma4, wagma8)
    assert osgp8 == pytest.approx(osgp4, rel=0.3), (osgp4, osgp8)


def test_a_seconds_budget_is_in_modeled_seconds(timeline):
    runs, store, _, _, _ = timeline
    steps = {m.rank: m.step for m in store.metric_history(runs["budget"].id, "step_seconds")}
    # 0.3 / 0.03 = 10 steps (and the one that reads the last "time is up" flags); in real
    # seconds it would have been 0.3 / (0.03 × 4), 2 or 3 steps.
    assert set(steps) == {0, 1} and all(9 <= count <= 12 for count in steps.values()), steps
    assert _final(runs["budget"], "wall_seconds") == pytest.approx(0.3, abs=0.1)


def test_a_run_that_overran_is_told_to_raise_the_time_scale(timeline):
    runs, store, stderr, db, _ = timeline
    overrun = runs["overrun"]
    assert _final(overrun, "overrun_steps") == 1.0
    assert min(m.value for m in store.metric_history(overrun.id, "emulation_overrun")) > 1
    advice = ("100% of steps overran their modeled time by more than 5%, so its times are not "
              "the modeled cluster's: raise compute.time_scale (now 1)")
    # On a loaded machine another of the timeline's runs may overrun too: "(and 1 more)".
    told = re.compile(rf"dsgd: run {overrun.id} \(overrun\)( \(and \d+ more\))?: "
                      + re.escape(advice))
    assert any(told.fullmatch(line) for line in stderr.splitlines()), stderr
    shown = dsgd("show", str(overrun.id), "--db", str(db))
    assert f"emulation: {advice}" in shown.stdout.splitlines()
    for name in ("seed0-a", "scale4", "scale8"):  # those fit: no advice
        assert _final(runs[name], "overrun_steps") <= 0.05
        assert "emulation:" not in dsgd("show", str(runs[name].id), "--db", str(db)).stdout


def test_a_resumed_run_goes_on_counting_its_overrun_steps(timeline, tmp_path):
    """Every step of a 10-microsecond model overruns. Resumed from its step-4 checkpoint, a run
    writes a step-8 checkpoint that counts 8 emulated steps, 8 overrun, not the 4 since the
    resume, and the run's overrun_steps covers all its steps. The run is `timeline`'s
    `overrun`, resumed from a copy of its database and checkpoints (the other tests read the
    original)."""
    runs, _, _, recorded_db, recorded_checkpoints = timeline
    db, checkpoints = tmp_path / "r.db", tmp_path / "ck"
    with sqlite3.connect(recorded_db) as source, sqlite3.connect(db) as copy:
        source.backup(copy)
    shutil.copytree(recorded_checkpoints, checkpoints)
    store = Store(str(db))
    run = store.get_run(runs["overrun"].id)
    directory = checkpoints / Path(store.checkpoint_dir(run.id)).name
    assert checkpoint.steps(directory) == [4, 8]
    assert [checkpoint.load(directory, 4, rank)["progress"]["padding"] for rank in (0, 1)] \
        == [(4, 4), (4, 4)]
    shutil.rmtree(checkpoint.step_directory(directory, 8))
    store.finish_run(run.id, "failed", "recorded as failed by the test")
    result = dsgd_in_process("run", "--resume", str(run.id), "--db", str(db),
                             "--checkpoint-dir", str(checkpoints))
    assert result.returncode == 0, result.stdout + result.stderr
    assert [entry["step"] for entry in store.resumes(run.id)] == [4]
    assert [checkpoint.load(directory, 8, rank)["progress"]["padding"] for rank in (0, 1)] \
        == [(8, 8), (8, 8)]
    run = store.get_run(run.id)
    assert run.status == "completed"
    assert _final(run, "overrun_steps") == 1.0


# -- many workers ----------------------------------------------------------------------------------

@pytest.mark.slow
def test_32_workers_of_logreg_and_mnist1d_mlp_start_and_train(tmp_path):
    spec = write_spec(tmp_path, """
        defaults:
          workers: 32
          epochs: 1
          steps_per_epoch: 4
          batch_size: 16
          log_interval: 2
          compute: {step_seconds: 0.05, time_scale: 20}
        experiments:
          - {name: logreg, task: logreg}
          - {name: mlp, task: mnist1d_mlp}
    """)
    db = tmp_path / "results.db"
    result = dsgd("run", str(spec), "--db", str(db), timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    store = Store(str(db))
    for run in store.runs():
        assert run.status == "completed"
        steps = {(m.rank, m.step) for m in store.metric_history(run.id, "step_seconds")}
        assert steps == {(rank, step) for rank in range(32) for step in (2, 4)}
        assert _final(run, "samples_per_second") == pytest.approx(32 * 16 / 0.05, rel=0.25)
