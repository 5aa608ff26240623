"""One small CUDA kernel, compiled and run by `cuda_check` before a CUDA launch (imported only
once numba.cuda's typing registries have loaded)."""

import numpy as np
from numba import cuda


@cuda.jit
def _add_one(values):
    i = cuda.grid(1)
    if i < values.shape[0]:
        values[i] += 1.0


def run() -> None:
    """RuntimeError unless the kernel compiles, runs and adds one to each value."""
    values = cuda.to_device(np.arange(4, dtype=np.float32))
    _add_one[1, 32](values)
    if not np.array_equal(values.copy_to_host(), np.arange(1, 5, dtype=np.float32)):
        raise RuntimeError("a test kernel returned wrong values")
