"""The declared CUDA kernels compile for a real GPU, with their signatures, on a machine
without one.

numba's CUDA simulator runs the kernels' Python, not what numba compiles for a GPU: it has
no types, no warp shuffles, no signatures. Compiling to PTX needs only NVIDIA's compiler
libraries (libNVVM, NVRTC: the `nvidia-cuda-nvcc-cu12` and `nvidia-cuda-nvrtc-cu12` wheels of
the `test` extra), not a GPU or a driver: each kernel of `numba_kernels._cuda.KERNELS` is
compiled for compute capability 9.0 (an H100 or H200) with its declared signature, as
`cuda.jit(signature)` compiles it on a GPU. A kernel whose body does not type under its
signature, or that uses what a GPU cannot compile, fails here.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = r'''
import json
from types import SimpleNamespace
from numba import cuda
import numba.cuda.dispatcher
from numba_kernels import _cuda

# A device function (`cuda.jit(device=True)`) called by a kernel compiles for the current
# device's compute capability, which asks the driver; there is none here: the same 9.0.
numba.cuda.dispatcher.get_current_device = lambda: SimpleNamespace(compute_capability=(9, 0))

assert not _cuda.SIM
compiled = {}
for name, kernel in sorted(_cuda.KERNELS.items()):
    ptx, _ = cuda.compile_ptx(kernel.pyfunc, kernel.signature, cc=(9, 0))
    compiled[name] = {"entry": ".entry" in ptx, "shuffle": "shfl.sync" in ptx}
print(json.dumps(compiled))
'''


def _library_dirs() -> list[str]:
    """Where the nvidia wheels put libNVVM and NVRTC (empty when they are not installed)."""
    dirs = []
    for package, sub in (("nvidia.cuda_nvcc", "nvvm/lib64"), ("nvidia.cuda_nvrtc", "lib")):
        try:
            spec = importlib.util.find_spec(package)
        except ModuleNotFoundError:
            return []
        if spec is None or not spec.submodule_search_locations:
            return []
        dirs.append(str(Path(list(spec.submodule_search_locations)[0]) / sub))
    return dirs


@pytest.mark.slow  # half a minute: CI runs it in a step of its own (.ci/run)
@pytest.mark.skipif(not _library_dirs() and not os.environ.get("DSGD_REQUIRE_PTX"),
                    reason="NVIDIA's compiler wheels are not installed (the test extra has them)")
def test_every_declared_kernel_compiles_for_a_gpu_with_its_signature():
    dirs = _library_dirs()
    assert dirs, "DSGD_REQUIRE_PTX is set but the nvidia compiler wheels are not installed"
    env = {key: value for key, value in os.environ.items() if key != "NUMBA_ENABLE_CUDASIM"}
    env["LD_LIBRARY_PATH"] = os.pathsep.join(dirs + [env.get("LD_LIBRARY_PATH", "")])
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    compiled = json.loads(done.stdout.strip().splitlines()[-1])
    assert {"_k_seg_qsgd_packed", "_k_seg_tern_packed", "_k_seg_dequant", "_k_wsum4"} <= set(compiled)
    assert all(found["entry"] for found in compiled.values()), compiled
    # the fused QSGD kernel sums its bucket by warp shuffles on a GPU (shared memory is only
    # the simulator's stand-in)
    assert compiled["_k_seg_qsgd_packed"]["shuffle"], compiled["_k_seg_qsgd_packed"]
