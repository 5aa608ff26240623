"""The rendezvous store of a launch on one machine, reachable by its owner alone.

torch's `TCPStore` listens on a TCP port, and a TCP port on a shared machine is open to every
local user (and, as libuv binds it, to every interface): whoever connects can read each
rank's gloo address and write dsgd's control keys (a samples-budget counter, the step to stop
at), and so forge a run's results. This store listens on a Unix socket inside the launch's
0700 directory instead, where only its owner can reach it; the server also checks each
connection's user (SO_PEERCRED), as the fork server does.

`StoreServer` runs in the launcher on a thread of its own (nothing here imports torch); each
worker's `worker.store_client.LocalStore` is a `torch.distributed.Store` that gloo and dsgd
use like any other. The semantics are c10d's:
`get` and `wait` block until their keys are set (or the timeout passes), `add` keeps a
decimal integer, `compare_set` sets when the value is the expected one (or the key is absent
and the expected value is empty) and returns the value it leaves.

The protocol: each request and each reply is a frame, a 4-byte length and that many bytes;
a request is an operation code and its fields, each a frame too. A client opens one
connection per thread, so that one thread blocked in `wait` never holds up another's `set`.
"""

from __future__ import annotations

import heapq
import os
import selectors
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

from dsgd_cli.launch.forkserver import peer_uid

SOCKET_NAME = "store.sock"
STORE_VARIABLE = "DSGD_STORE_SOCKET"  # a worker's environment: where its launch's store is
_LENGTH = struct.Struct("!I")
MAX_FRAME = 64 * 2**20  # no key or value dsgd or gloo writes is near this

# Operation codes (one byte) and the fields each request carries.
SET, GET, ADD, COMPARE_SET, CHECK, WAIT, DELETE, NUM_KEYS = (bytes([c]) for c in b"sgacwdDn")
OK, MISSING, TIMED_OUT = b"+", b"-", b"!"  # a reply's first byte


def store_path(launch_dir: str | Path) -> Path:
    return Path(launch_dir) / SOCKET_NAME


def bind(path: Path) -> socket.socket:
    """A listening Unix socket at `path`, its file its owner's alone from the start."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_mask = os.umask(0o177)
    try:
        listener.bind(str(path))
        listener.listen(4096)  # every rank of a launch at once
    except OSError:
        listener.close()
        raise
    finally:
        os.umask(old_mask)
    return listener


def start_process(path: Path, env: dict[str, str]) -> subprocess.Popen:
    """The store in a process of its own: the launcher's own threads (reading a thousand
    workers' events) would otherwise hold the interpreter's lock while the workers wait on
    the store. The socket is bound here, so the workers find it at once; the process ends
    with `terminate()`, or by itself once the launcher is gone."""
    with bind(path) as listener:
        return subprocess.Popen(
            [sys.executable, "-m", "dsgd_cli.launch.local_store", str(listener.fileno()),
             str(path), str(os.getpid())], pass_fds=[listener.fileno()], stdin=subprocess.DEVNULL, env=env,
            start_new_session=True)


def main(argv: list[str]) -> None:
    fd, path, launcher = int(argv[0]), Path(argv[1]), int(argv[2])
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    server = StoreServer(path, socket.socket(fileno=fd))
    server.serve(still_wanted=lambda: os.getppid() == launcher)


def frame(payload: bytes) -> bytes:
    return _LENGTH.pack(len(payload)) + payload


def request(code: bytes, *fields: bytes) -> bytes:
    return frame(code + b"".join(frame(field) for field in fields))


def fields_of(payload: bytes) -> list[bytes]:
    fields, at = [], 0
    while at < len(payload):
        (length,) = _LENGTH.unpack_from(payload, at)
        fields.append(payload[at + 4:at + 4 + length])
        at += 4 + length
    return fields


class _Parked:
    """A request waiting for keys that are not set yet; `done` once answered (or its client
    is gone), after which the lists and the heap that still hold it skip it."""

    def __init__(self, connection: socket.socket, code: bytes, keys: list[bytes],
                 deadline: float):
        self.connection, self.code, self.keys, self.deadline = connection, code, keys, deadline
        self.done = False

    def __lt__(self, other: _Parked) -> bool:  # the deadlines' heap
        return self.deadline < other.deadline


class StoreServer:
    """The store's keys, served on a Unix socket at `path` to connections of this user only:
    on a thread of its own (`start()`), or as the whole of a process (`serve()`, in
    `start_process`'s). `listener`: the socket, already bound at `path`."""

    def __init__(self, path: Path, listener: socket.socket | None = None):
        self.path = path
        self._values: dict[bytes, bytes] = {}
        # Waiting requests by key, and all of them by deadline: a thousand workers wait at once
        # (gloo's rendezvous, barriers), so neither list is ever scanned whole.
        self._parked: dict[bytes, list[_Parked]] = defaultdict(list)
        self._deadlines: list[_Parked] = []
        self._parked_by_connection: dict[socket.socket, set[_Parked]] = defaultdict(set)
        self._buffers: dict[socket.socket, bytearray] = {}
        self._listener = listener or bind(path)
        self._listener.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._wake_read, self._wake_write = socket.socketpair()
        self._selector.register(self._wake_read, selectors.EVENT_READ)
        self._closing = False
        self._thread: threading.Thread | None = None

    def start(self) -> StoreServer:
        """Serve on a thread of this process (tests, and a process that has time to spare)."""
        self._thread = threading.Thread(target=self.serve, daemon=True, name="dsgd-store")
        self._thread.start()
        return self

    def close(self) -> None:
        self._closing = True
        self._wake_write.send(b"x")
        if self._thread is not None:
            self._thread.join(5.0)
        for connection in list(self._buffers):
            connection.close()
        self._listener.close()
        self._wake_read.close()
        self._wake_write.close()
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass

    # -- the loop ------------------------------------------------------------------------------

    def serve(self, still_wanted=lambda: True) -> None:
        """Answer requests until `close()`, or until `still_wanted()` (asked every second)
        says no."""
        while not self._closing and still_wanted():
            deadline = self._next_deadline()
            for key, _ in self._selector.select(timeout=1.0 if deadline is None
                                                 else min(deadline, 1.0)):
                if key.fileobj is self._listener:
                    self._accept()
                elif key.fileobj is self._wake_read:
                    self._wake_read.recv(64)
                else:
                    self._receive(key.fileobj)
            self._expire(time.monotonic())
        self._selector.close()

    def _accept(self) -> None:
        try:
            connection, _ = self._listener.accept()
        except BlockingIOError:
            return
        if peer_uid(connection) != os.getuid():  # the directory keeps others out; this too
            connection.close()
            return
        connection.setblocking(True)
        self._buffers[connection] = bytearray()
        self._selector.register(connection, selectors.EVENT_READ)

    def _receive(self, connection: socket.socket) -> None:
        try:
            chunk = connection.recv(2**16)
        except OSError:
            chunk = b""
        if not chunk:
            self._drop(connection)
            return
        buffer = self._buffers[connection]
        buffer += chunk
        while len(buffer) >= 4:
            (length,) = _LENGTH.unpack_from(buffer)
            if length > MAX_FRAME:
                self._drop(connection)
                return
            if len(buffer) < 4 + length:
                break
            payload = bytes(buffer[4:4 + length])
            del buffer[:4 + length]
            self._handle(connection, payload[:1], fields_of(payload[1:]))

    def _drop(self, connection: socket.socket) -> None:
        self._selector.unregister(connection)
        del self._buffers[connection]
        for parked in self._parked_by_connection.pop(connection, []):
            parked.done = True
        connection.close()

    # -- the operations ------------------------------------------------------------------------

    def _handle(self, connection: socket.socket, code: bytes, fields: list[bytes]) -> None:
        if code == SET:
            key, value = fields
            self._set(key, value)
            self._reply(connection, OK)
        elif code == ADD:
            key, amount = fields
            total = int(self._values.get(key, b"0")) + int(amount)
            self._set(key, str(total).encode())
            self._reply(connection, OK, str(total).encode())
        elif code == COMPARE_SET:
            key, expected, desired = fields
            current = self._values.get(key)
            if (current is None and expected == b"") or current == expected:
                self._set(key, desired)
                current = desired
            self._reply(connection, OK, current if current is not None else expected)
        elif code == CHECK:
            present = all(key in self._values for key in fields)
            self._reply(connection, OK if present else MISSING)
        elif code == DELETE:
            (key,) = fields
            self._reply(connection, OK if self._values.pop(key, None) is not None else MISSING)
        elif code == NUM_KEYS:
            self._reply(connection, OK, str(len(self._values)).encode())
        elif code in (GET, WAIT):  # the first field: the timeout in milliseconds
            timeout_ms, *keys = fields
            parked = _Parked(connection, code, keys, time.monotonic() + int(timeout_ms) / 1000)
            if not self._answer(parked):
                for key in keys:
                    self._parked[key].append(parked)
                heapq.heappush(self._deadlines, parked)
                self._parked_by_connection[connection].add(parked)
        else:
            self._drop(connection)

    def _set(self, key: bytes, value: bytes) -> None:
        self._values[key] = value
        for parked in self._parked.pop(key, []):
            if not parked.done:
                self._answer(parked)

    def _answer(self, parked: _Parked) -> bool:
        """Reply to a request whose keys are all set; whether it was. A request waiting for
        several keys stays in the lists of the others, done."""
        if not all(key in self._values for key in parked.keys):
            return False
        self._finish(parked)
        value = self._values[parked.keys[0]] if parked.code == GET else b""
        self._reply(parked.connection, OK, value)
        return True

    def _expire(self, now: float) -> None:
        """Time out the requests whose deadline has passed."""
        while self._deadlines and self._deadlines[0].deadline <= now:
            parked = heapq.heappop(self._deadlines)
            if not parked.done:
                self._finish(parked)
                self._reply(parked.connection, TIMED_OUT)

    def _finish(self, parked: _Parked) -> None:
        parked.done = True
        self._parked_by_connection.get(parked.connection, set()).discard(parked)

    def _next_deadline(self) -> float | None:
        while self._deadlines and self._deadlines[0].done:
            heapq.heappop(self._deadlines)
        if not self._deadlines:
            return None
        return max(0.0, self._deadlines[0].deadline - time.monotonic())

    def _reply(self, connection: socket.socket, status: bytes, value: bytes = b"") -> None:
        try:
            connection.sendall(frame(status + value))
        except OSError:
            pass  # the client is gone; its connection is dropped when read


if __name__ == "__main__":
    main(sys.argv[1:])
