"""A worker's side of its launch's store (`launch.local_store`): a `torch.distributed.Store`
over the launch's Unix socket, which gloo's rendezvous and dsgd's control keys use like
torch's own stores."""

from __future__ import annotations

import socket
import struct
import threading
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from dsgd_cli.launch.forkserver import read_exactly
from dsgd_cli.launch.local_store import (ADD, CHECK, COMPARE_SET, DELETE, GET, MISSING, NUM_KEYS,
                                         OK, SET, TIMED_OUT, WAIT, request)

_LENGTH = struct.Struct("!I")


class LocalStore(dist.Store):
    """A worker's side of a `StoreServer` (see the module's text)."""

    def __init__(self, path: str | Path, timeout: timedelta = timedelta(seconds=600)):
        super().__init__()
        self._path, self._timeout = str(path), timeout
        self._local = threading.local()

    # -- what c10d asks of a store -------------------------------------------------------------

    def set(self, key, value) -> None:
        self._call(SET, _bytes(key), _bytes(value))

    def get(self, key) -> bytes:
        return self._call(GET, self._timeout_ms(), _bytes(key))

    def add(self, key, amount: int) -> int:
        return int(self._call(ADD, _bytes(key), str(int(amount)).encode()))

    def compare_set(self, key, expected, desired) -> bytes:
        return self._call(COMPARE_SET, _bytes(key), _bytes(expected), _bytes(desired))

    def check(self, keys) -> bool:
        return self._call(CHECK, *map(_bytes, keys), missing_ok=True) is not None

    def wait(self, keys, timeout: timedelta | None = None) -> None:
        self._call(WAIT, self._timeout_ms(timeout), *map(_bytes, keys))

    def delete_key(self, key) -> bool:
        return self._call(DELETE, _bytes(key), missing_ok=True) is not None

    def num_keys(self) -> int:
        return int(self._call(NUM_KEYS))

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout

    @property
    def timeout(self) -> timedelta:
        return self._timeout

    # -- the connection ------------------------------------------------------------------------

    def _timeout_ms(self, timeout: timedelta | None = None) -> bytes:
        return str(int((timeout or self._timeout).total_seconds() * 1000)).encode()

    def _connection(self) -> socket.socket:
        connection = getattr(self._local, "connection", None)
        if connection is None:
            connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            connection.connect(self._path)
            self._local.connection = connection
        return connection

    def _call(self, code: bytes, *fields: bytes, missing_ok: bool = False) -> bytes | None:
        connection = self._connection()
        try:
            connection.sendall(request(code, *fields))
            reply = _read_frame(connection)
        except OSError:
            self._local.connection = None
            connection.close()
            raise
        status, value = reply[:1], reply[1:]
        if status == OK:
            return value
        if status == MISSING and missing_ok:
            return None
        if status == TIMED_OUT:
            raise dist.DistStoreError(f"dsgd's store: timed out after "
                                      f"{self._timeout.total_seconds():g} s waiting for "
                                      f"{', '.join(f.decode(errors='replace') for f in fields[1:])}")
        raise dist.DistStoreError(f"dsgd's store: unexpected reply {status!r}")


def _bytes(value) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


def _read_frame(connection: socket.socket) -> bytes:
    closed = "dsgd's store closed the connection"
    (length,) = _LENGTH.unpack(read_exactly(connection, 4, closed))
    return read_exactly(connection, length, closed)
