"""numba's on-disk cache, safe when several processes compile at once.

numba saves a compiled function in a data file numbered by how many its index lists
(`name.1.nbc`, `name.2.nbc`, ...), then rewrites the index. Two processes that compile two
different specializations of one function at the same time (two code widths, two array
types) both take number 1: the second data file replaces the first, the index of one says
its signature is there, and the next process to load it runs the other's machine code, which
crashes (a segmentation fault in the test suite's CUDA simulator processes). Concurrent
`dsgd run`s on one machine (a sweep's SLURM tasks on a node) meet the same race.

`install()` makes each cache file's save and load hold an exclusive lock (`flock`) on one
lock file per cache directory: a save then sees every entry saved before it, and a load
never reads an index whose data file is being written. Nothing changes where locking is not
available (no `fcntl`, a read-only cache directory): numba's own behaviour.
"""

from __future__ import annotations

import functools
import os

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None

LOCK_NAME = "dsgd-numba-cache.lock"


def _locked(method):
    @functools.wraps(method)
    def under_lock(cache_file, *args, **kwargs):
        try:
            lock = open(os.path.join(cache_file._cache_path, LOCK_NAME), "a")
        except OSError:  # a directory this process cannot write: numba's own behaviour
            return method(cache_file, *args, **kwargs)
        with lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            return method(cache_file, *args, **kwargs)
    under_lock.dsgd_locked = True
    return under_lock


def install() -> bool:
    """Lock numba's cache files' saves and loads (once per process); whether they are."""
    if fcntl is None:
        return False
    try:
        from numba.core.caching import IndexDataCacheFile
    except ImportError:  # pragma: no cover - a numba without this class
        return False
    for name in ("save", "load"):
        method = getattr(IndexDataCacheFile, name)
        if not getattr(method, "dsgd_locked", False):
            setattr(IndexDataCacheFile, name, _locked(method))
    return True
