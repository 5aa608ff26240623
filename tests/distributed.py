"""Run a function in n real gloo worker processes (for tests of collectives and plugins)."""

from __future__ import annotations

import os
import socket
import traceback

import torch.distributed as dist
import torch.multiprocessing as mp

# What the workers of the in-process tests import. A fresh ("spawn") worker imports torch and
# these anew, and its first optimizer imports torch._dynamo: seconds of CPU each, paid by every
# worker at once on a small machine. `preloaded_context()` imports them once, in a forkserver;
# its workers are forked from it and start at once. Names that fail to import are skipped.
PRELOAD = ("numpy", "torch", "torch.distributed", "torch._dynamo", "pytest", "numba_kernels",
           "dsgd_cli.api", "dsgd_cli.comm.communicator", "dsgd_cli.worker.schedule", "dsgd_cli.spec.experiments",
           "dsgd_cli.results.store", "dsgd_cli.topology", "plugins.aggregators.backup",
           "plugins.aggregators.dasgd", "plugins.aggregators.gossip", "plugins.aggregators.lsgd",
           "plugins.aggregators.wagma", "plugins.compressors.casts",
           "plugins.compressors.powersgd", "plugins.compressors.quantization",
           "plugins.compressors.sign", "plugins.compressors.sparsification",
           "plugins.tasks.logreg")


def preloaded_context():
    """A multiprocessing context whose processes fork from a server that has imported
    `PRELOAD` (one per test session, started on first use). Like "spawn", every process
    starts from a fresh interpreter that has run nothing but those imports, not from a copy of
    the test process; unlike it, without importing torch again."""
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(list(PRELOAD))  # no effect once the server runs
    return context


# The warm-ups of `warm_numba_kernels` (functions of plugins.compressors._common and their
# arguments) in two groups of about equal compile time, about 17 s of CPU each with an empty
# cache, so that two processes can compile them side by side. Code widths: 2 bits for
# TernGrad's codes, 6 for QSGD's at its default 16 levels.
_WARM_UP_GROUPS = (
    (("warm_up_sparsification",), ("warm_up_codes", 2), ("warm_up_codes", 6)),
    (("warm_up_signs",), ("warm_up_quantization",), ("warm_up_terngrad",)),
)
_background_compiles: list = []


def warm_up_group(index: int) -> None:
    from plugins.compressors import _common

    for name, *args in _WARM_UP_GROUPS[index]:
        getattr(_common, name)(*args)


def _kernel_cache_is_filled() -> bool:
    """Whether numba's on-disk cache holds the CPU kernels, written after their sources last
    changed (a fresh clone has none). A cheap guess, by the files' names and times: when it
    is wrong, the warm-up compiles what is missing itself."""
    import os
    from pathlib import Path

    package = Path(__file__).resolve().parent.parent / "numba_kernels"
    cache = Path(os.environ["NUMBA_CACHE_DIR"]) if os.environ.get("NUMBA_CACHE_DIR") else package
    indexes = [path.stat().st_mtime for path in cache.rglob("_cpu.*.nbi")]
    sources = [path.stat().st_mtime for path in package.glob("*.py")]
    return bool(indexes) and min(indexes) >= max(sources)


def start_compiling_numba_kernels() -> None:
    """Start filling numba's on-disk cache with the kernels of `warm_numba_kernels` in two
    background processes, one per group of `_WARM_UP_GROUPS` (the test session calls this
    when it starts). With an empty cache (a fresh clone) the compilation takes over 30 s of
    CPU; this way it runs while pytest collects and runs the tests before the first one that
    starts workers, on both cores, instead of in that test. With a filled cache
    (`_kernel_cache_is_filled`) none is started: each would only import and load. numba
    writes its cache files atomically (a temporary file, then a rename), so these processes,
    the test process and any worker may compile or load the same kernel at once."""
    import subprocess
    import sys
    from pathlib import Path

    if _kernel_cache_is_filled():
        return
    tests = Path(__file__).resolve().parent
    for index in range(len(_WARM_UP_GROUPS)):
        code = (f"import sys; sys.path[:0] = [{str(tests)!r}, {str(tests.parent)!r}]; "
                f"import distributed; distributed.warm_up_group({index})")
        _background_compiles.append(subprocess.Popen(
            [sys.executable, "-c", code], cwd=tests.parent, stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))


def stop_compiling_numba_kernels() -> None:
    """End the background compilations still running (a session that never needed them); a
    kernel whose cache file was not written yet is compiled when next used."""
    while _background_compiles:
        process = _background_compiles.pop()
        if process.poll() is None:
            process.kill()
        process.wait()


def warm_numba_kernels() -> None:
    """Compile every kernel the built-in compressors use into numba's on-disk cache, once per
    test process, before workers start. Each worker's compressor loads its kernels in
    `setup`; with an empty cache (a fresh clone) every worker of a test would compile the
    same kernels at once: tens of seconds of CPU each, n times over on a 2-core machine.
    After this they load them from the cache in a fraction of a second. Waits first for the
    background compilations of `start_compiling_numba_kernels`, if any, then loads what they
    compiled (what one of them failed to compile is compiled here)."""
    while _background_compiles:
        _background_compiles.pop().wait()
    for index in range(len(_WARM_UP_GROUPS)):
        warm_up_group(index)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, fn, args, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        results[rank] = ("ok", fn(rank, world_size, *args))
    except Exception:
        results[rank] = ("error", traceback.format_exc())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_workers(fn, world_size: int = 2, *args, timeout: float = 120, preloaded: bool = False):
    """`fn(rank, world_size, *args)` in each of `world_size` processes; returns their results.
    `fn` must be importable (defined at module level). Fails if any worker fails or hangs.
    The processes are spawned, or with `preloaded` forked from `preloaded_context()`'s server."""
    warm_numba_kernels()
    context = preloaded_context() if preloaded else mp.get_context("spawn")
    with context.Manager() as manager:
        results = manager.dict()
        port = free_port()
        processes = [context.Process(target=_entry, args=(r, world_size, port, fn, args, results))
                     for r in range(world_size)]
        for p in processes:
            p.start()
        for p in processes:
            p.join(timeout)
        hung = [r for r, p in enumerate(processes) if p.is_alive()]
        for p in processes:
            if p.is_alive():
                p.kill()
        if hung:
            raise AssertionError(f"workers {hung} did not finish within {timeout}s (a hang)")
        out = dict(results)
    errors = [f"rank {r}:\n{v}" for r, (status, v) in sorted(out.items()) if status == "error"]
    if errors:
        raise AssertionError("\n".join(errors))
    return [out[r][1] for r in range(world_size)]


def _scenarios_entry(rank: int, world_size: int, directory: str, module: str) -> None:
    import importlib

    import torch

    scenarios = importlib.import_module(module).SCENARIOS

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{directory}/store", rank=rank,
                            world_size=world_size)
    results = {}
    try:
        for name, scenario in scenarios.items():
            results[name] = scenario(rank, world_size)
            dist.barrier()
    except BaseException:
        results["error"] = traceback.format_exc()
        torch.save(results, os.path.join(directory, f"rank{rank}.pt"))
        os._exit(1)
    torch.save(results, os.path.join(directory, f"rank{rank}.pt"))
    dist.destroy_process_group()


def run_scenarios(module: str, world_size: int, directory, timeout: float) -> list[dict]:
    """Every `scenario(rank, world_size)` of the test module `module`'s `SCENARIOS` dict in
    turn, with a barrier after each, on `world_size` processes forked from
    `preloaded_context()`'s server; one {name: result} dict per rank. Results come back
    through files in `directory`, so tensors of any size travel. Fails if a worker fails or
    hangs."""
    import time

    import torch

    warm_numba_kernels()
    context = preloaded_context()
    processes = [context.Process(target=_scenarios_entry,
                                 args=(rank, world_size, str(directory), module))
                 for rank in range(world_size)]
    for process in processes:
        process.start()
    deadline = time.monotonic() + timeout
    for process in processes:
        process.join(timeout=max(1.0, deadline - time.monotonic()))
    hung = [rank for rank, process in enumerate(processes) if process.is_alive()]
    for process in processes:
        if process.is_alive():
            process.kill()
    assert not hung, f"ranks {hung} hung (deadlock?)"
    results = [torch.load(os.path.join(directory, f"rank{rank}.pt")) for rank in range(world_size)]
    errors = [r["error"] for r in results if "error" in r]
    assert not errors, errors[0]
    return results
