"""Public functions: torch tensors in, torch tensors out.

Each function validates its arguments (dtype, contiguity, device, sizes,
ranges), allocates the outputs as torch tensors on the input's device and
calls the backend function of the same name: from :mod:`._cuda` (imported on
first use) for CUDA tensors, from :mod:`._cpu` otherwise.  Empty inputs
return empty outputs without calling a backend.
"""

from __future__ import annotations

import operator

import numpy as np

import torch

from . import _cpu, _host
from ._random import seed_key


#: Tests under the CUDA simulator set this: CPU tensors then go to the CUDA backend (and to
#: the torch-on-device paths of the segmented functions), as CUDA tensors would.
SIMULATE_CUDA = False


def runs_on_gpu(t) -> bool:
    """Whether work on ``t`` goes to the GPU (or, under the simulator's tests, would)."""
    return t.is_cuda or SIMULATE_CUDA


def _backend(t):
    if t.is_cuda or SIMULATE_CUDA:
        from . import _cuda

        return _cuda
    return _cpu


# ---------------------------------------------------------------------------
# validation
# ---------------------------------------------------------------------------


def _flat(x, name, dtype):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype != dtype:
        raise TypeError(f"{name} must have dtype {dtype}, got {x.dtype}")
    if not x.is_contiguous():
        raise ValueError(f"{name} must be contiguous (flatten it first)")
    if x.dim() != 1:
        x = x.view(-1)
    if x.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{name}: unsupported device {x.device}")
    return x


def _same_device(ref, t, name):
    if t.device != ref.device:
        raise ValueError(f"{name} is on {t.device}, expected {ref.device}")


def _out(out, n, dtype, device, name="out"):
    """(flat buffer the kernel writes, tensor to return): a new tensor, or the caller's
    ``out`` (checked) and a flat view of it."""
    if out is None:
        out = torch.empty(n, dtype=dtype, device=device)
        return out, out
    flat = _flat(out, name, dtype)
    if flat.numel() != n:
        raise ValueError(f"{name} has {flat.numel()} elements, expected {n}")
    if flat.device != torch.device(device):
        raise ValueError(f"{name} is on {flat.device}, expected {device}")
    return flat, out


def _int(v, name):
    """Python int from an int-like (int, NumPy integer, integer 1-element tensor)."""
    if isinstance(v, bool):
        raise TypeError(f"{name} must be an int, got bool")
    try:
        return operator.index(v)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(v).__name__}") from None


def _seed(seed):
    return seed_key(_int(seed, "seed"))


def _check_d(d, name="d"):
    d = _int(d, name)
    if d < 0:
        raise ValueError(f"{name} must be non-negative")
    return d


def _clip_k(k, d):
    return max(0, min(_int(k, "k"), d))


def _check_levels(levels):
    levels = _int(levels, "levels")
    if not 1 <= levels <= 127:
        raise ValueError(f"levels must be in [1, 127], got {levels}")
    return int(levels)


def _check_bits(bits):
    bits = _int(bits, "bits")
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in [1, 8], got {bits}")
    return int(bits)


def _buckets(d, bucket_size):
    return _host.buckets(d, None if bucket_size is None else _int(bucket_size, "bucket_size"))


def _scale_tensor(scale, device):
    """1-element float32 tensor on ``device`` from a float or tensor."""
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1:
            raise ValueError("scale must have exactly one element")
        s = scale.detach().reshape(1)
        if s.dtype != torch.float32 or s.device != device:
            s = s.to(device=device, dtype=torch.float32)
        return s.contiguous()
    return torch.full((1,), float(scale), dtype=torch.float32, device=device)


# ---------------------------------------------------------------------------
# QSGD
# ---------------------------------------------------------------------------


def qsgd_quantize(x, levels: int, bucket_size: int, seed: int):
    """QSGD stochastic quantisation (Alistarh et al., 2017) with bucketing.

    ``x`` (float32, flat, d elements) is split into consecutive buckets of
    ``bucket_size`` elements (the last one may be shorter; ``bucket_size <= 0``
    means a single bucket).  Returns ``(norms, q)``:

    * ``norms``: float32 [num_buckets], L2 norm of each bucket (accumulated in
      float64); ``num_buckets = ceil(d / bucket_size)`` (0 when d == 0);
    * ``q``: int8 [d], ``sign(x_k) * l_k`` with ``l_k in {0..levels}`` the
      stochastic rounding of ``a_k = |x_k| * (levels / norm)``: ``floor(a_k)``
      plus one with probability ``a_k - floor(a_k)``.  Zero-norm buckets give 0.

    The uniform draw of element k is ``uniform(seed, k)`` from the
    counter-based RNG (identical on CPU and CUDA).  ``1 <= levels <= 127``.
    ``E[qsgd_dequantize(*qsgd_quantize(x, s, b, seed), s, b)] = x``.
    """
    levels = _check_levels(levels)
    x = _flat(x, "x", torch.float32)
    key = _seed(seed)
    d = x.numel()
    nb, bs = _buckets(d, bucket_size)
    norms = torch.empty(nb, dtype=torch.float32, device=x.device)
    q = torch.empty(d, dtype=torch.int8, device=x.device)
    if d:
        _backend(x).qsgd_quantize(x, levels, bs, key, norms, q)
    return norms, q


def qsgd_dequantize(norms, q, levels: int, bucket_size: int, out=None):
    """Inverse of :func:`qsgd_quantize`: ``out[k] = q[k] * (norm_b / levels)``
    (float32 [d]).  ``out`` may be given (float32 [d], same device)."""
    levels = _check_levels(levels)
    q = _flat(q, "q", torch.int8)
    norms = _flat(norms, "norms", torch.float32)
    _same_device(q, norms, "norms")
    d = q.numel()
    nb, bs = _buckets(d, bucket_size)
    if norms.numel() != nb:
        raise ValueError(f"norms has {norms.numel()} elements, expected {nb} buckets")
    out, result = _out(out, d, torch.float32, q.device)
    if d:
        _backend(q).qsgd_dequantize(norms, q, levels, bs, out)
    return result


# ---------------------------------------------------------------------------
# TernGrad
# ---------------------------------------------------------------------------


def terngrad_quantize(x, seed: int):
    """TernGrad (Wen et al., 2017).  Returns ``(scale, t)``: ``scale`` =
    max|x| (float32 [1]); ``t`` int8 [d] in {-1, 0, 1}, ``t_k = sign(x_k)``
    with probability ``|x_k| / scale`` (decided as ``u_k * scale < |x_k|``
    with ``u_k = uniform(seed, k)``), else 0.  Unbiased."""
    x = _flat(x, "x", torch.float32)
    key = _seed(seed)
    d = x.numel()
    scale = torch.zeros(1, dtype=torch.float32, device=x.device)
    t = torch.empty(d, dtype=torch.int8, device=x.device)
    if d:
        _backend(x).terngrad_quantize(x, key, scale, t)
    return scale, t


def terngrad_dequantize(scale, t, out=None):
    """``out = scale * t`` (float32 [d]); ``scale`` is the [1] tensor (or a
    float) returned by :func:`terngrad_quantize`."""
    t = _flat(t, "t", torch.int8)
    d = t.numel()
    out, result = _out(out, d, torch.float32, t.device)
    if d:
        _backend(t).scale_int8(t, _scale_tensor(scale, t.device), out)
    return result


# ---------------------------------------------------------------------------
# signs
# ---------------------------------------------------------------------------


def sign_pack(x):
    """Pack signs: uint8 [ceil(d/8)], bit j of byte i is 1 iff
    ``x[8i+j] >= 0`` (zeros count as +, NaN as -); unused high bits are 0."""
    x = _flat(x, "x", torch.float32)
    out = torch.empty(_host.sign_bytes(x.numel()), dtype=torch.uint8, device=x.device)
    if x.numel():
        _backend(x).sign_pack(x, out)
    return out


def sign_unpack(packed, d: int, scale=1.0, out=None):
    """Unpack to float32 [d] of ``+scale`` (bit set) / ``-scale``.  ``scale``
    is a Python float or a 1-element tensor."""
    packed = _flat(packed, "packed", torch.uint8)
    d = _check_d(d)
    if packed.numel() != _host.sign_bytes(d):
        raise ValueError(f"packed has {packed.numel()} bytes, expected {_host.sign_bytes(d)}")
    out, result = _out(out, d, torch.float32, packed.device)
    if d:
        _backend(packed).sign_unpack(packed, _scale_tensor(scale, packed.device), out)
    return result


def sign_vote(packed_list_tensor, d: int, out=None):
    """Majority vote over n workers' packed signs.

    ``packed_list_tensor``: uint8 [n, ceil(d/8)] (a 1-D tensor counts as
    n = 1).  Returns float32 [d]: +1 where ``2 * (#workers with bit set) >= n``
    else -1 (ties go to +1)."""
    p = packed_list_tensor
    if not isinstance(p, torch.Tensor) or p.dtype != torch.uint8:
        raise TypeError("packed_list_tensor must be a uint8 torch.Tensor")
    if not p.is_contiguous():
        raise ValueError("packed_list_tensor must be contiguous")
    if p.dim() == 1:
        p = p.view(1, -1)
    if p.dim() != 2:
        raise ValueError("packed_list_tensor must be [n, ceil(d/8)]")
    d = _check_d(d)
    if p.shape[1] != _host.sign_bytes(d):
        raise ValueError(f"packed rows have {p.shape[1]} bytes, expected {_host.sign_bytes(d)}")
    out, result = _out(out, d, torch.float32, p.device)
    if d == 0:
        return result
    if p.shape[0] == 0:
        out.fill_(1.0)
    else:
        _backend(p).sign_vote(p, out)
    return result


# ---------------------------------------------------------------------------
# bit packing
# ---------------------------------------------------------------------------


def code_bits(levels: int) -> int:
    """Bits of the two's-complement codes in [-levels, levels]: 2 for TernGrad's {-1, 0, 1},
    6 for 16 QSGD levels, 8 for 127."""
    return _host.code_bits(_check_levels(levels))


def packed_size(d: int, bits: int) -> int:
    """Bytes of ``d`` codes of ``bits`` bits: ``ceil(d * bits / 8)``."""
    return _host.packed_bytes(_check_d(d), _check_bits(bits))


def pack_codes(q, bits: int):
    """Pack int8 codes in ``[-2^(bits-1), 2^(bits-1))`` into a little-endian bit stream of
    ``bits`` bits each: uint8 [ceil(d * bits / 8)]; code k occupies bits ``[k*bits,
    (k+1)*bits)``, unused high bits are 0.  Codes outside the range keep only their low
    ``bits`` bits.  ``bits`` is 1 to 8."""
    q = _flat(q, "q", torch.int8)
    bits = _check_bits(bits)
    out = torch.empty(_host.packed_bytes(q.numel(), bits), dtype=torch.uint8, device=q.device)
    if q.numel():
        _backend(q).pack_codes(q, bits, out)
    return out


def unpack_codes(packed, d: int, bits: int, out=None):
    """Inverse of :func:`pack_codes`: int8 [d], sign-extended from ``bits`` bits."""
    packed = _flat(packed, "packed", torch.uint8)
    bits = _check_bits(bits)
    d = _check_d(d)
    if packed.numel() != _host.packed_bytes(d, bits):
        raise ValueError(f"packed has {packed.numel()} bytes, expected {_host.packed_bytes(d, bits)}")
    out, result = _out(out, d, torch.int8, packed.device)
    if d:
        _backend(packed).unpack_codes(packed, bits, out)
    return result


def dequantize_add(norms, packed, bits: int, levels: int, bucket_size: int, out):
    """``out += dequantized codes``, from a packed payload: ``out[k] += code_k * (norm_b /
    levels)`` with the codes of :func:`pack_codes` (``bits`` bits) and ``norm_b`` the float32
    scale of element k's bucket. Returns ``out``. The same float32 arithmetic as
    ``out += qsgd_dequantize(norms, unpack_codes(packed, d, bits), levels, bucket_size)``,
    in one pass; TernGrad's ``scale * t`` is the case of 1 level and one bucket."""
    packed = _flat(packed, "packed", torch.uint8)
    norms = _flat(norms, "norms", torch.float32)
    bits = _check_bits(bits)
    levels = _check_levels(levels)
    if not (out.dtype == torch.float32 and out.is_contiguous()):
        raise ValueError("out must be a contiguous float32 tensor")
    flat_out = out.view(-1)
    _same_device(flat_out, packed, "packed")
    _same_device(flat_out, norms, "norms")
    d = flat_out.numel()
    if packed.numel() != _host.packed_bytes(d, bits):
        raise ValueError(f"packed has {packed.numel()} bytes, expected {_host.packed_bytes(d, bits)}")
    nb, bs = _buckets(d, bucket_size)
    if norms.numel() != nb:
        raise ValueError(f"norms has {norms.numel()} elements, expected {nb} buckets")
    if not d:
        return out
    if nb == 1 or bs % 8 == 0:  # buckets of whole groups of 8 codes: one fused pass
        _backend(packed).dequantize_add(norms, packed, bits, levels, bs, flat_out)
    else:
        flat_out += qsgd_dequantize(norms, unpack_codes(packed, d, bits), levels, bucket_size)
    return out


# ---------------------------------------------------------------------------
# sparsification
# ---------------------------------------------------------------------------


def topk(x, k: int):
    """Exactly the ``k`` entries of largest magnitude.

    Returns ``(indices, values)``: int64 indices sorted ascending and float32
    ``values = x[indices]``.  Among equal magnitudes the lower index wins; NaN
    counts as the largest magnitude.  ``k`` is clipped to [0, d].  Implemented
    as threshold selection: a sampled threshold estimate, a parallel filter
    pass and an exact fix-up on the candidates (no full sort)."""
    x = _flat(x, "x", torch.float32)
    d = x.numel()
    k = _clip_k(k, d)
    idx = torch.empty(k, dtype=torch.int64, device=x.device)
    vals = torch.empty(k, dtype=torch.float32, device=x.device)
    if k == 0:
        return idx, vals
    if k == d:
        torch.arange(d, out=idx)
        vals.copy_(x)
        return idx, vals
    _backend(x).topk(x, k, idx, vals)
    return idx, vals


def randomk_indices(d: int, k: int, seed: int, device="cpu"):
    """``k`` distinct indices of ``range(d)``, uniformly random, sorted
    ascending (int64 tensor on ``device``).

    They are the k indices with the smallest keys ``hash64(seed, i)`` (made
    unique by appending the index bits), so they depend only on (d, k, seed):
    every worker using the same seed gets the same set, on CPU and CUDA."""
    d = _check_d(d)
    k = _clip_k(k, d)
    device = torch.device(device)
    idx = torch.empty(k, dtype=torch.int64, device=device)
    if k == 0:
        return idx
    if k == d:
        torch.arange(d, out=idx)
        return idx
    _backend(idx).randomk_indices(d, k, _seed(seed), idx)
    return idx


def randomk(x, k: int, seed: int):
    """Random-k sparsification: ``(indices, values)`` with the ``k`` indices of
    :func:`randomk_indices` (same seed -> same indices on every worker, whatever
    x holds) and ``values = x[indices]`` (unscaled; multiply by d/k for an
    unbiased estimate)."""
    x = _flat(x, "x", torch.float32)
    d = x.numel()
    idx = randomk_indices(d, k, seed, x.device)
    vals = torch.empty(idx.numel(), dtype=torch.float32, device=x.device)
    if idx.numel():
        _backend(x).gather(x, idx, vals)
    return idx, vals


def scatter(indices, values, d: int, out=None, accumulate: bool = False):
    """Dense float32 [d]: zeros except ``out[indices] = values`` (or, with
    ``accumulate=True``, ``out[indices] += values`` onto the existing ``out``,
    duplicates summed).  Without accumulate a given ``out`` is zeroed first.
    Out-of-range indices raise IndexError on CPU and are skipped on CUDA."""
    indices = _flat(indices, "indices", torch.int64)
    values = _flat(values, "values", torch.float32)
    _same_device(indices, values, "values")
    if indices.numel() != values.numel():
        raise ValueError("indices and values must have the same length")
    d = _check_d(d)
    fresh = out is None
    out, result = _out(out, d, torch.float32, indices.device)
    if fresh or not accumulate:
        out.zero_()
    if indices.numel():
        bad = _backend(indices).scatter(indices, values, out, bool(accumulate))
        if bad:
            raise IndexError(f"{bad} indices out of range [0, {d})")
    return result


# ---------------------------------------------------------------------------
# weighted sum
# ---------------------------------------------------------------------------


def weighted_sum(tensors, weights, out=None):
    """Fused ``out = sum_k weights[k] * tensors[k]`` over equal-length flat
    float32 tensors (one or more, same device).  ``out`` may alias any of the
    inputs.  Weights are applied in float32."""
    tensors = list(tensors)
    weights = [float(w) for w in weights]
    if not tensors:
        raise ValueError("weighted_sum needs at least one tensor")
    if len(weights) != len(tensors):
        raise ValueError("tensors and weights must have the same length")
    xs = [_flat(t, f"tensors[{i}]", torch.float32) for i, t in enumerate(tensors)]
    d = xs[0].numel()
    for i, t in enumerate(xs):
        if t.numel() != d:
            raise ValueError(f"tensors[{i}] has {t.numel()} elements, expected {d}")
        _same_device(xs[0], t, f"tensors[{i}]")
    out, result = _out(out, d, torch.float32, xs[0].device)
    if d == 0:
        return result
    # an input aliasing out must be read by the first pass (see _host.wsum_passes)
    if len(xs) > 4:
        ptr = out.data_ptr()
        for i in range(4, len(xs)):
            if xs[i].data_ptr() == ptr:
                xs[0], xs[i] = xs[i], xs[0]
                weights[0], weights[i] = weights[i], weights[0]
                break
    _backend(out).weighted_sum(xs, weights, out)
    return result


# ---------------------------------------------------------------------------
# segmented kernels: one call per bucket of tensors
# ---------------------------------------------------------------------------


class Segments:
    """A flat bucket cut into consecutive segments, one per tensor: the tables the segmented
    kernels read. Make it once per bucket (it copies its tables to ``device`` once) and keep
    it; tables derived from it (where each segment's norms or bytes start) are cached in it.

    Every segmented function computes, for each segment, exactly what the per-tensor
    function computes for that tensor alone: the same random draws (each segment has its own
    seed), the same norms and bits. The payload of a bucket is the per-tensor payloads laid
    end to end: segment s's norms start at ``norm_starts(b)[s]``, its packed bytes at
    ``byte_starts(bits)[s]`` (each segment starts on a byte)."""

    def __init__(self, sizes, device="cpu"):
        self.sizes_list = [int(n) for n in sizes]
        if any(n < 0 for n in self.sizes_list):
            raise ValueError("segment sizes must be non-negative")
        self.device = torch.device("cpu" if device is None else device)
        self.count = len(self.sizes_list)
        self.starts_list = _exclusive_cumsum(self.sizes_list)
        self.numel = self.starts_list[-1] if self.count else 0
        self.starts_list = self.starts_list[:-1]
        self.starts = self.table(self.starts_list)
        self.sizes = self.table(self.sizes_list)
        self._cache: dict = {}

    def table(self, values, dtype=torch.int64) -> torch.Tensor:
        """A small per-segment table on the bucket's device (copied from the host once)."""
        return torch.tensor(values, dtype=dtype).to(self.device)

    def cached(self, name, make):
        """``make()``, computed once per bucket and name."""
        if name not in self._cache:
            self._cache[name] = make()
        return self._cache[name]

    def norm_starts(self, bucket_size: int) -> tuple[torch.Tensor, int]:
        """(where each segment's norms start, total norms) for QSGD buckets of ``bucket_size``
        elements that never straddle two segments."""
        bucket_size = _int(bucket_size, "bucket_size")

        def make():
            counts = [_host.buckets(n, bucket_size)[0] for n in self.sizes_list]
            starts = _exclusive_cumsum(counts)
            return self.table(starts[:-1]), starts[-1]

        return self.cached(("norms", bucket_size), make)

    def byte_starts(self, bits) -> tuple[torch.Tensor, int]:
        """(where each segment's packed codes start, total bytes), ``bits`` per element (an
        int, or one per segment)."""
        bits = self.per_segment(bits, "bits")

        def make():
            starts = _exclusive_cumsum([_host.packed_bytes(n, b)
                                        for n, b in zip(self.sizes_list, bits)])
            return self.table(starts[:-1]), starts[-1]

        return self.cached(("bytes", bits), make)

    def per_segment(self, value, name) -> tuple:
        """``value`` repeated per segment when it is one int, else checked to be one each."""
        if isinstance(value, (list, tuple)):
            if len(value) != self.count:
                raise ValueError(f"{name}: expected one per segment ({self.count}), got {len(value)}")
            return tuple(_int(v, name) for v in value)
        return (_int(value, name),) * self.count

    def k_starts(self, ks) -> tuple[torch.Tensor, torch.Tensor, int, tuple]:
        """(k per segment, where each segment's kept entries start, total kept, the k per
        segment on the host), each k clipped to its segment's size."""
        ks = tuple(max(0, min(_int(k, "k"), n)) for k, n in zip(self.per_segment(ks, "k"),
                                                                   self.sizes_list))

        def make():
            starts = _exclusive_cumsum(ks)
            return self.table(ks), self.table(starts[:-1]), starts[-1], ks

        return self.cached(("k", ks), make)

    def int_table(self, name, values) -> torch.Tensor:
        """A cached per-segment int64 table of ``values`` (levels, bits)."""
        values = self.per_segment(values, name)
        return self.cached((name, values), lambda: self.table(values))

    def keys(self, seeds) -> torch.Tensor:
        """The counter-based RNG's stream key of each segment's seed (int64 bit patterns of
        the uint64 keys), on the bucket's device: changes every step, so not cached. On a GPU
        it travels from pinned memory without waiting."""
        if len(seeds) != self.count:
            raise ValueError(f"seeds: expected one per segment ({self.count}), got {len(seeds)}")
        host = torch.from_numpy(np.array([_seed(s) for s in seeds], dtype=np.uint64).view(np.int64))
        if self.device.type == "cuda":
            return host.pin_memory().to(self.device, non_blocking=True)
        return host

    def check(self, x, name="x"):
        if x.numel() != self.numel:
            raise ValueError(f"{name} has {x.numel()} elements, the segments {self.numel}")
        if x.device != self.device:
            raise ValueError(f"{name} is on {x.device}, the segments' tables on {self.device}")


def _exclusive_cumsum(values) -> list[int]:
    out = [0]
    for v in values:
        out.append(out[-1] + int(v))
    return out


def qsgd_quantize_segments(x, segments: Segments, levels, bucket_size: int, seeds):
    """:func:`qsgd_quantize` of each segment of ``x`` with its own seed (and levels: an int
    or one per segment). Returns ``(norms, q)`` for the whole bucket: segment s's norms from
    ``segments.norm_starts(bucket_size)[0][s]``, its codes at its own elements."""
    x = _flat(x, "x", torch.float32)
    segments.check(x)
    level_values = tuple(_check_levels(v) for v in segments.per_segment(levels, "levels"))
    norm_starts, total = segments.norm_starts(bucket_size)
    norms = torch.empty(total, dtype=torch.float32, device=x.device)
    q = torch.empty(x.numel(), dtype=torch.int8, device=x.device)
    if not x.numel():
        return norms, q
    _backend(x).qsgd_quantize_segments(
        x, segments.starts, segments.sizes, norm_starts, segments.keys(seeds),
        segments.int_table("levels", level_values), _int(bucket_size, "bucket_size"), norms, q)
    return norms, q


def pack_codes_segments(q, segments: Segments, bits):
    """:func:`pack_codes` of each segment (``bits``: an int or one per segment), laid end to
    end, each segment starting on a byte: uint8 [segments.byte_starts(bits)[1]]."""
    q = _flat(q, "q", torch.int8)
    segments.check(q, "q")
    bits = tuple(_check_bits(b) for b in segments.per_segment(bits, "bits"))
    byte_starts, total = segments.byte_starts(bits)
    out = torch.empty(total, dtype=torch.uint8, device=q.device)
    if not q.numel():
        return out
    _backend(q).pack_codes_segments(q, segments.starts, segments.sizes, byte_starts,
                                    segments.int_table("bits", bits), out)
    return out


#: bits of TernGrad's codes {-1, 0, 1}
TERNARY_BITS = 2

#: the largest QSGD bucket the fused GPU kernel takes (one warp per bucket); larger buckets
#: (and `bucket_size` 0: a whole tensor) go through the two-pass kernels
FUSED_BUCKET_MAX = 8192


def qsgd_packed_segments(x, segments: Segments, levels, bucket_size: int, seeds):
    """:func:`qsgd_quantize_segments` then :func:`pack_codes_segments` at ``code_bits`` of
    each segment's levels: ``(norms, packed)``, the same bits. On a GPU one fused kernel
    computes both where every QSGD bucket starts on a byte (``bucket_size * bits`` a
    multiple of 8, as for the default 512), with no int8 codes in memory between them."""
    x = _flat(x, "x", torch.float32)
    segments.check(x)
    level_values = tuple(_check_levels(v) for v in segments.per_segment(levels, "levels"))
    bits = tuple(_host.code_bits(v) for v in level_values)
    bucket_size = _int(bucket_size, "bucket_size")
    fused = (runs_on_gpu(x) and 0 < bucket_size <= FUSED_BUCKET_MAX
             and all(bucket_size * b % 8 == 0 for b in bits))
    if not fused:
        norms, q = qsgd_quantize_segments(x, segments, level_values, bucket_size, seeds)
        return norms, pack_codes_segments(q, segments, bits)
    norm_starts, total_norms = segments.norm_starts(bucket_size)
    byte_starts, total_bytes = segments.byte_starts(bits)
    norms = torch.empty(total_norms, dtype=torch.float32, device=x.device)
    packed = torch.empty(total_bytes, dtype=torch.uint8, device=x.device)
    if x.numel():
        _backend(x).qsgd_packed_segments(
            x, segments.starts, segments.sizes, norm_starts, byte_starts, segments.keys(seeds),
            segments.int_table("levels", level_values), segments.int_table("bits", bits),
            bucket_size, norms, packed)
    return norms, packed


def terngrad_packed_segments(x, segments: Segments, seeds):
    """:func:`terngrad_quantize_segments` then :func:`pack_codes_segments` at 2 bits:
    ``(scales, packed)``, the same bits; on a GPU the codes are computed where they are
    packed (no int8 codes in memory)."""
    if not runs_on_gpu(x):
        scales, t = terngrad_quantize_segments(x, segments, seeds)
        return scales, pack_codes_segments(t, segments, TERNARY_BITS)
    x = _flat(x, "x", torch.float32)
    segments.check(x)
    byte_starts, total = segments.byte_starts(TERNARY_BITS)
    scales = torch.zeros(segments.count, dtype=torch.float32, device=x.device)
    packed = torch.empty(total, dtype=torch.uint8, device=x.device)
    if x.numel():
        _backend(x).terngrad_packed_segments(x, segments.starts, segments.sizes, byte_starts,
                                             segments.keys(seeds), scales, packed)
    return scales, packed


def dequantize_segments(norms, packed, segments: Segments, bits, levels, bucket_size: int,
                        out=None, add: bool = False, scratch=None):
    """The inverse of :func:`qsgd_quantize_segments` + :func:`pack_codes_segments`: each
    segment's codes times float32(norm of its bucket / levels), written into ``out`` (a new
    float32 [numel] when None) or, with ``add``, added to it (:func:`dequantize_add`, the
    same float32 arithmetic). TernGrad is the case of 1 level and ``bucket_size`` 0.
    ``scratch``: int8 [numel] for unpacked codes, allocated when None."""
    packed = _flat(packed, "packed", torch.uint8)
    norms = _flat(norms, "norms", torch.float32)
    bits = tuple(_check_bits(b) for b in segments.per_segment(bits, "bits"))
    level_values = tuple(_check_levels(v) for v in segments.per_segment(levels, "levels"))
    byte_starts, total_bytes = segments.byte_starts(bits)
    norm_starts, total_norms = segments.norm_starts(bucket_size)
    if packed.numel() != total_bytes:
        raise ValueError(f"packed has {packed.numel()} bytes, expected {total_bytes}")
    if norms.numel() != total_norms:
        raise ValueError(f"norms has {norms.numel()} elements, expected {total_norms}")
    if add and out is None:
        raise ValueError("add=True needs out")
    out, result = _out(out, segments.numel, torch.float32, segments.device)
    if not segments.numel:
        return result
    if scratch is None:
        scratch = torch.empty(segments.numel, dtype=torch.int8, device=out.device)
    _backend(out).dequantize_segments(
        norms, packed, segments.starts, segments.sizes, norm_starts, byte_starts,
        segments.int_table("bits", bits), segments.int_table("levels", level_values),
        _int(bucket_size, "bucket_size"), bool(add), scratch, out)
    return result


def terngrad_quantize_segments(x, segments: Segments, seeds):
    """:func:`terngrad_quantize` of each segment: ``(scales, t)``, one scale per segment."""
    x = _flat(x, "x", torch.float32)
    segments.check(x)
    scales = torch.zeros(segments.count, dtype=torch.float32, device=x.device)
    t = torch.empty(x.numel(), dtype=torch.int8, device=x.device)
    if not x.numel():
        return scales, t
    _backend(x).terngrad_quantize_segments(x, segments.starts, segments.sizes,
                                           segments.keys(seeds), scales, t)
    return scales, t


def sign_pack_segments(x, segments: Segments):
    """:func:`sign_pack` of each segment, laid end to end (each starts on a byte)."""
    x = _flat(x, "x", torch.float32)
    segments.check(x)
    byte_starts, total = segments.byte_starts(1)
    out = torch.empty(total, dtype=torch.uint8, device=x.device)
    if not x.numel():
        return out
    _backend(x).sign_pack_segments(x, segments.starts, segments.sizes, byte_starts, out)
    return out


def sign_unpack_segments(packed, segments: Segments, high, low, out=None):
    """Segment s of the bucket: ``high[s]`` where its bit is set, ``low[s]`` where not
    (float32 tensors of one value per segment; ``sign_unpack(p, d, scale)`` is high = scale,
    low = -scale)."""
    packed = _flat(packed, "packed", torch.uint8)
    byte_starts, total = segments.byte_starts(1)
    if packed.numel() != total:
        raise ValueError(f"packed has {packed.numel()} bytes, expected {total}")
    high = _flat(high, "high", torch.float32)
    low = _flat(low, "low", torch.float32)
    if high.numel() != segments.count or low.numel() != segments.count:
        raise ValueError("high and low need one value per segment")
    out, result = _out(out, segments.numel, torch.float32, segments.device)
    if not segments.numel:
        return result
    _backend(packed).sign_unpack_segments(packed, segments.starts, segments.sizes, byte_starts,
                                          high, low, out)
    return result


def sign_vote_segments(packed_rows, segments: Segments, out=None):
    """:func:`sign_vote` of each segment; ``packed_rows``: uint8 [workers, bucket's bytes]."""
    p = packed_rows
    if not isinstance(p, torch.Tensor) or p.dtype != torch.uint8 or not p.is_contiguous():
        raise TypeError("packed_rows must be a contiguous uint8 torch.Tensor")
    if p.dim() == 1:
        p = p.view(1, -1)
    byte_starts, total = segments.byte_starts(1)
    if p.dim() != 2 or p.shape[1] != total:
        raise ValueError(f"packed_rows must be [workers, {total}]")
    out, result = _out(out, segments.numel, torch.float32, segments.device)
    if not segments.numel:
        return result
    if p.shape[0] == 0:
        out.fill_(1.0)
        return result
    _backend(p).sign_vote_segments(p, segments.starts, segments.sizes, byte_starts, out)
    return result


def _selection(x, segments: Segments, ks):
    """What a per-segment selection starts from: `x` checked and flat, the segments' k
    table (`Segments.k_starts`), and the empty index and value outputs."""
    x = _flat(x, "x", torch.float32)
    segments.check(x)
    table = segments.k_starts(ks)
    total = table[2]
    idx = torch.empty(total, dtype=torch.int64, device=x.device)
    vals = torch.empty(total, dtype=torch.float32, device=x.device)
    return x, table, idx, vals


def topk_segments(x, segments: Segments, ks):
    """:func:`topk` of each segment (``ks``: an int or one per segment, clipped to its size):
    ``(indices, values)`` laid end to end, indices into the bucket, ascending per segment.
    On a GPU it is ``torch.topk`` per segment, all on the device (no synchronisation; among
    equal magnitudes the pick is torch's, not necessarily the lowest index). The CPU runs
    the exact selection of :func:`topk` on each segment, in one compiled loop."""
    x, (k_table, k_starts, total, ks), idx, vals = _selection(x, segments, ks)
    if not total:
        return idx, vals
    if not runs_on_gpu(x):
        _cpu.topk_segments(x, segments.starts, segments.sizes, k_table, k_starts, idx, vals)
        return idx, vals
    o = 0
    for lo, n, k in zip(segments.starts_list, segments.sizes_list, ks):
        if k:
            chosen = torch.topk(x[lo:lo + n].abs(), k, sorted=False).indices.sort().values
            torch.add(chosen, lo, out=idx[o:o + k])
            o += k
    torch.index_select(x, 0, idx, out=vals)
    return idx, vals


def randomk_segments(x, segments: Segments, ks, seeds):
    """:func:`randomk` of each segment with its own seed: ``(indices, values)`` laid end to
    end, indices into the bucket. The indices are those of :func:`randomk_indices` for each
    segment alone. On a GPU the keys are hashed and the k smallest chosen with torch ops on
    the device (``torch.topk``), which selects the same indices: the keys are distinct."""
    x, (k_table, k_starts, total, ks), idx, vals = _selection(x, segments, ks)
    if not total:
        return idx, vals
    if not runs_on_gpu(x):
        shifts, thresholds = segments.cached(("randomk", ks), lambda: _randomk_tables(segments, ks))
        _cpu.randomk_segments(x, segments.starts, segments.sizes, k_table, k_starts,
                              segments.keys(seeds), shifts, thresholds, idx, vals)
        return idx, vals
    keys = segments.keys(seeds)
    o = 0
    for s, (lo, n, k) in enumerate(zip(segments.starts_list, segments.sizes_list, ks)):
        if not k:
            continue
        if k == n:
            torch.arange(lo, lo + n, out=idx[o:o + k])
        else:
            chosen = torch.topk(randomk_keys(keys[s], n), k, largest=False, sorted=False).indices
            torch.add(chosen.sort().values, lo, out=idx[o:o + k])
        o += k
    torch.index_select(x, 0, idx, out=vals)
    return idx, vals


def _randomk_tables(segments, ks):
    shifts, thresholds = [], []
    for n, k in zip(segments.sizes_list, ks):
        if 0 < k < n:
            shifts.append([int(v) for v in _host.randomk_shifts(n)])
            thresholds.append([int(v) for v in _host.randomk_thresholds(n, k)])
        else:
            shifts.append([0, 0])
            thresholds.append([0, 0, 0])
    as_int64 = lambda rows: torch.from_numpy(np.array(rows, dtype=np.uint64).view(np.int64))  # noqa: E731
    return as_int64(shifts).to(segments.device), as_int64(thresholds).to(segments.device)


_MASK = {bits: (1 << (64 - bits)) - 1 for bits in range(64)}


def _shr(z, bits):
    """Logical right shift of int64 bit patterns (torch's >> is arithmetic)."""
    return (z >> bits) & _MASK[bits]


def _wrap(v: int) -> int:
    """A uint64 constant as the int64 of the same bits."""
    return v - (1 << 64) if v >= 1 << 63 else v


def randomk_keys(key, d: int):
    """Random-k's unique 63-bit sort keys of indices 0..d-1 (``_cpu._rk_key``) in torch int64
    arithmetic, on ``key``'s device: ``key`` is a 0-d int64 tensor holding the stream key's
    bits. Multiplication wraps modulo 2^64 in int64 as in uint64, so the bits are the same."""
    from ._random import _GAMMA_INT, _M1_INT, _M2_INT

    i = torch.arange(d, dtype=torch.int64, device=key.device)
    z = key + (i + 1) * _wrap(_GAMMA_INT)
    z = (z ^ _shr(z, 30)) * _wrap(_M1_INT)
    z = (z ^ _shr(z, 27)) * _wrap(_M2_INT)
    h = z ^ _shr(z, 31)
    sh_hi, sh_lo = (int(v) for v in _host.randomk_shifts(d))
    return (_shr(h, sh_hi) << sh_lo) | i
