"""The local data cache (dsgd_cli/datacache.py) and its use by the MNIST-1D tasks."""

from __future__ import annotations

import multiprocessing
import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from dsgd_cli import datacache
from dsgd_cli.api import TaskData
from plugins.tasks import mnist1d
from plugins.tasks.mnist1d import CNNOptions, MLPOptions, MNIST1DCNN, MNIST1DMLP

N = 200  # small and above the option's minimum (100)
FIELDS = ("train_x", "train_y", "test_x", "test_y")


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    directory = tmp_path / "cache"
    monkeypatch.setenv("DSGD_CACHE_DIR", str(directory))
    monkeypatch.delenv("DSGD_NO_DATA_CACHE", raising=False)
    monkeypatch.setattr(datacache, "_warned_unwritable", False)
    return directory


@pytest.fixture
def makes(monkeypatch) -> list:
    """Counts the real generations (calls of mnist1d.make)."""
    calls = []
    real = mnist1d.make

    def counting(num_samples, data_seed):
        calls.append((num_samples, data_seed))
        return real(num_samples, data_seed)

    monkeypatch.setattr(mnist1d, "make", counting)
    return calls


def fresh(num_samples: int, data_seed: int) -> TaskData:
    """Generation with the cache disabled."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DSGD_NO_DATA_CACHE", "1")
        return mnist1d.generate(num_samples, data_seed)


def assert_identical(a: TaskData, b: TaskData) -> None:
    for name in FIELDS:
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert torch.equal(x, y), name


def files(directory: Path) -> list[Path]:
    return sorted(directory.iterdir()) if directory.exists() else []


# -- location and key ------------------------------------------------------------------------

def test_cache_dir_follows_env_then_xdg_then_home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("DSGD_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert datacache.cache_dir() == tmp_path / "home" / ".cache" / "dsgd"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/ignored")  # XDG: only absolute paths
    assert datacache.cache_dir() == tmp_path / "home" / ".cache" / "dsgd"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert datacache.cache_dir() == tmp_path / "xdg" / "dsgd"
    monkeypatch.setenv("DSGD_CACHE_DIR", str(tmp_path / "mine"))
    assert datacache.cache_dir() == tmp_path / "mine"


def test_key_is_canonical_and_covers_every_option(cache):
    options = mnist1d.cache_options(N, 3)
    assert set(options) >= {"num_samples", "data_seed", "generation", "packages"}
    assert options["packages"]["mnist1d"]  # the installed version is part of the key
    assert set(options["generation"]) >= {"train_split", "padding", "iid_noise_scale"}
    reordered = dict(reversed(list(options.items())))
    assert datacache.cache_path("mnist1d", reordered) == datacache.cache_path("mnist1d", options)
    path = datacache.cache_path("mnist1d", options, label="n200-seed3")
    assert path.parent == cache and path.name.startswith("mnist1d-n200-seed3-")
    changed = [{**options, "packages": {**options["packages"], "mnist1d": "9.9"}},
               {**options, "generation": {**options["generation"], "iid_noise_scale": 0.03}},
               {**options, "generator": options["generator"] + 1}]
    paths = {datacache.cache_path("mnist1d", o) for o in changed}
    assert len(paths) == 3 and datacache.cache_path("mnist1d", options) not in paths


# -- hits and misses -------------------------------------------------------------------------

def test_hit_returns_the_tensors_of_a_fresh_generation(cache, makes):
    expected = fresh(N, 3)
    makes.clear()
    first = mnist1d.generate(N, 3)
    assert makes == [(N, 3)] and len(files(cache)) == 1
    second = mnist1d.generate(N, 3)
    assert makes == [(N, 3)]  # loaded, not generated
    assert_identical(first, expected)
    assert_identical(second, expected)
    assert second.train_x.dtype == torch.float32 and second.train_y.dtype == torch.int64
    assert second.train_x.shape == (160, 40) and second.test_y.shape == (40,)


def test_both_mnist1d_tasks_share_the_cache(cache, makes):
    mlp = MNIST1DMLP(MLPOptions(num_samples=N, data_seed=5, hidden=8)).load_data(seed=0)
    cnn = MNIST1DCNN(CNNOptions(num_samples=N, data_seed=5, channels=4)).load_data(seed=1)
    assert makes == [(N, 5)] and len(files(cache)) == 1
    assert_identical(mlp, cnn)
    assert_identical(cnn, fresh(N, 5))


def test_different_options_miss(cache, makes):
    a = mnist1d.generate(N, 3)
    b = mnist1d.generate(N, 4)
    c = mnist1d.generate(N + 100, 3)
    assert makes == [(N, 3), (N, 4), (N + 100, 3)] and len(files(cache)) == 3
    assert not torch.equal(a.train_x, b.train_x)
    assert c.train_x.shape[0] == 240 != a.train_x.shape[0]
    assert_identical(b, fresh(N, 4))
    assert_identical(c, fresh(N + 100, 3))


def test_disabled_cache_writes_nothing(cache, makes, monkeypatch):
    monkeypatch.setenv("DSGD_NO_DATA_CACHE", "1")
    mnist1d.generate(N, 3)
    mnist1d.generate(N, 3)
    assert makes == [(N, 3), (N, 3)] and not cache.exists()


def test_generation_leaves_the_global_generators_alone(cache):
    import random

    np.random.seed(123)
    random.seed(123)
    expected = (np.random.rand(), random.random())
    np.random.seed(123)
    random.seed(123)
    mnist1d.generate(N, 3)  # miss
    mnist1d.generate(N, 3)  # hit
    assert (np.random.rand(), random.random()) == expected


# -- damaged files ---------------------------------------------------------------------------

def truncate(blob: bytes) -> bytes:
    return blob[: len(blob) // 2]


def flip(blob: bytes) -> bytes:
    damaged = bytearray(blob)
    for i in range(len(blob) // 2, len(blob) // 2 + 16):
        damaged[i] ^= 0xFF
    return bytes(damaged)


@pytest.mark.parametrize("damage", [truncate, flip, lambda blob: b"", lambda blob: blob[:40]],
                         ids=["truncated", "flipped", "empty", "header-only"])
def test_damaged_file_is_rebuilt(cache, makes, capsys, damage):
    mnist1d.generate(N, 3)
    (path,) = files(cache)
    path.write_bytes(damage(path.read_bytes()))
    expected = fresh(N, 3)
    makes.clear()
    rebuilt = mnist1d.generate(N, 3)
    assert makes == [(N, 3)]  # not trusted: generated again
    assert "damaged" in capsys.readouterr().err
    assert_identical(rebuilt, expected)
    assert files(cache) == [path]  # replaced, and valid again:
    assert_identical(mnist1d.generate(N, 3), rebuilt)
    assert makes == [(N, 3)]


def test_valid_file_of_another_key_is_not_trusted(cache, makes):
    mnist1d.generate(N, 4)
    (other,) = files(cache)
    target = datacache.cache_path("mnist1d", mnist1d.cache_options(N, 3), label=f"n{N}-seed3")
    target.write_bytes(other.read_bytes())  # checksum fine, but made for seed 4
    assert_identical(mnist1d.generate(N, 3), fresh(N, 3))  # fresh: one more make
    assert makes == [(N, 4), (N, 3), (N, 3)]


# -- concurrency and unwritable directories --------------------------------------------------

def _generate_after_barrier(cache_dir: str, barrier, out: str) -> None:
    """A worker of one run: misses, then waits for the other before writing."""
    os.environ["DSGD_CACHE_DIR"] = cache_dir

    def make():
        data = mnist1d.make(N, 3)
        barrier.wait(timeout=120)  # both have missed and generated; now both write at once
        return data

    data = datacache.cached("mnist1d", mnist1d.cache_options(N, 3), make, label=f"n{N}-seed3")
    torch.save({f: getattr(data, f) for f in FIELDS}, out)


def _context():
    # spawn, not fork: torch's intra-op thread pool can deadlock in a forked child.
    return multiprocessing.get_context("spawn")


def test_two_processes_writing_at_once_leave_one_valid_file(cache, tmp_path, makes):
    expected = fresh(N, 3)
    context = _context()
    barrier = context.Barrier(2)
    outs = [str(tmp_path / f"out{i}.pt") for i in range(2)]
    workers = [context.Process(target=_generate_after_barrier, args=(str(cache), barrier, out))
               for out in outs]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=180)
    assert [worker.exitcode for worker in workers] == [0, 0]
    (path,) = files(cache)  # one file, no temporary left behind
    assert path.suffix == ".pt" and not path.name.startswith(".")
    for out in outs:
        saved = torch.load(out, weights_only=True)
        assert_identical(TaskData(*(saved[f] for f in FIELDS)), expected)
    makes.clear()
    assert_identical(mnist1d.generate(N, 3), expected)  # the file is valid: a hit
    assert makes == []


def _rewrite(cache_dir: str, rounds: int) -> None:
    os.environ["DSGD_CACHE_DIR"] = cache_dir
    data = _big_data()
    key = datacache.canonical_key("big", {})
    for _ in range(rounds):
        datacache._write(datacache.cache_path("big", {}), key, data)


def _big_data() -> TaskData:
    x = torch.arange(500_000, dtype=torch.float32).reshape(-1, 40)  # 2 MB
    return TaskData(x, torch.arange(len(x)), x[:10].clone(), torch.arange(10))


def test_readers_never_see_a_partial_file(cache, capsys):
    """One process rewrites a big file over and over; every read here is whole and valid."""
    path = datacache.cache_path("big", {})
    key = datacache.canonical_key("big", {})
    expected = _big_data()
    datacache._write(path, key, expected)
    writer = _context().Process(target=_rewrite, args=(str(cache), 10))
    writer.start()
    reads, deadline = 0, time.monotonic() + 180  # a guard against a hung writer, not a limit
    try:
        while (writer.is_alive() or reads == 0) and time.monotonic() < deadline:
            data = datacache._read(path, key)
            assert data is not None
            assert_identical(data, expected)
            reads += 1
        writer.join(timeout=10)
    finally:
        if writer.is_alive():
            writer.kill()
    assert writer.exitcode == 0
    assert "damaged" not in capsys.readouterr().err
    assert files(cache) == [path]


def test_unwritable_cache_dir_still_returns_the_data(tmp_path, monkeypatch, capsys, makes):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("DSGD_CACHE_DIR", str(blocker / "cache"))  # cannot be created, even by root
    monkeypatch.delenv("DSGD_NO_DATA_CACHE", raising=False)
    monkeypatch.setattr(datacache, "_warned_unwritable", False)
    first = mnist1d.generate(N, 3)
    second = mnist1d.generate(N, 3)
    assert makes == [(N, 3), (N, 3)]
    expected = fresh(N, 3)
    assert_identical(first, expected)
    assert_identical(second, expected)
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(warnings) == 1 and "not writable" in warnings[0]


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0,
                    reason="root writes into read-only directories")
def test_read_only_cache_dir_still_returns_the_data(cache, makes):
    cache.mkdir()
    cache.chmod(0o500)
    try:
        assert_identical(mnist1d.generate(N, 3), fresh(N, 3))
        assert files(cache) == []
    finally:
        cache.chmod(0o700)
