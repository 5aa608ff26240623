"""CPU kernels (numba ``@njit``).

All kernels take NumPy views of the torch buffers (zero-copy) and write into
pre-allocated outputs.  Parallel kernels split the work into fixed chunks
(``prange`` over chunks, a plain inner loop that LLVM can vectorise); random
numbers depend only on the element's global index, never on the chunking, so
the results are identical to the CUDA kernels' for the same seed.

Compiled with ``cache=True``: the JIT cost is paid once per machine.  If you
edit :mod:`numba_kernels._random`, delete ``numba_kernels/__pycache__`` (numba's
cache does not track changes of called functions in other modules).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from ._random import SAMPLE_KEY, hash64, uniform

#: elements per parallel work item of the element-wise / reduction kernels
CHUNK = 1 << 16
#: packed bytes per parallel work item of the sign kernels
BYTE_CHUNK = 1 << 13
#: sample size used to estimate the top-k threshold
TOPK_SAMPLE = 1 << 14
#: below this size top-k skips sampling and partitions all magnitudes
TOPK_SMALL = 1 << 16

_ABS_MASK = np.uint32(0x7FFFFFFF)
_INF_BITS = np.uint32(0x7F800000)


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------


@njit(cache=True, inline="always")
def _magkey(u):
    """Order-preserving uint32 key of |x| from the float32 bit pattern ``u``.

    -0.0 maps to 0, NaN maps to +inf (NaN ranks as the largest magnitude, as
    in ``torch.topk``)."""
    m = np.uint32(u & _ABS_MASK)
    if m > _INF_BITS:
        m = _INF_BITS
    return m


@njit(cache=True)
def _bucket_tasks(d, bs):
    """Split buckets of ``bs`` elements into sub-chunks of <= CHUNK."""
    nb = (d + bs - 1) // bs
    nsub = (bs + CHUNK - 1) // CHUNK
    sub = (bs + nsub - 1) // nsub
    return nb, nsub, sub


# ---------------------------------------------------------------------------
# QSGD
# ---------------------------------------------------------------------------


@njit(cache=True, parallel=True, fastmath=True)
def _bucket_sqsums(x, bs, nsub, sub, partial):
    d = x.size
    ntasks = partial.size
    for t in prange(ntasks):
        b = t // nsub
        s = t - b * nsub
        lo = b * bs + s * sub
        hi = min(lo + sub, min(b * bs + bs, d))
        acc = 0.0
        for i in range(lo, hi):
            v = np.float64(x[i])
            acc += v * v
        partial[t] = acc


@njit(cache=True, parallel=True)
def bucket_norms(x, bs, norms):
    """norms[b] = ||x[b*bs:(b+1)*bs]||_2 (float64 accumulation)."""
    d = x.size
    nb, nsub, sub = _bucket_tasks(d, bs)
    partial = np.empty(nb * nsub, np.float64)
    _bucket_sqsums(x, bs, nsub, sub, partial)
    for b in prange(nb):
        acc = 0.0
        for s in range(nsub):
            acc += partial[b * nsub + s]
        norms[b] = np.float32(math.sqrt(acc))


@njit(cache=True, parallel=True)
def qsgd_quantize(x, norms, levels, bs, key, q):
    """Stochastic rounding of |x|/norm*levels; see package docs.

    a = |x| * (levels / norm) is formed in float64 (exact product of two
    float32), the level is floor(a) + [u < a - floor(a)], clamped to levels."""
    d = x.size
    nb, nsub, sub = _bucket_tasks(d, bs)
    flev = np.float32(levels)
    flev64 = np.float64(levels)
    for t in prange(nb * nsub):
        b = t // nsub
        s = t - b * nsub
        lo = b * bs + s * sub
        hi = min(lo + sub, min(b * bs + bs, d))
        nrm = norms[b]
        if nrm > 0:
            scale = np.float64(flev / nrm)
        else:
            scale = 0.0
        for i in range(lo, hi):
            v = x[i]
            a = np.float64(abs(v)) * scale
            if not (a >= 0.0):  # NaN input
                a = 0.0
            elif a > flev64:  # rounding of the norm, or inf
                a = flev64
            fl = np.floor(a)
            lvl = np.int32(fl)
            if np.float64(uniform(key, i)) < a - fl:
                lvl += 1
            if v < 0:
                lvl = -lvl
            q[i] = np.int8(lvl)


@njit(cache=True, parallel=True)
def qsgd_dequantize(norms, q, levels, bs, out):
    d = q.size
    nb, nsub, sub = _bucket_tasks(d, bs)
    flev = np.float32(levels)
    for t in prange(nb * nsub):
        b = t // nsub
        s = t - b * nsub
        lo = b * bs + s * sub
        hi = min(lo + sub, min(b * bs + bs, d))
        sc = norms[b] / flev
        for i in range(lo, hi):
            out[i] = np.float32(q[i]) * sc


# ---------------------------------------------------------------------------
# TernGrad
# ---------------------------------------------------------------------------


@njit(cache=True, parallel=True)
def max_abs(x):
    d = x.size
    nch = (d + CHUNK - 1) // CHUNK
    part = np.zeros(nch, np.float32)
    for c in prange(nch):
        m = np.float32(0.0)
        for i in range(c * CHUNK, min(d, c * CHUNK + CHUNK)):
            a = abs(x[i])
            if a > m:
                m = a
        part[c] = m
    m = np.float32(0.0)
    for c in range(nch):
        if part[c] > m:
            m = part[c]
    return m


@njit(cache=True, parallel=True)
def terngrad_quantize(x, scale, key, t):
    """t = sign(x) if u * scale < |x| (exact in float64) else 0."""
    d = x.size
    sc = np.float64(scale)
    nch = (d + CHUNK - 1) // CHUNK
    for c in prange(nch):
        for i in range(c * CHUNK, min(d, c * CHUNK + CHUNK)):
            v = x[i]
            keep = np.float64(uniform(key, i)) * sc < np.float64(abs(v))
            r = np.int8(0)
            if keep:
                r = np.int8(1) if v > 0 else np.int8(-1)
            t[i] = r


@njit(cache=True, parallel=True)
def scale_int8(t, scale, out):
    for i in prange(t.size):
        out[i] = np.float32(t[i]) * scale


# ---------------------------------------------------------------------------
# signs
# ---------------------------------------------------------------------------


@njit(cache=True, parallel=True)
def sign_pack(x, out):
    d = x.size
    nfull = d // 8
    nch = (nfull + BYTE_CHUNK - 1) // BYTE_CHUNK
    for c in prange(nch):
        for i in range(c * BYTE_CHUNK, min(nfull, c * BYTE_CHUNK + BYTE_CHUNK)):
            base = 8 * i
            b = np.uint32(0)
            for j in range(8):
                b |= np.uint32(x[base + j] >= 0) << np.uint32(j)
            out[i] = np.uint8(b)
    if nfull * 8 < d:
        b = np.uint32(0)
        for j in range(d - nfull * 8):
            b |= np.uint32(x[nfull * 8 + j] >= 0) << np.uint32(j)
        out[nfull] = np.uint8(b)


@njit(cache=True, parallel=True)
def sign_unpack(packed, d, scale, out):
    nfull = d // 8
    nch = (nfull + BYTE_CHUNK - 1) // BYTE_CHUNK
    neg = -scale
    for c in prange(nch):
        for i in range(c * BYTE_CHUNK, min(nfull, c * BYTE_CHUNK + BYTE_CHUNK)):
            b = np.uint32(packed[i])
            base = 8 * i
            for j in range(8):
                out[base + j] = scale if (b >> np.uint32(j)) & np.uint32(1) else neg
    if nfull * 8 < d:
        b = np.uint32(packed[nfull])
        for j in range(d - nfull * 8):
            out[nfull * 8 + j] = scale if (b >> np.uint32(j)) & np.uint32(1) else neg


_VOTE_BYTES = 512


@njit(cache=True, parallel=True)
def sign_vote(packed, d, out):
    """packed: uint8 [n, ceil(d/8)]; out[i] = +1 if 2*#pos >= n else -1."""
    n = packed.shape[0]
    nbytes = (d + 7) // 8
    nch = (nbytes + _VOTE_BYTES - 1) // _VOTE_BYTES
    for c in prange(nch):
        lo = c * _VOTE_BYTES
        hi = min(nbytes, lo + _VOTE_BYTES)
        cnt = np.zeros(8 * _VOTE_BYTES, np.int32)
        for w in range(n):
            for i in range(lo, hi):
                b = np.int32(packed[w, i])
                o = 8 * (i - lo)
                for j in range(8):
                    cnt[o + j] += (b >> j) & 1
        e_hi = min(d, 8 * hi)
        for e in range(8 * lo, e_hi):
            out[e] = np.float32(1.0) if 2 * cnt[e - 8 * lo] >= n else np.float32(-1.0)


# ---------------------------------------------------------------------------
# top-k / random-k selection
# ---------------------------------------------------------------------------


@njit(cache=True)
def estimate_threshold(sample, k, d, boost):
    """Key t such that about k*(1+margin) of the d keys are >= t.

    ``sample`` holds uint32 magnitude keys of a (stratified) sample.  Returns 0
    ("take everything") when the margin covers the whole sample."""
    s = sample.size
    if s == 0:
        return np.uint32(0)
    p = k / d
    mean = s * p
    r = int(boost * (mean + 4.0 * math.sqrt(mean * (1.0 - p)) + 8.0))
    if r >= s:
        return np.uint32(0)
    part = np.partition(sample.copy(), s - r)
    return np.uint32(part[s - r])


@njit(cache=True, parallel=True)
def _sample_magkeys(xb, s, out):
    d = xb.size
    stride = d // s
    for j in prange(s):
        pos = j * stride + np.int64(hash64(SAMPLE_KEY, j) % np.uint64(stride))
        out[j] = _magkey(xb[pos])


@njit(cache=True, parallel=True)
def _count_ge(xb, t, counts):
    d = xb.size
    for c in prange(counts.size):
        n = 0
        for i in range(c * CHUNK, min(d, c * CHUNK + CHUNK)):
            n += _magkey(xb[i]) >= t
        counts[c] = n


@njit(cache=True, parallel=True)
def _gather_ge(xb, t, offsets, cidx, ckey):
    d = xb.size
    for c in prange(offsets.size - 1):
        p = offsets[c]
        for i in range(c * CHUNK, min(d, c * CHUNK + CHUNK)):
            m = _magkey(xb[i])
            if m >= t:
                cidx[p] = i
                ckey[p] = m
                p += 1


@njit(cache=True)
def _exclusive_cumsum(counts):
    off = np.empty(counts.size + 1, np.int64)
    off[0] = 0
    for c in range(counts.size):
        off[c + 1] = off[c] + counts[c]
    return off


@njit(cache=True)
def _keep_largest(cidx, ckey, k, idx_out):
    """Write to idx_out the positions of the k largest keys, lowest index first
    among equal keys, in index order (cidx is ascending)."""
    C = ckey.size
    if C == k:
        for p in range(C):
            idx_out[p] = cidx[p]
        return
    v = np.partition(ckey.copy(), C - k)[C - k]
    g = 0
    for p in range(C):
        g += ckey[p] > v
    need = k - g
    j = 0
    for p in range(C):
        m = ckey[p]
        if m > v:
            idx_out[j] = cidx[p]
            j += 1
        elif m == v and need > 0:
            need -= 1
            idx_out[j] = cidx[p]
            j += 1


@njit(cache=True, parallel=True)
def _gather_values(x, idx, out):
    for p in prange(idx.size):
        out[p] = x[idx[p]]


@njit(cache=True)
def topk(x, xb, k, idx_out, val_out):
    """Exact top-k by magnitude via sampled threshold + filter + fix-up.

    ``xb`` is ``x`` viewed as uint32.  1 <= k < d."""
    d = xb.size
    nch = (d + CHUNK - 1) // CHUNK
    counts = np.empty(nch, np.int64)
    if d <= TOPK_SMALL:
        t = np.uint32(0)
        sample = np.empty(0, np.uint32)
    else:
        sample = np.empty(TOPK_SAMPLE, np.uint32)
        _sample_magkeys(xb, TOPK_SAMPLE, sample)
        t = estimate_threshold(sample, k, d, 1.0)
    boost = 1.0
    while True:
        _count_ge(xb, t, counts)
        C = 0
        for c in range(nch):
            C += counts[c]
        if C >= k or t == 0:
            break
        boost *= 4.0
        t = estimate_threshold(sample, k, d, boost)
    offsets = _exclusive_cumsum(counts)
    cidx = np.empty(C, np.int64)
    ckey = np.empty(C, np.uint32)
    _gather_ge(xb, t, offsets, cidx, ckey)
    _keep_largest(cidx, ckey, k, idx_out)
    _gather_values(x, idx_out, val_out)


@njit(cache=True, inline="always")
def _rk_key(key, i, sh_hi, sh_lo):
    """Unique 63-bit sort key of index i: random prefix | index bits."""
    h = hash64(key, i)
    return ((h >> sh_hi) << sh_lo) | np.uint64(i)


@njit(cache=True, parallel=True)
def _rk_count(key, d, sh_hi, sh_lo, T, counts):
    for c in prange(counts.size):
        n = 0
        for i in range(c * CHUNK, min(d, c * CHUNK + CHUNK)):
            n += _rk_key(key, i, sh_hi, sh_lo) < T
        counts[c] = n


@njit(cache=True, parallel=True)
def _rk_gather(key, d, sh_hi, sh_lo, T, offsets, cidx, ckey):
    for c in prange(offsets.size - 1):
        p = offsets[c]
        for i in range(c * CHUNK, min(d, c * CHUNK + CHUNK)):
            kk = _rk_key(key, i, sh_hi, sh_lo)
            if kk < T:
                cidx[p] = i
                ckey[p] = kk
                p += 1


def randomk_threshold(d: int, k: int, boost: float) -> int:
    """Host: key threshold T with P(key < T) ~ k/d * (1 + margin); 2**63 = all."""
    p = k / d
    frac = p * boost + boost * (5.0 * math.sqrt(p * (1.0 - p) / d) + 16.0 / d)
    if frac >= 1.0:
        return 1 << 63
    return int(frac * float(1 << 63))


def randomk_shifts(d: int):
    lo = max(0, (d - 1).bit_length())
    return np.uint64(lo + 1), np.uint64(lo)


@njit(cache=True)
def randomk(key, d, k, sh_hi, sh_lo, T0, T1, T2, idx_out):
    """k smallest unique keys -> indices (ascending).  T0 < T1 < T2 are
    increasingly generous thresholds (T2 = 2**63 accepts everything)."""
    nch = (d + CHUNK - 1) // CHUNK
    counts = np.empty(nch, np.int64)
    for attempt in range(3):
        T = T0 if attempt == 0 else (T1 if attempt == 1 else T2)
        _rk_count(key, d, sh_hi, sh_lo, T, counts)
        C = 0
        for c in range(nch):
            C += counts[c]
        if C >= k:
            break
    offsets = _exclusive_cumsum(counts)
    cidx = np.empty(C, np.int64)
    ckey = np.empty(C, np.uint64)
    _rk_gather(key, d, sh_hi, sh_lo, T, offsets, cidx, ckey)
    if C == k:
        for p in range(C):
            idx_out[p] = cidx[p]
        return
    v = np.partition(ckey.copy(), k - 1)[k - 1]
    j = 0
    for p in range(C):
        if ckey[p] <= v:
            idx_out[j] = cidx[p]
            j += 1


# ---------------------------------------------------------------------------
# scatter / weighted sum
# ---------------------------------------------------------------------------


@njit(cache=True, parallel=True)
def scatter_set(idx, vals, out):
    """out[idx] = vals; returns the number of out-of-range indices skipped."""
    d = out.size
    n = idx.size
    nch = (n + CHUNK - 1) // CHUNK
    bad = np.zeros(nch, np.int64)
    for c in prange(nch):
        nb = 0
        for p in range(c * CHUNK, min(n, c * CHUNK + CHUNK)):
            i = idx[p]
            if i >= 0 and i < d:
                out[i] = vals[p]
            else:
                nb += 1
        bad[c] = nb
    return bad.sum()


@njit(cache=True)
def scatter_add(idx, vals, out):
    """out[idx] += vals (sequential: duplicate indices accumulate)."""
    d = out.size
    bad = 0
    for p in range(idx.size):
        i = idx[p]
        if i >= 0 and i < d:
            out[i] += vals[p]
        else:
            bad += 1
    return bad


@njit(cache=True, parallel=True)
def wsum1(x0, w0, out):
    for i in prange(out.size):
        out[i] = w0 * x0[i]


@njit(cache=True, parallel=True)
def wsum2(x0, w0, x1, w1, out):
    for i in prange(out.size):
        out[i] = w0 * x0[i] + w1 * x1[i]


@njit(cache=True, parallel=True)
def wsum3(x0, w0, x1, w1, x2, w2, out):
    for i in prange(out.size):
        out[i] = w0 * x0[i] + w1 * x1[i] + w2 * x2[i]


@njit(cache=True, parallel=True)
def wsum4(x0, w0, x1, w1, x2, w2, x3, w3, out):
    for i in prange(out.size):
        out[i] = w0 * x0[i] + w1 * x1[i] + w2 * x2[i] + w3 * x3[i]
