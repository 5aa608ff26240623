"""CPU backend: numba ``@njit`` kernels.

The public functions have the same names and signatures as :mod:`._cuda`'s:
validated flat torch tensors in (the kernels get zero-copy NumPy views of
them), results written into the pre-allocated outputs.

Parallel kernels split the work into fixed chunks of ``CHUNK`` elements
(``prange`` over chunks or buckets, a plain inner loop that LLVM vectorises).  Random numbers depend only on the element's global index,
never on the chunking, so results are identical to the CUDA kernels' for the
same seed.

Every ``prange`` kernel is compiled twice (see :func:`_twins`): a parallel
version and a serial one.  Inputs of at most ``CHUNK`` elements use the serial
one -- a parallel region cannot help there, and on a busy machine each one can
cost a scheduler time slice.

Loops: every hot loop runs over a slice starting at 0
(``xs = x[lo:hi]; for i in range(xs.size)``).  With ``range(lo, hi)`` numba
cannot prove the index non-negative, keeps its negative-index wraparound check
and LLVM does not vectorise the loop (about 5x slower).

Compiled with ``cache=True``: the JIT cost is paid once per machine.  If you
edit :mod:`._random` or :mod:`._host`, delete ``numba_kernels/__pycache__``
(numba's cache does not track changes of called functions in other modules).
"""

from __future__ import annotations

import functools
import math
import types

import numpy as np
import torch
from numba import njit, prange

from . import _host
from ._host import ABS_MASK, INF_BITS, TOPK_SAMPLE, TOPK_SMALL, estimate_threshold, radix_select, split
from ._random import SAMPLE_KEY, hash64, uniform

#: elements per parallel work item; inputs up to this size run serially
CHUNK = 1 << 16


def _twins(fn):
    """(parallel, serial) numba dispatchers of one ``prange`` kernel.

    The serial twin is a copy of the function under another qualified name so
    that the two get separate on-disk cache entries."""
    par = njit(cache=True, parallel=True)(fn)
    g = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__ + "_serial", fn.__defaults__, fn.__closure__)
    g.__qualname__ = fn.__qualname__ + "_serial"
    g.__module__ = fn.__module__
    g.__doc__ = fn.__doc__
    return par, njit(cache=True)(g)


def _entry(fn):
    """A backend function: torch tensors in, ``fn`` gets NumPy views of them."""

    def run(*args):
        return fn(*_host.views(args, torch.Tensor.numpy))

    return functools.update_wrapper(run, fn, updated=())


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------

_magkey = njit(cache=True, inline="always")(_host.magkey)


@njit(cache=True)
def _exclusive_cumsum(counts):
    off = np.empty(counts.size + 1, np.int64)
    off[0] = 0
    for c in range(counts.size):
        off[c + 1] = off[c] + counts[c]
    return off


# ---------------------------------------------------------------------------
# QSGD
# ---------------------------------------------------------------------------


@njit(cache=True, inline="always")
def _piece(t, nsub, sub, bs, d):
    """Piece ``t`` of the buckets of ``bs`` elements, each cut in ``nsub`` pieces of ``sub``:
    its bucket and its element range [lo, hi)."""
    b = t // nsub
    lo = min(d, b * bs + (t - b * nsub) * sub)
    return b, lo, min(lo + sub, min(b * bs + bs, d))


@njit(cache=True, fastmath=True)
def _sumsq(xs):
    acc = 0.0
    for i in range(xs.size):
        v = np.float64(xs[i])
        acc += v * v
    return acc


@njit(cache=True)
def _qscale(nrm, levels):
    """levels / norm, rounded to float32 (0 for a zero norm), as float64."""
    scale = 0.0
    if nrm > 0:
        scale = np.float64(np.float32(levels) / nrm)
    return scale


@njit(cache=True)
def _quantize_run(xs, qs, base, scale, levels, key):
    """Quantise one run of a bucket; ``base`` = global index of xs[0].

    ``a = |x| * scale`` is an exact float64 product of two float32 values,
    clamped to [0, levels]; the level is ``floor(a) + [u < a - floor(a)]``."""
    flev = np.float64(levels)
    for i in range(xs.size):
        v = xs[i]
        a = np.float64(abs(v)) * scale
        if not (a >= 0.0):  # NaN input
            a = 0.0
        a = min(a, flev)  # rounding of the norm, or inf
        fl = np.floor(a)
        lvl = np.int32(fl) + np.int32(np.float64(uniform(key, base + i)) < a - fl)
        qs[i] = np.int8(-lvl if v < 0 else lvl)


def _qsgd_fused_k(x, levels, bs, key, norms, q):
    # buckets of <= CHUNK elements: norm and quantise while the bucket is hot
    d = x.size
    for b in prange(norms.size):
        lo = b * bs
        hi = min(d, lo + bs)
        xs = x[lo:hi]
        nrm = np.float32(math.sqrt(_sumsq(xs)))
        norms[b] = nrm
        _quantize_run(xs, q[lo:hi], lo, _qscale(nrm, levels), levels, key)


def _sqsums_k(x, bs, nsub, sub, partial):
    d = x.size
    for t in prange(partial.size):
        b, lo, hi = _piece(t, nsub, sub, bs, d)
        partial[t] = _sumsq(x[lo:hi])


def _qsgd_tasks_k(x, norms, levels, bs, nsub, sub, key, q):
    d = x.size
    for t in prange(norms.size * nsub):
        b, lo, hi = _piece(t, nsub, sub, bs, d)
        _quantize_run(x[lo:hi], q[lo:hi], lo, _qscale(norms[b], levels), levels, key)


def _qsgd_dequant_k(norms, q, levels, bs, nsub, sub, out):
    d = q.size
    flev = np.float32(levels)
    for t in prange(norms.size * nsub):
        b, lo, hi = _piece(t, nsub, sub, bs, d)
        sc = norms[b] / flev
        qs = q[lo:hi]
        os = out[lo:hi]
        for i in range(qs.size):
            os[i] = np.float32(qs[i]) * sc


_qsgd_fused_p, _qsgd_fused_s = _twins(_qsgd_fused_k)
_sqsums_p, _sqsums_s = _twins(_sqsums_k)
_qsgd_tasks_p, _qsgd_tasks_s = _twins(_qsgd_tasks_k)
_qsgd_dequant_p, _qsgd_dequant_s = _twins(_qsgd_dequant_k)


@njit(cache=True)
def _qsgd_quantize(x, levels, bs, key, norms, q):
    """QSGD: per-bucket L2 norms (float64 accumulation) and stochastic levels
    (see :func:`_quantize_run`), uniform draws ``uniform(key, index)``."""
    d = x.size
    nb = norms.size
    nsub, sub = split(bs, CHUNK)
    if nsub == 1:
        if d > CHUNK:
            _qsgd_fused_p(x, levels, bs, key, norms, q)
        else:
            _qsgd_fused_s(x, levels, bs, key, norms, q)
        return
    # buckets larger than CHUNK: parallel partial sums, then quantise
    partial = np.empty(nb * nsub, np.float64)
    _sqsums_p(x, bs, nsub, sub, partial)
    for b in range(nb):
        norms[b] = np.float32(math.sqrt(partial[b * nsub : b * nsub + nsub].sum()))
    _qsgd_tasks_p(x, norms, levels, bs, nsub, sub, key, q)


qsgd_quantize = _entry(_qsgd_quantize)


@njit(cache=True)
def _qsgd_dequantize(norms, q, levels, bs, out):
    """out = q * float32(norm / levels)."""
    d = q.size
    nsub, sub = split(bs, CHUNK)
    if d > CHUNK:
        _qsgd_dequant_p(norms, q, levels, bs, nsub, sub, out)
    else:
        _qsgd_dequant_s(norms, q, levels, bs, nsub, sub, out)


qsgd_dequantize = _entry(_qsgd_dequantize)


# ---------------------------------------------------------------------------
# TernGrad
# ---------------------------------------------------------------------------


def _max_abs_k(xb):
    d = xb.size
    nch = (d + CHUNK - 1) // CHUNK
    part = np.zeros(nch, np.uint32)
    for c in prange(nch):
        xs = xb[c * CHUNK : min(d, c * CHUNK + CHUNK)]
        m = np.uint32(0)
        for i in range(xs.size):
            a = np.uint32(xs[i] & ABS_MASK)
            m = max(m, a if a <= INF_BITS else np.uint32(0))
        part[c] = m
    res = np.zeros(1, np.uint32)
    res[0] = part.max()
    return res.view(np.float32)[0]


def _terngrad_k(x, scale, key, t):
    d = x.size
    sc = np.float64(scale)
    nch = (d + CHUNK - 1) // CHUNK
    for c in prange(nch):
        lo = c * CHUNK
        xs = x[lo : min(d, lo + CHUNK)]
        ts = t[lo : min(d, lo + CHUNK)]
        for i in range(xs.size):
            v = xs[i]
            keep = np.float64(uniform(key, lo + i)) * sc < np.float64(abs(v))
            r = np.int8(1) if v > 0 else np.int8(-1)
            ts[i] = r if keep else np.int8(0)


def _scale_int8_k(t, scale, out):
    for i in prange(t.size):
        out[i] = np.float32(t[i]) * scale


_max_abs_p, _max_abs_s = _twins(_max_abs_k)
_terngrad_p, _terngrad_s = _twins(_terngrad_k)
_scale_int8_p, _scale_int8_s = _twins(_scale_int8_k)


@njit(cache=True)
def _terngrad_quantize(x, key, scale, t):
    """scale[0] = max |x| (NaN entries ignored; an integer max on the uint32
    view, which vectorises); t = sign(x) if u * scale < |x| (exact in float64)
    else 0."""
    xb = x.view(np.uint32)
    scale[0] = _max_abs_p(xb) if x.size > CHUNK else _max_abs_s(xb)
    if x.size > CHUNK:
        _terngrad_p(x, scale[0], key, t)
    else:
        _terngrad_s(x, scale[0], key, t)


terngrad_quantize = _entry(_terngrad_quantize)


@_entry
@njit(cache=True)
def scale_int8(t, scale, out):
    """out = t * scale[0]."""
    if t.size > CHUNK:
        _scale_int8_p(t, scale[0], out)
    else:
        _scale_int8_s(t, scale[0], out)


# ---------------------------------------------------------------------------
# signs
# ---------------------------------------------------------------------------

_WORDS = 1024  # 64-bit words (8 packed bytes) per parallel work item


def _sign_pack_k(x, out):
    # bulk: 64 signs -> one little-endian uint64 word (= 8 packed bytes)
    d = x.size
    nw = d // 64
    o64 = out[: 8 * nw].view(np.uint64)
    nch = (nw + _WORDS - 1) // _WORDS
    for c in prange(nch):
        lo = c * _WORDS
        hi = min(nw, lo + _WORDS)
        xs = x[64 * lo : 64 * hi]
        os = o64[lo:hi]
        for i in range(os.size):
            w = np.uint64(0)
            for j in range(64):
                w |= np.uint64(xs[64 * i + j] >= 0) << np.uint64(j)
            os[i] = w
    rest = x[64 * nw :]
    ro = out[8 * nw :]
    for i in range(ro.size):
        b = np.uint32(0)
        for j in range(min(8, rest.size - 8 * i)):
            b |= np.uint32(rest[8 * i + j] >= 0) << np.uint32(j)
        ro[i] = np.uint8(b)


def _sign_unpack_k(packed, d, scale, neg, out):
    # a set bit gives `scale`, a clear one `neg` (-scale, or onebit's mean of the negatives)
    nw = d // 64
    p64 = packed[: 8 * nw].view(np.uint64)
    nch = (nw + _WORDS - 1) // _WORDS
    for c in prange(nch):
        lo = c * _WORDS
        hi = min(nw, lo + _WORDS)
        ps = p64[lo:hi]
        os = out[64 * lo : 64 * hi]
        for i in range(ps.size):
            w = ps[i]
            for j in range(64):
                os[64 * i + j] = scale if (w >> np.uint64(j)) & np.uint64(1) else neg
    rest = packed[8 * nw :]
    ro = out[64 * nw : d]
    for e in range(ro.size):
        b = np.uint32(rest[e >> 3])
        ro[e] = scale if (b >> np.uint32(e & 7)) & np.uint32(1) else neg


_VOTE_BYTES = 2048


def _sign_vote_k(packed, d, out):
    # Bit-sliced counting: per chunk of bytes the n rows are added into
    # ceil(log2(n+1)) bit-planes (ripple carry on whole bytes, vectorised over
    # the chunk), the planes are compared with ceil(n/2) bitwise, and the
    # majority bits are expanded to +-1.
    n = packed.shape[0]
    nbytes = (d + 7) // 8
    nch = (nbytes + _VOTE_BYTES - 1) // _VOTE_BYTES
    one = np.float32(1.0)
    nplanes = 1
    while (1 << nplanes) <= n:
        nplanes += 1
    thr = (n + 1) // 2
    for c in prange(nch):
        lo = c * _VOTE_BYTES
        hi = min(nbytes, lo + _VOTE_BYTES)
        m = hi - lo
        planes = np.zeros((nplanes, m), np.uint8)
        carry = np.empty(m, np.uint8)
        for w in range(n):
            carry[:] = packed[w, lo:hi]
            for p in range(nplanes):
                pl = planes[p]
                for i in range(m):
                    t = pl[i]
                    pl[i] = t ^ carry[i]
                    carry[i] = t & carry[i]
        gt = np.zeros(m, np.uint8)
        eq = np.full(m, np.uint8(255))
        for p in range(nplanes - 1, -1, -1):
            pl = planes[p]
            if (thr >> p) & 1:
                for i in range(m):
                    eq[i] &= pl[i]
            else:
                for i in range(m):
                    gt[i] |= eq[i] & pl[i]
                    eq[i] &= ~pl[i]
        os = out[8 * lo : min(d, 8 * hi)]
        full = os.size // 8
        for i in range(full):
            b = np.uint32(gt[i] | eq[i])
            for j in range(8):
                os[8 * i + j] = one if (b >> np.uint32(j)) & np.uint32(1) else -one
        for e in range(8 * full, os.size):
            b = np.uint32(gt[e >> 3] | eq[e >> 3])
            os[e] = one if (b >> np.uint32(e & 7)) & np.uint32(1) else -one


_sign_pack_p, _sign_pack_s = _twins(_sign_pack_k)
_sign_unpack_p, _sign_unpack_s = _twins(_sign_unpack_k)
_sign_vote_p, _sign_vote_s = _twins(_sign_vote_k)


@njit(cache=True)
def _sign_pack(x, out):
    """out[i] bit j = (x[8i+j] >= 0), little-endian bit order."""
    if x.size > CHUNK:
        _sign_pack_p(x, out)
    else:
        _sign_pack_s(x, out)


@njit(cache=True)
def _sign_unpack(packed, scale, neg, out):
    """out[i] = scale if bit i is set else neg."""
    if out.size > CHUNK:
        _sign_unpack_p(packed, out.size, scale, neg, out)
    else:
        _sign_unpack_s(packed, out.size, scale, neg, out)


@njit(cache=True)
def _sign_vote(packed, out):
    """packed: uint8 [n, ceil(d/8)]; out[i] = +1 if 2*#set >= n else -1."""
    if out.size > CHUNK:
        _sign_vote_p(packed, out.size, out)
    else:
        _sign_vote_s(packed, out.size, out)


sign_pack = _entry(_sign_pack)
sign_vote = _entry(_sign_vote)


@_entry
@njit(cache=True)
def sign_unpack(packed, scale, out):
    """out[i] = +scale[0] if bit i is set else -scale[0]."""
    _sign_unpack(packed, scale[0], -scale[0], out)


# ---------------------------------------------------------------------------
# bit packing of small signed codes
# ---------------------------------------------------------------------------

_GROUPS = 8192  # groups of 8 codes per slice (slices start at 0: see the module notes)

# The packing kernels read the code width from the global BITS, which each copy made by
# `_per_bits` fixes: numba compiles a global as a constant, so the loops over a group's bytes
# and codes unroll into straight shifts. With the width a runtime argument they do not, and
# unpacking 1.2M 6-bit codes took twice as long (benchmarks/RESULTS.md, 2026-11-23). Eight
# widths make eight copies of each kernel, so these run serially, without a parallel twin
# each: workers run one numba thread anyway, and every copy is compiled on first use.
BITS = 0  # never used as 0: every compiled copy has its own


def _pack_codes_k(q, out):
    # Eight codes of BITS bits fill exactly BITS bytes, so each group of 8 is assembled in
    # one int64 (two's complement truncated to BITS) and stored as its low BITS bytes.
    mask = (1 << BITS) - 1
    full = q.size // 8
    nch = (full + _GROUPS - 1) // _GROUPS
    for c in range(nch):
        lo = c * _GROUPS
        hi = min(full, lo + _GROUPS)
        qs = q[8 * lo : 8 * hi]
        os = out[BITS * lo : BITS * hi]
        for g in range(hi - lo):
            word = 0
            for j in range(8):
                word |= (np.int64(qs[8 * g + j]) & mask) << (BITS * j)
            for b in range(BITS):
                os[BITS * g + b] = np.uint8((word >> (8 * b)) & 0xFF)
    rest = q[8 * full :]
    if rest.size:
        word = 0
        for j in range(rest.size):
            word |= (np.int64(rest[j]) & mask) << (BITS * j)
        tail = out[BITS * full :]
        for b in range(tail.size):
            tail[b] = np.uint8((word >> (8 * b)) & 0xFF)


def _unpack_codes_k(packed, q):
    # Sign extension without a branch: c - 2·(c & 2^(BITS-1)) maps [0, 2^BITS) back to
    # [-2^(BITS-1), 2^(BITS-1)).
    mask = (1 << BITS) - 1
    half = 1 << (BITS - 1)
    full = q.size // 8
    nch = (full + _GROUPS - 1) // _GROUPS
    for c in range(nch):
        lo = c * _GROUPS
        hi = min(full, lo + _GROUPS)
        ps = packed[BITS * lo : BITS * hi]
        qs = q[8 * lo : 8 * hi]
        for g in range(hi - lo):
            word = 0
            for b in range(BITS):
                word |= np.int64(ps[BITS * g + b]) << (8 * b)
            for j in range(8):
                code = (word >> (BITS * j)) & mask
                qs[8 * g + j] = np.int8(code - ((code & half) << 1))
    rest = q[8 * full :]
    if rest.size:
        tail = packed[BITS * full :]
        word = 0
        for b in range(tail.size):
            word |= np.int64(tail[b]) << (8 * b)
        for j in range(rest.size):
            code = (word >> (BITS * j)) & mask
            rest[j] = np.int8(code - ((code & half) << 1))


def _dequantize_add_k(norms, packed, levels, bs, out):
    # out += code * float32(norm / levels), each code unpacked where it is added: the same
    # float32 products and sums as unpacking, dequantizing and adding in three passes, read
    # and written once. Buckets start at multiples of 8 elements (or there is one), so a
    # bucket holds whole groups of 8 codes (BITS bytes each); only the tensor's end may cut
    # its last group short.
    mask = (1 << BITS) - 1
    half = 1 << (BITS - 1)
    d = out.size
    flev = np.float32(levels)
    for b in range(norms.size):
        lo = b * bs
        hi = min(d, lo + bs)
        sc = norms[b] / flev
        full = (hi - lo) // 8
        g0 = lo // 8
        ps = packed[BITS * g0 : BITS * (g0 + full)]
        os = out[lo : lo + 8 * full]
        for g in range(full):
            word = 0
            for k in range(BITS):
                word |= np.int64(ps[BITS * g + k]) << (8 * k)
            for j in range(8):
                code = (word >> (BITS * j)) & mask
                os[8 * g + j] += np.float32(code - ((code & half) << 1)) * sc
        rest = out[lo + 8 * full : hi]
        if rest.size:
            tail = packed[BITS * (g0 + full) :]
            word = 0
            for k in range(min(BITS, tail.size)):
                word |= np.int64(tail[k]) << (8 * k)
            for j in range(rest.size):
                code = (word >> (BITS * j)) & mask
                rest[j] += np.float32(code - ((code & half) << 1)) * sc


def _per_bits(fn):
    """{bits: numba dispatcher of `fn` with the global BITS = bits} for 1 to 8 bits. Each copy
    has its own qualified name, so that numba caches each apart."""
    copies = {}
    for bits in range(1, 9):
        name = f"{fn.__name__}_{bits}bits"
        copy = types.FunctionType(fn.__code__, {**fn.__globals__, "BITS": bits}, name,
                                  fn.__defaults__, fn.__closure__)
        copy.__qualname__ = f"{fn.__qualname__}_{bits}bits"
        copy.__module__ = fn.__module__
        copies[bits] = njit(cache=True)(copy)
    return copies


_PACK_CODES = _per_bits(_pack_codes_k)
_UNPACK_CODES = _per_bits(_unpack_codes_k)
_DEQUANTIZE_ADD = _per_bits(_dequantize_add_k)


@_entry
def pack_codes(q, bits, out):
    """out: the codes' low `bits` bits as one little-endian bit stream."""
    _PACK_CODES[bits](q, out)


@_entry
def unpack_codes(packed, bits, q):
    _UNPACK_CODES[bits](packed, q)


@_entry
def dequantize_add(norms, packed, bits, levels, bs, out):
    """out += unpacked code * float32(norm of its bucket / levels); ``bs`` is a multiple of 8
    or the whole tensor."""
    _DEQUANTIZE_ADD[bits](norms, packed, levels, bs, out)


# ---------------------------------------------------------------------------
# top-k / random-k selection
# ---------------------------------------------------------------------------
# Candidates are gathered 64 elements at a time: a vectorised pass builds a
# 64-bit hit mask, then only the set bits are visited (de Bruijn bit index).
# The exact k-th key among the candidates comes from an MSB-first radix
# select, so the result does not depend on the threshold that was used.

_DEBRUIJN_INT = 0x03F79D71B4CB0A89
_DEBRUIJN = np.uint64(_DEBRUIJN_INT)
_DEBRUIJN_TAB = np.zeros(64, np.int64)
for _i in range(64):
    _DEBRUIJN_TAB[(((1 << _i) * _DEBRUIJN_INT) & ((1 << 64) - 1)) >> 58] = _i
del _i
_S58 = np.uint64(58)
_U1 = np.uint64(1)


@njit(cache=True, inline="always")
def _lowest_bit_index(w):
    """Index of the lowest set bit of w != 0, and w with that bit cleared."""
    lsb = w & (~w + _U1)
    return _DEBRUIJN_TAB[np.int64((lsb * _DEBRUIJN) >> _S58)], w ^ lsb


@njit(cache=True)
def _sample_magkeys(xb, s, out):
    """Stratified sample: one hashed position in each of s strata."""
    d = xb.size
    stride = d // s
    for j in range(s):
        pos = j * stride + np.int64(hash64(SAMPLE_KEY, j) % np.uint64(stride))
        out[j] = _magkey(xb[pos])


def _count_ge_k(xb, t, counts):
    d = xb.size
    for c in prange(counts.size):
        xs = xb[c * CHUNK : min(d, c * CHUNK + CHUNK)]
        n = 0
        for i in range(xs.size):
            n += _magkey(xs[i]) >= t
        counts[c] = n


def _gather_ge_k(xb, t, offsets, cidx, ckey):
    d = xb.size
    for c in prange(offsets.size - 1):
        lo = c * CHUNK
        xs = xb[lo : min(d, lo + CHUNK)]
        p = offsets[c]
        nw = xs.size // 64
        for wi in range(nw):
            base = 64 * wi
            w = np.uint64(0)
            for j in range(64):
                w |= np.uint64(_magkey(xs[base + j]) >= t) << np.uint64(j)
            while w != 0:
                j, w = _lowest_bit_index(w)
                cidx[p] = lo + base + j
                ckey[p] = _magkey(xs[base + j])
                p += 1
        for i in range(64 * nw, xs.size):
            m = _magkey(xs[i])
            if m >= t:
                cidx[p] = lo + i
                ckey[p] = m
                p += 1


_count_ge_p, _count_ge_s = _twins(_count_ge_k)
_gather_ge_p, _gather_ge_s = _twins(_gather_ge_k)


@njit(cache=True)
def _keep_extreme(cidx, ckey, k, largest, nbits, idx_out):
    """idx_out = cidx of the k largest (or smallest) keys, in candidate order;
    among keys equal to the k-th one, the earliest candidates win."""
    C = ckey.size
    if C == k:
        idx_out[:] = cidx
        return
    r = C - k if largest else k - 1
    v, below, equal = radix_select(ckey, r, nbits)
    strict = C - below - equal if largest else below
    need = k - strict
    j = 0
    for p in range(C):
        kk = np.uint64(ckey[p])
        if kk == v:
            if need > 0:
                need -= 1
                idx_out[j] = cidx[p]
                j += 1
        elif (kk > v) == largest:
            idx_out[j] = cidx[p]
            j += 1


def _gather_k(x, idx, out):
    for p in prange(idx.size):
        out[p] = x[idx[p]]


_gather_p, _gather_s = _twins(_gather_k)


@njit(cache=True)
def _gather(x, idx, out):
    """out = x[idx] (serial below 4*CHUNK indices)."""
    if idx.size > 4 * CHUNK:
        _gather_p(x, idx, out)
    else:
        _gather_s(x, idx, out)


gather = _entry(_gather)


@njit(cache=True)
def _topk(x, k, idx_out, val_out):
    """Exact top-k by magnitude: sampled threshold, parallel count + filter
    pass, exact fix-up on the candidates; 1 <= k < d.  Ties at the k-th
    magnitude go to the lowest indices."""
    xb = x.view(np.uint32)
    d = xb.size
    par = d > CHUNK
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
    C = d
    while True:
        if t == 0:  # everything is a candidate
            counts[:] = CHUNK
            counts[-1] = d - (nch - 1) * CHUNK
            C = d
            break
        if par:
            _count_ge_p(xb, t, counts)
        else:
            _count_ge_s(xb, t, counts)
        C = counts.sum()
        if C >= k:
            break
        boost *= 4.0  # the sample over-estimated the threshold: widen
        t = estimate_threshold(sample, k, d, boost)
    offsets = _exclusive_cumsum(counts)
    cidx = np.empty(C, np.int64)
    ckey = np.empty(C, np.uint32)
    if par:
        _gather_ge_p(xb, t, offsets, cidx, ckey)
    else:
        _gather_ge_s(xb, t, offsets, cidx, ckey)
    _keep_extreme(cidx, ckey, k, True, 32, idx_out)
    _gather(x, idx_out, val_out)


topk = _entry(_topk)


@njit(cache=True, inline="always")
def _rk_key(key, i, sh_hi, sh_lo):
    """Unique 63-bit sort key of index i: random prefix | index bits."""
    h = hash64(key, i)
    return ((h >> sh_hi) << sh_lo) | np.uint64(i)


def _rk_count_k(key, d, sh_hi, sh_lo, T, counts):
    for c in prange(counts.size):
        lo = c * CHUNK
        n = 0
        for i in range(min(CHUNK, d - lo)):
            n += _rk_key(key, lo + i, sh_hi, sh_lo) < T
        counts[c] = n


def _rk_gather_k(key, d, sh_hi, sh_lo, T, offsets, cidx, ckey):
    for c in prange(offsets.size - 1):
        lo = c * CHUNK
        m = min(CHUNK, d - lo)
        p = offsets[c]
        nw = m // 64
        for wi in range(nw):
            base = lo + 64 * wi
            w = np.uint64(0)
            for j in range(64):
                w |= np.uint64(_rk_key(key, base + j, sh_hi, sh_lo) < T) << np.uint64(j)
            while w != 0:
                j, w = _lowest_bit_index(w)
                cidx[p] = base + j
                ckey[p] = _rk_key(key, base + j, sh_hi, sh_lo)
                p += 1
        for i in range(lo + 64 * nw, lo + m):
            kk = _rk_key(key, i, sh_hi, sh_lo)
            if kk < T:
                cidx[p] = i
                ckey[p] = kk
                p += 1


_rk_count_p, _rk_count_s = _twins(_rk_count_k)
_rk_gather_p, _rk_gather_s = _twins(_rk_gather_k)


@njit(cache=True)
def _randomk(key, d, k, sh_hi, sh_lo, T0, T1, T2, idx_out):
    """The k indices with the smallest unique keys, ascending.  T0 < T1 < T2
    are increasingly generous key thresholds (T2 = 2**63 accepts all)."""
    par = d > CHUNK
    nch = (d + CHUNK - 1) // CHUNK
    counts = np.empty(nch, np.int64)
    T = T0
    for attempt in range(3):
        T = T0 if attempt == 0 else (T1 if attempt == 1 else T2)
        if par:
            _rk_count_p(key, d, sh_hi, sh_lo, T, counts)
        else:
            _rk_count_s(key, d, sh_hi, sh_lo, T, counts)
        if counts.sum() >= k:
            break
    offsets = _exclusive_cumsum(counts)
    C = offsets[-1]
    cidx = np.empty(C, np.int64)
    ckey = np.empty(C, np.uint64)
    if par:
        _rk_gather_p(key, d, sh_hi, sh_lo, T, offsets, cidx, ckey)
    else:
        _rk_gather_s(key, d, sh_hi, sh_lo, T, offsets, cidx, ckey)
    _keep_extreme(cidx, ckey, k, False, 64, idx_out)


@_entry
def randomk_indices(d, k, key, idx_out):
    """k distinct indices (ascending) from the counter-based RNG; 1 <= k < d."""
    _randomk(key, d, k, *_host.randomk_shifts(d), *_host.randomk_thresholds(d, k), idx_out)


# ---------------------------------------------------------------------------
# scatter / weighted sum
# ---------------------------------------------------------------------------


def _scatter_set_k(idx, vals, out):
    d = out.size
    n = idx.size
    nch = (n + CHUNK - 1) // CHUNK
    bad = np.zeros(nch, np.int64)
    for c in prange(nch):
        ids = idx[c * CHUNK : min(n, c * CHUNK + CHUNK)]
        vs = vals[c * CHUNK : min(n, c * CHUNK + CHUNK)]
        nb = 0
        for p in range(ids.size):
            i = ids[p]
            if i >= 0 and i < d:
                out[i] = vs[p]
            else:
                nb += 1
        bad[c] = nb
    return bad.sum()


_scatter_set_p, _scatter_set_s = _twins(_scatter_set_k)


@_entry
@njit(cache=True)
def scatter(idx, vals, out, accumulate):
    """out[idx] = vals, or with ``accumulate`` out[idx] += vals (sequentially:
    duplicate indices accumulate).  Returns the number of out-of-range indices
    skipped."""
    if not accumulate:
        return _scatter_set_p(idx, vals, out) if idx.size > CHUNK else _scatter_set_s(idx, vals, out)
    d = out.size
    bad = 0
    for p in range(idx.size):
        i = idx[p]
        if i >= 0 and i < d:
            out[i] += vals[p]
        else:
            bad += 1
    return bad


def _wsum1_k(x0, w0, out):
    for i in prange(out.size):
        out[i] = w0 * x0[i]


def _wsum2_k(x0, w0, x1, w1, out):
    for i in prange(out.size):
        out[i] = w0 * x0[i] + w1 * x1[i]


def _wsum3_k(x0, w0, x1, w1, x2, w2, out):
    for i in prange(out.size):
        out[i] = w0 * x0[i] + w1 * x1[i] + w2 * x2[i]


def _wsum4_k(x0, w0, x1, w1, x2, w2, x3, w3, out):
    for i in prange(out.size):
        out[i] = w0 * x0[i] + w1 * x1[i] + w2 * x2[i] + w3 * x3[i]


#: {number of inputs: (parallel, serial)}; ``out`` may alias x0
_WSUM = {1: _twins(_wsum1_k), 2: _twins(_wsum2_k), 3: _twins(_wsum3_k), 4: _twins(_wsum4_k)}


@_entry
def weighted_sum(xs, ws, out):
    """out = sum_k ws[k] * xs[k] in fused passes (see :func:`._host.wsum_passes`)."""
    serial = out.size <= CHUNK
    for args in _host.wsum_passes(xs, ws, out):
        _WSUM[len(args) // 2][serial](*args, out)


# ---------------------------------------------------------------------------
# segmented kernels: a flat bucket of consecutive segments (one per tensor)
# ---------------------------------------------------------------------------
# One call does the work of one call per segment, with each segment's own seed, levels,
# norms and code width, so the results are those of the per-tensor kernels bit for bit: each
# segment is handed to the same per-tensor kernel as a slice. ``starts``/``sizes`` are the
# segments' element ranges, ``*_starts`` where each segment's part of another output begins
# (its first norm, byte, kept entry). Empty segments are skipped.

_PACK1, _PACK2, _PACK3, _PACK4, _PACK5, _PACK6, _PACK7, _PACK8 = (_PACK_CODES[b] for b in range(1, 9))
_UNPACK1, _UNPACK2, _UNPACK3, _UNPACK4, _UNPACK5, _UNPACK6, _UNPACK7, _UNPACK8 = (
    _UNPACK_CODES[b] for b in range(1, 9))
_DQADD1, _DQADD2, _DQADD3, _DQADD4, _DQADD5, _DQADD6, _DQADD7, _DQADD8 = (
    _DEQUANTIZE_ADD[b] for b in range(1, 9))


@njit(cache=True)
def _pack_bits(bits, qs, os):
    """pack_codes of one segment at a width known only at run time."""
    if bits == 1:
        _PACK1(qs, os)
    elif bits == 2:
        _PACK2(qs, os)
    elif bits == 3:
        _PACK3(qs, os)
    elif bits == 4:
        _PACK4(qs, os)
    elif bits == 5:
        _PACK5(qs, os)
    elif bits == 6:
        _PACK6(qs, os)
    elif bits == 7:
        _PACK7(qs, os)
    else:
        _PACK8(qs, os)


@njit(cache=True)
def _unpack_bits(bits, ps, qs):
    if bits == 1:
        _UNPACK1(ps, qs)
    elif bits == 2:
        _UNPACK2(ps, qs)
    elif bits == 3:
        _UNPACK3(ps, qs)
    elif bits == 4:
        _UNPACK4(ps, qs)
    elif bits == 5:
        _UNPACK5(ps, qs)
    elif bits == 6:
        _UNPACK6(ps, qs)
    elif bits == 7:
        _UNPACK7(ps, qs)
    else:
        _UNPACK8(ps, qs)


@njit(cache=True)
def _dequantize_add_bits(bits, norms, ps, levels, bs, os):
    if bits == 1:
        _DQADD1(norms, ps, levels, bs, os)
    elif bits == 2:
        _DQADD2(norms, ps, levels, bs, os)
    elif bits == 3:
        _DQADD3(norms, ps, levels, bs, os)
    elif bits == 4:
        _DQADD4(norms, ps, levels, bs, os)
    elif bits == 5:
        _DQADD5(norms, ps, levels, bs, os)
    elif bits == 6:
        _DQADD6(norms, ps, levels, bs, os)
    elif bits == 7:
        _DQADD7(norms, ps, levels, bs, os)
    else:
        _DQADD8(norms, ps, levels, bs, os)


@njit(cache=True)
def _segment_buckets(n, bucket_size):
    """(number of buckets, bucket size) of a segment of n > 0 elements (``_host.buckets``)."""
    bs = n if bucket_size <= 0 or bucket_size > n else bucket_size
    return (n + bs - 1) // bs, bs


@_entry
@njit(cache=True)
def qsgd_quantize_segments(x, starts, sizes, norm_starts, keys, levels, bucket_size, norms, q):
    """qsgd_quantize of each segment, with its own key and levels."""
    keys = keys.view(np.uint64)
    for s in range(starts.size):
        n = sizes[s]
        if n == 0:
            continue
        lo = starts[s]
        nb, bs = _segment_buckets(n, bucket_size)
        n0 = norm_starts[s]
        _qsgd_quantize(x[lo : lo + n], levels[s], bs, keys[s], norms[n0 : n0 + nb], q[lo : lo + n])


@_entry
@njit(cache=True)
def pack_codes_segments(q, starts, sizes, byte_starts, bits, out):
    """pack_codes of each segment at its own width, each starting on a byte."""
    for s in range(starts.size):
        n = sizes[s]
        if n == 0:
            continue
        lo = starts[s]
        b0 = byte_starts[s]
        _pack_bits(bits[s], q[lo : lo + n], out[b0 : b0 + (n * bits[s] + 7) // 8])


@_entry
@njit(cache=True)
def dequantize_segments(norms, packed, starts, sizes, norm_starts, byte_starts, bits, levels,
                        bucket_size, add, scratch, out):
    """Each segment's codes times float32(norm of its bucket / levels), written into ``out``
    (qsgd_dequantize of unpack_codes) or, with ``add``, added to it (dequantize_add).
    ``scratch``: int8, one per element (codes unpacked before dequantizing)."""
    for s in range(starts.size):
        n = sizes[s]
        if n == 0:
            continue
        lo = starts[s]
        nb, bs = _segment_buckets(n, bucket_size)
        n0 = norm_starts[s]
        b0 = byte_starts[s]
        ns = norms[n0 : n0 + nb]
        ps = packed[b0 : b0 + (n * bits[s] + 7) // 8]
        os = out[lo : lo + n]
        if add and (nb == 1 or bs % 8 == 0):  # whole groups of 8 codes per bucket: one pass
            _dequantize_add_bits(bits[s], ns, ps, levels[s], bs, os)
            continue
        qs = scratch[lo : lo + n]
        _unpack_bits(bits[s], ps, qs)
        if add:
            flev = np.float32(levels[s])
            for b in range(nb):
                sc = ns[b] / flev
                qb = qs[b * bs : min(n, b * bs + bs)]
                ob = os[b * bs : min(n, b * bs + bs)]
                for i in range(qb.size):
                    ob[i] += np.float32(qb[i]) * sc
        else:
            _qsgd_dequantize(ns, qs, levels[s], bs, os)


@_entry
@njit(cache=True)
def terngrad_quantize_segments(x, starts, sizes, keys, scales, t):
    """terngrad_quantize of each segment: one scale (max |x|) per segment."""
    keys = keys.view(np.uint64)
    for s in range(starts.size):
        n = sizes[s]
        lo = starts[s]
        if n:
            _terngrad_quantize(x[lo : lo + n], keys[s], scales[s : s + 1], t[lo : lo + n])


@_entry
@njit(cache=True)
def sign_pack_segments(x, starts, sizes, byte_starts, out):
    """sign_pack of each segment, each starting on a byte."""
    for s in range(starts.size):
        n = sizes[s]
        lo = starts[s]
        b0 = byte_starts[s]
        if n:
            _sign_pack(x[lo : lo + n], out[b0 : b0 + (n + 7) // 8])


@_entry
@njit(cache=True)
def sign_unpack_segments(packed, starts, sizes, byte_starts, high, low, out):
    """Segment s: high[s] where the bit is set, low[s] where it is not."""
    for s in range(starts.size):
        n = sizes[s]
        lo = starts[s]
        b0 = byte_starts[s]
        if n:
            _sign_unpack(packed[b0 : b0 + (n + 7) // 8], high[s], low[s], out[lo : lo + n])


@_entry
@njit(cache=True)
def sign_vote_segments(packed, starts, sizes, byte_starts, out):
    """sign_vote of each segment; packed: uint8 [workers, bytes of the bucket]."""
    for s in range(starts.size):
        n = sizes[s]
        lo = starts[s]
        b0 = byte_starts[s]
        if n:
            _sign_vote(packed[:, b0 : b0 + (n + 7) // 8], out[lo : lo + n])


@_entry
@njit(cache=True)
def topk_segments(x, starts, sizes, ks, k_starts, idx_out, val_out):
    """topk of each segment (ks[s] entries); indices are the bucket's, ascending."""
    for s in range(starts.size):
        n = sizes[s]
        k = ks[s]
        if k == 0:
            continue
        lo = starts[s]
        k0 = k_starts[s]
        io = idx_out[k0 : k0 + k]
        vo = val_out[k0 : k0 + k]
        xs = x[lo : lo + n]
        if k == n:
            for i in range(n):
                io[i] = i
                vo[i] = xs[i]
        else:
            _topk(xs, k, io, vo)
        for i in range(k):
            io[i] += lo


@_entry
@njit(cache=True)
def randomk_segments(x, starts, sizes, ks, k_starts, keys, shifts, thresholds, idx_out,
                     val_out):
    """randomk of each segment (ks[s] entries, its own key); indices are the bucket's.
    ``shifts``: [segments, 2] (_host.randomk_shifts), ``thresholds``: [segments, 3]."""
    keys = keys.view(np.uint64)
    shifts = shifts.view(np.uint64)
    thresholds = thresholds.view(np.uint64)
    for s in range(starts.size):
        n = sizes[s]
        k = ks[s]
        if k == 0:
            continue
        lo = starts[s]
        k0 = k_starts[s]
        io = idx_out[k0 : k0 + k]
        if k == n:
            for i in range(n):
                io[i] = i
        else:
            _randomk(keys[s], n, k, shifts[s, 0], shifts[s, 1], thresholds[s, 0],
                     thresholds[s, 1], thresholds[s, 2], io)
        for i in range(k):
            io[i] += lo
    _gather(x, idx_out, val_out)
