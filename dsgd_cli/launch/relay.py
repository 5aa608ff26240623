"""What torchrun starts for each rank: a relay to the launch's fork server (forkserver.py).

    python -m dsgd_cli.launch.relay MODULE ARGS...

asks the fork server named by $DSGD_FORK_SERVER to fork a worker that runs `MODULE.main(ARGS)`
with this process's environment, working directory and standard streams; then passes the
signals it gets on to that worker and ends as the worker ended (the same exit code, or killed
by the same signal), so torchrun sees the worker's fate as its own. Without a fork server (no
variable, or none answering) it becomes the worker itself: `python -m MODULE ARGS...`.

It imports only the standard library: it starts in milliseconds.
"""

from __future__ import annotations

import os
import resource
import signal
import socket
import sys
import time
from typing import NoReturn

from dsgd_cli.launch.forkserver import SOCKET_VARIABLE, send_request

# Passed on to the worker. SIGKILL cannot be caught: the fork server sees the relay's
# connection close and kills the worker itself.
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
             signal.SIGUSR2)


def main(argv: list[str] | None = None) -> None:
    module, *args = argv or sys.argv[1:]
    connection = _connect(os.environ.get(SOCKET_VARIABLE))
    if connection is None:
        _become_worker(module, args)
    with connection, connection.makefile("rb") as replies:
        try:
            send_request(connection, module, args)
            pid = _reply(replies, "pid")
        except (OSError, ValueError):
            pid = None
        # No pid: the server forked no worker for this relay (it is stopping, could not
        # fork, or died before it got this far).
        if pid is None:
            _become_worker(module, args)
        for sig in FORWARDED:
            signal.signal(sig, lambda signum, _, pid=pid: _forward(pid, signum))
        code = _reply(replies, "exit")
    if code is None:  # the server was killed before its worker ended
        _wait_until_gone(pid)
        sys.exit(f"dsgd: the fork server is gone; the exit code of worker {pid} is unknown")
    if code < 0:  # killed by a signal: die of the same one (without a core file of its own)
        resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))
        try:
            signal.signal(-code, signal.SIG_DFL)
        except (OSError, ValueError):  # SIGKILL and SIGSTOP have no handler to reset
            pass
        os.kill(os.getpid(), -code)
        code = 128 - code  # as a shell reports it, should the signal not end this process
    sys.exit(code)


def _connect(path: str | None) -> socket.socket | None:
    if not path:
        return None
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        connection.connect(path)
    except OSError:  # no server (it failed to start, or has ended)
        connection.close()
        return None
    return connection


def _reply(replies, expected: str) -> int | None:
    """The number of the server's next line, which must be `EXPECTED N`; None at its end."""
    line = replies.readline().decode()
    if not line:
        return None
    word, number = line.split()
    if word != expected:
        raise ValueError(f"fork server said {line!r}, expected {expected!r}")
    return int(number)


def _forward(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass  # already gone: its exit is on its way


def _wait_until_gone(pid: int) -> None:
    """Until process `pid` has ended (it is not this process's child: no wait() for it). A
    zombie has ended: its new parent may never reap it."""
    while True:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                if stat.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return
        except OSError:  # gone (or no /proc: ask the kernel)
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
        time.sleep(0.1)


def _become_worker(module: str, args: list[str]) -> NoReturn:
    os.execv(sys.executable, [sys.executable, "-m", module, *args])


if __name__ == "__main__":
    main()
