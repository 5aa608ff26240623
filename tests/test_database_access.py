"""Databases dsgd may not change: read-only files and directories, paths with no database,
SQLite files of another program. Reading commands read them without writing; `dsgd run`
refuses in one line before it launches anything."""

from __future__ import annotations

import importlib
import os
import sqlite3
import stat
import tempfile
import traceback
from pathlib import Path

import pytest

from conftest import dsgd, dsgd_in_process, write_spec
from dsgd_cli.store import MetricRow, Store

NOBODY = 65534
SPEC = """
experiments:
  - name: tiny
    task: {name: logreg}
    steps_per_epoch: 2
"""


@pytest.fixture
def shared_dir():
    """A directory other users may enter (pytest's tmp_path is private to its owner)."""
    directory = Path(tempfile.mkdtemp(prefix="dsgd-access-"))
    directory.chmod(0o755)
    yield directory
    for path in directory.rglob("*"):
        path.chmod(0o777)
    directory.chmod(0o777)
    for path in sorted(directory.rglob("*"), reverse=True):
        path.unlink() if path.is_file() else path.rmdir()
    directory.rmdir()


def recorded_db(path: Path) -> Path:
    store = Store(str(path))
    run_id = store.create_run("old", {"task": {"name": "logreg"}, "optimizer": {"name": "sgd"},
                                      "aggregator": {"name": "allreduce"},
                                      "compressor": {"name": "none"}, "workers": 2},
                              None, [])
    store.add_metrics(run_id, [MetricRow("test_accuracy", 0.75)])
    store.finish_run(run_id, "completed")
    store.engine.dispose()  # no WAL or shared-memory file left open
    return path


def dsgd_as_user_without_write_access(*args: str) -> tuple[int, str, str]:
    """`dsgd ARGS` run in-process by a user who may not write where root could: as root
    (CI), in a forked child that drops to `nobody`; otherwise as this user."""
    if os.geteuid() != 0:
        return _run_main(args)
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report (code, stdout, stderr) through the pipe, then leave
        try:
            # Import what the command needs while it may: Python's own library may lie in a
            # directory `nobody` cannot read (/root), and commands import lazily.
            _run_main([args[0], "--help"])
            for module in ("ctypes", "statistics", "dsgd_cli.analysis", "dsgd_cli.query",
                           "dsgd_cli.launcher", "dsgd_cli.spec"):
                importlib.import_module(module)
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            code, out, err = _run_main(args)
        except BaseException:
            code, out, err = -1, "", traceback.format_exc()
        try:
            os.write(write_end, f"{code}\0{out}\0{err}".encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        data = pipe.read().decode()
    os.waitpid(pid, 0)
    code, out, err = data.split("\0")
    return int(code), out, err


def _run_main(args) -> tuple[int, str, str]:
    result = dsgd_in_process(*args)
    return result.returncode, result.stdout, result.stderr


def read_only(path: Path) -> None:
    path.chmod(stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH)


@pytest.mark.parametrize("where", ["file", "directory"])
def test_a_database_that_cannot_be_written(shared_dir, where):
    directory = shared_dir / "results"
    directory.mkdir()
    db = recorded_db(directory / "r.db")
    spec = write_spec(shared_dir, SPEC)
    spec.chmod(0o644)
    if where == "file":
        directory.chmod(0o777)
        read_only(db)
    else:  # the file could be written, but not its journal next to it
        db.chmod(0o666)
        directory.chmod(0o755)
    before = db.read_bytes()

    code, out, err = dsgd_as_user_without_write_access("run", str(spec), "--db", str(db))
    assert code == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"dsgd: error: cannot write to results database sqlite:///{db}"), err
    assert "readonly" in err

    for args in (["runs"], ["compare", "-f", "csv"], ["show", "1"]):
        code, out, err = dsgd_as_user_without_write_access(*args, "--db", str(db))
        assert (code, err) == (0, ""), (args, err)
        assert "old" in out, out
    assert db.read_bytes() == before  # nothing changed, not even the version row


@pytest.mark.parametrize("command", [["runs"], ["compare"], ["show", "1"]])
def test_reading_commands_never_create_a_database(tmp_path, command):
    db = tmp_path / "garbage"
    result = dsgd(*command, env={"DSGD_DB": str(db)})
    assert result.returncode == 2
    assert result.stderr == f"dsgd: error: no results database at {db} (`dsgd run` creates one)\n"
    assert not db.exists()


def test_another_programs_runs_table_is_refused_and_left_alone(tmp_path):
    db = tmp_path / "theirs.db"
    with sqlite3.connect(db) as connection:
        connection.execute("CREATE TABLE runs (id INTEGER PRIMARY KEY, name TEXT)")
    spec = write_spec(tmp_path, SPEC)
    for command in (["runs"], ["compare"], ["show", "1"], ["run", str(spec)]):
        result = dsgd(*command, "--db", str(db))
        assert result.returncode == 2, (command, result.stderr)
        assert result.stderr == (
            f"dsgd: error: sqlite:///{db} is not a dsgd results database: its table 'runs' "
            "lacks the columns 'experiment', 'spec_file', 'status' and 12 more\n"), command
    with sqlite3.connect(db) as connection:  # no table of dsgd's was added to their file
        tables = connection.execute("SELECT name FROM sqlite_master WHERE type='table'").fetchall()
    assert tables == [("runs",)]


@pytest.mark.parametrize("run_id", ["99999999999999999999999", "0", "-5", "7"])
def test_show_of_a_run_that_cannot_exist(tmp_path, run_id):
    db = recorded_db(tmp_path / "r.db")
    result = dsgd("show", "--db", str(db), "--", run_id)
    assert result.returncode == 2, result.stderr
    assert result.stderr == f"dsgd: error: no run with id {run_id}\n"
