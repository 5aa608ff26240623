"""numba_kernels: numba CPU / CUDA kernels for gradient compression and
model averaging in dsgd.

All public functions take and return torch tensors.  Inputs are flat (1-D,
contiguous) float32 buffers -- callers flatten; contiguous tensors of any shape
are viewed as flat.  CPU tensors run numba ``@njit(parallel=True)`` kernels on
zero-copy NumPy views; CUDA tensors run ``numba.cuda`` kernels on zero-copy
``__cuda_array_interface__`` views, launched on torch's current stream (the
CUDA module is imported only when a CUDA tensor shows up).  Outputs are
allocated as torch tensors on the input's device.  Empty inputs give empty
outputs.

Public API
----------
``qsgd_quantize(x, levels, bucket_size, seed) -> (norms, q)``
``qsgd_dequantize(norms, q, levels, bucket_size, out=None) -> out``
``terngrad_quantize(x, seed) -> (scale, t)``
``terngrad_dequantize(scale, t, out=None) -> out``
``sign_pack(x) -> packed``
``sign_unpack(packed, d, scale=1.0, out=None) -> out``
``sign_vote(packed_list_tensor, d, out=None) -> out``
``pack_codes(q, bits) -> packed``
``unpack_codes(packed, d, bits, out=None) -> q``
``dequantize_add(norms, packed, bits, levels, bucket_size, out) -> out``
``code_bits(levels) -> bits``, ``packed_size(d, bits) -> bytes``
``topk(x, k) -> (indices, values)``
``randomk(x, k, seed) -> (indices, values)``
``randomk_indices(d, k, seed, device) -> indices``
``scatter(indices, values, d, out=None, accumulate=False) -> out``
``weighted_sum(tensors, weights, out=None) -> out``
``derive_seed(*parts) -> int``

Buckets: ``Segments(sizes, device)`` describes a flat bucket of consecutive tensors (made
once per bucket); ``qsgd_quantize_segments``, ``pack_codes_segments``,
``dequantize_segments``, ``terngrad_quantize_segments``, ``sign_pack_segments``,
``sign_unpack_segments``, ``sign_vote_segments``, ``topk_segments`` and
``randomk_segments`` do in one call what the per-tensor function does for each segment
alone, bit for bit (each segment with its own seed). The CPU backend runs one compiled loop
over the segments; the CUDA backend launches one or two kernels for the whole bucket, each
thread finding its segment by a binary search (top-k and random-k: torch ops on the device,
one ``torch.topk`` per segment, without synchronising). ``qsgd_packed_segments`` and
``terngrad_packed_segments`` return the packed codes directly: on a GPU QSGD's norms, codes
and packing are one fused kernel (a warp per QSGD bucket), TernGrad's codes are computed
where they are packed; on the CPU they are the two calls above.

Randomness
----------
Every random draw is a pure function of ``(seed, element index)`` (a
SplitMix64-style counter-based hash, see :mod:`numba_kernels._random`), so the
CPU and CUDA kernels produce bit-identical random decisions for the same seed,
independent of threading.  Re-using a seed re-uses the random numbers: derive a
fresh seed per step and per tensor, e.g. ``derive_seed(base, step, tensor_id)``
(add the worker rank for stochastic quantisation, which should be independent
across workers; leave it out for random-k, whose index set must agree across
workers).

Kernels are compiled on first use with ``cache=True`` (cached next to the
sources), so the JIT cost is paid once per machine. The CUDA kernels of the
compressors' step are declared with one explicit signature each
(``_cuda.KERNELS``): no type inference at a launch, and a test compiles each to
PTX for a real GPU on a machine without one (tests/test_kernels_ptx.py).

Modules
-------
``_dispatch``: the public functions -- validate, allocate outputs, pick the
backend by device; ``_cpu`` / ``_cuda``: the two backends, with the same
functions and signatures; ``_host``: host-side code both backends share
(layouts, sizes, selection thresholds); ``_random``: the counter-based RNG;
``_cache_lock``: numba's cache files saved and loaded under a lock, so that processes
compiling at once never mix their kernels.
"""

from . import _cache_lock

_cache_lock.install()  # before any kernel is compiled or loaded from numba's cache

from ._dispatch import (  # noqa: E402
    TERNARY_BITS,
    Segments,
    code_bits,
    dequantize_segments,
    pack_codes_segments,
    qsgd_packed_segments,
    qsgd_quantize_segments,
    randomk_segments,
    runs_on_gpu,
    sign_pack_segments,
    sign_unpack_segments,
    sign_vote_segments,
    terngrad_packed_segments,
    terngrad_quantize_segments,
    topk_segments,
    dequantize_add,
    pack_codes,
    packed_size,
    qsgd_dequantize,
    qsgd_quantize,
    randomk,
    randomk_indices,
    scatter,
    sign_pack,
    sign_unpack,
    sign_vote,
    terngrad_dequantize,
    terngrad_quantize,
    topk,
    unpack_codes,
    weighted_sum,
)
from ._random import derive_seed  # noqa: E402

__all__ = [
    "qsgd_quantize",
    "qsgd_dequantize",
    "terngrad_quantize",
    "terngrad_dequantize",
    "sign_pack",
    "sign_unpack",
    "sign_vote",
    "dequantize_add",
    "pack_codes",
    "unpack_codes",
    "code_bits",
    "packed_size",
    "topk",
    "randomk",
    "randomk_indices",
    "scatter",
    "weighted_sum",
    "derive_seed",
    "Segments",
    "qsgd_quantize_segments",
    "qsgd_packed_segments",
    "pack_codes_segments",
    "dequantize_segments",
    "terngrad_quantize_segments",
    "terngrad_packed_segments",
    "sign_pack_segments",
    "sign_unpack_segments",
    "sign_vote_segments",
    "topk_segments",
    "randomk_segments",
    "runs_on_gpu",
    "TERNARY_BITS",
]
