"""Databases dsgd may not change: read-only files and directories, paths with no database,
SQLite files of another program. Reading commands read them without writing; `dsgd run`
refuses in one line before it launches anything."""

from __future__ import annotations

import ctypes
import os
import sqlite3
import stat
import traceback
from pathlib import Path

import pytest

from conftest import dsgd, dsgd_in_process, write_spec
from dsgd_cli.results.store import MetricRow, Store

SPEC = """
experiments:
  - name: tiny
    task: {name: logreg}
    steps_per_epoch: 2
"""


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
    """`dsgd ARGS` run in-process by a user whom file permissions stop from writing: as root
    (CI), in a forked child that gives up the capability to override them; otherwise as this
    user. The child stays root and keeps the capability to read and search every directory,
    so it imports dsgd and its libraries wherever the checkout lives (a clone in a private
    0700 directory too), and write permission bits bind it as they bind any user."""
    if os.geteuid() != 0:
        return _run_main(args)
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report (code, stdout, stderr) through the pipe, then leave
        try:
            _drop_capability(CAP_DAC_OVERRIDE)
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


CAP_DAC_OVERRIDE = 1  # linux/capability.h: bypass file read, write and execute permission checks
_CAPABILITY_VERSION_3 = 0x20080522


class _CapabilityHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapabilityData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]


def _drop_capability(capability: int) -> None:
    """Remove `capability` from this process's effective, permitted and inheritable sets
    (capget/capset, version 3: two 32-bit words per set)."""
    libc = ctypes.CDLL(None, use_errno=True)
    header = _CapabilityHeader(_CAPABILITY_VERSION_3, 0)
    data = (_CapabilityData * 2)()
    if libc.capget(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capget failed")
    word, bit = divmod(capability, 32)
    for name in ("effective", "permitted", "inheritable"):
        setattr(data[word], name, getattr(data[word], name) & ~(1 << bit))
    if libc.capset(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capset failed")


def _run_main(args) -> tuple[int, str, str]:
    result = dsgd_in_process(*args)
    return result.returncode, result.stdout, result.stderr


def read_only(path: Path) -> None:
    path.chmod(stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH)


@pytest.mark.parametrize("where", ["file", "directory"])
def test_a_database_that_cannot_be_written(tmp_path, where):
    directory = tmp_path / "results"
    directory.mkdir()
    db = recorded_db(directory / "r.db")
    spec = write_spec(tmp_path, SPEC)
    if where == "file":
        directory.chmod(0o777)
        read_only(db)
    else:  # the file could be written, but not its journal next to it
        db.chmod(0o666)
        directory.chmod(0o555)
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


@pytest.mark.parametrize("run_id", [
    "99999999999999999999999",
    # slow: [-5] (default) takes the same path, an id that no run has, through a real process
    pytest.param("0", marks=pytest.mark.slow), "-5", pytest.param("7", marks=pytest.mark.slow)])
def test_show_of_a_run_that_cannot_exist(tmp_path, run_id):
    db = recorded_db(tmp_path / "r.db")
    result = dsgd("show", "--db", str(db), "--", run_id)
    assert result.returncode == 2, result.stderr
    assert result.stderr == f"dsgd: error: no run with id {run_id}\n"
