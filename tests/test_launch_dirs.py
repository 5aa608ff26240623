"""Where a launch's directory goes (launch/launch_dirs.py): a TMPDIR another user could swap
it in is refused; the fork server's socket must be this user's before the agent sends it an
environment; directories a killed `dsgd run` left are removed by the next one.

Before, with TMPDIR a 0777 directory, another user renamed `dsgd-launch-*` as it appeared,
put a `forkserver.sock` of theirs in its place, and received both ranks' environments."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from conftest import dsgd_in_process, write_spec
from dsgd_cli.launch import launch_dirs
from dsgd_cli.launch.agent import LocalAgent, check_owner

NOBODY = 65534
SPEC = """
    defaults: {task: logreg, workers: 2, epochs: 1, steps_per_epoch: 2, log_interval: 1}
    experiments:
      - {name: plain}
"""


@pytest.fixture
def tmpdir_at(monkeypatch):
    """Point TMPDIR at a directory, for this process's `tempfile` too."""
    def point(directory):
        monkeypatch.setenv("TMPDIR", str(directory))
        monkeypatch.setattr(tempfile, "tempdir", None)
    return point


def test_a_tmpdir_others_may_write_without_the_sticky_bit_is_refused(tmp_path, tmpdir_at):
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    tmpdir_at(open_dir)
    spec = write_spec(tmp_path, SPEC)
    result = dsgd_in_process("run", str(spec), "--db", str(tmp_path / "r.db"))
    assert result.returncode == 2, result.stderr
    message = result.stderr.strip()
    assert "\n" not in message and "Traceback" not in message
    assert message == (f"dsgd: error: TMPDIR (where dsgd makes each launch's directory) "
                       f"{open_dir} is writable by other users without the sticky bit (mode "
                       f"777), so they could swap what is in it: refused")
    assert list(open_dir.iterdir()) == []  # no launch directory made
    assert not (tmp_path / "r.db").exists()


def test_a_sticky_tmpdir_is_used_and_left_clean(tmp_path, tmpdir_at):
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    tmpdir_at(sticky)
    spec = write_spec(tmp_path, SPEC)
    result = dsgd_in_process("run", str(spec), "--db", str(tmp_path / "r.db"))
    assert result.returncode == 0, result.stderr
    assert list(sticky.glob("dsgd-launch-*")) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as a second user")
def test_the_agent_sends_nothing_to_another_users_socket():
    shared = Path(tempfile.mkdtemp(dir="/tmp"))  # pytest's tmp_path is closed to other users
    shared.chmod(0o777)
    path = shared / "forkserver.sock"
    ready_read, ready_write = os.pipe()
    pid = os.fork()
    if pid == 0:  # another user's fake fork server
        try:
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            listener.bind(str(path))
            os.chmod(path, 0o777)
            listener.listen(1)
            os.write(ready_write, b"x")
            time.sleep(10)
        finally:
            os._exit(0)
    os.close(ready_write)
    try:
        assert os.read(ready_read, 1) == b"x", "the other user's server did not start"
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
            connection.connect(str(path))
            with pytest.raises(PermissionError, match="is not this user's"):
                check_owner(connection, path)
        # The agent's own request for a worker checks it before sending the environment.
        agent = LocalAgent(1, "dsgd_cli.worker.process", [], {"DSGD_SECRET": "x"},
                           os.open(os.devnull, os.O_WRONLY), path)
        with pytest.raises(PermissionError, match="is not this user's"):
            agent._request(0, [])
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        shutil.rmtree(shared)


def test_a_killed_launchers_directories_are_removed_and_no_other(tmp_path):
    def launch_dir(name, mark):
        directory = tmp_path / f"dsgd-launch-{name}"
        directory.mkdir(mode=0o700)
        (directory / "experiments.json").write_text("{}")
        if mark is not None:
            (directory / launch_dirs.OWNER_FILE).write_text(mark)
        return directory

    finished = subprocess.Popen(["true"])
    finished.wait()
    gone = launch_dir("gone", f"{finished.pid} 1")  # its launcher has exited
    reused = launch_dir("reused", f"{os.getpid()} 1")  # this pid, another start time
    live = launch_dir("live", launch_dirs._identity(os.getpid()))
    unmarked = launch_dir("unmarked", None)
    used = launch_dir("used", f"{finished.pid} 1")  # launcher gone, a worker still in it
    worker = subprocess.Popen(["sleep", "30"], env={**os.environ,
                                                    launch_dirs.RUN_MARKER: str(used)})
    try:
        removed = launch_dirs.remove_stale(tmp_path)
    finally:
        worker.kill()
        worker.wait()
    assert sorted(removed) == sorted([gone, reused])
    assert not gone.exists() and not reused.exists()
    assert live.exists() and unmarked.exists() and used.exists()


def test_dsgd_run_removes_what_a_killed_run_left_before_it_starts(tmp_path, tmpdir_at):
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    tmpdir_at(sticky)
    finished = subprocess.Popen(["true"])
    finished.wait()
    left = sticky / "dsgd-launch-left"  # its launcher has exited
    left.mkdir(mode=0o700)
    (left / launch_dirs.OWNER_FILE).write_text(f"{finished.pid} 1")
    spec = write_spec(tmp_path, SPEC)
    result = dsgd_in_process("run", str(spec), "--db", str(tmp_path / "r.db"))
    assert result.returncode == 0, result.stderr
    assert list(sticky.glob("dsgd-launch-*")) == []


def test_a_launch_directory_names_its_launcher(tmp_path, tmpdir_at):
    tmpdir_at(tmp_path)
    directory = launch_dirs.make_launch_dir()
    assert (directory.stat().st_mode & 0o777) == 0o700
    assert (directory / launch_dirs.OWNER_FILE).read_text() == launch_dirs._identity(os.getpid())
    assert launch_dirs.remove_stale(tmp_path) == []
