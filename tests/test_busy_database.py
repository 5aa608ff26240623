"""A busy SQLite database (another process holding its lock) delays recording; it neither
fails a run nor calls a finished run stopped (results/busy.py).

Before, a lock held for 60 s made `dsgd run` exit 1 after the 30 s busy timeout with "run 8
was stopped and is left 'running'", although its workers had finished."""

from __future__ import annotations

import sqlite3
import threading
import time

import pytest
from sqlalchemy.exc import OperationalError

from conftest import dsgd_in_process, write_spec
from dsgd_cli.results import busy, database
from dsgd_cli.results.store import MetricRow, Store

BUSY_LINE = "is busy (another process holds its lock): waiting to write"
CONFIG = {"task": {"name": "logreg"}, "aggregator": {"name": "allreduce"},
          "compressor": {"name": "none"}, "optimizer": {"name": "sgd"}, "workers": 1}


def _hold_lock(path, seconds: float, held: threading.Event,
               until: threading.Event | None = None) -> threading.Thread:
    """Another connection takes the database's exclusive lock for `seconds`, or, given
    `until`, until that event is set (at most a minute)."""
    def hold():
        connection = sqlite3.connect(path, timeout=30, isolation_level=None)
        connection.execute("BEGIN EXCLUSIVE")
        held.set()
        if until is None:
            time.sleep(seconds)
        else:
            until.wait(60)
        connection.execute("COMMIT")
        connection.close()
    thread = threading.Thread(target=hold)
    thread.start()
    return thread


@pytest.fixture
def quick_busy(monkeypatch):
    """SQLite gives up after 0.2 s of waiting, the notice comes after 0.5 s."""
    monkeypatch.setattr(database, "SQLITE_BUSY_TIMEOUT", 0.2)
    monkeypatch.setattr(busy, "NOTICE_AFTER_S", 0.5)


def test_a_write_waits_past_the_busy_timeout_and_says_so_once(tmp_path, quick_busy, capsys):
    store = Store(str(tmp_path / "r.db"))
    run_id = store.create_run("e", CONFIG, None, [])
    held = threading.Event()
    holder = _hold_lock(str(tmp_path / "r.db"), 1.5, held)  # far past SQLite's 0.2 s
    held.wait(10)
    store.add_metrics(run_id, [MetricRow("train_loss", 0.5, step=1, rank=0)])
    holder.join()
    assert [m.value for m in store.metric_history(run_id, "train_loss")] == [0.5]
    lines = [line for line in capsys.readouterr().err.splitlines() if BUSY_LINE in line]
    assert len(lines) == 1


def test_an_interrupt_ends_the_wait(tmp_path, quick_busy):
    store = Store(str(tmp_path / "r.db"))
    run_id = store.create_run("e", CONFIG, None, [])
    held = threading.Event()
    holder = _hold_lock(str(tmp_path / "r.db"), 1.5, held)
    held.wait(10)
    store.interrupted = lambda: True
    with pytest.raises(OperationalError, match="locked"):
        store.finish_run(run_id, "interrupted")
    holder.join()


def test_a_run_completes_while_another_process_holds_the_lock(tmp_path, monkeypatch):
    """A real run of 8 modeled steps of 0.25 s, each logged; the lock is taken once the run is
    recorded and held until the run has said it waits (past SQLite's busy timeout, made 1 s
    here, as the notice's wait). Released on the notice, not after a fixed time: a loaded
    machine can take longer to start the workers than any fixed hold."""
    monkeypatch.setattr(database, "SQLITE_BUSY_TIMEOUT", 1.0)
    monkeypatch.setattr(busy, "NOTICE_AFTER_S", 1.0)
    noticed = threading.Event()
    say_busy = busy._say_busy

    def say_and_note(shown_url):
        say_busy(shown_url)
        noticed.set()

    monkeypatch.setattr(busy, "_say_busy", say_and_note)
    db = tmp_path / "r.db"
    spec = write_spec(tmp_path, """
        defaults: {task: logreg, workers: 2, epochs: 1, steps_per_epoch: 8, log_interval: 1,
                   compute: {step_seconds: 0.25}}
        experiments:
          - {name: plain}
    """)
    held = threading.Event()
    holders = []

    def lock_once_recorded():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                with sqlite3.connect(db) as reader:
                    if reader.execute("SELECT count(*) FROM runs").fetchone()[0]:
                        break
            except sqlite3.Error:
                pass
            time.sleep(0.05)
        holders.append(_hold_lock(str(db), 0.0, held, until=noticed))

    watcher = threading.Thread(target=lock_once_recorded)
    watcher.start()
    result = dsgd_in_process("run", str(spec), "--db", str(db))
    noticed.set()  # frees the holder should the run have ended without waiting
    watcher.join()
    for holder in holders:
        holder.join()
    assert held.is_set()
    assert result.returncode == 0, result.stderr
    assert BUSY_LINE in result.stderr
    (run,) = Store(str(db)).runs()
    assert run.status == "completed"
    losses = Store(str(db)).metric_history(run.id, "train_loss")
    assert sorted((m.rank, m.step) for m in losses) == [
        (rank, step) for rank in (0, 1) for step in range(1, 9)]


def test_a_run_whose_workers_finished_is_not_called_stopped_when_recording_fails(
        tmp_path, monkeypatch):
    """The database failing after every worker said `done` (an interrupt during a wait for
    a busy database): the run is left 'running' to be recovered, but was not stopped."""
    from conftest import experiment_config
    from dsgd_cli.launch import launcher, unrecorded

    monkeypatch.setattr(unrecorded, "keep", lambda *args: tmp_path / "kept")
    experiment = launcher.Experiment("e", experiment_config("e", workers=2))
    running = launcher._Running(0, experiment, 7, tmp_path)
    store = Store(str(tmp_path / "r.db"))
    error = OperationalError("INSERT", {}, Exception("database is locked"))
    running.events.done_ranks = {0}
    assert "run 7 (e) was stopped and is left 'running'" in str(
        launcher.recording_lost(error, running, store))
    running.events.done_ranks = {0, 1}
    assert "run 7 (e) had finished training and is left 'running'; " in str(
        launcher.recording_lost(error, running, store))
