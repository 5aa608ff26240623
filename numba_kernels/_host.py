"""Host-side code shared by the CPU and CUDA backends.

Buffer layouts and sizes, the top-k / random-k selection thresholds, the split
of a weighted sum into fused passes and the views of torch tensors the kernels
take.  It all runs on the CPU, for either backend; the numba functions here are
also called from the CPU kernels.  :func:`magkey` is plain Python compiled by
both backends (as the bodies in :mod:`numba_kernels._random`).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from numba import njit

#: sample size used to estimate the top-k threshold
TOPK_SAMPLE = 1 << 15
#: up to this size top-k skips sampling and takes every element as candidate
TOPK_SMALL = 1 << 16
#: bits per digit of the radix selects
RADIX_BITS = 11

ABS_MASK = np.uint32(0x7FFFFFFF)
INF_BITS = np.uint32(0x7F800000)


def views(args, view):
    """``args`` with every torch tensor, also inside a list, replaced by ``view(tensor)``."""
    return [
        view(a.detach()) if isinstance(a, torch.Tensor) else views(a, view) if isinstance(a, list) else a
        for a in args
    ]


# ---------------------------------------------------------------------------
# layouts and sizes
# ---------------------------------------------------------------------------


def buckets(d, bucket_size):
    """(number of buckets, bucket size) of ``d`` elements; ``bucket_size`` None, <= 0 or
    over ``d`` means one bucket."""
    if d == 0:
        return 0, 1
    bs = d if bucket_size is None or bucket_size <= 0 or bucket_size > d else int(bucket_size)
    return -(-d // bs), bs


@njit(cache=True)
def split(bs, chunk):
    """(pieces, piece size): a bucket of ``bs`` elements cut in equal pieces of at most
    ``chunk`` elements (the last one may be shorter)."""
    nsub = (bs + chunk - 1) // chunk
    return nsub, (bs + nsub - 1) // nsub


def sign_bytes(d):
    """Bytes of ``d`` packed signs."""
    return (d + 7) // 8


def packed_bytes(d, bits):
    """Bytes of ``d`` codes of ``bits`` bits."""
    return (d * bits + 7) // 8


def code_bits(levels):
    """Bits of two's-complement codes in [-levels, levels]."""
    return levels.bit_length() + 1


def wsum_passes(xs, ws, out):
    """Argument lists ``[x0, w0, x1, w1, ...]`` of the fused passes computing
    ``out = sum_k ws[k] * xs[k]``: the first pass writes ``out`` from up to 4 inputs, each
    later one adds up to 3 more to it (``out`` is its input 0, weight 1).  An input aliasing
    ``out`` must be among the first 4."""
    ws = [np.float32(w) for w in ws]
    passes = [(xs[:4], ws[:4])]
    for j in range(4, len(xs), 3):
        passes.append(([out] + xs[j : j + 3], [np.float32(1.0)] + ws[j : j + 3]))
    return [[v for pair in zip(a, w) for v in pair] for a, w in passes]


# ---------------------------------------------------------------------------
# top-k / random-k selection
# ---------------------------------------------------------------------------


def magkey(u):
    """Order-preserving uint32 key of |x| from the float32 bit pattern ``u``.

    -0.0 maps to 0, NaN maps to +inf (NaN ranks as the largest magnitude, as
    in ``torch.topk``)."""
    m = np.uint32(u & ABS_MASK)
    if m > INF_BITS:
        m = INF_BITS
    return m


@njit(cache=True)
def radix_select(keys, r, nbits):
    """Exact value v of ascending rank r (0-based) among unsigned integer
    ``keys`` of ``nbits`` bits (MSB-first radix select).
    Returns (v, #keys < v, #keys == v)."""
    prefix = np.uint64(0)
    mask = np.uint64(0)
    below = 0
    equal = 0
    hist = np.zeros(1 << RADIX_BITS, np.int64)
    shift = nbits
    while shift > 0:
        w = min(RADIX_BITS, shift)
        shift -= w
        hist[:] = 0
        dm = np.uint64((1 << w) - 1)
        sh = np.uint64(shift)
        for i in range(keys.size):
            kk = np.uint64(keys[i])
            if (kk & mask) == prefix:
                hist[np.int64((kk >> sh) & dm)] += 1
        acc = 0
        dsel = 0
        for dg in range(1 << w):
            if acc + hist[dg] > r:
                dsel = dg
                break
            acc += hist[dg]
        r -= acc
        below += acc
        equal = hist[dsel]
        prefix |= np.uint64(dsel) << sh
        mask |= dm << sh
    return prefix, below, equal


@njit(cache=True)
def estimate_threshold(sample, k, d, boost):
    """Key t such that about k*(1+margin) of the d keys are >= t.

    ``sample`` holds uint32 magnitude keys of a stratified sample.  Returns 0
    ("take everything") when the margin covers the whole sample."""
    s = sample.size
    if s == 0:
        return np.uint32(0)
    p = k / d
    mean = s * p
    r = int(boost * (mean + 3.0 * math.sqrt(mean * (1.0 - p)) + 4.0))
    if r >= s:
        return np.uint32(0)
    v, _b, _e = radix_select(sample, s - r, 32)
    return np.uint32(v)


def randomk_shifts(d):
    """Shifts building random-k's unique key ``(hash >> (b+1)) << b | index``,
    b = number of index bits."""
    lo = max(0, (d - 1).bit_length())
    return np.uint64(lo + 1), np.uint64(lo)


def randomk_thresholds(d, k):
    """Three increasingly generous key thresholds T with P(key < T) ~ k/d + margin;
    the last one, 2**63, accepts every key."""
    p = k / d
    ts = []
    for boost in (1.0, 4.0):
        frac = boost * (p + 4.0 * math.sqrt(p * (1.0 - p) / d) + 8.0 / d)
        ts.append(np.uint64(1 << 63 if frac >= 1.0 else int(frac * float(1 << 63))))
    return ts + [np.uint64(1 << 63)]
