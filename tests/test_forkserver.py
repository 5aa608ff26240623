"""The fork server and its relays (dsgd_cli/launch/forkserver.py, relay.py): a relay's worker
is forked by the server with the relay's environment, directory and streams; the relay passes
signals on and ends as its worker ended; a relay that is killed takes its worker with it;
without a server the relay runs the worker itself."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from dsgd_cli.comm.events import LAUNCHER_PID
from dsgd_cli.launch import forkserver

# The "worker" the relays ask for: reports where and what it runs, then does as told.
PROBE = textwrap.dedent("""
    import json, os, signal, sys, time

    def main(args):
        action, report = args
        rank = os.environ.get("RANK", "?")
        with open(report.replace("RANK", rank), "w") as file:
            json.dump({"pid": os.getpid(), "parent": os.getppid(), "cwd": os.getcwd(),
                       "probe_value": os.environ.get("PROBE_VALUE"), "argv": sys.argv,
                       "name": open("/proc/self/comm").read().strip(),
                       "niceness": os.nice(0), "rank": rank,
                       "world_size": os.environ.get("WORLD_SIZE"),
                       "master_port": os.environ.get("MASTER_PORT"),
                       "store": os.environ.get("DSGD_STORE_SOCKET")}, file)
        print("hello from the worker", flush=True)
        if action == "rank1fails":  # once ranks 0 and 2 have reported
            while rank == "1" and not all(os.path.exists(report.replace("RANK", other))
                                          for other in ("0", "2")):
                time.sleep(0.05)
            action = "exit3" if rank == "1" else "sleep"
        if action.startswith("exit"):
            sys.exit(int(action[4:]))
        if action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if action == "term":
            signal.signal(signal.SIGTERM, lambda *_: sys.exit(7))
        time.sleep(120)

    if __name__ == "__main__":
        main(sys.argv[1:])
""")


def _start_server(directory: Path) -> subprocess.Popen:
    """A fork server of `directory`, as torchrun.py starts one (its working directory is
    where the forked workers import the probe from)."""
    with forkserver.listen(forkserver.socket_path(directory)) as listener:
        return subprocess.Popen(
            [sys.executable, "-m", "dsgd_cli.launch.forkserver", str(listener.fileno()),
             str(directory)], pass_fds=[listener.fileno()], cwd=directory,
            env={**os.environ, LAUNCHER_PID: str(os.getpid())})


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    directory = tmp_path_factory.mktemp("forkserver")
    (directory / "forkprobe.py").write_text(PROBE)
    process = _start_server(directory)
    yield process, directory, forkserver.socket_path(directory)
    process.terminate()
    process.wait()


def _relay(socket_path, directory: Path, action: str, tmp_path: Path, **popen):
    # PYTHONPATH: for a relay that runs the probe itself (forked ones import it in the server)
    env = {**os.environ, "PROBE_VALUE": action, "PYTHONPATH": str(directory)}
    if socket_path is not None:
        env[forkserver.SOCKET_VARIABLE] = str(socket_path)
    return subprocess.Popen([sys.executable, "-m", "dsgd_cli.launch.relay", "forkprobe",
                             action, str(tmp_path / "report.json")], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, text=True, **popen)


def _report(tmp_path: Path, name: str = "report.json") -> dict:
    import json

    path = tmp_path / name
    deadline = time.monotonic() + 60
    while True:
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):  # not yet written, or half-written
            assert time.monotonic() < deadline, "the worker did not start"
            time.sleep(0.05)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0] == "Z"


def test_the_worker_is_forked_with_the_relays_environment_directory_and_streams(server, tmp_path):
    process, directory, path = server
    relay = _relay(path, directory, "exit3", tmp_path)
    out, _ = relay.communicate(timeout=60)
    assert relay.returncode == 3  # the worker's exit code
    assert out == "hello from the worker\n"  # through the relay's own stdout
    report = _report(tmp_path)
    assert report["parent"] == process.pid and report["pid"] != relay.pid
    assert (report["cwd"], report["probe_value"]) == (str(tmp_path), "exit3")
    assert report["argv"] == ["forkprobe", "exit3", str(tmp_path / "report.json")]
    assert report["name"] == "dsgd-rank-?"  # no RANK: not started by torchrun


def test_a_worker_killed_by_a_signal_kills_its_relay_with_it(server, tmp_path):
    _, directory, path = server
    relay = _relay(path, directory, "kill", tmp_path)
    relay.communicate(timeout=60)
    assert relay.returncode == -signal.SIGKILL


def test_the_relay_passes_signals_on(server, tmp_path):
    _, directory, path = server
    relay = _relay(path, directory, "term", tmp_path)
    report = _report(tmp_path)
    assert relay.stdout.readline() == "hello from the worker\n"  # its handler is in place
    relay.send_signal(signal.SIGTERM)
    relay.communicate(timeout=60)
    assert relay.returncode == 7  # the worker's handler ran and chose the code
    assert _gone(report["pid"])


def test_a_killed_relay_takes_its_worker_with_it(server, tmp_path):
    _, directory, path = server
    relay = _relay(path, directory, "sleep", tmp_path)
    report = _report(tmp_path)
    relay.kill()  # no chance to pass anything on: the server sees its connection close
    relay.wait()
    deadline = time.monotonic() + 30
    while not _gone(report["pid"]):
        assert time.monotonic() < deadline, "the worker outlived its relay"
        time.sleep(0.05)


def test_without_a_server_the_relay_runs_the_worker_itself(server, tmp_path):
    _, directory, _ = server
    for socket_path in (None, tmp_path / "nobody-listens.sock"):
        relay = _relay(socket_path, directory, "exit0", tmp_path)
        out, _ = relay.communicate(timeout=60)
        assert relay.returncode == 0 and out == "hello from the worker\n"
        report = _report(tmp_path)
        assert report["pid"] == relay.pid  # the relay became the worker
        (tmp_path / "report.json").unlink()


def test_a_stopped_server_reports_its_workers_exits_then_leaves(tmp_path):
    """SIGTERM (the launcher stopping the launch) ends the serving, not the reporting: a
    running worker's relay still ends as its worker did; a relay that comes later runs its
    worker itself; the server leaves with its last worker."""
    (tmp_path / "forkprobe.py").write_text(PROBE)
    server = _start_server(tmp_path)
    path = forkserver.socket_path(tmp_path)
    running_dir = tmp_path / "running"
    running_dir.mkdir()
    relay = _relay(path, tmp_path, "sleep", running_dir)
    worker = _report(running_dir)
    assert worker["parent"] == server.pid
    server.terminate()
    later_dir = tmp_path / "later"
    later_dir.mkdir()
    deadline = time.monotonic() + 30
    while True:
        later = _relay(path, tmp_path, "exit0", later_dir)
        later.communicate(timeout=60)
        if _report(later_dir)["pid"] == later.pid:  # not forked: the server stopped serving
            break
        (later_dir / "report.json").unlink()
        assert time.monotonic() < deadline, "the server went on forking after SIGTERM"
    assert server.poll() is None  # still there for its running worker
    relay.send_signal(signal.SIGTERM)  # passed on; the probe dies of it
    relay.communicate(timeout=60)
    assert relay.returncode == -signal.SIGTERM
    assert server.wait(timeout=30) == 0


def test_the_server_preloads_without_threads_or_cuda(tmp_path):
    """Forking is safe only from a process with one thread and no CUDA context: in the
    environment a launch gives its server (OMP_NUM_THREADS=1: else OpenBLAS, loaded with
    numpy, starts a thread per core), the imports start neither."""
    from dsgd_cli.launch import torchrun

    code = ("import importlib, os, torch; from dsgd_cli.launch import forkserver\n"
            "for name in forkserver.PRELOAD: importlib.import_module(name)\n"
            "print(len(os.listdir('/proc/self/task')), torch.cuda.is_initialized())")
    env = {**torchrun.environment(tmp_path), "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120, env=env)
    assert result.stdout.split() == ["1", "False"], result.stderr


def test_a_launch_whose_torchrun_cannot_start_leaves_no_fork_server(tmp_path, monkeypatch):
    from conftest import write_spec
    from dsgd_cli.launch import launcher, torchrun
    from dsgd_cli.results.store import Store
    from dsgd_cli.spec.experiments import load_spec

    real_popen, servers = subprocess.Popen, []

    def torchrun_refused(args, **kwargs):
        if "torch.distributed.run" in args:
            raise OSError("no such program")
        servers.append(real_popen(args, **kwargs))
        return servers[-1]

    monkeypatch.setattr(torchrun.subprocess, "Popen", torchrun_refused)
    monkeypatch.setenv("DSGD_LAUNCHER", "torchrun")
    spec = write_spec(tmp_path, """
        experiments:
          - {name: a, task: {name: logreg, samples: 64}, steps_per_epoch: 2}
    """)
    (experiment,) = load_spec(spec)
    result = launcher.launch(experiment, Store(str(tmp_path / "r.db")), str(spec))
    assert (result.status, result.reason) == ("failed", "cannot start torchrun: no such program")
    (server,) = servers
    assert server.poll() is not None  # stopped and reaped


def _request_as(uid: int, path: Path, directory: Path) -> str:
    """What the server answers a request from a process of user `uid` (forked from this
    one: a fresh interpreter of another user could not read the repository)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: only system calls, then leave
        answer = b"?"
        try:
            os.setgid(uid)
            os.setuid(uid)
            import socket
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
                connection.settimeout(30)
                connection.connect(str(path))
                try:
                    forkserver.send_request(connection, "forkprobe",
                                            ["exit0", str(directory / f"report-{uid}.json")])
                except OSError:
                    pass  # closed before the whole request was read
                answer = connection.makefile("rb").readline() or b"closed"
        except ConnectionResetError:  # closed with the request unread
            answer = b"closed"
        except BaseException as error:
            answer = repr(error).encode()
        finally:
            os.write(write_end, answer)
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as answers:
        answer = answers.read().decode()
    os.waitpid(pid, 0)
    return answer


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root, to connect as another user")
def test_the_server_refuses_another_users_request():
    """Any process that can reach the socket could otherwise have a process forked as this
    user with a module, environment and directory of its choosing."""
    import shutil
    import tempfile

    directory = Path(tempfile.mkdtemp(prefix="dsgd-forkserver-"))
    try:
        directory.chmod(0o777)  # another user may reach the socket: the check is the server's
        (directory / "forkprobe.py").write_text(PROBE)
        server = _start_server(directory)
        path = forkserver.socket_path(directory)
        path.chmod(0o777)
        try:
            assert _request_as(65534, path, directory) == "closed"  # no worker forked
            assert _request_as(os.getuid(), path, directory).startswith("pid ")
        finally:
            server.terminate()
            server.wait(timeout=60)
    finally:
        shutil.rmtree(directory)


def test_a_worker_runs_as_nice_as_its_launch_asks(server, tmp_path, monkeypatch):
    _, directory, path = server
    monkeypatch.setenv(forkserver.NICENESS_VARIABLE, "7")
    relay = _relay(path, directory, "exit0", tmp_path)
    relay.communicate(timeout=60)
    assert _report(tmp_path)["niceness"] == os.nice(0) + 7


def test_a_crowded_launch_runs_its_workers_nicer_than_its_launcher():
    from dsgd_cli.launch import torchrun

    crowded = torchrun.Torchrun(torchrun.Shape((os.cpu_count() or 1) + 1))
    roomy = torchrun.Torchrun(torchrun.Shape(1))
    try:
        crowded.start_server()
        roomy.start_server()
        assert crowded._env[forkserver.NICENESS_VARIABLE] == str(torchrun.CROWDED_WORKER_NICENESS)
        assert forkserver.NICENESS_VARIABLE not in roomy._env
    finally:
        crowded.close()
        roomy.close()


def test_the_agent_starts_every_rank_and_stops_the_others_when_one_fails(server, tmp_path):
    """dsgd's agent in torchrun's place: each rank forked with torchrun's variables and the
    launch's store (a socket in the launch's directory, no TCP port); when rank 1 fails, the others are stopped (SIGTERM) and only rank 1 is
    reported as failed by itself."""
    from dsgd_cli.launch.agent import LocalAgent
    from dsgd_cli.launch.outcome import WorkerExit

    _, directory, path = server
    read_end, write_end = os.pipe()
    agent = LocalAgent(3, "forkprobe", ["rank1fails", str(tmp_path / "RANK.json")],
                       {**os.environ, "PYTHONPATH": str(directory)}, write_end, path)
    try:
        agent.start()
        os.close(write_end)
        # The store is in this process, on no TCP port (torchrun's TCPStore was on *:PORT)
        assert _listening_tcp_inodes() & _own_socket_inodes() == set()
        reports = [_report(tmp_path, f"{rank}.json") for rank in range(3)]
        assert agent.wait(timeout=60) == 1
        assert agent.failures() == [WorkerExit(1, 3)]
        assert agent.not_zero() == {0, 1, 2}  # 0 and 2 stopped by the agent
        assert [(r["rank"], r["world_size"], r["master_port"], r["store"]) for r in reports] == [
            (str(rank), "3", None, str(directory / "store.sock")) for rank in range(3)]
        with open(read_end) as output:
            assert output.read().count("hello from the worker") == 3
    finally:
        agent.close()


def _own_socket_inodes() -> set[int]:
    inodes = set()
    for fd in Path("/proc/self/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def _listening_tcp_inodes() -> set[int]:
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A":  # LISTEN
                inodes.add(int(fields[9]))
    return inodes
