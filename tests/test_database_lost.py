"""The results database stops taking writes in the middle of a run (made immutable, as a full
disk or a lost server would): `dsgd run` stops on one line, keeps what the workers recorded,
and `dsgd runs recover` stores it and ends the run once the database can be written again."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import dsgd_in_process, experiment_config, write_spec
from dsgd_cli.errors import StoreError
from dsgd_cli.results.reader import Results
from results_helpers import count_metrics

SPEC = """
experiments:
  - {name: long, task: logreg, workers: 2, epochs: 100000, log_interval: 1}
  - {name: later, task: logreg, workers: 2, steps_per_epoch: 2}
"""


def chattr(flag: str, *paths: Path) -> None:
    subprocess.run(["chattr", flag, *map(str, paths)], check=True, capture_output=True)


@pytest.fixture
def immutable_files():
    """chattr +i, as root; undone at the end whatever happens."""
    if os.geteuid() != 0:
        pytest.skip("needs root, for chattr +i (a read-only file stays writable to open handles)")
    made: list[Path] = []

    def make(*paths: Path) -> None:
        chattr("+i", *paths)
        made.extend(paths)

    yield make
    for path in made:
        subprocess.run(["chattr", "-i", str(path)], capture_output=True)


def _metrics_stored(db: Path) -> int:
    """Metrics of run 1 stored so far; 0 while `dsgd run` is still creating the database (the
    file can exist before its tables do)."""
    try:
        results = Results(str(db))
        return count_metrics(results, 1) if results.runs() else 0
    except StoreError:
        return 0


def test_a_database_that_stops_taking_writes_mid_run(tmp_path, immutable_files):
    spec = write_spec(tmp_path, SPEC)
    db, temporary = tmp_path / "r.db", tmp_path / "tmp"
    temporary.mkdir()
    process = subprocess.Popen([sys.executable, "-m", "dsgd_cli", "run", str(spec), "--db", str(db)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               cwd=tmp_path, env={**os.environ, "TMPDIR": str(temporary)})
    try:
        deadline = time.monotonic() + 180
        while _metrics_stored(db) <= 4:
            assert process.poll() is None and time.monotonic() < deadline, process.communicate()
            time.sleep(0.5)
        stored_before = count_metrics(Results(str(db)), 1)
        immutable_files(db, Path(f"{db}-wal"))
        _, stderr = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 1, stderr
    assert "Traceback" not in stderr
    message = stderr.strip().splitlines()[-1]
    match = re.fullmatch(
        rf"dsgd: error: cannot write to results database sqlite:///{re.escape(str(db))}: (.+); "
        r"run 1 \(long\) was stopped and is left 'running'; once the database can be written, "
        rf"`dsgd runs recover (\S+) --db {re.escape(str(db))}` records what its workers recorded "
        r"\(kept there\) and ends it; later experiments were not run", message)
    assert match, message
    kept = Path(match.group(2))
    assert kept.parent == tmp_path and sorted(p.name for p in kept.iterdir()) == [
        "rank0.jsonl", "rank1.jsonl", "unrecorded.json"]
    assert [(run.experiment, run.status) for run in Results(str(db)).runs()] == [("long", "running")]
    assert [p.name for p in temporary.iterdir()
            if p.name.startswith(("dsgd-launch-", "torchelastic_"))] == []
    assert subprocess.run(["pgrep", "-f", str(temporary)], capture_output=True).stdout == b""

    refused = dsgd_in_process("runs", "recover", str(kept), "--db", str(db))
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert kept.exists()

    chattr("-i", db, Path(f"{db}-wal"))  # the database comes back
    recovered = dsgd_in_process("runs", "recover", str(kept), "--db", str(db))
    assert recovered.returncode == 0, recovered.stderr
    assert re.fullmatch(r"run 1: \d+ records recovered; interrupted\n", recovered.stdout)
    (run,) = Results(str(db)).runs()
    assert (run.status, run.reason) == (
        "interrupted", f"stopped: the results database could not be written ({match.group(1)})")
    assert count_metrics(Results(str(db)), 1) > stored_before
    steps = [r.step for r in Results(str(db)).metric_history(1, "train_loss") if r.rank == 0]
    assert steps == list(range(1, len(steps) + 1))  # every step recorded once
    assert not kept.exists()


# -- what is kept, and what recovery stores (no root needed) -------------------------------------

def _write_steps(events_dir: Path, steps: range, done: bool = False) -> None:
    from dsgd_cli.comm.events import EventWriter, events_path

    for rank in (0, 1):
        writer = EventWriter(events_path(events_dir, rank), rank)
        for step in steps:
            writer.metric("train_loss", 1.0 / step, step=step, epoch=0)
        if done:
            writer.write("done")
        writer.close()


@pytest.mark.parametrize("finished, status", [(True, "completed"), (False, "interrupted")])
def test_recovery_stores_each_record_once_and_ends_the_run(tmp_path, monkeypatch, finished, status):
    from sqlalchemy.exc import OperationalError

    from dsgd_cli.launch import unrecorded
    from dsgd_cli.launch.launcher import Callbacks, _Running
    from dsgd_cli.spec.experiments import Experiment
    from dsgd_cli.results.store import Store

    db, events_dir = tmp_path / "r.db", tmp_path / "events"
    events_dir.mkdir()
    store = Store(str(db))
    run_id = store.create_run("x", experiment_config(), None, [])
    running = _Running(0, Experiment("x", experiment_config()), run_id, events_dir)
    _write_steps(events_dir, range(1, 4))
    running.ingest(store, Callbacks())  # steps 1-3 stored
    _write_steps(events_dir, range(4, 6), done=finished)

    def lost(*args):
        raise OperationalError("INSERT", {}, Exception("disk I/O error"))

    monkeypatch.setattr(store, "add_metrics", lost)
    with pytest.raises(OperationalError):
        running.ingest(store, Callbacks())  # steps 4-5 read, not stored
    _write_steps(events_dir, range(6, 7))  # what the workers wrote before they were stopped
    kept = unrecorded.keep(run_id, running.experiment, running.events, "disk I/O error",
                          where=tmp_path)
    monkeypatch.undo()

    result = dsgd_in_process("runs", "recover", str(kept), "--db", str(db))
    assert (result.returncode, result.stderr) == (0, ""), result.stderr
    assert result.stdout == f"run {run_id}: 6 records recovered; {status}\n"  # steps 4-6, 2 ranks
    run = Results(str(db)).get_run(run_id)
    assert run.status == status
    if not finished:
        assert run.reason == "stopped: the results database could not be written (disk I/O error)"
    history = Results(str(db)).metric_history(run_id, "train_loss")
    assert sorted((r.rank, r.step) for r in history) == [(rank, step) for rank in (0, 1)
                                                         for step in range(1, 7)]
    assert not kept.exists()
    again = dsgd_in_process("runs", "recover", str(kept), "--db", str(db))
    assert (again.returncode, again.stderr) == (
        2, f"dsgd: error: {kept}: not a directory of unrecorded records (no unrecorded.json)\n")


# -- the launcher and recovery decode the same events alike --------------------------------------

def _event_stream() -> dict[int, list[dict]]:
    """Per rank, what the workers of a run wrote before they were asked to stop: metrics, one
    that is not a number (as JSON's NaN, which an older worker could write), and `stopped`."""
    def metric(rank, step, value):
        return {"type": "metric", "rank": rank, "name": "train_loss", "value": value,
                "step": step, "epoch": 0, "seconds": 0.5 * step, "per_rank": True}

    return {rank: [{"type": "start", "rank": rank, "total_steps": 10},
                   *(metric(rank, step, 1.0 / step) for step in (1, 2, 3)),
                   metric(rank, 4, float("nan")),
                   {"type": "stopped", "rank": rank}]
            for rank in (0, 1)}


def _write_raw(events_dir: Path, stream: dict[int, list[dict]]) -> None:
    import json

    from dsgd_cli.comm.events import events_path

    for rank, events in stream.items():
        with open(events_path(events_dir, rank), "a") as file:
            file.writelines(json.dumps(event) + "\n" for event in events)  # NaN as JSON's NaN


def _recorded(db: Path, run_id: int) -> list[tuple]:
    return sorted((r.rank, r.step, r.value, r.seconds)
                  for r in Results(str(db)).metric_history(run_id, "train_loss"))


def test_the_launcher_and_recovery_record_the_same_from_the_same_events(tmp_path):
    from dsgd_cli.launch import unrecorded
    from dsgd_cli.launch.launcher import Callbacks, _Running
    from dsgd_cli.results.store import Store
    from dsgd_cli.spec.experiments import Experiment

    experiment = Experiment("x", experiment_config())
    recorded = {}
    for path in ("launcher", "recovery"):
        db, events_dir = tmp_path / f"{path}.db", tmp_path / path
        events_dir.mkdir()
        _write_raw(events_dir, _event_stream())
        store = Store(str(db))
        run_id = store.create_run("x", experiment.config, None, [])
        running = _Running(0, experiment, run_id, events_dir)
        if path == "launcher":
            running.ingest(store, Callbacks())
            assert running.all_left and not running.complete  # both ranks stopped as asked
        else:  # nothing read yet when the database was lost: recovery reads it all
            kept = unrecorded.keep(run_id, experiment, running.events, "gone", where=tmp_path)
            result = dsgd_in_process("runs", "recover", str(kept), "--db", str(db))
            assert result.stdout == f"run {run_id}: 6 records recovered; interrupted\n", result.stderr
        recorded[path] = _recorded(db, run_id)
    assert recorded["recovery"] == recorded["launcher"]
    assert [(rank, step) for rank, step, _, _ in recorded["launcher"]] == [
        (rank, step) for rank in (0, 1) for step in (1, 2, 3)]


def test_run_events_decodes_each_kind_of_event(tmp_path):
    from dsgd_cli.launch.run_events import RunEvents
    from dsgd_cli.results.store import MetricRow

    stream = _event_stream()
    stream[1].insert(0, {"type": "run", "rank": 1, "run_id": 7})
    stream[1].append({"type": "progress", "rank": 1, "done": 3, "total": 10, "unit": "updates"})
    stream[0].append({"type": "error", "rank": 0, "reason": "boom", "at": 1.0})
    _write_raw(tmp_path, stream)
    events = RunEvents(tmp_path)  # the ranks found as their files appear
    assert events.read() is False  # rank 0 leads; rank 1's progress is not shown
    assert [(row.rank, row.step) for row in events.unstored] == [
        (rank, step) for rank in (0, 1) for step in (1, 2, 3)]
    assert events.unstored[0] == MetricRow("train_loss", 1.0, 1, 0, 0, 0.5)
    assert (events.run_id, events.stopped_ranks, events.done_ranks) == (7, {0, 1}, set())
    assert [event["reason"] for event in events.problems] == ["boom"]
    assert (events.progress.total_steps, events.progress.step, events.progress.train_loss) == (
        10, 3, 1.0 / 3)  # rank 0's last finite loss, not NaN
    sizes = {rank: events_path.stat().st_size for rank, events_path in
             ((r, tmp_path / f"rank{r}.jsonl") for r in (0, 1))}
    assert events.offsets == sizes
    assert RunEvents(tmp_path, ranks=[1], offsets=sizes).read() is False  # nothing new
