"""The fork server of a launch: one process that imports torch once, and forks every worker.

A worker that starts as a fresh interpreter spends seconds of CPU importing torch (and
torch._dynamo, which torch's optimizers import on first use) before it does any work: at 64
workers on a small machine that is most of a minute, paid by all of them at once, and each
keeps a private copy of what the imports built. Forked from one process that has done the
imports, a worker starts at once and shares those pages with its siblings until it writes
them.

torchrun still starts one process per rank, and watches it: that process is the relay
(relay.py). It connects to this server's socket and sends its environment (RANK, MASTER_PORT,
...), its working directory, its standard streams (as file descriptors) and the worker's
module and arguments; the server forks, the child becomes the worker, and the relay passes
signals on to it and exits with its exit status. So torchrun sees its workers come and go as
before, and `dsgd run` reads their failures from torchrun as before.

The launcher (torchrun.py) creates the listening socket before it starts the server or
torchrun, so a relay never finds the socket missing; requests wait in the socket's backlog
until the server has finished its imports.

    python -m dsgd_cli.launch.forkserver FD RUN_DIR

FD is the listening socket, inherited; RUN_DIR, the launch's directory, is there to be seen:
the workers inherit this command line, so `ps` shows which launch they belong to (and names
each `dsgd-rank-N`).

Nothing is imported at module level beyond the standard library: the relay shares the
protocol below.
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import selectors
import signal
import socket
import struct
import sys
import traceback
from pathlib import Path
from typing import NoReturn

SOCKET_VARIABLE = "DSGD_FORK_SERVER"  # the socket's path, in the environment of torchrun's workers
NICENESS_VARIABLE = "DSGD_WORKER_NICENESS"  # added to a worker's niceness (launch/torchrun.py)
SOCKET_NAME = "forkserver.sock"
# What every worker imports before it trains; torch._dynamo is imported by torch.optim on
# first use (torch 2.x), and costs as much CPU as torch itself.
WORKER_MODULE = "dsgd_cli.worker.process"  # what the relays ask for
PRELOAD = ("torch", "torch.distributed", "torch._dynamo", WORKER_MODULE)
STREAMS = 3  # stdin, stdout, stderr
REQUEST_TIMEOUT_S = 30.0
_LENGTH = struct.Struct("!I")
_CREDENTIALS = struct.Struct("3i")  # Linux's struct ucred: pid, uid, gid


# -- protocol: a request (relay -> server), then two lines back ("pid N", "exit CODE") --------

def send_request(connection: socket.socket, module: str, args: list[str],
                 env: dict[str, str] | None = None, streams: list[int] | None = None) -> None:
    """A whole request: the worker's environment (by default this process's) and its standard
    streams' descriptors (by default this process's), which ride with the length prefix."""
    body = json.dumps({"module": module, "args": args, "cwd": os.getcwd(),
                       "env": dict(os.environ) if env is None else env}).encode()
    socket.send_fds(connection, [_LENGTH.pack(len(body))],
                    list(range(STREAMS)) if streams is None else streams)
    connection.sendall(body)


def read_exactly(connection: socket.socket, count: int, cut_short: str) -> bytes:
    """`count` bytes from `connection`; ConnectionError(`cut_short`) if it ends first."""
    data = bytearray()
    while len(data) < count:
        chunk = connection.recv(count - len(data))
        if not chunk:
            raise ConnectionError(cut_short)
        data += chunk
    return bytes(data)


def read_request(connection: socket.socket) -> tuple[dict, list[int]]:
    """A request and the relay's stream descriptors (now this process's)."""
    head, fds, _, _ = socket.recv_fds(connection, _LENGTH.size, STREAMS)
    try:
        if len(head) != _LENGTH.size or len(fds) != STREAMS:
            raise ConnectionError("incomplete request")
        (length,) = _LENGTH.unpack(head)
        return json.loads(read_exactly(connection, length, "incomplete request")), fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def peer_uid(connection: socket.socket) -> int | None:
    """The user id of the process at the other end of a Unix socket, as the kernel saw it
    connect (SO_PEERCRED); None where that cannot be known."""
    try:
        raw = connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDENTIALS.size)
    except (OSError, AttributeError):  # AttributeError: no SO_PEERCRED on this platform
        return None
    return _CREDENTIALS.unpack(raw)[1]


def socket_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / SOCKET_NAME


def listen(path: Path) -> socket.socket:
    """The listening socket, bound at `path` (OSError if it cannot be, e.g. a path too long
    for a Unix socket). Its backlog holds every rank of a launch at once."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        server.bind(str(path))
        server.listen(4096)
    except OSError:
        server.close()
        raise
    return server


# -- the server --------------------------------------------------------------------------------

class ForkServer:
    """Accepts requests, forks a worker for each, and reports each worker's pid and exit code
    on its relay's connection. A relay that disappears takes its worker with it.

    SIGTERM (the launcher stopping the launch) and the launcher's death end the serving of
    new requests, not the server: it goes on reporting its workers' exits, so each relay
    ends as its worker did, and leaves once the last worker has ended."""

    def __init__(self, listener: socket.socket):
        self.listener = listener
        self.selector = selectors.DefaultSelector()
        self.workers: dict[int, socket.socket] = {}  # pid -> its relay's connection
        self.stopping = False  # SIGTERM came
        self.prepared = False  # the launch's plan has been prepared for (see prepare())
        self.serving = True  # the listener is open
        # Signals wake the selector through a pipe; their handlers only take note.
        self.wakeup_read, self.wakeup_write = os.pipe()
        os.set_blocking(self.wakeup_write, False)
        signal.set_wakeup_fd(self.wakeup_write)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.signal(signal.SIGTERM, self._stop)
        self.selector.register(listener, selectors.EVENT_READ, "accept")
        self.selector.register(self.wakeup_read, selectors.EVENT_READ, "signal")

    def _stop(self, *_) -> None:
        self.stopping = True

    def serve(self) -> None:
        from dsgd_cli.comm.events import launcher_gone

        while True:
            for key, _ in self.selector.select(timeout=1.0):
                if key.data == "accept":
                    self.accept()
                elif key.data == "signal":
                    os.read(self.wakeup_read, 4096)
                elif self.workers.get(key.data) is key.fileobj:  # not reaped in this round
                    self.relay_left(key.fileobj, key.data)
            self.reap()
            if self.stopping or launcher_gone():
                if self.serving:
                    self.selector.unregister(self.listener)
                    self.listener.close()  # relays that come now start their workers themselves
                    self.serving = False
                if not self.workers:
                    return

    def accept(self) -> None:
        try:
            connection, _ = self.listener.accept()
        except OSError:  # e.g. out of file descriptors: the relay waits, or gives up
            return
        # A request chooses the module, arguments, environment and directory of a process
        # forked as this user: only this user's processes may make one. Refused, another
        # user's relay (or one where the peer is unknown) runs its worker itself, as itself.
        if peer_uid(connection) != os.getuid():
            connection.close()
            return
        connection.settimeout(REQUEST_TIMEOUT_S)
        try:
            request, fds = read_request(connection)
        except (OSError, ValueError):  # ConnectionError is an OSError
            connection.close()  # the relay starts its worker itself
            return
        self.prepare(request)
        try:
            pid = os.fork()
        except OSError:  # out of processes or memory: the relay starts its worker itself
            pid = None
        if pid == 0:
            connection.close()
            self.become_worker(request, fds)
        for fd in fds:
            os.close(fd)
        if pid is None:
            connection.close()
            return
        self.workers[pid] = connection
        self.selector.register(connection, selectors.EVENT_READ, pid)
        try:
            connection.sendall(f"pid {pid}\n".encode())
        except OSError:
            self.relay_left(connection, pid)

    def prepare(self, request: dict) -> None:
        """Before the first worker: build once what every worker of the plan builds first
        (dsgd_cli/worker/preload.py), so they share it."""
        if self.prepared or request["module"] != WORKER_MODULE or not request["args"]:
            return
        self.prepared = True
        from dsgd_cli.worker.preload import prepare  # imported with WORKER_MODULE already

        if prepare(Path(request["args"][0])):
            gc.freeze()  # what it made, too, stays out of the collector's passes

    def become_worker(self, request: dict, fds: list[int]) -> NoReturn:
        """In the forked child: drop the server's state, take the relay's environment,
        directory and streams, and run the worker's `main(args)`."""
        code = 1
        try:
            signal.set_wakeup_fd(-1)
            for sig in (signal.SIGCHLD, signal.SIGTERM):
                signal.signal(sig, signal.SIG_DFL)
            self.selector.close()
            self.listener.close()
            os.close(self.wakeup_read)
            os.close(self.wakeup_write)
            for connection in self.workers.values():
                connection.close()
            for target, fd in enumerate(fds):
                os.dup2(fd, target)
            for fd in set(fds) - {0, 1, 2}:
                os.close(fd)
            os.setsid()  # a session of its own, as torchrun gives each process it starts
            os.nice(int(request["env"].get(NICENESS_VARIABLE, "0")))
            os.environ.clear()
            os.environ.update(request["env"])
            os.chdir(request["cwd"])
            sys.argv = [request["module"], *request["args"]]
            name_process(f"dsgd-rank-{request['env'].get('RANK', '?')}")
            importlib.import_module(request["module"]).main(request["args"])
            code = 0
        except SystemExit as exit:  # as the interpreter would end on it
            if isinstance(exit.code, int) or exit.code is None:
                code = exit.code or 0
            else:
                print(exit.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            finally:  # whatever happens, never back into the server's loop
                os._exit(code)

    def reap(self) -> None:
        """Report every worker that has exited to its relay."""
        while self.workers:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            connection = self.workers.pop(pid, None)
            if connection is None:
                continue
            if connection in self.selector.get_map():
                self.selector.unregister(connection)
            try:
                connection.sendall(f"exit {os.waitstatus_to_exitcode(status)}\n".encode())
            except OSError:
                pass  # its relay is gone
            connection.close()

    def relay_left(self, connection: socket.socket, pid: int) -> None:
        """A relay's connection became readable: relays send nothing after their request, so
        the relay is gone (killed: torchrun gave up on it). Its worker must not outlive it;
        reap() collects it. (`pid` is still unreaped here, so it is still the worker's.)"""
        self.selector.unregister(connection)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def name_process(name: str) -> None:
    """Shown by `ps` and `top` (Linux, 15 characters at most); elsewhere nothing happens."""
    try:
        Path("/proc/self/comm").write_text(name[:15])
    except OSError:
        pass


def main(argv: list[str] | None = None) -> None:
    fd, _run_dir = argv or sys.argv[1:]
    listener = socket.socket(fileno=int(fd))
    for name in PRELOAD:
        importlib.import_module(name)
    # Objects that exist now are shared with every worker; kept out of the garbage
    # collector's passes, their pages stay shared instead of being copied into each worker.
    gc.freeze()
    ForkServer(listener).serve()


if __name__ == "__main__":
    main()
