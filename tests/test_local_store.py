"""The launch's rendezvous store on one machine (launch/local_store.py, worker/store_client.py):
c10d's semantics over a Unix socket in the launch's 0700 directory, no TCP listener, and no
way in for another user.

Before, the launcher held a `TCPStore` on `*:PORT`: any local user could list every rank's
gloo address and add to a samples-budget counter, and a run stopped at once and was recorded
`completed`."""

from __future__ import annotations

import os
import socket
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dsgd_cli.launch.local_store import StoreServer, start_process, store_path
from dsgd_cli.worker.store_client import LocalStore

NOBODY = 65534


@pytest.fixture
def launch_dir():
    with tempfile.TemporaryDirectory(prefix="dsgd-launch-") as directory:  # 0700, as a launch's
        yield Path(directory)


@pytest.fixture
def server(launch_dir):
    server = StoreServer(store_path(launch_dir)).start()
    yield server
    server.close()


def test_the_store_keeps_c10d_semantics(server):
    store = LocalStore(server.path, timedelta(seconds=5))
    store.set("a", b"1")
    assert store.get("a") == b"1"
    assert store.add("counter", 5) == 5 and store.add("counter", -2) == 3
    assert store.get("counter") == b"3"
    # compare_set: an absent key with an empty expectation is set; a wrong one is left
    assert store.compare_set("stop_at", "", "7") == b"7"
    assert store.compare_set("stop_at", "", "9") == b"7"
    assert store.compare_set("stop_at", "7", "8") == b"8"
    assert store.check(["a", "counter"]) and not store.check(["a", "absent"])
    assert store.num_keys() == 3
    assert store.delete_key("a") and not store.delete_key("a")
    assert not store.check(["a"])


def test_get_and_wait_block_until_another_connection_sets_the_key(server):
    waiter, setter = (LocalStore(server.path, timedelta(seconds=10)) for _ in range(2))
    got = []
    thread = threading.Thread(target=lambda: got.append(waiter.get("late")))
    thread.start()
    waiter_wait = threading.Thread(target=lambda: waiter.wait(["late", "later"]))
    waiter_wait.start()
    time.sleep(0.2)
    assert got == []  # still waiting: the key is not there
    setter.set("late", b"here")
    thread.join(5)
    assert got == [b"here"]
    assert waiter_wait.is_alive()  # it waits for both keys
    setter.set("later", b"")
    waiter_wait.join(5)
    assert not waiter_wait.is_alive()


def test_a_wait_times_out_with_the_keys_it_waited_for(server):
    store = LocalStore(server.path, timedelta(seconds=5))
    with pytest.raises(dist.DistStoreError, match="never"):
        store.wait(["never"], timedelta(milliseconds=200))
    store.set("after", b"1")  # the connection is still in step after a timeout
    assert store.get("after") == b"1"


def test_the_socket_is_its_owners_alone(server, launch_dir):
    assert (launch_dir.stat().st_mode & 0o777) == 0o700
    assert (server.path.stat().st_mode & 0o077) == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as a second user")
def test_another_user_cannot_reach_the_store(server, launch_dir):
    """Another user cannot reach the socket through the directory, and the server refuses
    their connection even where the path is open to them."""
    assert _as_nobody(lambda: _connect(server.path)) == "PermissionError"
    os.chmod(launch_dir, 0o777)  # were the directory open, the server still checks the user
    os.chmod(server.path, 0o777)
    result = _as_nobody(lambda: _set_through(server.path))
    assert result in ("ConnectionError", "BrokenPipeError", "ConnectionResetError")
    assert not LocalStore(server.path, timedelta(seconds=5)).check(["planted"])


def test_gloo_meets_and_trains_through_the_store(server):
    """Four ranks in threads of one process: gloo's rendezvous, an all-reduce and the
    control keys dsgd uses, all through the store."""
    world = 2
    results = {}

    def rank_main(rank):
        store = LocalStore(server.path, timedelta(seconds=30))
        group = dist.ProcessGroupGloo(dist.PrefixStore("pg/", store), rank, world,
                                      timedelta(seconds=30))
        tensor = torch.full((4,), float(rank + 1))
        group.allreduce([tensor]).wait()
        results[rank] = (tensor.tolist(), store.add("samples", 10))

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert {rank: value[0] for rank, value in results.items()} == {0: [3.0] * 4, 1: [3.0] * 4}
    assert sorted(value[1] for value in results.values()) == [10, 20]


def _connect(path: Path) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
        connection.connect(str(path))


def _set_through(path: Path) -> None:
    store = LocalStore(path, timedelta(seconds=5))
    store.set("planted", b"1")


def _as_nobody(action) -> str:
    """Run `action` in a child process as user nobody; the name of what it raised, or 'ok'."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        try:
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            action()
            outcome = "ok"
        except BaseException as error:  # noqa: BLE001 - reported to the parent by name
            outcome = type(error).__name__
        os.write(write_end, outcome.encode())
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as pipe:
        outcome = pipe.read()
    os.waitpid(pid, 0)
    return outcome


def test_the_store_process_serves_until_told_and_not_past_its_launcher(launch_dir):
    """`start_process`: a store of its own process, ended by terminate(), or by itself
    within seconds once the process that started it is gone."""
    process = start_process(store_path(launch_dir), dict(os.environ))
    try:
        store = LocalStore(store_path(launch_dir), timedelta(seconds=5))
        store.set("k", b"v")
        assert store.get("k") == b"v"
    finally:
        process.terminate()
        assert process.wait(10) == 0
    orphan_dir = launch_dir / "orphan"
    orphan_dir.mkdir()
    read_end, write_end = os.pipe()
    launcher = os.fork()
    if launcher == 0:  # a launcher that starts the store, says its pid and dies
        try:
            os.write(write_end, str(start_process(store_path(orphan_dir),
                                                  dict(os.environ)).pid).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as pipe:
        orphan = int(pipe.read())
    os.waitpid(launcher, 0)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _alive(orphan):
        time.sleep(0.1)
    assert not _alive(orphan)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False
