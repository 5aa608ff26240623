"""CUDA backend: ``numba.cuda.jit`` kernels and their launches.

This module is imported lazily by :mod:`numba_kernels._dispatch` the first time
a CUDA tensor is seen, so importing the package never needs a GPU.

The public functions have the same names and signatures as :mod:`._cpu`'s:
validated flat CUDA tensors in (the kernels get zero-copy
``numba.cuda.as_cuda_array`` views of them), results written into the
pre-allocated outputs.  Kernels are launched on torch's current stream of the
tensors' device, and scratch memory comes from torch's caching allocator.
Under the CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``) CPU tensors stand in for
CUDA tensors.

Element-wise kernels use grid-stride loops.  Top-k / random-k use an
order-preserving block compaction (block-wide scans in shared memory) plus a
radix select on the candidates, so their results are identical to the CPU
kernels' (exact selection, lowest index first among equal magnitudes).

The per-tensor top-k and random-k copy small arrays (per-block counts, radix
histograms, the top-k threshold sample) to the host and therefore synchronise
the stream; all other helpers are asynchronous. The compressors use
``topk_segments`` / ``randomk_segments`` of :mod:`._dispatch` instead, which
select with torch ops on the device and never synchronise.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os

import numpy as np
import torch
from numba import cuda

from . import _host, _random

try:  # numba-cuda
    from numba.cuda.core import config as _cfg

    SIM = bool(_cfg.ENABLE_CUDASIM)
except Exception:  # pragma: no cover - plain numba
    SIM = os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0")

#: threads per block (power of two); smaller under the simulator for speed
TPB = 32 if SIM else 256
#: contiguous elements per thread in the compaction kernels (block = TPB*ITEMS)
ITEMS = 8 if SIM else 16
#: cap on the grid of grid-stride kernels
MAX_BLOCKS = 2 if SIM else 4096
#: elements per bucket sub-chunk for the QSGD norm reduction
NORM_CHUNK = 4 * TPB if SIM else 16384

_uniform = cuda.jit(device=True)(_random.uniform_py)
_hash64 = cuda.jit(device=True)(_random.hash64_py)
_magkey = cuda.jit(device=True)(_host.magkey)

_STREAMS: dict = {}


def _view(t):
    return cuda.as_cuda_array(t, sync=False)


def _stream(device):
    """numba view of torch's current stream on ``device`` (cached)."""
    ptr = torch.cuda.current_stream(device).cuda_stream
    if ptr not in _STREAMS:
        _STREAMS[ptr] = cuda.external_stream(ptr)
    return _STREAMS[ptr]


def _torch_alloc(device):
    """Scratch arrays from torch's caching allocator: bytes viewed as ``dtype``."""

    def alloc(n, dtype):
        dtype = np.dtype(dtype)
        return _view(torch.empty(int(n) * dtype.itemsize, dtype=torch.uint8, device=device)).view(dtype)

    return alloc


def _sim_alloc(n, dtype):
    return cuda.device_array(int(n), dtype=dtype)


@contextlib.contextmanager
def _current(device):
    """Make numba's current device ``device``."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if cuda.get_current_device().id == idx:
        yield
    else:
        with cuda.gpus[idx]:
            yield


def _entry(fn):
    """A backend function: torch tensors in.  ``fn`` gets numba views of them and
    ``stream`` and ``alloc(n, numpy_dtype)`` (scratch memory) keywords."""

    def launch(*args):
        if SIM:  # no CUDA tensors under the simulator: CPU tensors stand in for them
            return fn(*_host.views(args, torch.Tensor.numpy), stream=0, alloc=_sim_alloc)
        device = next(a.device for a in args if isinstance(a, torch.Tensor))
        with _current(device):
            return fn(*_host.views(args, _view), stream=_stream(device), alloc=_torch_alloc(device))

    return functools.update_wrapper(launch, fn)


def _grid(n):
    return max(1, min((n + TPB - 1) // TPB, MAX_BLOCKS))


def _to_host(arr, stream):
    if stream:
        h = arr.copy_to_host(stream=stream)
        stream.synchronize()
        return h
    return arr.copy_to_host()


def _upload(host, alloc, stream):
    dev = alloc(host.size, host.dtype)
    if host.size:
        dev.copy_to_device(host, stream=stream)
    return dev


# ---------------------------------------------------------------------------
# kernels declared with their signature
# ---------------------------------------------------------------------------
#
# The kernels of the compressors' step are declared with one explicit signature each
# (`_kernel`): numba compiles exactly that signature, once per process (loaded from its
# on-disk cache where an earlier process compiled it), so a launch infers no types and never
# compiles. The launch configurations (grid, block, stream) are kept per kernel. Under the
# simulator, signatures are not enforced by numba: each launch checks its arguments against
# the declared signature instead, so that the simulator's tests catch a signature a GPU would
# refuse (`KERNELS` is what tests/test_kernels_ptx.py compiles for real GPUs).

#: every kernel declared with `_kernel`, by name
KERNELS: dict = {}


class _Kernel:
    """A kernel of one signature: compiled on first use, launched as ``kernel[grid, block,
    stream](*args)``."""

    def __init__(self, pyfunc, signature: str):
        self.pyfunc = pyfunc
        self.signature = signature
        self.name = pyfunc.__name__
        self._dispatcher = None
        self._launchers: dict = {}

    def dispatcher(self):
        if self._dispatcher is None:
            self._dispatcher = cuda.jit(self.signature, cache=not SIM)(self.pyfunc)
        return self._dispatcher

    def __getitem__(self, config):
        launcher = self._launchers.get(config)
        if launcher is None:
            launcher = self.dispatcher()[config]
            if SIM:
                launcher = _checked(launcher, self)
            self._launchers[config] = launcher
        return launcher


#: the argument types of the declared kernels: contiguous 1-D arrays, one 2-D, scalars
F32, F64, I8, U8, I64 = "float32[::1]", "float64[::1]", "int8[::1]", "uint8[::1]", "int64[::1]"
U8_2D, INT, FLOAT, BOOL = "uint8[:, ::1]", "int64", "float32", "boolean"


def _sig(*argtypes: str) -> str:
    return f"void({', '.join(argtypes)})"


def _kernel(signature: str):
    """Declare a kernel with its signature (see `_Kernel`)."""
    def declare(pyfunc):
        kernel = _Kernel(pyfunc, signature)
        KERNELS[kernel.name] = kernel
        return kernel
    return declare


def _checked(launch, kernel: _Kernel):
    """The simulator's launch of ``kernel``, refusing arguments its signature does not name
    (a GPU would refuse them: no matching definition)."""
    from numba import typeof
    from numba.core import sigutils

    expected, _ = sigutils.normalize_signature(kernel.signature)

    def call(*args):
        got = tuple(typeof(getattr(a, "_ary", a)) for a in args)
        if len(got) != len(expected) or any(g != e for g, e in zip(got, expected)):
            raise TypeError(f"kernel {kernel.name} launched with ({', '.join(map(str, got))}); "
                            f"its signature is {kernel.signature}")
        return launch(*args)

    return call


# ---------------------------------------------------------------------------
# device helpers
# ---------------------------------------------------------------------------


@cuda.jit(device=True)
def _rk_key(key, i, sh_hi, sh_lo):
    h = _hash64(key, i)
    return ((h >> sh_hi) << sh_lo) | np.uint64(i)


@cuda.jit(device=True)
def _block_sum(v, sm):
    tid = cuda.threadIdx.x
    sm[tid] = v
    cuda.syncthreads()
    w = TPB // 2
    while w > 0:
        if tid < w:
            sm[tid] += sm[tid + w]
        cuda.syncthreads()
        w //= 2
    r = sm[0]
    cuda.syncthreads()
    return r


@cuda.jit(device=True)
def _block_scan2(a, b, sa, sb):
    """Exclusive block-wide scan of two int64 values; returns
    (excl_a, excl_b, total_a, total_b).  All threads must call it."""
    tid = cuda.threadIdx.x
    sa[tid] = a
    sb[tid] = b
    cuda.syncthreads()
    off = 1
    while off < TPB:
        ta = 0
        tb = 0
        if tid >= off:
            ta = sa[tid - off]
            tb = sb[tid - off]
        cuda.syncthreads()
        sa[tid] += ta
        sb[tid] += tb
        cuda.syncthreads()
        off *= 2
    ia = sa[tid]
    ib = sb[tid]
    tot_a = sa[TPB - 1]
    tot_b = sb[TPB - 1]
    cuda.syncthreads()
    return ia - a, ib - b, tot_a, tot_b


if SIM:
    @cuda.jit(device=True)
    def _warp_sum(v, sm):
        """The butterfly of `_warp_sum` below through shared memory (the simulator has no
        warp shuffles): the same additions in the same order. Every thread of the block must
        call it."""
        tid = cuda.threadIdx.x
        off = 16
        while off > 0:
            sm[tid] = v
            cuda.syncthreads()
            v += sm[tid ^ off]
            cuda.syncthreads()
            off //= 2
        return v
else:
    @cuda.jit(device=True)
    def _warp_sum(v, sm):
        """Sum of ``v`` over the 32 lanes of a warp, by a butterfly of shuffles: every lane
        gets the same bits (each addition is of the same two partial sums on both lanes).
        All 32 lanes must call it."""
        off = 16
        while off > 0:
            v += cuda.shfl_xor_sync(0xFFFFFFFF, v, off)
            off //= 2
        return v


# ---------------------------------------------------------------------------
# small utility kernels
# ---------------------------------------------------------------------------


@cuda.jit
def _k_fill(arr, value):
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    while i < arr.size:
        arr[i] = value
        i += stride


@cuda.jit
def _k_gather(x, idx, out):
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    while i < idx.size:
        out[i] = x[idx[i]]
        i += stride


@cuda.jit
def _k_copy(src, dst):
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    while i < src.size:
        dst[i] = src[i]
        i += stride


@_entry
def gather(x, idx, out, stream, alloc):
    _k_gather[_grid(idx.size), TPB, stream](x, idx, out)


# ---------------------------------------------------------------------------
# QSGD
# ---------------------------------------------------------------------------


@cuda.jit
def _k_bucket_sq(x, bs, nsub, sub, partial):
    sm = cuda.shared.array(TPB, np.float64)
    tid = cuda.threadIdx.x
    d = x.size
    t = cuda.blockIdx.x
    while t < partial.size:
        b = t // nsub
        s = t - b * nsub
        lo = b * bs + s * sub
        hi = min(lo + sub, min(b * bs + bs, d))
        acc = 0.0
        i = lo + tid
        while i < hi:
            v = np.float64(x[i])
            acc += v * v
            i += TPB
        tot = _block_sum(acc, sm)
        if tid == 0:
            partial[t] = tot
        t += cuda.gridDim.x


@cuda.jit
def _k_norms(partial, nsub, levels, norms, scales):
    b = cuda.grid(1)
    stride = cuda.gridsize(1)
    flev = np.float32(levels)
    while b < norms.size:
        acc = 0.0
        for s in range(nsub):
            acc += partial[b * nsub + s]
        nrm = np.float32(math.sqrt(acc))
        norms[b] = nrm
        sc = 0.0
        if nrm > 0:
            sc = np.float64(flev / nrm)
        scales[b] = sc
        b += stride


@cuda.jit(device=True)
def _qsgd_code(v, scale, flev, key, j):
    """Element j's QSGD code: |v| scaled to [0, levels], rounded up with probability its
    fraction (uniform draw j of the segment's stream ``key``), signed like v."""
    a = np.float64(abs(v)) * scale
    if not (a >= 0.0):
        a = 0.0
    elif a > flev:
        a = flev
    fl = math.floor(a)
    lvl = np.int32(fl) + np.int32(np.float64(_uniform(key, j)) < a - fl)
    if v < 0:
        lvl = -lvl
    return lvl


@cuda.jit
def _k_qsgd_quant(x, scales, levels, bs, key, q):
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    flev = np.float64(levels)
    while i < x.size:
        q[i] = np.int8(_qsgd_code(x[i], scales[i // bs], flev, key, i))
        i += stride


@cuda.jit
def _k_qsgd_dequant(norms, q, levels, bs, out):
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    flev = np.float32(levels)
    while i < q.size:
        out[i] = np.float32(q[i]) * (norms[i // bs] / flev)
        i += stride


@_entry
def qsgd_quantize(x, levels, bs, key, norms, q, stream, alloc):
    """norms[nb] and q[d] are written; bs >= 1 (already normalised)."""
    d = x.size
    nb = norms.size
    nsub, sub = _host.split(bs, NORM_CHUNK)
    partial = alloc(nb * nsub, np.float64)
    scales = alloc(nb, np.float64)
    _k_bucket_sq[max(1, min(nb * nsub, 16 * MAX_BLOCKS)), TPB, stream](x, bs, nsub, sub, partial)
    _k_norms[_grid(nb), TPB, stream](partial, nsub, levels, norms, scales)
    _k_qsgd_quant[_grid(d), TPB, stream](x, scales, levels, bs, np.uint64(key), q)


@_entry
def qsgd_dequantize(norms, q, levels, bs, out, stream, alloc):
    _k_qsgd_dequant[_grid(q.size), TPB, stream](norms, q, levels, bs, out)


# ---------------------------------------------------------------------------
# TernGrad
# ---------------------------------------------------------------------------


@cuda.jit
def _k_maxabs(x, out):
    sm = cuda.shared.array(TPB, np.float32)
    tid = cuda.threadIdx.x
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    m = np.float32(0.0)
    while i < x.size:
        a = abs(x[i])
        if a > m:
            m = a
        i += stride
    sm[tid] = m
    cuda.syncthreads()
    w = TPB // 2
    while w > 0:
        if tid < w:
            if sm[tid + w] > sm[tid]:
                sm[tid] = sm[tid + w]
        cuda.syncthreads()
        w //= 2
    if tid == 0:
        cuda.atomic.max(out, 0, sm[0])


@cuda.jit
def _k_tern_quant(x, scale, key, t):
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    sc = np.float64(scale[0])
    while i < x.size:
        v = x[i]
        r = np.int8(0)
        if np.float64(_uniform(key, i)) * sc < np.float64(abs(v)):
            r = np.int8(1) if v > 0 else np.int8(-1)
        t[i] = r
        i += stride


@cuda.jit
def _k_scale_int8(t, scale, out):
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    s = scale[0]
    while i < t.size:
        out[i] = np.float32(t[i]) * s
        i += stride


@_entry
def terngrad_quantize(x, key, scale, t, stream, alloc):
    """scale: float32 [1] (output, max |x|), t: int8 [d] (output)."""
    _k_fill[1, TPB, stream](scale, np.float32(0.0))
    _k_maxabs[_grid(x.size), TPB, stream](x, scale)
    _k_tern_quant[_grid(x.size), TPB, stream](x, scale, np.uint64(key), t)


@_entry
def scale_int8(t, scale, out, stream, alloc):
    _k_scale_int8[_grid(t.size), TPB, stream](t, scale, out)


# ---------------------------------------------------------------------------
# signs
# ---------------------------------------------------------------------------


@cuda.jit
def _k_sign_pack(x, out):
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    d = x.size
    while i < out.size:
        base = 8 * i
        n = min(8, d - base)
        b = np.uint32(0)
        for j in range(n):
            if x[base + j] >= 0:
                b |= np.uint32(1) << np.uint32(j)
        out[i] = np.uint8(b)
        i += stride


@cuda.jit
def _k_sign_unpack(packed, scale, out):
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    s = scale[0]
    while i < out.size:
        bit = (np.uint32(packed[i >> 3]) >> np.uint32(i & 7)) & np.uint32(1)
        out[i] = s if bit else -s
        i += stride


@cuda.jit(device=True)
def _vote(packed, byte, sh):
    """The majority of the workers' sign bits `sh` of `byte` (rows of `packed`): +1 on a
    tie."""
    n = packed.shape[0]
    cnt = 0
    for w in range(n):
        cnt += np.int32((np.uint32(packed[w, byte]) >> sh) & np.uint32(1))
    return np.float32(1.0) if 2 * cnt >= n else np.float32(-1.0)


@cuda.jit
def _k_sign_vote(packed, out):
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    while i < out.size:
        out[i] = _vote(packed, i >> 3, np.uint32(i & 7))
        i += stride


@_entry
def sign_pack(x, out, stream, alloc):
    _k_sign_pack[_grid(out.size), TPB, stream](x, out)


@_entry
def sign_unpack(packed, scale, out, stream, alloc):
    """scale: float32 [1]."""
    _k_sign_unpack[_grid(out.size), TPB, stream](packed, scale, out)


@_entry
def sign_vote(packed, out, stream, alloc):
    """packed: uint8 [n, ceil(d/8)], out: float32 [d]."""
    _k_sign_vote[_grid(out.size), TPB, stream](packed, out)


# ---------------------------------------------------------------------------
# bit packing of small signed codes (one thread per group of 8 codes = `bits` bytes)
# ---------------------------------------------------------------------------


@cuda.jit
def _k_pack_codes(q, bits, out):
    g = cuda.grid(1)
    stride = cuda.gridsize(1)
    mask = (1 << bits) - 1
    ngroups = (q.size + 7) // 8
    while g < ngroups:
        word = 0
        for j in range(min(8, q.size - 8 * g)):
            word |= (np.int64(q[8 * g + j]) & mask) << (bits * j)
        for b in range(min(bits, out.size - bits * g)):
            out[bits * g + b] = np.uint8((word >> (8 * b)) & 0xFF)
        g += stride


@cuda.jit
def _k_unpack_codes(packed, bits, q):
    g = cuda.grid(1)
    stride = cuda.gridsize(1)
    mask = (1 << bits) - 1
    half = 1 << (bits - 1)
    ngroups = (q.size + 7) // 8
    while g < ngroups:
        word = 0
        for b in range(min(bits, packed.size - bits * g)):
            word |= np.int64(packed[bits * g + b]) << (8 * b)
        for j in range(min(8, q.size - 8 * g)):
            code = (word >> (bits * j)) & mask
            q[8 * g + j] = np.int8(code - ((code & half) << 1))
        g += stride


@cuda.jit
def _k_dequantize_add(norms, packed, bits, levels, bs, out):
    g = cuda.grid(1)
    stride = cuda.gridsize(1)
    mask = (1 << bits) - 1
    half = 1 << (bits - 1)
    flev = np.float32(levels)
    ngroups = (out.size + 7) // 8
    while g < ngroups:
        word = 0
        for b in range(min(bits, packed.size - bits * g)):
            word |= np.int64(packed[bits * g + b]) << (8 * b)
        for j in range(min(8, out.size - 8 * g)):
            i = 8 * g + j
            code = (word >> (bits * j)) & mask
            out[i] += np.float32(code - ((code & half) << 1)) * (norms[i // bs] / flev)
        g += stride


@_entry
def pack_codes(q, bits, out, stream, alloc):
    _k_pack_codes[_grid((q.size + 7) // 8), TPB, stream](q, bits, out)


@_entry
def unpack_codes(packed, bits, q, stream, alloc):
    _k_unpack_codes[_grid((q.size + 7) // 8), TPB, stream](packed, bits, q)


@_entry
def dequantize_add(norms, packed, bits, levels, bs, out, stream, alloc):
    _k_dequantize_add[_grid((out.size + 7) // 8), TPB, stream](norms, packed, bits, levels, bs, out)


# ---------------------------------------------------------------------------
# scatter / weighted sum
# ---------------------------------------------------------------------------


@cuda.jit
def _k_scatter(idx, vals, out, accumulate):
    p = cuda.grid(1)
    stride = cuda.gridsize(1)
    d = out.size
    while p < idx.size:
        i = idx[p]
        if i >= 0 and i < d:
            if accumulate:
                cuda.atomic.add(out, i, vals[p])
            else:
                out[i] = vals[p]
        p += stride


@_entry
def scatter(idx, vals, out, accumulate, stream, alloc):
    """out[idx] = vals (or += with atomics).  Out-of-range indices are skipped
    and not counted (that would synchronise): returns None."""
    _k_scatter[_grid(idx.size), TPB, stream](idx, vals, out, accumulate)


@_kernel(_sig(F32, FLOAT, F32))
def _k_wsum1(x0, w0, out):
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    while i < out.size:
        out[i] = w0 * x0[i]
        i += stride


@_kernel(_sig(F32, FLOAT, F32, FLOAT, F32))
def _k_wsum2(x0, w0, x1, w1, out):
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    while i < out.size:
        out[i] = w0 * x0[i] + w1 * x1[i]
        i += stride


@_kernel(_sig(F32, FLOAT, F32, FLOAT, F32, FLOAT, F32))
def _k_wsum3(x0, w0, x1, w1, x2, w2, out):
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    while i < out.size:
        out[i] = w0 * x0[i] + w1 * x1[i] + w2 * x2[i]
        i += stride


@_kernel(_sig(F32, FLOAT, F32, FLOAT, F32, FLOAT, F32, FLOAT, F32))
def _k_wsum4(x0, w0, x1, w1, x2, w2, x3, w3, out):
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    while i < out.size:
        out[i] = w0 * x0[i] + w1 * x1[i] + w2 * x2[i] + w3 * x3[i]
        i += stride


_WSUM = {1: _k_wsum1, 2: _k_wsum2, 3: _k_wsum3, 4: _k_wsum4}


@_entry
def weighted_sum(xs, ws, out, stream, alloc):
    """out = sum_k ws[k] * xs[k] in fused passes (see :func:`._host.wsum_passes`)."""
    for args in _host.wsum_passes(xs, ws, out):
        _WSUM[len(args) // 2][_grid(out.size), TPB, stream](*args, out)


# ---------------------------------------------------------------------------
# order-preserving compaction, radix select, top-k, random-k
# ---------------------------------------------------------------------------
#
# Compaction layout: block b owns elements [b*SEG, (b+1)*SEG), SEG = TPB*ITEMS;
# thread t of the block owns the contiguous run of ITEMS elements starting at
# b*SEG + t*ITEMS.  A count kernel writes per-block totals (offsets are an
# exclusive scan done on the host), the write kernel recounts each run, does
# one block-wide exclusive scan and writes the run in order -- so the output
# keeps the input order with a single scan per block.

SEG = TPB * ITEMS


def _layout(n):
    return max(1, -(-n // SEG))


def _offsets(counts_host, alloc, stream):
    off = np.zeros(counts_host.size, np.int64)
    if counts_host.size > 1:
        np.cumsum(counts_host[:-1], out=off[1:])
    return _upload(off, alloc, stream)


@cuda.jit
def _k_sample(xb, s, out):
    j = cuda.grid(1)
    stride = cuda.gridsize(1)
    d = xb.size
    st = d // s
    while j < s:
        pos = j * st + np.int64(_hash64(_random.SAMPLE_KEY, j) % np.uint64(st))
        out[j] = _magkey(xb[pos])
        j += stride


@cuda.jit
def _k_magkeys(xb, ckey, cidx):
    """All elements as candidates: ckey = |x| key, cidx = arange."""
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    while i < xb.size:
        ckey[i] = _magkey(xb[i])
        cidx[i] = i
        i += stride


@cuda.jit(device=True)
def _items(size):
    """This thread's contiguous share [lo, hi) of its block's SEG elements."""
    lo = cuda.blockIdx.x * SEG + cuda.threadIdx.x * ITEMS
    return lo, min(size, lo + ITEMS)


@cuda.jit(device=True)
def _count_topk(xb, t, lo, hi):
    n = 0
    for i in range(lo, hi):
        if _magkey(xb[i]) >= t:
            n += 1
    return n


@cuda.jit
def _k_topk_count(xb, t, counts):
    sm = cuda.shared.array(TPB, np.int64)
    lo, hi = _items(xb.size)
    tot = _block_sum(_count_topk(xb, t, lo, hi), sm)
    if cuda.threadIdx.x == 0:
        counts[cuda.blockIdx.x] = tot


@cuda.jit
def _k_topk_write(xb, t, offsets, cidx, ckey):
    sa = cuda.shared.array(TPB, np.int64)
    sb = cuda.shared.array(TPB, np.int64)
    lo, hi = _items(xb.size)
    ex, _eb, _ta, _tb = _block_scan2(_count_topk(xb, t, lo, hi), 0, sa, sb)
    p = offsets[cuda.blockIdx.x] + ex
    for i in range(lo, hi):
        m = _magkey(xb[i])
        if m >= t:
            cidx[p] = i
            ckey[p] = m
            p += 1


@cuda.jit(device=True)
def _count_rk(key, sh_hi, sh_lo, T, lo, hi):
    n = 0
    for i in range(lo, hi):
        if _rk_key(key, i, sh_hi, sh_lo) < T:
            n += 1
    return n


@cuda.jit
def _k_rk_count(key, d, sh_hi, sh_lo, T, counts):
    sm = cuda.shared.array(TPB, np.int64)
    lo, hi = _items(d)
    tot = _block_sum(_count_rk(key, sh_hi, sh_lo, T, lo, hi), sm)
    if cuda.threadIdx.x == 0:
        counts[cuda.blockIdx.x] = tot


@cuda.jit
def _k_rk_write(key, d, sh_hi, sh_lo, T, offsets, cidx, ckey):
    sa = cuda.shared.array(TPB, np.int64)
    sb = cuda.shared.array(TPB, np.int64)
    lo, hi = _items(d)
    ex, _eb, _ta, _tb = _block_scan2(_count_rk(key, sh_hi, sh_lo, T, lo, hi), 0, sa, sb)
    p = offsets[cuda.blockIdx.x] + ex
    for i in range(lo, hi):
        kk = _rk_key(key, i, sh_hi, sh_lo)
        if kk < T:
            cidx[p] = i
            ckey[p] = kk
            p += 1


_NBINS = 1 << _host.RADIX_BITS


@cuda.jit
def _k_hist(keys, prefix, mask, shift, dmask, hist):
    """hist[digit] += #keys with (key & mask) == prefix, digit = key >> shift."""
    sh = cuda.shared.array(_NBINS, np.int32)
    tid = cuda.threadIdx.x
    j = tid
    while j < _NBINS:
        sh[j] = 0
        j += TPB
    cuda.syncthreads()
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    while i < keys.size:
        kk = np.uint64(keys[i])
        if (kk & mask) == prefix:
            cuda.atomic.add(sh, np.int64((kk >> shift) & dmask), np.int32(1))
        i += stride
    cuda.syncthreads()
    j = tid
    while j < _NBINS:
        if sh[j]:
            cuda.atomic.add(hist, j, sh[j])
        j += TPB


@cuda.jit(device=True)
def _count_sel(ckey, v, largest, lo, hi):
    """(#keys strictly on the kept side of v, #keys equal to v) in [lo, hi)."""
    ns = 0
    ne = 0
    for i in range(lo, hi):
        kk = ckey[i]
        if kk == v:
            ne += 1
        elif (kk > v) == largest:
            ns += 1
    return ns, ne


@cuda.jit
def _k_sel_count(ckey, v, largest, cs, ce):
    sa = cuda.shared.array(TPB, np.int64)
    lo, hi = _items(ckey.size)
    ns, ne = _count_sel(ckey, v, largest, lo, hi)
    ts = _block_sum(ns, sa)
    te = _block_sum(ne, sa)
    if cuda.threadIdx.x == 0:
        cs[cuda.blockIdx.x] = ts
        ce[cuda.blockIdx.x] = te


@cuda.jit
def _k_sel_write(ckey, cidx, v, largest, need, off_s, off_e, out):
    """Keep strict elements and the first ``need`` ties, in order."""
    sa = cuda.shared.array(TPB, np.int64)
    sb = cuda.shared.array(TPB, np.int64)
    lo, hi = _items(ckey.size)
    ns, ne = _count_sel(ckey, v, largest, lo, hi)
    xs, xe, _ta, _tb = _block_scan2(ns, ne, sa, sb)
    gs = off_s[cuda.blockIdx.x] + xs  # strict elements before this one
    ge = off_e[cuda.blockIdx.x] + xe  # ties before this one
    for i in range(lo, hi):
        kk = ckey[i]
        if kk == v:
            if ge < need:
                out[gs + ge] = cidx[i]
            ge += 1
        elif (kk > v) == largest:
            out[gs + min(ge, need)] = cidx[i]
            gs += 1


def _radix_select(keys, r, nbits, alloc, stream):
    """Value v of ascending rank r (0-based) among unsigned ``keys`` of
    ``nbits`` bits (MSB-first, 11-bit digits, one small device->host copy per
    digit); also returns (#keys < v, #keys == v)."""
    prefix = 0
    mask = 0
    below = 0
    equal = 0
    hist = alloc(_NBINS, np.int32)
    zeros = np.zeros(_NBINS, np.int32)
    g = _grid(keys.size)
    shift = nbits
    while shift > 0:
        w = min(_host.RADIX_BITS, shift)
        shift -= w
        hist.copy_to_device(zeros, stream=stream)
        _k_hist[g, TPB, stream](
            keys, np.uint64(prefix), np.uint64(mask), np.uint64(shift), np.uint64((1 << w) - 1), hist
        )
        h = _to_host(hist, stream)[: 1 << w].astype(np.int64)
        cum = np.cumsum(h)
        digit = int(np.searchsorted(cum, r, side="right"))
        under = int(cum[digit - 1]) if digit > 0 else 0
        r -= under
        below += under
        equal = int(h[digit])
        prefix |= digit << shift
        mask |= ((1 << w) - 1) << shift
    return prefix, below, equal


def _select(ckey, cidx, k, largest, nbits, idx_out, alloc, stream):
    """idx_out[:k] = cidx of the k largest (or smallest) keys, lowest
    position first among ties, in candidate order."""
    C = ckey.size
    if C == k:
        _k_copy[_grid(C), TPB, stream](cidx, idx_out)
        return
    r = C - k if largest else k - 1
    v, below, equal = _radix_select(ckey, r, nbits, alloc, stream)
    strict = C - below - equal if largest else below
    need = k - strict
    vv = np.uint32(v) if nbits == 32 else np.uint64(v)
    nb = _layout(C)
    cs = alloc(nb, np.int64)
    ce = alloc(nb, np.int64)
    _k_sel_count[nb, TPB, stream](ckey, vv, largest, cs, ce)
    off_s = _offsets(_to_host(cs, stream), alloc, stream)
    off_e = _offsets(_to_host(ce, stream), alloc, stream)
    _k_sel_write[nb, TPB, stream](ckey, cidx, vv, largest, np.int64(need), off_s, off_e, idx_out)


@_entry
def topk(x, k, idx_out, val_out, stream, alloc):
    """Exact top-k by magnitude; 1 <= k < d.  idx_out int64 [k] ascending,
    val_out float32 [k]."""
    d = x.size
    xb = x.view(np.uint32)
    t = np.uint32(0)
    if d > _host.TOPK_SMALL:
        s = _host.TOPK_SAMPLE
        sdev = alloc(s, np.uint32)
        _k_sample[_grid(s), TPB, stream](xb, s, sdev)
        sample = _to_host(sdev, stream)
        t = np.uint32(_host.estimate_threshold(sample, k, d, 1.0))
        nb = _layout(d)
        counts = alloc(nb, np.int64)
        boost = 1.0
        while t != 0:
            _k_topk_count[nb, TPB, stream](xb, t, counts)
            hc = _to_host(counts, stream)
            C = int(hc.sum())
            if C >= k:
                break
            boost *= 4.0
            t = np.uint32(_host.estimate_threshold(sample, k, d, boost))
    if t != 0:
        cidx = alloc(C, np.int64)
        ckey = alloc(C, np.uint32)
        _k_topk_write[nb, TPB, stream](xb, t, _offsets(hc, alloc, stream), cidx, ckey)
    else:  # every element is a candidate: skip the compaction
        cidx = alloc(d, np.int64)
        ckey = alloc(d, np.uint32)
        _k_magkeys[_grid(d), TPB, stream](xb, ckey, cidx)
    _select(ckey, cidx, k, True, 32, idx_out, alloc, stream)
    _k_gather[_grid(k), TPB, stream](x, idx_out, val_out)


@_entry
def randomk_indices(d, k, key, idx_out, stream, alloc):
    """k distinct indices (ascending) from the counter-based RNG; 1 <= k < d."""
    sh_hi, sh_lo = _host.randomk_shifts(d)
    nb = _layout(d)
    counts = alloc(nb, np.int64)
    for T in _host.randomk_thresholds(d, k):
        _k_rk_count[nb, TPB, stream](key, d, sh_hi, sh_lo, T, counts)
        hc = _to_host(counts, stream)
        C = int(hc.sum())
        if C >= k:
            break
    cidx = alloc(C, np.int64)
    ckey = alloc(C, np.uint64)
    _k_rk_write[nb, TPB, stream](key, d, sh_hi, sh_lo, T, _offsets(hc, alloc, stream), cidx, ckey)
    _select(ckey, cidx, k, False, 64, idx_out, alloc, stream)


# ---------------------------------------------------------------------------
# segmented kernels: a whole bucket of tensors per launch
# ---------------------------------------------------------------------------
# The same functions as the CPU backend's ``*_segments``: each segment (tensor) of a flat
# bucket is computed as the per-tensor kernel computes it alone (its own key, levels, QSGD
# buckets, first byte), but one launch covers the whole bucket instead of one per tensor.
# A thread finds its segment by a binary search over the segments' first elements (or first
# bytes, first norms): a few dozen segments cost a handful of steps. Compiled with
# ``cache=True``: the first run on a machine compiles, later processes load them.


@cuda.jit(device=True)
def _find(table, i):
    """The last s with table[s] <= i (table ascending; empty segments share their start with
    the next one, so the search lands on the segment that holds i)."""
    lo = 0
    hi = table.size - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if table[mid] <= i:
            lo = mid
        else:
            hi = mid - 1
    return lo


@cuda.jit(device=True)
def _seg_bs(n, bucket_size):
    return n if bucket_size <= 0 or bucket_size > n else bucket_size


@_kernel(_sig(F32, I64, I64, I64, I64, INT, F32, F64))
def _k_seg_norms(x, starts, sizes, norm_starts, levels, bucket_size, norms, scales):
    # one block per QSGD bucket (grid-stride over buckets): float64 block sum of squares
    sm = cuda.shared.array(TPB, np.float64)
    tid = cuda.threadIdx.x
    g = cuda.blockIdx.x
    while g < norms.size:
        s = _find(norm_starts, g)
        n = sizes[s]
        bs = _seg_bs(n, bucket_size)
        lo = starts[s] + (g - norm_starts[s]) * bs
        hi = min(lo + bs, starts[s] + n)
        acc = 0.0
        i = lo + tid
        while i < hi:
            v = np.float64(x[i])
            acc += v * v
            i += TPB
        tot = _block_sum(acc, sm)
        if tid == 0:
            nrm = np.float32(math.sqrt(tot))
            norms[g] = nrm
            sc = 0.0
            if nrm > 0:
                sc = np.float64(np.float32(levels[s]) / nrm)
            scales[g] = sc
        g += cuda.gridDim.x


@_kernel(_sig(F32, I64, I64, I64, I64, I64, INT, F64, I8))
def _k_seg_quant(x, starts, sizes, norm_starts, keys, levels, bucket_size, scales, q):
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    while i < x.size:
        s = _find(starts, i)
        j = i - starts[s]
        bs = _seg_bs(sizes[s], bucket_size)
        q[i] = np.int8(_qsgd_code(x[i], scales[norm_starts[s] + j // bs], np.float64(levels[s]),
                                  np.uint64(keys[s]), j))
        i += stride


@_entry
def qsgd_quantize_segments(x, starts, sizes, norm_starts, keys, levels, bucket_size, norms, q,
                           stream, alloc):
    """Two launches for the whole bucket: the norms, then the codes."""
    scales = alloc(norms.size, np.float64)
    if norms.size:
        _k_seg_norms[max(1, min(norms.size, 16 * MAX_BLOCKS)), TPB, stream](
            x, starts, sizes, norm_starts, levels, bucket_size, norms, scales)
    _k_seg_quant[_grid(x.size), TPB, stream](x, starts, sizes, norm_starts, keys, levels,
                                             bucket_size, scales, q)


@_kernel(_sig(I8, I64, I64, I64, I64, U8))
def _k_seg_pack(q, starts, sizes, byte_starts, bits, out):
    # one thread per output byte: the codes whose bits fall in it
    ob = cuda.grid(1)
    stride = cuda.gridsize(1)
    while ob < out.size:
        s = _find(byte_starts, ob)
        b = bits[s]
        n = sizes[s]
        mask = (np.int64(1) << b) - 1
        first = 8 * (ob - byte_starts[s])  # the byte's first bit in the segment's stream
        c = first // b
        last = min(n - 1, (first + 7) // b)
        acc = np.int64(0)
        while c <= last:
            v = np.int64(q[starts[s] + c]) & mask
            pos = c * b - first
            if pos >= 0:
                acc |= v << pos
            else:
                acc |= v >> (-pos)
            c += 1
        out[ob] = np.uint8(acc & 0xFF)
        ob += stride


@_entry
def pack_codes_segments(q, starts, sizes, byte_starts, bits, out, stream, alloc):
    _k_seg_pack[_grid(out.size), TPB, stream](q, starts, sizes, byte_starts, bits, out)


@_kernel(_sig(F32, U8, I64, I64, I64, I64, I64, I64, INT, BOOL, F32))
def _k_seg_dequant(norms, packed, starts, sizes, norm_starts, byte_starts, bits, levels,
                   bucket_size, add, out):
    # one thread per element: its code read from the packed stream where it lies
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    while i < out.size:
        s = _find(starts, i)
        j = i - starts[s]
        b = bits[s]
        n = sizes[s]
        bit = j * b
        byte = byte_starts[s] + bit // 8
        word = np.int64(packed[byte])
        if (bit % 8) + b > 8:  # the code runs into the next byte
            word |= np.int64(packed[byte + 1]) << 8
        code = (word >> (bit % 8)) & ((np.int64(1) << b) - 1)
        code = code - ((code & (np.int64(1) << (b - 1))) << 1)
        bs = _seg_bs(n, bucket_size)
        value = np.float32(code) * (norms[norm_starts[s] + j // bs] / np.float32(levels[s]))
        if add:
            out[i] += value
        else:
            out[i] = value
        i += stride


@_entry
def dequantize_segments(norms, packed, starts, sizes, norm_starts, byte_starts, bits, levels,
                        bucket_size, add, scratch, out, stream, alloc):
    """One launch; ``scratch`` is not needed (each thread decodes its own code)."""
    _k_seg_dequant[_grid(out.size), TPB, stream](norms, packed, starts, sizes, norm_starts,
                                                 byte_starts, bits, levels, bucket_size, add, out)


@_kernel(_sig(F32, I64, F32))
def _k_seg_maxabs(x, starts, scales):
    # max |x| per segment (NaN left out, as on the CPU); scales start at 0
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    while i < x.size:
        a = abs(x[i])
        if a <= np.float32(np.inf):
            cuda.atomic.max(scales, _find(starts, i), a)
        i += stride


@_kernel(_sig(F32, I64, I64, F32, I8))
def _k_seg_tern(x, starts, keys, scales, t):
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    while i < x.size:
        s = _find(starts, i)
        j = i - starts[s]
        v = x[i]
        keep = np.float64(_uniform(np.uint64(keys[s]), j)) * np.float64(scales[s]) < np.float64(abs(v))
        r = np.int8(1) if v > 0 else np.int8(-1)
        t[i] = r if keep else np.int8(0)
        i += stride


@_entry
def terngrad_quantize_segments(x, starts, sizes, keys, scales, t, stream, alloc):
    """Two launches: the scales (atomic max per segment), then the codes."""
    _k_seg_maxabs[_grid(x.size), TPB, stream](x, starts, scales)
    _k_seg_tern[_grid(x.size), TPB, stream](x, starts, keys, scales, t)


@_kernel(_sig(F32, I64, I64, I64, U8))
def _k_seg_sign_pack(x, starts, sizes, byte_starts, out):
    ob = cuda.grid(1)
    stride = cuda.gridsize(1)
    while ob < out.size:
        s = _find(byte_starts, ob)
        base = 8 * (ob - byte_starts[s])
        lo = starts[s] + base
        b = np.uint32(0)
        for j in range(min(8, sizes[s] - base)):
            if x[lo + j] >= 0:
                b |= np.uint32(1) << np.uint32(j)
        out[ob] = np.uint8(b)
        ob += stride


@_kernel(_sig(U8, I64, I64, F32, F32, F32))
def _k_seg_sign_unpack(packed, starts, byte_starts, high, low, out):
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    while i < out.size:
        s = _find(starts, i)
        j = i - starts[s]
        bit = (np.uint32(packed[byte_starts[s] + (j >> 3)]) >> np.uint32(j & 7)) & np.uint32(1)
        out[i] = high[s] if bit else low[s]
        i += stride


@_kernel(_sig(U8_2D, I64, I64, F32))
def _k_seg_sign_vote(packed, starts, byte_starts, out):
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    while i < out.size:
        s = _find(starts, i)
        j = i - starts[s]
        out[i] = _vote(packed, byte_starts[s] + (j >> 3), np.uint32(j & 7))
        i += stride


@_entry
def sign_pack_segments(x, starts, sizes, byte_starts, out, stream, alloc):
    _k_seg_sign_pack[_grid(out.size), TPB, stream](x, starts, sizes, byte_starts, out)


@_entry
def sign_unpack_segments(packed, starts, sizes, byte_starts, high, low, out, stream, alloc):
    _k_seg_sign_unpack[_grid(out.size), TPB, stream](packed, starts, byte_starts, high, low, out)


@_entry
def sign_vote_segments(packed, starts, sizes, byte_starts, out, stream, alloc):
    _k_seg_sign_vote[_grid(out.size), TPB, stream](packed, starts, byte_starts, out)


# -- fused: QSGD's norm, codes and packing in one pass per bucket -------------------------
#
# One warp per QSGD bucket (the loop over buckets is uniform per block, as the simulator's
# stand-in for shuffles needs): the lanes sum the bucket's squares (float64, a shuffle
# butterfly), then each lane takes 8 consecutive elements, computes their codes and writes
# their `bits` bytes. The x it reads twice is the warp's own bucket (2 KiB at 512 elements),
# so the second read comes from cache; no int8 codes go through memory. It needs every
# bucket to start on a byte (bucket_size * bits a multiple of 8, `_dispatch` checks).


@_kernel(_sig(F32, I64, I64, I64, I64, I64, I64, I64, INT, F32, U8))
def _k_seg_qsgd_packed(x, starts, sizes, norm_starts, byte_starts, keys, levels, bits,
                       bucket_size, norms, packed):
    sm = cuda.shared.array(TPB, np.float64)
    lane = cuda.threadIdx.x % 32
    warps_per_block = cuda.blockDim.x // 32
    first = cuda.blockIdx.x * warps_per_block
    while first < norms.size:
        g = first + cuda.threadIdx.x // 32
        active = g < norms.size
        acc = 0.0
        if active:
            s = _find(norm_starts, g)
            n = sizes[s]
            bs = _seg_bs(n, bucket_size)
            base = starts[s]
            j0 = (g - norm_starts[s]) * bs
            j1 = min(j0 + bs, n)
            j = j0 + lane
            while j < j1:
                v = np.float64(x[base + j])
                acc += v * v
                j += 32
        acc = _warp_sum(acc, sm)
        if active:
            nrm = np.float32(math.sqrt(acc))
            if lane == 0:
                norms[g] = nrm
            scale = 0.0
            if nrm > 0:
                scale = np.float64(np.float32(levels[s]) / nrm)
            flev = np.float64(levels[s])
            key = np.uint64(keys[s])
            b = bits[s]
            mask = (np.int64(1) << b) - 1
            c = j0 + 8 * lane
            while c < j1:
                m = min(8, j1 - c)
                word = np.int64(0)
                for k in range(m):
                    code = np.int64(_qsgd_code(x[base + c + k], scale, flev, key, c + k))
                    word |= (code & mask) << (k * b)
                byte = byte_starts[s] + (c * b) // 8
                for k in range((m * b + 7) // 8):
                    packed[byte + k] = np.uint8((word >> (8 * k)) & 0xFF)
                c += 256
        first += cuda.gridDim.x * warps_per_block


@_entry
def qsgd_packed_segments(x, starts, sizes, norm_starts, byte_starts, keys, levels, bits,
                         bucket_size, norms, packed, stream, alloc):
    """One launch for the whole bucket: norms and packed codes."""
    warps_per_block = TPB // 32
    blocks = max(1, min(-(-norms.size // warps_per_block), 16 * MAX_BLOCKS))
    _k_seg_qsgd_packed[blocks, TPB, stream](x, starts, sizes, norm_starts, byte_starts, keys,
                                            levels, bits, bucket_size, norms, packed)


# -- fused: TernGrad's codes and packing (after the scales) ---------------------------------


@_kernel(_sig(F32, I64, I64, I64, I64, F32, U8))
def _k_seg_tern_packed(x, starts, sizes, byte_starts, keys, scales, packed):
    # one thread per output byte: the 4 two-bit codes it holds, computed where they are packed
    ob = cuda.grid(1)
    stride = cuda.gridsize(1)
    while ob < packed.size:
        s = _find(byte_starts, ob)
        j0 = 4 * (ob - byte_starts[s])
        base = starts[s]
        scale = np.float64(scales[s])
        key = np.uint64(keys[s])
        byte = np.uint32(0)
        for k in range(min(4, sizes[s] - j0)):
            v = x[base + j0 + k]
            code = np.uint32(0)
            if np.float64(_uniform(key, j0 + k)) * scale < np.float64(abs(v)):
                code = np.uint32(1) if v > 0 else np.uint32(3)  # -1 in two bits
            byte |= code << np.uint32(2 * k)
        packed[ob] = np.uint8(byte)
        ob += stride


@_entry
def terngrad_packed_segments(x, starts, sizes, byte_starts, keys, scales, packed, stream, alloc):
    """Two launches: the scales (atomic max per segment), then the packed codes."""
    _k_seg_maxabs[_grid(x.size), TPB, stream](x, starts, scales)
    _k_seg_tern_packed[_grid(packed.size), TPB, stream](x, starts, sizes, byte_starts, keys,
                                                        scales, packed)
