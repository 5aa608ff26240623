"""Faults a run must survive: markup in names and errors, diverging training (NaN), and
numbers in spec files as people write them (NaN is an error, `1e-3` a number)."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from rich.text import Text
from typer.testing import CliRunner

from conftest import compare_json, dsgd, dsgd_in_process, experiment_config, write_spec
from dsgd_cli.launch import launcher
from dsgd_cli.launch import torchrun
from dsgd_cli.cli import app
from dsgd_cli.commands.run import status_markup
from dsgd_cli.errors import RunFailed, SpecError
from dsgd_cli.comm.events import EventReader, EventWriter, events_path
from dsgd_cli.launch.outcome import RunResult, WorkerExit, run_result, torchrun_failures
from dsgd_cli.options import option, parse_options
from dsgd_cli.spec.experiments import load_spec
from dsgd_cli.results.store import MetricRow, Store
from results_helpers import count_metrics

TINY = """
defaults:
  task: {name: logreg}
  workers: 2
  epochs: 1
  steps_per_epoch: 3
"""


def tiny_spec(directory: Path, experiments: str, name: str = "spec.yaml") -> Path:
    """A spec of tiny runs: `experiments` is the rest of the YAML after `defaults`."""
    return write_spec(directory, TINY + textwrap.dedent(experiments), name)

# -- names and error text are plain text, never rich markup ----------------------------------


def test_names_with_brackets_run_and_are_recorded(tmp_path):
    spec = tiny_spec(tmp_path, """
    experiments:
      - name: "a[bold]b"
      - name: g
        grid: {optimizer.lr: [0.1]}
    """)
    db = tmp_path / "r.db"
    result = dsgd("run", str(spec), "--db", str(db), env={"COLUMNS": "200"}, timeout=180)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "Traceback" not in output
    # Once in the progress bar, once in the summary table.
    assert result.stdout.count("g[optimizer.lr=0.1]") >= 2, result.stdout
    assert result.stdout.count("a[bold]b") >= 2, result.stdout
    rows = compare_json(db)
    assert [(r["experiment"], r["status"]) for r in rows] == [
        ("a[bold]b", "completed"), ("g[optimizer.lr=0.1]", "completed")]


def test_failure_reason_is_shown_as_plain_text():
    reason = "rank 0: RuntimeError: [/tmp/gloo.cc:42] Connection closed by peer [/127.0.0.1]:4242 [red]\\"
    markup = status_markup(RunResult(1, "a[/]b", "failed", reason, 0))
    text = Text.from_markup(markup)  # what the progress column does with it: must not raise
    assert text.plain == f"failed ({reason})"
    assert [(text.plain[s.start:s.end], str(s.style)) for s in text.spans] == [("failed", "red")]
    assert status_markup(RunResult(2, "x", "completed")) == "completed"


# -- NaN and infinity in a spec are errors -----------------------------------------------------


@pytest.mark.parametrize("text, expected", [
    ("experiments:\n  - {name: a, task: logreg, optimizer: {name: sgd, lr: .nan}}\n",
     "experiments[0].optimizer.lr: expected a finite number, got nan"),
    ("defaults: {optimizer: {name: sgd, lr: .inf}}\nexperiments:\n  - {name: a, task: logreg}\n",
     "defaults.optimizer.lr: expected a finite number, got inf"),
    ("experiments:\n  - {name: a, task: logreg, network: {latency: -.inf}}\n",
     "experiments[0].network.latency: expected a finite number, got -inf"),
    ("experiments:\n  - {name: a, task: logreg, grid: {optimizer.lr: [0.1, .NaN]}}\n",
     "experiments[0].grid.optimizer.lr[1]: expected a finite number, got nan"),
], ids=["option", "in defaults", "spec key", "grid value"])
def test_non_finite_numbers_are_spec_errors(tmp_path, text, expected):
    spec = tmp_path / "bad.yaml"
    spec.write_text(text)
    db = tmp_path / "results.db"
    result = dsgd_in_process("run", str(spec), "--db", str(db))  # refused before any launch
    assert result.returncode == 2, result.stderr
    message = result.stderr.strip()
    assert "\n" not in message and "Traceback" not in message
    assert message == f"dsgd: error: {spec}: {expected}"
    assert not db.exists()


@dataclass
class Numbers:
    lr: float = option(0.1, min=0.0)
    scale: float | None = option(None)
    weights: list[float] = option([])


@pytest.mark.parametrize("raw, path, shown", [
    ({"lr": float("nan")}, "a.lr", "nan"),
    ({"lr": float("-inf")}, "a.lr", "-inf"),
    ({"scale": float("inf")}, "a.scale", "inf"),
    ({"weights": [1.0, float("nan")]}, "a.weights[1]", "nan"),
])
def test_options_reject_non_finite_numbers(raw, path, shown):
    with pytest.raises(SpecError) as caught:
        parse_options(Numbers, raw, "a")
    assert caught.value.path == path
    assert caught.value.detail == f"expected a finite number, got {shown}"


# -- scientific notation ---------------------------------------------------------------------


def test_scientific_notation_loads_as_numbers(tmp_path):
    spec = tiny_spec(tmp_path, """
    experiments:
      - name: small
        target_accuracy: 5e-1
        optimizer: {name: sgd, lr: 1e-3, weight_decay: 0.0e+0}
      - name: large
        optimizer: {name: adam, lr: 1E6, eps: .5e-7}
      - name: not-numbers
        task: {name: logreg, features: 12}
        save_dir: 1e
    """)
    small, large, other = load_spec(spec)
    assert small.config["optimizer"]["lr"] == 0.001 and small.config["target_accuracy"] == 0.5
    assert large.config["optimizer"]["lr"] == 1000000.0 and large.config["optimizer"]["eps"] == 5e-8
    assert isinstance(large.config["optimizer"]["lr"], float)
    assert other.config["task"]["features"] == 12 and isinstance(other.config["task"]["features"], int)
    assert other.config["steps_per_epoch"] == 3 and isinstance(other.config["steps_per_epoch"], int)
    assert Path(other.config["save_dir"]).name == "1e"  # still a string


def test_scientific_notation_is_not_a_string_anymore(tmp_path):
    spec = tiny_spec(tmp_path, """
    experiments:
      - name: a
        optimizer: {name: sgd, lr: 1e-3}
        aggregator: {name: local_sgd, period: 2}
    """)
    result = dsgd_in_process("run", str(spec), "--dry-run")  # launches nothing
    assert result.returncode == 0, result.stderr
    assert "optimizer options: lr=0.001" in result.stdout
    bad = tiny_spec(tmp_path, """
    experiments:
      - {name: a, optimizer: {name: sgd, lr: e5}}
    """, name="bad.yaml")
    result = dsgd_in_process("run", str(bad), "--dry-run")
    assert result.returncode == 2
    assert "experiments[0].optimizer.lr: expected a number, got 'e5'" in result.stderr


# -- values that are not finite never reach the database ---------------------------------------


def test_store_drops_non_finite_values(tmp_path):
    store = Store(str(tmp_path / "r.db"))
    experiment = load_spec(tiny_spec(tmp_path, "experiments: [{name: a}]\n"))[0]
    run_id = store.create_run("a", experiment.config, None, [])
    store.add_metrics(run_id, [MetricRow("train_loss", 2.0, step=1, rank=0),
                               MetricRow("train_loss", float("nan"), step=2, rank=0),
                               MetricRow("train_loss", float("inf"), step=3, rank=0),
                               MetricRow("test_loss", float("-inf"), epoch=0)])
    store.add_metrics(run_id, [MetricRow("test_loss", float("nan"))])  # nothing left to insert
    store.finish_run(run_id, "diverged", "train_loss is nan at step 2 on rank 0", 0)
    assert [(m.step, m.value) for m in store.metric_history(run_id, "train_loss")] == [(1, 2.0)]
    assert count_metrics(store, run_id) == 1
    run = store.get_run(run_id)
    assert {s.name: (s.final, s.best) for s in run.summaries} == {"train_loss": (2.0, 2.0)}


def test_event_writer_writes_strict_json_only(tmp_path):
    path = events_path(tmp_path, 0)
    writer = EventWriter(path, 0)
    writer.metric("train_loss", 1.5, step=1)
    writer.metric("train_loss", float("nan"), step=2)
    writer.metric("test_loss", float("inf"), epoch=0)
    writer.write("diverged", step=2, name="train_loss", value=float("-inf"), at=time.time())
    writer.close()

    def no_constants(name):
        raise AssertionError(f"{name} in the events file")

    events = [json.loads(line, parse_constant=no_constants) for line in path.read_text().splitlines()]
    assert [(e["type"], e.get("step"), e["value"]) for e in events] == [
        ("metric", 1, 1.5), ("diverged", 2, "-inf")]


def test_event_writer_is_thread_safe(tmp_path):
    path = events_path(tmp_path, 1)
    writer = EventWriter(path, 1)

    def write_many(thread: int) -> None:
        for step in range(300):
            writer.metric(f"m{thread}", step + 0.5, step=step)

    threads = [threading.Thread(target=write_many, args=(t,)) for t in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    writer.close()
    events = EventReader(path).read()
    assert len(events) == 6 * 300
    for t in range(6):
        assert [e["step"] for e in events if e["name"] == f"m{t}"] == list(range(300))


# -- a diverged run: stopped at once, recorded, and the spec goes on ---------------------------

# Stands in for torchrun: both "workers" report, then rank 1's loss becomes NaN. It writes the
# NaN as a metric the way an old worker did (bare NaN in the JSON), then a `diverged` event,
# and rank 0 stays blocked in a collective that will never finish.
FAKE_TORCHRUN = """
import json, os, sys, time
while not os.path.exists(sys.argv[1]):  # started early, before the spec was validated
    time.sleep(0.01)
experiments = json.load(open(sys.argv[1]))["experiments"]

for index, entry in enumerate(experiments):
    config = entry["config"]  # each plan entry: the experiment's config and its run plan
    events = os.path.join(sys.argv[2], str(index))
    os.makedirs(events, exist_ok=True)
    diverges = config["name"].startswith("bad")

    def write(rank, **event):
        with open(f"{events}/rank{rank}.jsonl", "a") as file:
            file.write(json.dumps({"rank": rank, **event}) + "\\n")

    def metric(rank, step, value):
        write(rank, type="metric", name="train_loss", value=value, step=step, epoch=0,
              seconds=0.1 * step, per_rank=True)

    for rank in range(config["workers"]):
        write(rank, type="start", total_steps=3)
    for step in (1, 2, 3):
        for rank in range(config["workers"]):
            value = float("nan") if diverges and rank == 1 and step == 3 else 1.0 / step
            metric(rank, step, value)
    if diverges:
        write(1, type="diverged", step=3, name="train_loss", value="nan", at=time.time())
        time.sleep(120)
        sys.exit(1)
    for rank in range(config["workers"]):
        write(rank, type="done")
"""


@pytest.fixture
def fake_torchrun(tmp_path, monkeypatch):
    script = tmp_path / "fake_torchrun.py"
    script.write_text(FAKE_TORCHRUN)
    monkeypatch.setenv("DSGD_LAUNCHER", "torchrun")  # a stand-in for torchrun
    monkeypatch.setattr(torchrun, "command",
                        lambda shape, config, events: [sys.executable, str(script), str(config),
                                                       str(events)])


def test_run_result_names_the_first_problem(tmp_path):
    experiment = load_spec(tiny_spec(tmp_path, "experiments: [{name: a}]\n"))[0]
    diverged = {"type": "diverged", "rank": 1, "step": 12, "name": "train_loss", "value": "inf",
                "at": 100.0}
    peer_lost = {"type": "error", "rank": 0, "reason": "RuntimeError: [/x] Connection closed",
                 "at": 100.5}
    result = run_result(7, experiment, [peer_lost, diverged], set(), 1, "")
    assert result == RunResult(7, "a", "diverged", "train_loss is inf at step 12 on rank 1", 1)
    crashed = {**peer_lost, "at": 99.0}
    result = run_result(7, experiment, [diverged, crashed], set(), 1, "")
    assert (result.status, result.reason, result.failed_rank) == (
        "failed", "rank 0: RuntimeError: [/x] Connection closed", 0)
    assert run_result(7, experiment, [], {0, 1}, 0, "").status == "completed"


def test_launch_stops_a_diverged_run_at_once(tmp_path, fake_torchrun):
    experiment = load_spec(tiny_spec(tmp_path, "experiments: [{name: bad}]\n"))[0]
    store = Store(str(tmp_path / "r.db"))
    started = time.monotonic()
    result = launcher.launch(experiment, store, None)
    assert time.monotonic() - started < launcher.GRACE_AFTER_ERROR_S  # not waiting for rank 0
    assert result == RunResult(1, "bad", "diverged", "train_loss is nan at step 3 on rank 1", 1)
    run = store.get_run(1)
    assert (run.status, run.reason, run.failed_rank) == ("diverged", result.reason, 1)
    losses = store.metric_history(1, "train_loss")
    assert sorted((m.rank, m.step) for m in losses) == [(0, 1), (0, 2), (0, 3), (1, 1), (1, 2)]
    assert all(math.isfinite(m.value) for m in losses)
    assert {s.name: s.final for s in run.summaries} == {"train_loss": pytest.approx((1 / 3 + 1 / 2) / 2)}


def test_dsgd_run_goes_on_after_a_diverged_run(tmp_path, fake_torchrun):
    spec = tiny_spec(tmp_path, """
    experiments:
      - name: bad
      - name: good
    """)
    db = tmp_path / "r.db"
    result = CliRunner().invoke(app, ["run", str(spec), "--db", str(db)])
    assert isinstance(result.exception, RunFailed), result.output
    assert result.exception.exit_code == 1
    assert str(result.exception) == (
        "1 of 2 runs failed: bad (run 1): diverged: train_loss is nan at step 3 on rank 1")
    assert "diverged (train_loss is nan at step 3 on rank 1)" in result.output  # progress line
    lines = result.output.splitlines()
    bad = next(line for line in lines if line.startswith("1 ") and "bad" in line)  # summary rows
    good = next(line for line in lines if line.startswith("2 ") and "good" in line)
    assert "diverged" in bad and "completed" in good
    assert [(r.experiment, r.status) for r in Store(str(db)).runs()] == [
        ("bad", "diverged"), ("good", "completed")]


def test_a_real_worker_that_diverges_keeps_the_steps_before(tmp_path):
    """The issue's own example: SGD with lr 1e6 on mnist1d_mlp diverges within a few steps,
    inside the first log interval. The steps before it are flushed and kept; the next
    experiment of the spec runs."""
    spec = write_spec(tmp_path, """
        defaults: {task: mnist1d_mlp, workers: 2, steps_per_epoch: 20, log_interval: 50}
        experiments:
          - {name: bad, optimizer: {name: sgd, lr: 1.0e+6}}
          - {name: good, steps_per_epoch: 2}
    """)
    db = tmp_path / "r.db"
    result = dsgd_in_process("run", str(spec), "--db", str(db))
    assert result.returncode == 1, result.stdout + result.stderr
    store = Store(str(db))
    bad, good = store.runs()
    assert (bad.status, good.status) == ("diverged", "completed")
    diverged_at = int(bad.reason.split(" at step ")[1].split()[0])
    assert diverged_at >= 1 and bad.failed_rank in (0, 1)
    # The rank that diverged flushed its steps before the divergence (its peer may still be
    # waiting in that step's all-reduce when the run is stopped).
    losses = [m for m in store.metric_history(bad.id, "train_loss") if m.rank == bad.failed_rank]
    assert [m.step for m in losses] == [diverged_at] and math.isfinite(losses[0].value)


# -- signals and launch failures ----------------------------------------------------------------

def _workers(cli: subprocess.Popen) -> dict[int, tuple[int, str]]:
    """rank -> (pid, temp dir) of the workers a `dsgd run` process has started (the children
    of its fork server, each named dsgd-rank-N, with the server's arguments), once they are
    there."""
    workers, parents = {}, [cli.pid]
    while parents:
        children = subprocess.run(["pgrep", "-P", ",".join(map(str, parents))],
                                  capture_output=True, text=True).stdout.split()
        parents = [int(pid) for pid in children]
        for pid in parents:
            try:
                args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                name = Path(f"/proc/{pid}/comm").read_text().strip()
            except OSError:
                continue
            if name.startswith("dsgd-rank-"):
                workers[int(name.removeprefix("dsgd-rank-"))] = (pid, args[-2].decode())
    return workers


def _alive(directory: str) -> list[str]:
    """Live processes whose arguments name a run's temp dir."""
    found = subprocess.run(["pgrep", "-af", directory], capture_output=True, text=True)
    return [line for line in found.stdout.splitlines() if "pgrep" not in line]


def _start_and_wait_for_training(spec: Path, db: Path, cwd: Path):
    """`dsgd run SPEC` in a subprocess, returned once its first run has recorded metrics and
    both workers are up, with the workers."""
    cli = subprocess.Popen([sys.executable, "-m", "dsgd_cli", "run", str(spec), "--db", str(db)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        time.sleep(0.5)
        if db.exists() and Store(str(db)).runs() and count_metrics(Store(str(db)), 1) > 4:
            workers = _workers(cli)
            if len(workers) == 2:
                return cli, workers
    cli.kill()
    raise AssertionError(f"training did not start: {cli.communicate()}")


@pytest.mark.parametrize("signum,exit_code", [
    pytest.param(signal.SIGTERM, 143, marks=pytest.mark.slow),  # the same path as SIGINT
    (signal.SIGINT, 130),
    pytest.param(signal.SIGHUP, 129, marks=pytest.mark.slow)],  # SIGHUP: SSH dropped
    ids=["SIGTERM", "SIGINT", "SIGHUP"])
def test_a_signal_interrupts_the_run_and_stops_its_processes(tmp_path, signum, exit_code):
    spec = write_spec(tmp_path, """
        experiments:
          - {name: long, task: logreg, epochs: 100000, log_interval: 1}
          - {name: never, task: logreg, steps_per_epoch: 2}
    """)
    db = tmp_path / "r.db"
    process, workers = _start_and_wait_for_training(spec, db, tmp_path)
    directory = workers[0][1]
    process.send_signal(signum)
    try:
        _, stderr = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == exit_code
    assert stderr.strip().splitlines()[-1] == "dsgd: interrupted"
    assert "Traceback" not in stderr
    (run,) = Store(str(db)).runs()  # the next experiment never started
    assert (run.status, run.reason) == ("interrupted", f"interrupted by {signum.name}")
    assert {s.name for s in run.summaries} >= {"train_loss"}
    assert _alive(directory) == []
    assert not Path(directory).exists()


def test_workers_leave_when_dsgd_is_killed_outright(tmp_path):
    """SIGKILL gives `dsgd run` no chance to stop its workers; they notice at their next
    log step that it is gone, and leave (torchrun with them), instead of training on for
    nobody. The run stays `running`: nothing was left to record its end."""
    spec = write_spec(tmp_path, """
        experiments:
          - {name: long, task: logreg, epochs: 100000, log_interval: 1}
    """)
    db = tmp_path / "r.db"
    process, workers = _start_and_wait_for_training(spec, db, tmp_path)
    directory = workers[0][1]
    process.kill()
    process.wait()
    deadline = time.monotonic() + 60
    while _alive(directory):
        assert time.monotonic() < deadline, f"still alive: {_alive(directory)}"
        time.sleep(0.2)
    (run,) = Store(str(db)).runs()
    assert run.status == "running"


def test_a_launch_that_cannot_start_is_recorded_as_failed(tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise OSError("no such program")

    monkeypatch.setattr(torchrun.subprocess, "Popen", refuse)
    spec = write_spec(tmp_path, """
        experiments:
          - {name: a, task: logreg, steps_per_epoch: 2}
    """)
    (experiment,) = load_spec(spec)
    store = Store(str(tmp_path / "r.db"))
    result = launcher.launch(experiment, store, str(spec))
    assert (result.status, result.reason) == ("failed", "cannot start torchrun: no such program")
    (run,) = store.runs()
    assert run.status == "failed" and run.ended_at is not None


TORCHRUN_SUMMARY = """\
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
dsgd_cli.worker.process FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-22_10:31:54
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 20063)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-22_10:31:54
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 20064)  (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 20064
============================================================
"""


def test_the_killed_rank_is_blamed_not_the_survivor():
    failures = torchrun_failures(TORCHRUN_SUMMARY)
    assert [(f.rank, f.exitcode) for f in failures] == [(1, -9), (0, 1)]
    (experiment,) = [launcher.Experiment("a", experiment_config("a", workers=2))]
    survivor = {"type": "error", "rank": 0, "reason": "RuntimeError: Connection closed by peer",
                "at": 1.0}
    result = run_result(1, experiment, [survivor], set(), 1, "", failures)
    assert (result.status, result.failed_rank, result.reason) == (
        "failed", 1, "rank 1: killed by SIGKILL")
    # A worker that dies at start-up without a word: its exit code, not torchrun's banner.
    result = run_result(1, experiment, [], set(), 1, "=====", [WorkerExit(1, 1)])
    assert (result.failed_rank, result.reason) == (1, "rank 1: exited with code 1")
    # A worker's own exception still names itself.
    own = {"type": "error", "rank": 1, "reason": "ValueError: bad", "at": 1.0}
    result = run_result(1, experiment, [own], set(), 1, "", [WorkerExit(1, 1)])
    assert result.reason == "rank 1: ValueError: bad"


@pytest.mark.parametrize("aggregator", [
    "allreduce", pytest.param("adpsgd", marks=pytest.mark.slow)])  # adpsgd: background threads
def test_a_worker_killed_by_a_signal_is_named_with_the_signal(tmp_path, aggregator):
    spec = write_spec(tmp_path, f"""
        experiments:
          - {{name: long, task: logreg, epochs: 100000, log_interval: 1,
              aggregator: {{name: {aggregator}}}}}
          - {{name: after, task: logreg, steps_per_epoch: 2}}
    """)
    db = tmp_path / "r.db"
    process, workers = _start_and_wait_for_training(spec, db, tmp_path)
    os.kill(workers[1][0], signal.SIGKILL)
    try:
        _, stderr = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 1
    assert "Traceback" not in stderr
    killed, after = Store(str(db)).runs()
    assert (killed.status, killed.failed_rank, killed.reason) == (
        "failed", 1, "rank 1: killed by SIGKILL")
    assert count_metrics(Store(str(db)), killed.id) > 4  # what it recorded is kept
    assert after.status == "completed"
    assert _alive(workers[0][1]) == []


def _record_one_run(path: str) -> None:
    store = Store(path)
    config = {"task": {"name": "t"}, "aggregator": {"name": "a"}, "compressor": {"name": "c"},
              "optimizer": {"name": "o"}, "workers": 2}
    store.finish_run(store.create_run("x", config, None, []), "completed")


@pytest.mark.slow  # end to end; test_store's test_processes_creating_one_database_at_once covers the same race 20 times
def test_processes_creating_a_new_database_at_once_all_succeed(tmp_path):
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    path = str(tmp_path / "new.db")
    processes = [context.Process(target=_record_one_run, args=(path,)) for _ in range(6)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(60)
    assert [p.exitcode for p in processes] == [0] * 6
    assert len(Store(path).runs()) == 6


# -- a worker that dies at start-up, a second interrupt, an error in dsgd itself ---------------

DIES_AT_START = """
import os, signal, sys
from dsgd_cli.worker import process as runtime
if os.environ["RANK"] == "1":
    {how}
runtime.main(sys.argv[1:])
"""


@pytest.mark.parametrize("how, reason", [
    # Slow: the same failure records as "exit code"; a worker killed by a signal is named so
    # by test_a_worker_killed_by_a_signal_is_named_with_the_signal[allreduce] (a real run)
    # and test_the_killed_rank_is_blamed_not_the_survivor (torchrun's records of a SIGKILL).
    pytest.param("os.kill(os.getpid(), signal.SIGKILL)", "rank 1: killed by SIGKILL",
                 marks=pytest.mark.slow),
    ("sys.exit(3)", "rank 1: exited with code 3"),
], ids=["signal", "exit code"])
def test_a_worker_that_dies_at_start_up_is_named(tmp_path, monkeypatch, how, reason):
    """Real torchrun, whose rank 1 dies before it writes a word: the reason comes from
    torchrun's failure records, not from its banner."""
    script = tmp_path / "dies_at_start.py"
    script.write_text(DIES_AT_START.format(how=how))
    torchrun_command = torchrun.command

    def command(shape, config, events):
        args = torchrun_command(shape, config, events)
        at = args.index("dsgd_cli.launch.relay")
        # instead of `-m dsgd_cli.launch.relay dsgd_cli.worker.process`
        return args[:at - 1] + [str(script)] + args[at + 2:]

    monkeypatch.setenv("DSGD_LAUNCHER", "torchrun")  # a stand-in for torchrun
    monkeypatch.setattr(torchrun, "command", command)
    (experiment,) = load_spec(tiny_spec(tmp_path, "experiments: [{name: a}]\n"))
    store = Store(str(tmp_path / "r.db"))
    result = launcher.launch(experiment, store, None)
    assert (result.status, result.failed_rank, result.reason) == ("failed", 1, reason)
    (run,) = store.runs()
    assert (run.status, run.failed_rank, run.reason) == ("failed", 1, reason)
    assert _alive(str(script)) == []


# Stands in for torchrun and one worker, which torchrun starts in a session of its own; both
# note a SIGTERM and carry on. Only SIGKILL stops them.
STUBBORN = """
import os, signal, subprocess, sys, time
config, events = sys.argv[1:3]
here = os.path.dirname(os.path.abspath(__file__))

def carry_on(*_):
    with open(os.path.join(here, "terminated"), "a") as file:
        file.write(f"{os.getpid()}\\n")

signal.signal(signal.SIGTERM, carry_on)
if sys.argv[3:] != ["worker"]:
    subprocess.Popen([sys.executable, __file__, config, events, "worker"], start_new_session=True)
else:
    os.makedirs(os.path.join(events, "0"), exist_ok=True)
    with open(os.path.join(events, "0", "rank0.jsonl"), "a") as file:
        file.write('{"type": "metric", "rank": 0, "name": "train_loss", "value": 0.5, "step": 1, '
                   '"epoch": 0, "seconds": 0.1, "per_rank": true}\\n')
while True:
    time.sleep(1)
"""

# `dsgd run` with the stand-in for torchrun, and no end to the wait after SIGTERM.
STUBBORN_DSGD = """
import os, sys
os.environ["DSGD_LAUNCHER"] = "torchrun"  # the stand-in is torchrun's
from dsgd_cli import cli
from dsgd_cli.launch import torchrun
torchrun.TERMINATE_WAIT_S = 600
torchrun.command = lambda shape, config, events: [
    sys.executable, {script!r}, str(config), str(events)]
sys.argv = ["dsgd", "run", {spec!r}, "--db", {db!r}]
cli.main()
"""


def _wait_for(condition, what: str, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"no {what} within {seconds} s"
        time.sleep(0.2)


def test_a_second_interrupt_kills_the_run_at_once(tmp_path):
    script = tmp_path / "stubborn.py"
    script.write_text(STUBBORN)
    spec = tiny_spec(tmp_path, "experiments: [{name: stubborn}, {name: never}]\n")
    db = tmp_path / "r.db"
    terminated = tmp_path / "terminated"
    code = STUBBORN_DSGD.format(script=str(script), spec=str(spec), db=str(db))
    cli = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        _wait_for(lambda: db.exists() and Store(str(db)).runs()
                  and count_metrics(Store(str(db)), 1) > 0, "metrics")
        cli.send_signal(signal.SIGINT)
        # Both got SIGTERM, and dsgd waits for them to go.
        _wait_for(lambda: terminated.exists() and len(terminated.read_text().split()) == 2,
                  "SIGTERM to torchrun and its worker", 30)
        assert cli.poll() is None
        cli.send_signal(signal.SIGINT)
        _, stderr = cli.communicate(timeout=30)
    finally:
        cli.kill()
        for line in _alive(str(script)):  # only if the test failed: nothing else is ours
            os.kill(int(line.split()[0]), signal.SIGKILL)
    assert cli.returncode == 130
    assert stderr == "dsgd: interrupted\n"
    (run,) = Store(str(db)).runs()
    assert (run.status, run.reason) == ("interrupted", "interrupted by SIGINT")
    assert {s.name: s.final for s in run.summaries} == {"train_loss": 0.5}
    assert _alive(str(script)) == []


def test_an_error_in_dsgd_during_a_run_fails_it_and_stops_its_processes(tmp_path, fake_torchrun):
    (experiment,) = load_spec(tiny_spec(tmp_path, "experiments: [{name: bad}]\n"))  # runs 120 s
    store = Store(str(tmp_path / "r.db"))

    def disk_full(run_id, rows):
        raise RuntimeError("disk full")

    store.add_metrics = disk_full
    with pytest.raises(RuntimeError, match="disk full"):
        launcher.launch(experiment, store, None)
    (run,) = store.runs()
    assert (run.status, run.reason) == ("failed", "dsgd failed: RuntimeError('disk full')")
    assert run.ended_at is not None
    assert _alive(str(tmp_path / "fake_torchrun.py")) == []
