"""dsgd's own agent for a launch on one machine: what torchrun does there, without a process
per rank.

On one machine torchrun hosts the rendezvous store, starts one process per rank (for dsgd a
relay, relay.py, to the launch's fork server), watches them, and when one fails stops the
others and reports which failed first. At a thousand workers the relays alone cost gigabytes
(about 7.7 MiB each) and torchrun starts them one after another. This agent asks the fork
server (forkserver.py) for each rank's worker directly, over one connection per rank, with
the environment torchrun would have given it; the server reports each worker's pid and exit
on that connection, as it does to a relay. The rendezvous store is the launcher's, as
torchrun's agent keeps it, so it outlives any worker: a small process of its own (so that the
launcher's threads never hold up its answers), and unlike torchrun's TCP store it listens on
a Unix socket in the launch's 0700 directory (local_store.py), out of every other user's
reach. Before the agent sends a worker's environment to the fork server
it checks that the server's socket is its own user's.

`LocalAgent` stands where torchrun's `subprocess.Popen` stood for the launcher: `poll()`,
`wait()` and `returncode` (0 when every worker exited with 0, else 1), and it tells which
workers failed by themselves (`failures()`, the first first) and which did not exit with 0
(`not_zero()`), which the launcher read from torchrun's log before.

Multi-machine launches keep torchrun (its c10d rendezvous), as does `DSGD_LAUNCHER=torchrun`.
"""

from __future__ import annotations

import os
import resource
import selectors
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsgd_cli.launch import forkserver
from dsgd_cli.launch.local_store import STORE_VARIABLE, start_process, store_path
from dsgd_cli.launch.outcome import WorkerExit

LAUNCHER_VARIABLE = "DSGD_LAUNCHER"  # "torchrun": torchrun on one machine too
TERMINATE_WAIT_S = 5.0  # after SIGTERM to the others of a failed worker, before SIGKILL


def wanted() -> bool:
    """Whether a launch on one machine uses this agent (the default) rather than torchrun."""
    return os.environ.get(LAUNCHER_VARIABLE, "").strip().lower() != "torchrun"


def worker_environment(base: dict[str, str], rank: int, workers: int,
                       store: Path) -> dict[str, str]:
    """What torchrun --standalone puts in a rank's environment, less its own bookkeeping, and
    with the launch's store (a socket path) where torchrun puts a TCP address and port."""
    env = dict(base)
    env.update({
        "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
        "ROLE_NAME": "default", "WORLD_SIZE": str(workers), "LOCAL_WORLD_SIZE": str(workers),
        "GROUP_WORLD_SIZE": "1", "ROLE_WORLD_SIZE": str(workers),
        STORE_VARIABLE: str(store),
        "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
    })
    return env


@dataclass
class _Worker:
    rank: int
    connection: socket.socket
    pid: int | None = None
    exitcode: int | None = None
    # The signal the agent last sent it to stop it, after another worker failed; None if
    # it sent none.
    closed_with: signal.Signals | None = None
    replies: bytearray = field(default_factory=bytearray)


class LocalAgent:
    """The workers of one launch on this machine, forked by the fork server listening at
    `server`: rank r runs `module.main(args)` with `worker_environment(env, r, ...)`, its
    standard output and error on `output` (a file descriptor), its input /dev/null."""

    def __init__(self, workers: int, module: str, args: list[str], env: dict[str, str],
                 output: int, server: Path):
        self.workers = workers
        self._module, self._args, self._env = module, args, env
        self._output, self._server = output, server
        self._ranks: list[_Worker] = []
        self._order: list[int] = []  # ranks that exited with a code other than 0, in that order
        self._lock = threading.Lock()
        self._ended = threading.Event()
        self._watcher: threading.Thread | None = None
        self.store: Any = None
        self.returncode: int | None = None

    # -- start ---------------------------------------------------------------------------------

    def start(self) -> None:
        """Host the store, then ask the server for every rank's worker (OSError if the server
        cannot be reached: the launch then fails to start, as when torchrun cannot)."""
        raise_descriptor_limit(self.workers)
        self.store = start_process(store_path(self._server.parent), self._env)
        stdin = os.open(os.devnull, os.O_RDONLY)
        try:
            for rank in range(self.workers):
                self._ranks.append(self._request(rank, [stdin, self._output, self._output]))
        except OSError:
            self._abandon()
            raise
        finally:
            os.close(stdin)
        self._watcher = threading.Thread(target=self._watch, daemon=True, name="dsgd-agent")
        self._watcher.start()

    def _request(self, rank: int, streams: list[int]) -> _Worker:
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            connection.connect(str(self._server))
            check_owner(connection, self._server)
            env = worker_environment(self._env, rank, self.workers,
                                     store_path(self._server.parent))
            forkserver.send_request(connection, self._module, self._args, env=env,
                                    streams=streams)
        except OSError:
            connection.close()
            raise
        return _Worker(rank, connection)

    def _abandon(self) -> None:
        """The start failed part way: closing the connections makes the server kill what it
        forked for them."""
        for worker in self._ranks:
            worker.connection.close()
        self.returncode = 1
        self._ended.set()

    # -- watch ---------------------------------------------------------------------------------

    def _watch(self) -> None:
        selector = selectors.DefaultSelector()
        for worker in self._ranks:
            selector.register(worker.connection, selectors.EVENT_READ, worker)
        open_count = len(self._ranks)
        stop_at: float | None = None  # when to SIGKILL the workers asked to stop
        while open_count:
            for key, _ in selector.select(timeout=0.5):
                worker: _Worker = key.data
                if not self._read(worker):
                    selector.unregister(worker.connection)
                    worker.connection.close()
                    open_count -= 1
            if stop_at is None and self._order:
                self._close_others(signal.SIGTERM)
                stop_at = time.monotonic() + TERMINATE_WAIT_S
            elif stop_at is not None and time.monotonic() > stop_at:
                self._close_others(signal.SIGKILL)
                stop_at = float("inf")
        selector.close()
        with self._lock:
            # A worker whose server went before it reported an exit counts as failed.
            self.returncode = 0 if all(w.exitcode == 0 for w in self._ranks) else 1
        self._ended.set()

    def _read(self, worker: _Worker) -> bool:
        """Take what the server said of `worker`; False once its connection has ended."""
        try:
            chunk = worker.connection.recv(256)
        except OSError:
            chunk = b""
        worker.replies += chunk
        while b"\n" in worker.replies:
            line, _, rest = bytes(worker.replies).partition(b"\n")
            worker.replies = bytearray(rest)
            word, number = line.decode().split()
            with self._lock:
                if word == "pid":
                    worker.pid = int(number)
                elif word == "exit":
                    worker.exitcode = int(number)
                    if worker.exitcode != 0:
                        self._order.append(worker.rank)
        return bool(chunk)

    def _close_others(self, sig: signal.Signals) -> None:
        """Stop every worker still running after one failed, as torchrun does."""
        with self._lock:
            running = [w for w in self._ranks if w.exitcode is None and w.pid is not None]
            for worker in running:
                worker.closed_with = sig
        for worker in running:
            try:
                os.kill(worker.pid, sig)
            except ProcessLookupError:
                pass  # it has just ended: its exit is on its way

    # -- what subprocess.Popen offers ------------------------------------------------------------

    def poll(self) -> int | None:
        return self.returncode if self._ended.is_set() else None

    def wait(self, timeout: float | None = None) -> int:
        import subprocess

        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired("dsgd agent", timeout)
        return self.returncode

    # -- what torchrun's log said ----------------------------------------------------------------

    def failures(self) -> list[WorkerExit]:
        """The workers that failed by themselves (not stopped by the agent), the first first."""
        with self._lock:
            by_rank = {w.rank: w for w in self._ranks}
            return [WorkerExit(rank, by_rank[rank].exitcode) for rank in self._order
                    if not _stopped_by_agent(by_rank[rank])]

    def exited_zero(self) -> set[int]:
        """The ranks seen to exit with code 0 so far."""
        with self._lock:
            return {w.rank for w in self._ranks if w.exitcode == 0}

    def not_zero(self) -> set[int]:
        """The ranks that exited with a code other than 0, stopped by the agent or not."""
        with self._lock:
            return set(self._order)

    def close(self) -> None:
        """Once the workers are gone: end the watch and release the store."""
        for worker in self._ranks:
            worker.connection.close()
        if self._watcher is not None:
            self._watcher.join(TERMINATE_WAIT_S)
        if self.store is not None:
            self.store.terminate()
            self.store.wait()
            self.store = None


def _stopped_by_agent(worker: _Worker) -> bool:
    """Whether `worker` died of the agent's signal. One that died of another signal after
    the agent began stopping it (killed by someone else meanwhile: its exit may be read after
    its peer's) failed by itself."""
    if worker.closed_with is None:
        return False
    return worker.exitcode is None or worker.exitcode >= 0 or -worker.exitcode == worker.closed_with


def check_owner(connection: socket.socket, path: Path) -> None:
    """Refuse (OSError) a fork server that is not this user's: nothing of a launch, least of
    all its environment, goes to a socket another user made."""
    if forkserver.peer_uid(connection) != os.getuid():
        raise PermissionError(f"the fork server's socket {path} is not this user's")


def raise_descriptor_limit(workers: int) -> None:
    """The launcher holds a connection per worker and its store another, the fork server a
    connection per worker and, for a moment, each one's three streams: raise this process's
    soft limit on open files (which the server inherits) towards the hard one when it is
    lower than that needs."""
    needed = 4 * workers + 256
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, target), hard))
