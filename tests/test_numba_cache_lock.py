"""numba's cache is safe when two processes compile at once (numba_kernels/_cache_lock.py).

Two processes compile two specializations of one cached function at the same moment, each
save slowed between reading the index and writing it back (a slow disk, a loaded machine). Unlocked, both number their
data file 1: one overwrites the other and the index sends a later process to the wrong
machine code (the CUDA simulator tests crashed so on a fresh clone). Locked, the second
save sees the first's entry and takes number 2, and a third process loads both."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# The lock's module alone (numba_kernels installs it on import, with torch: seconds each).
INSTALL = textwrap.dedent(r'''
    import importlib.util
    spec = importlib.util.spec_from_file_location("cache_lock", "numba_kernels/_cache_lock.py")
    cache_lock = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cache_lock)
    assert cache_lock.install()
''')

COMPILER = INSTALL + textwrap.dedent(r'''
    import sys, time
    from pathlib import Path
    sys.path.insert(0, sys.argv[1])
    from numba.core import caching

    save_index = caching.IndexDataCacheFile._save_index

    def slow_save(cache_file, overloads):
        # between reading the index and writing it back: where another save would land
        time.sleep(1.0)
        return save_index(cache_file, overloads)

    caching.IndexDataCacheFile._save_index = slow_save
    go = Path(sys.argv[1]) / "go"
    while not go.exists():
        time.sleep(0.01)
    import cached_double
    print(cached_double.double(21 if sys.argv[2] == "int" else 21.5))
''')

LOADER = INSTALL + textwrap.dedent(r'''
    import sys
    sys.path.insert(0, sys.argv[1])
    import cached_double
    print(cached_double.double(21), cached_double.double(21.5))
    print(sorted(cached_double.double.stats.cache_hits.values()))
''')


def test_two_processes_compiling_at_once_keep_both_specializations(tmp_path):
    (tmp_path / "cached_double.py").write_text(
        "from numba import njit\n\n\n@njit(cache=True)\ndef double(x):\n    return x * 2\n")
    compilers = [subprocess.Popen([sys.executable, "-c", COMPILER, str(tmp_path), kind],
                                  cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True) for kind in ("int", "float")]
    (tmp_path / "go").touch()
    outputs = [process.communicate(timeout=300) for process in compilers]
    assert [process.returncode for process in compilers] == [0, 0], outputs
    assert [out.strip() for out, _ in outputs] == ["42", "43.0"]
    data_files = sorted(path.name.split(".")[-2] for path in
                        (tmp_path / "__pycache__").glob("cached_double.double-*.nbc"))
    assert data_files == ["1", "2"]  # one data file each, not one overwriting the other
    loaded = subprocess.run([sys.executable, "-c", LOADER, str(tmp_path)], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert loaded.returncode == 0, loaded.stderr[-2000:]
    values, hits = loaded.stdout.splitlines()
    assert values == "42 43.0"
    assert hits == "[1, 1]"  # both came from the cache


def test_importing_the_kernels_installs_the_lock():
    import numba_kernels  # noqa: F401
    from numba.core.caching import IndexDataCacheFile

    assert IndexDataCacheFile.save.dsgd_locked and IndexDataCacheFile.load.dsgd_locked
