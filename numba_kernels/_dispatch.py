"""Public functions: torch tensors in, torch tensors out.

Each function validates its arguments (dtype, contiguity, device, sizes,
ranges), allocates the outputs as torch tensors on the input's device and
calls the backend function of the same name: from :mod:`._cuda` (imported on
first use) for CUDA tensors, from :mod:`._cpu` otherwise.  Empty inputs
return empty outputs without calling a backend.
"""

from __future__ import annotations

import operator

import torch

from . import _cpu, _host
from ._random import seed_key


def _backend(t):
    if t.is_cuda:
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
