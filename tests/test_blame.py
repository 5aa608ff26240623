"""Who is named when a run fails: a rank that leaves with code 0 mid-run, a rank that never
enters a collective, torchrun itself killed; and the launch's output, capped, whose last lines
explain a run that failed without a word."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import TINY_SPEC, dsgd, dsgd_in_process, experiment_config, write_spec
from dsgd_cli.launch import launcher, torchrun
from dsgd_cli.launch.outcome import last_lines, left_early, listed_ranks, run_result
from dsgd_cli.results.store import Store

EXPERIMENT = launcher.Experiment("a", experiment_config("a", workers=2))

# torchrun's summary after rank 0 failed (its peer had left with code 0): rank 1 is not in it.
SUMMARY_WITHOUT_RANK_1 = """\
Failures:
  <NO_OTHER_FAILURES>
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-25_20:40:02
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 4242)
  error_file: <N/A>
============================================================
"""
PEER_RESET = {"type": "error", "rank": 0, "at": 1.0,
              "reason": "RuntimeError: all_reduce over all 2 workers: Connection reset by peer"}


def _said(problems=(), done=(), stopped=()):
    """What the workers said, as `left_early` reads it from a run's `RunEvents`."""
    return SimpleNamespace(problems=list(problems), done_ranks=set(done),
                           stopped_ranks=set(stopped))


def test_a_rank_that_left_with_code_0_is_the_cause_not_its_peer():
    left = left_early(EXPERIMENT, _said([PEER_RESET]), listed_ranks(SUMMARY_WITHOUT_RANK_1), 1)
    assert left == [1]
    result = run_result(1, EXPERIMENT, [PEER_RESET], set(), 1, "", [], None, left)
    assert (result.status, result.failed_rank, result.reason) == (
        "failed", 1, "rank 1: exited with code 0 before the end of the run")
    # Every rank left with code 0 before its `done`: torchrun succeeded, and wrote no summary.
    assert left_early(EXPERIMENT, _said(), set(), 0) == [0, 1]
    # Unknown without torchrun's summary (torchrun itself killed), or with a `done`.
    assert left_early(EXPERIMENT, _said([PEER_RESET]), set(), -9) == []
    assert left_early(EXPERIMENT, _said([PEER_RESET], done={1}), listed_ranks(SUMMARY_WITHOUT_RANK_1), 1) == []


def test_a_rank_behind_in_the_collectives_is_named():
    timeout = {"type": "error", "rank": 0, "at": 1.0, "behind": [1],
               "reason": "CommTimeout: all_reduce over all 2 workers: no progress for 15 s "
                         "(the spec's timeout); ranks behind: 1"}
    result = run_result(1, EXPERIMENT, [timeout], set(), 1, "")
    assert (result.failed_rank, result.reason) == (
        1, "rank 1: never entered the collective that rank 0 waited in (CommTimeout: "
           "all_reduce over all 2 workers: no progress for 15 s (the spec's timeout); "
           "ranks behind: 1)")


def test_torchrun_killed_by_a_signal_reads_as_such_with_the_last_lines_of_output():
    output = "starting\nworker says one\n\nworker says two\nworker says three\n"
    result = run_result(1, EXPERIMENT, [], set(), -signal.SIGKILL, last_lines(output))
    assert result.reason == ("torchrun killed by SIGKILL: worker says one | worker says two | "
                             "worker says three")
    result = run_result(1, EXPERIMENT, [], set(), 1, last_lines(""))
    assert result.reason == "torchrun exited with code 1: (no output)"


def test_the_launch_output_is_capped_keeping_its_newest_part(tmp_path):
    log = torchrun.CappedLog(tmp_path / "torchrun.log", limit=64 * 1024)
    with os.fdopen(os.dup(log.write_end), "w") as output:
        for index in range(20000):  # about 600 kB
            print(f"line {index:05d} of a chatty plugin", file=output)
    text = log.text()
    assert len(text.encode()) <= 64 * 1024 + len(torchrun.CappedLog.DROPPED)
    assert text.startswith(torchrun.CappedLog.DROPPED.decode())
    assert text.endswith("line 19999 of a chatty plugin\n")
    kept = [line for line in text.splitlines()[1:] if line.startswith("line ")]
    numbers = [int(line.split()[1]) for line in kept[1:]]  # the first may be cut
    assert numbers == list(range(numbers[0], 20000))


@pytest.mark.parametrize("aggregator", [
    "{name: misbehave, action: sys_exit, step: 2}",
    "{name: misbehave, action: os_exit, hook: setup}",
], ids=["sys.exit in a hook", "os._exit in setup"])
def test_a_rank_that_exits_0_mid_run_is_named(plugin_env, tmp_path, aggregator):
    """Rank 1 leaves with code 0 part-way: it is the cause, not rank 0's connection reset.
    Leaving in `setup`, before its links are made, rank 0 may wait for it in a barrier that
    no error ends: the agent sees the exit without a `done` and ends the run at once (it
    hung until the test's limit before)."""
    spec = write_spec(tmp_path, TINY_SPEC.replace("steps_per_epoch: 2", "steps_per_epoch: 5")
                      .replace("  - name: a\n", f"  - {{name: a, aggregator: {aggregator}}}\n"))
    db = tmp_path / "r.db"
    result = dsgd("run", str(spec), "--db", str(db), env=plugin_env)
    assert result.returncode == 1, result.stderr
    (run,) = Store(str(db)).runs()
    assert (run.status, run.failed_rank, run.reason) == (
        "failed", 1, "rank 1: exited with code 0 before the end of the run")


@pytest.mark.slow  # three launches that each wait out a timeout
def test_a_rank_that_never_enters_a_collective_is_named(plugin_env, tmp_path):
    """Rank 1 sleeps (in after_backward at step 2, in setup, in finish) past the spec's
    timeout: rank 0's collective times out, and rank 1 is named."""
    spec = write_spec(tmp_path, """
        defaults:
          task: {name: logreg}
          workers: 2
          epochs: 1
          steps_per_epoch: 4
          timeout: 3
        experiments:
          - {name: step, aggregator: {name: misbehave, action: sleep, seconds: 30, step: 2}}
          - {name: setup, aggregator: {name: misbehave, action: sleep, seconds: 30, hook: setup}}
          - {name: finish, aggregator: {name: misbehave, action: sleep, seconds: 30, hook: finish}}
    """)
    db = tmp_path / "r.db"
    result = dsgd("run", str(spec), "--db", str(db), env=plugin_env)
    assert result.returncode == 1, result.stderr
    for run in Store(str(db)).runs():
        assert (run.status, run.failed_rank) == ("failed", 1), run.reason
        assert run.reason.startswith("rank 1: never entered the collective that rank 0 waited "
                                     "in (CommTimeout: "), run.reason
        assert run.reason.endswith("no progress for 3 s (the spec's timeout); ranks behind: 1)")


def test_a_deleted_run_is_reported_as_deleted_and_the_next_experiment_runs(tmp_path, monkeypatch):
    """In process, with test_faults' stand-in for torchrun: run 1 is deleted as soon as it
    records its first metrics; it ends as `deleted`, and the second experiment completes."""
    from test_faults import FAKE_TORCHRUN, tiny_spec
    from dsgd_cli.spec.experiments import load_spec

    script = tmp_path / "fake_torchrun.py"
    script.write_text(FAKE_TORCHRUN)
    monkeypatch.setenv("DSGD_LAUNCHER", "torchrun")  # a stand-in for torchrun
    monkeypatch.setattr(torchrun, "command", lambda shape, plan, run_dir: [
        sys.executable,
        str(script), str(plan), str(run_dir)])
    experiments = load_spec(tiny_spec(tmp_path, "experiments: [{name: a}, {name: b}]\n"))
    store = Store(str(tmp_path / "r.db"))

    def delete_run_1(experiment, progress):
        if experiment.name == "a" and store.get_run(1) is not None:
            store.delete_runs([1], force=True)

    callbacks = launcher.Callbacks(progress=delete_run_1)
    results = launcher.run_all(experiments, store, None, callbacks)
    assert [(r.experiment, r.status, r.reason) for r in results] == [
        ("a", "deleted", "run 1 was deleted from the database while it ran; its workers were "
                         "stopped"),
        ("b", "completed", None)]
    assert [(run.experiment, run.status) for run in store.runs()] == [("b", "completed")]


@pytest.mark.slow  # a real launch, deleted from another process; the test above is in process
def test_a_run_deleted_while_it_trains_is_stopped_and_the_spec_goes_on(tmp_path):
    """`dsgd runs delete 1 --force` while run 1 trains: run 1 stops, saying so in one true line
    (no advice to recover a run that is gone, no `dsgd-unrecorded-*` directory), and the next
    experiment runs."""
    from test_faults import _alive, _start_and_wait_for_training

    spec = write_spec(tmp_path, """
        experiments:
          - {name: long, task: logreg, epochs: 100000, log_interval: 1}
          - {name: after, task: logreg, steps_per_epoch: 2}
    """)
    db = tmp_path / "r.db"
    process, workers = _start_and_wait_for_training(spec, db, tmp_path)
    deleted = dsgd_in_process("runs", "delete", "1", "--force", "--db", str(db))
    assert deleted.returncode == 0, deleted.stderr
    try:
        _, stderr = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 1
    assert stderr.strip() == ("dsgd: error: 1 of 2 runs failed: long (run 1): deleted: run 1 was "
                              "deleted from the database while it ran; its workers were stopped")
    (after,) = Store(str(db)).runs()  # SQLite gives it the free id 1 again
    assert (after.experiment, after.status) == ("after", "completed")
    assert list(tmp_path.glob("dsgd-unrecorded-*")) == []
    assert _alive(workers[0][1]) == []


# -- a full disk is named, with its path ------------------------------------------------------

@pytest.fixture
def tiny_tmpfs(tmp_path):
    """A 1 MiB tmpfs mounted for the test; skipped where it cannot be (not root, no mount)."""
    mount_point = tmp_path / "tmpfs"
    mount_point.mkdir()
    if shutil.which("mount") is None:
        pytest.skip("no mount command")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount_point)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {mounted.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], capture_output=True)


def _fill(directory: Path) -> None:
    """Fill `directory`'s filesystem."""
    with open(directory / "filler", "wb") as filler:
        try:
            while True:
                filler.write(b"\0" * 65536)
                filler.flush()
        except OSError as error:
            assert error.errno == errno.ENOSPC


def test_a_failed_checkpoint_write_on_a_full_disk_says_so_with_its_directory(tmp_path, monkeypatch):
    """torch.save on a full disk raises "unexpected pos N vs M", with the ENOSPC behind it:
    the worker's error names the lack of space and the checkpoint directory."""
    from dsgd_cli.worker import training

    torch_error = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 9792 vs 9686")
    torch_error.__context__ = OSError(errno.ENOSPC, "No space left on device")

    def save(*args):
        raise torch_error

    monkeypatch.setattr(training.checkpoint, "save", save)
    monkeypatch.setattr(training.checkpoint, "rng_state", lambda device: {})
    nothing = SimpleNamespace(state_dict=dict)
    worker = SimpleNamespace(model=nothing, optimizer=nothing, aggregator=nothing,
                             ctx=SimpleNamespace(compressor=nothing), device="cpu", rank=1,
                             world_size=2, checkpoint_dir=str(tmp_path / "run-1"))
    loop = SimpleNamespace(worker=worker)
    with pytest.raises(training.NoSpaceLeft) as raised:
        training.TrainingLoop._save_checkpoint(loop, 40, {})
    assert str(raised.value) == (f"no space left on device for the checkpoint of step 40 in "
                                 f"{tmp_path / 'run-1'}")
    # Another error of torch.save, on a disk with room, is left as it is.
    torch_error.__context__ = None
    with pytest.raises(RuntimeError, match="unexpected pos"):
        training.TrainingLoop._save_checkpoint(loop, 40, {})


def test_torch_save_on_a_full_tmpfs_is_recognised(tiny_tmpfs):
    import torch

    from dsgd_cli.worker.training import out_of_space

    assert not out_of_space(RuntimeError("unexpected pos 1 vs 2"), tiny_tmpfs)
    with pytest.raises(RuntimeError) as raised:
        with open(tiny_tmpfs / "big.pt", "wb") as file:
            torch.save({"w": torch.zeros(600_000)}, file)
    assert out_of_space(raised.value, tiny_tmpfs)


@pytest.mark.slow  # a real full tmpfs under a launch; the translation is tested in process
def test_a_full_launch_directory_is_named(tiny_tmpfs, tmp_path):
    """$TMPDIR fills up while the workers write their events: the run says so, with the
    launch directory, instead of "torchrun exited with code 1: (no output)"."""
    spec = write_spec(tmp_path, """
        experiments:
          - {name: long, task: logreg, epochs: 100000, log_interval: 1}
    """)
    db = tmp_path / "r.db"
    result = dsgd("run", str(spec), "--db", str(db), env={"TMPDIR": str(tiny_tmpfs)})
    assert result.returncode == 1, result.stderr
    (run,) = Store(str(db)).runs()
    assert run.status == "failed"
    assert run.reason.startswith(f"no space left on device in the launch directory "
                                 f"{tiny_tmpfs}/dsgd-launch-"), run.reason
    assert f"(in $TMPDIR, {tiny_tmpfs})" in run.reason


@pytest.mark.slow  # a real full tmpfs under a run; the translation is tested in process
def test_a_full_checkpoint_directory_is_named(tiny_tmpfs, tmp_path):
    spec = write_spec(tmp_path, """
        experiments:
          - {name: saves, task: logreg, workers: 2, epochs: 1, steps_per_epoch: 6,
             checkpoint_every: 2}
    """)
    _fill(tiny_tmpfs)
    db = tmp_path / "r.db"
    result = dsgd("run", str(spec), "--db", str(db), "--checkpoint-dir", str(tiny_tmpfs / "ck"))
    assert result.returncode == 1, result.stderr
    (run,) = Store(str(db)).runs()
    assert run.status == "failed"
    assert "NoSpaceLeft: no space left on device for the checkpoint of step 2 in " \
           f"{tiny_tmpfs / 'ck'}" in run.reason, run.reason


@pytest.mark.parametrize("rank_1_dies_of, named", [
    (signal.SIGKILL, "rank 1: killed by SIGKILL"),  # someone else's kill, read late
    (signal.SIGTERM, "rank 0: RuntimeError: all_reduce over all 2 workers: Connection reset "
                     "by peer"),  # the agent's own stop
])
def test_a_kill_read_after_the_agent_began_stopping_its_worker_is_still_its_cause(
        tmp_path, rank_1_dies_of, named):
    """Rank 1 is killed; rank 0 fails on the broken link and its exit reaches the agent
    first, so the agent starts stopping rank 1 (SIGTERM) before it reads rank 1's exit. A
    death by another signal than the agent's is rank 1's own failure, named as the cause."""
    import socket

    from dsgd_cli.launch.agent import LocalAgent, _Worker

    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid nobody has: the agent's SIGTERM finds no process
    agent = LocalAgent(2, "m", [], {}, -1, tmp_path / "none.sock")
    ends = [socket.socketpair() for _ in range(2)]
    agent._ranks = [_Worker(rank, ours, pid=gone.pid) for rank, (ours, _) in enumerate(ends)]
    ends[0][1].sendall(b"exit 1\n")
    agent._read(agent._ranks[0])
    agent._close_others(signal.SIGTERM)
    ends[1][1].sendall(f"exit {-rank_1_dies_of}\n".encode())
    agent._read(agent._ranks[1])
    result = run_result(1, EXPERIMENT, [PEER_RESET], set(), 1, "", agent.failures())
    assert result.reason == named
    for ours, theirs in ends:
        ours.close()
        theirs.close()
