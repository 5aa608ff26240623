"""Whether numba.cuda can compile and run the kernels here, asked before a run launches.

numba-cuda 0.30 (its newest release) registers `np.row_stack` when its CUDA typing registries
load (`numba.cuda.np.arrayobj`), and numpy 2.5 removed `row_stack`: with that pair every
CUDA kernel fails to compile, and before this check a run failed at rank 0's first step.
numba-cuda is in maintenance mode and declined the fix (NVIDIA/numba-cuda issue 907), so
dsgd's `cuda` and `test` extras pin `numpy<2.5`; an environment that got numpy 2.5 some
other way is refused here, before anything launches, on one line that names the versions
and the fix.

`problem()` imports the typing chain (which needs no GPU: the CPU tests call it, with and
without `numpy.row_stack`), then, where a GPU is there, compiles and launches one small
kernel and checks its result. It does not import torch.
"""

from __future__ import annotations

import importlib.metadata

FIX = "pip install 'numpy<2.5' (or reinstall with pip install 'dsgd[cuda]', which pins it)"


def versions() -> str:
    """numba, numba-cuda and numpy as installed, for the message."""
    names = []
    for distribution in ("numba", "numba-cuda", "numpy"):
        try:
            names.append(f"{distribution} {importlib.metadata.version(distribution)}")
        except importlib.metadata.PackageNotFoundError:
            names.append(f"{distribution} not installed")
    return ", ".join(names)


def problem(launch: bool = True) -> str | None:
    """Why numba.cuda cannot run dsgd's kernels here (None: it can). `launch`: also compile
    and run one kernel when a GPU (or the simulator) is there."""
    try:
        from numba import cuda
        import numba.cuda.np.arrayobj  # noqa: F401  the registries that touch numpy's names
    except Exception as error:  # an import that fails half-way can raise anything
        return _message(error)
    if not launch or not cuda.is_available():
        return None
    try:
        from numba_kernels import _probe

        _probe.run()
    except Exception as error:
        return _message(error)
    return None


def _message(error: Exception) -> str:
    reason = f"{type(error).__name__}: {error}".splitlines()[0]
    hint = FIX if "row_stack" in reason else "see docs/install.md"
    return f"numba.cuda cannot compile dsgd's CUDA kernels here ({versions()}; {reason}): {hint}"
