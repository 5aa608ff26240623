"""The first launch's torchrun starts before the spec is validated: it is used when the
validated launch has its shape, stopped unused otherwise, and its workers never outlive the
`dsgd` that started them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import write_spec
from dsgd_cli.launch import launcher
from dsgd_cli.launch import torchrun
from dsgd_cli.spec.experiments import load_spec
from dsgd_cli.results.store import Store

SPEC = """
experiments:
  - {name: a, task: {name: logreg, samples: 256}, workers: 2, steps_per_epoch: 2}
"""


def _processes_marked(name: str, value: str) -> list[int]:
    """Live processes whose environment has NAME=VALUE."""
    marker = f"{name}={value}".encode()
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if marker in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def _workers_forked(run_dir: str) -> list[int]:
    """The launch's workers: its processes that the fork server forked and named."""
    return [pid for pid in _processes_marked(torchrun.RUN_MARKER, run_dir)
            if _name(pid).startswith("dsgd-rank-")]


def _name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _wait_until_none(name: str, value: str, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while _processes_marked(name, value):
        assert time.monotonic() < deadline, f"processes with {name}={value} still alive"
        time.sleep(0.2)


def test_the_early_fork_server_serves_the_first_launch(tmp_path, monkeypatch):
    """On one machine dsgd's agent starts the workers once the spec is valid: the early
    start is the fork server's, and the launch uses that server."""
    spec = write_spec(tmp_path, SPEC)
    early = torchrun.early_start(spec, None, None, None)
    assert early is not None and early.process is None and early.fork_server is not None
    (experiment,) = load_spec(spec)
    servers_started_later = []
    monkeypatch.setattr(torchrun.Torchrun, "_start_fork_server",
                        lambda self, *args: servers_started_later.append(self))
    store = Store(str(tmp_path / "r.db"))
    (result,) = launcher.run_all([experiment], store, str(spec), early=early)
    assert result.status == "completed", result.reason
    assert servers_started_later == []  # no second server
    assert {m.step for m in store.metric_history(result.run_id, "train_loss")} == {2}
    assert not early.dir.exists()


@pytest.mark.slow  # the torchrun launcher (DSGD_LAUNCHER=torchrun); CI runs -m slow
def test_the_early_torchrun_runs_the_first_launch(tmp_path, monkeypatch):
    monkeypatch.setenv("DSGD_LAUNCHER", "torchrun")
    spec = write_spec(tmp_path, SPEC)
    early = torchrun.early_start(spec, None, None, None)
    assert early is not None and early.process is not None
    (experiment,) = load_spec(spec)
    assert early.shape == launcher.launch_shape(experiment)
    started_later = []
    monkeypatch.setattr(torchrun.Torchrun, "start", lambda self: started_later.append(self))
    store = Store(str(tmp_path / "r.db"))
    (result,) = launcher.run_all([experiment], store, str(spec), early=early)
    assert result.status == "completed", result.reason
    assert started_later == []  # no second torchrun
    assert {m.step for m in store.metric_history(result.run_id, "train_loss")} == {2}
    assert not early.dir.exists()


def test_an_early_torchrun_of_another_shape_is_stopped_unused(tmp_path):
    spec = write_spec(tmp_path, SPEC)
    early = torchrun.early_start(spec, None, None, None)  # 2 workers
    (experiment,) = load_spec(spec, workers=3)
    store = Store(str(tmp_path / "r.db"))
    (result,) = launcher.run_all([experiment], store, str(spec), early=early)
    assert result.status == "completed", result.reason
    assert early.processes() == set() and not early.dir.exists()
    assert {m.rank for m in store.metric_history(result.run_id, "train_loss")} == {0, 1, 2}


def test_no_early_start_for_a_spec_unreadable_that_far(tmp_path):
    for text in ("experiments: [", "experiments: [{name: a, workers: two}]",
                 "experiments: [{name: a, workers: 100}]",
                 "experiments: [{name: a, wrong_key: 1}]"):
        assert torchrun.early_start(write_spec(tmp_path, text), None, None, None) is None
    spec = write_spec(tmp_path, "experiments: [{name: a, workers: 3}, {name: b, workers: 2}]")
    early = torchrun.early_start(spec, ["b"], None, None)  # the first selected experiment
    try:
        assert early.shape == torchrun.Shape(2)
    finally:
        early.close()
    assert early.processes() == set()


def test_a_spec_that_fails_validation_stops_the_early_torchrun(tmp_path):
    spec = write_spec(tmp_path, """
    experiments:
      - {name: a, task: logreg, workers: 2, optimizer: {name: sgd, lr: fast}}
    """)
    db = tmp_path / "r.db"
    cli = subprocess.Popen([sys.executable, "-m", "dsgd_cli", "run", str(spec), "--db", str(db)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, stderr = cli.communicate(timeout=120)
    assert cli.returncode == 2
    assert stderr.count("\n") == 1 and "experiments[0].optimizer.lr" in stderr
    assert not db.exists()
    _wait_until_none(torchrun.LAUNCHER_PID, str(cli.pid), seconds=10)


def test_the_early_fork_server_leaves_when_its_launcher_is_killed(tmp_path):
    spec = write_spec(tmp_path, SPEC)
    code = ("import sys; from dsgd_cli.launch.torchrun import early_start; "
            f"t = early_start({str(spec)!r}, None, None, None); "
            "print(t.dir, t.fork_server.pid, flush=True); import time; time.sleep(600)")
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    run_dir, server = holder.stdout.readline().split()
    assert int(server) in _processes_marked(torchrun.RUN_MARKER, run_dir)
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    _wait_until_none(torchrun.RUN_MARKER, run_dir)


def test_waiting_workers_leave_when_their_launcher_is_killed(tmp_path, monkeypatch):
    monkeypatch.setenv("DSGD_LAUNCHER", "torchrun")  # torchrun's workers start before the plan
    spec = write_spec(tmp_path, SPEC)
    code = ("import sys; from dsgd_cli.launch.torchrun import early_start; "
            f"t = early_start({str(spec)!r}, None, None, None); print(t.dir, flush=True); "
            "import time; time.sleep(600)")
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    run_dir = holder.stdout.readline().strip()
    deadline = time.monotonic() + 120
    while len(_workers_forked(run_dir)) < 2:
        assert time.monotonic() < deadline, "the workers did not start"
        time.sleep(0.2)
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    _wait_until_none(torchrun.RUN_MARKER, run_dir)


def test_workers_keep_large_temporaries_in_the_heap_unless_told_otherwise(monkeypatch, tmp_path):
    env = torchrun.environment(tmp_path)
    assert env["MALLOC_MMAP_THRESHOLD_"] == str(64 * 2**20)
    assert env[torchrun.RUN_MARKER] == str(tmp_path) and env[torchrun.LAUNCHER_PID] == str(os.getpid())
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "131072")  # the user's choice wins
    assert torchrun.environment(tmp_path)["MALLOC_MMAP_THRESHOLD_"] == "131072"
