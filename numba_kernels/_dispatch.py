"""Host wrappers: torch tensors in, torch tensors out.

Each wrapper validates dtype / contiguity / device, makes zero-copy views
(CPU: ``tensor.detach().numpy()``; CUDA: ``numba.cuda.as_cuda_array``),
allocates the outputs as torch tensors on the input's device and launches the
CPU (:mod:`._cpu`) or CUDA (:mod:`._cuda`, imported lazily) kernel.  Empty
inputs return empty outputs without launching anything.
"""

from __future__ import annotations

import operator

import numpy as np
import torch

from . import _cpu
from ._random import seed_key

_cuda_mod = None
_STREAMS: dict = {}

_NP2TORCH = {
    np.dtype(np.float32): (torch.float32, None),
    np.dtype(np.float64): (torch.float64, None),
    np.dtype(np.int8): (torch.int8, None),
    np.dtype(np.uint8): (torch.uint8, None),
    np.dtype(np.int32): (torch.int32, None),
    np.dtype(np.int64): (torch.int64, None),
    np.dtype(np.uint32): (torch.int32, np.uint32),
    np.dtype(np.uint64): (torch.int64, np.uint64),
}


# ---------------------------------------------------------------------------
# plumbing
# ---------------------------------------------------------------------------


def _cuda():
    global _cuda_mod
    if _cuda_mod is None:
        from . import _cuda as mod

        _cuda_mod = mod
    return _cuda_mod


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


def _np(t):
    return t.detach().numpy()


def _dev(t):
    from numba import cuda

    return cuda.as_cuda_array(t.detach(), sync=False)


def _stream(t):
    """numba view of torch's current stream on t's device (cached)."""
    from numba import cuda

    s = torch.cuda.current_stream(t.device)
    ptr = s.cuda_stream
    ns = _STREAMS.get(ptr)
    if ns is None:
        ns = cuda.external_stream(ptr)
        _STREAMS[ptr] = ns
    return ns


class _on_device:
    """Make the numba current device match the tensor's device."""

    def __init__(self, t):
        self.idx = t.device.index if t.device.index is not None else torch.cuda.current_device()
        self.ctx = None

    def __enter__(self):
        from numba import cuda

        if cuda.get_current_device().id != self.idx:
            self.ctx = cuda.gpus[self.idx]
            self.ctx.__enter__()
        return self

    def __exit__(self, *exc):
        if self.ctx is not None:
            self.ctx.__exit__(*exc)
        return False


def _torch_alloc(device):
    def alloc(n, dtype):
        tdt, view = _NP2TORCH[np.dtype(dtype)]
        t = torch.empty(int(n), dtype=tdt, device=device)
        a = _dev(t)
        return a.view(view) if view is not None else a

    return alloc


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


def _seed(seed):
    return seed_key(_int(seed, "seed"))


def _num_buckets(d, bucket_size):
    if d == 0:
        return 0, 1
    bs = d if bucket_size is None or bucket_size <= 0 or bucket_size > d else int(bucket_size)
    return -(-d // bs), bs


def _int(v, name):
    """Python int from an int-like (int, NumPy integer, integer 1-element tensor)."""
    if isinstance(v, bool):
        raise TypeError(f"{name} must be an int, got bool")
    try:
        return operator.index(v)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(v).__name__}") from None


def _check_levels(levels):
    levels = _int(levels, "levels")
    if not 1 <= levels <= 127:
        raise ValueError(f"levels must be in [1, 127], got {levels}")
    return int(levels)


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
    nb, bs = _num_buckets(d, None if bucket_size is None else _int(bucket_size, "bucket_size"))
    norms = torch.empty(nb, dtype=torch.float32, device=x.device)
    q = torch.empty(d, dtype=torch.int8, device=x.device)
    if d == 0:
        return norms, q
    if x.is_cuda:
        with _on_device(x):
            _cuda().qsgd_quantize(
                _dev(x), levels, bs, key, _dev(norms), _dev(q), _stream(x), _torch_alloc(x.device)
            )
    else:
        _cpu.qsgd_quantize(_np(x), levels, bs, key, norms.numpy(), q.numpy())
    return norms, q


def qsgd_dequantize(norms, q, levels: int, bucket_size: int, out=None):
    """Inverse of :func:`qsgd_quantize`: ``out[k] = q[k] * (norm_b / levels)``
    (float32 [d]).  ``out`` may be given (float32 [d], same device)."""
    levels = _check_levels(levels)
    q = _flat(q, "q", torch.int8)
    norms = _flat(norms, "norms", torch.float32)
    _same_device(q, norms, "norms")
    d = q.numel()
    nb, bs = _num_buckets(d, None if bucket_size is None else _int(bucket_size, "bucket_size"))
    if norms.numel() != nb:
        raise ValueError(f"norms has {norms.numel()} elements, expected {nb} buckets")
    out, result = _out(out, d, torch.float32, q.device)
    if d == 0:
        return result
    if q.is_cuda:
        with _on_device(q):
            _cuda().qsgd_dequantize(_dev(norms), _dev(q), levels, bs, _dev(out), _stream(q))
    else:
        _cpu.qsgd_dequantize(_np(norms), _np(q), levels, bs, _np(out))
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
    t = torch.empty(d, dtype=torch.int8, device=x.device)
    if d == 0:
        return torch.zeros(1, dtype=torch.float32, device=x.device), t
    if x.is_cuda:
        scale = torch.empty(1, dtype=torch.float32, device=x.device)
        with _on_device(x):
            _cuda().terngrad_quantize(_dev(x), key, _dev(scale), _dev(t), _stream(x))
    else:
        xn = _np(x)
        m = _cpu.max_abs(xn.view(np.uint32))
        _cpu.terngrad_quantize(xn, m, key, t.numpy())
        scale = torch.tensor([m], dtype=torch.float32)
    return scale, t


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


def _scale_float(scale):
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1:
            raise ValueError("scale must have exactly one element")
        return np.float32(scale.item())
    return np.float32(scale)


def terngrad_dequantize(scale, t, out=None):
    """``out = scale * t`` (float32 [d]); ``scale`` is the [1] tensor (or a
    float) returned by :func:`terngrad_quantize`."""
    t = _flat(t, "t", torch.int8)
    d = t.numel()
    out, result = _out(out, d, torch.float32, t.device)
    if d == 0:
        return result
    if t.is_cuda:
        s = _scale_tensor(scale, t.device)
        with _on_device(t):
            _cuda().scale_int8(_dev(t), _dev(s), _dev(out), _stream(t))
    else:
        _cpu.scale_int8(_np(t), _scale_float(scale), _np(out))
    return result


# ---------------------------------------------------------------------------
# signs
# ---------------------------------------------------------------------------


def sign_pack(x):
    """Pack signs: uint8 [ceil(d/8)], bit j of byte i is 1 iff
    ``x[8i+j] >= 0`` (zeros count as +, NaN as -); unused high bits are 0."""
    x = _flat(x, "x", torch.float32)
    d = x.numel()
    out = torch.empty((d + 7) // 8, dtype=torch.uint8, device=x.device)
    if d == 0:
        return out
    if x.is_cuda:
        with _on_device(x):
            _cuda().sign_pack(_dev(x), _dev(out), _stream(x))
    else:
        _cpu.sign_pack(_np(x), out.numpy())
    return out


def _check_d(d, name="d"):
    d = _int(d, name)
    if d < 0:
        raise ValueError(f"{name} must be non-negative")
    return d


def sign_unpack(packed, d: int, scale=1.0, out=None):
    """Unpack to float32 [d] of ``+scale`` (bit set) / ``-scale``.  ``scale``
    is a Python float or a 1-element tensor."""
    packed = _flat(packed, "packed", torch.uint8)
    d = _check_d(d)
    if packed.numel() != (d + 7) // 8:
        raise ValueError(f"packed has {packed.numel()} bytes, expected {(d + 7) // 8}")
    out, result = _out(out, d, torch.float32, packed.device)
    if d == 0:
        return result
    if packed.is_cuda:
        s = _scale_tensor(scale, packed.device)
        with _on_device(packed):
            _cuda().sign_unpack(_dev(packed), _dev(s), _dev(out), _stream(packed))
    else:
        _cpu.sign_unpack(_np(packed), d, _scale_float(scale), _np(out))
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
    if p.shape[1] != (d + 7) // 8:
        raise ValueError(f"packed rows have {p.shape[1]} bytes, expected {(d + 7) // 8}")
    out, result = _out(out, d, torch.float32, p.device)
    if d == 0:
        return result
    if p.shape[0] == 0:
        out.fill_(1.0)
        return result
    if p.is_cuda:
        with _on_device(p):
            _cuda().sign_vote(_dev(p), _dev(out), _stream(p))
    else:
        _cpu.sign_vote(_np(p), d, _np(out))
    return result


# ---------------------------------------------------------------------------
# bit packing
# ---------------------------------------------------------------------------


def code_bits(levels: int) -> int:
    """Bits of the two's-complement codes in [-levels, levels]: 2 for TernGrad's {-1, 0, 1},
    6 for 16 QSGD levels, 8 for 127."""
    levels = _check_levels(levels)
    return levels.bit_length() + 1


def _check_bits(bits):
    bits = _int(bits, "bits")
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in [1, 8], got {bits}")
    return int(bits)


def packed_size(d: int, bits: int) -> int:
    """Bytes of ``d`` codes of ``bits`` bits: ``ceil(d * bits / 8)``."""
    return (_check_d(d) * _check_bits(bits) + 7) // 8


def pack_codes(q, bits: int):
    """Pack int8 codes in ``[-2^(bits-1), 2^(bits-1))`` into a little-endian bit stream of
    ``bits`` bits each: uint8 [ceil(d * bits / 8)]; code k occupies bits ``[k*bits,
    (k+1)*bits)``, unused high bits are 0.  Codes outside the range keep only their low
    ``bits`` bits.  ``bits`` is 1 to 8."""
    q = _flat(q, "q", torch.int8)
    bits = _check_bits(bits)
    out = torch.empty(packed_size(q.numel(), bits), dtype=torch.uint8, device=q.device)
    if q.numel() == 0:
        return out
    if q.is_cuda:
        with _on_device(q):
            _cuda().pack_codes(_dev(q), bits, _dev(out), _stream(q))
    else:
        _cpu.pack_codes(_np(q), bits, out.numpy())
    return out


def unpack_codes(packed, d: int, bits: int, out=None):
    """Inverse of :func:`pack_codes`: int8 [d], sign-extended from ``bits`` bits."""
    packed = _flat(packed, "packed", torch.uint8)
    bits = _check_bits(bits)
    d = _check_d(d)
    if packed.numel() != packed_size(d, bits):
        raise ValueError(f"packed has {packed.numel()} bytes, expected {packed_size(d, bits)}")
    out, result = _out(out, d, torch.int8, packed.device)
    if d == 0:
        return result
    if packed.is_cuda:
        with _on_device(packed):
            _cuda().unpack_codes(_dev(packed), bits, _dev(out), _stream(packed))
    else:
        _cpu.unpack_codes(_np(packed), bits, _np(out))
    return result


# ---------------------------------------------------------------------------
# sparsification
# ---------------------------------------------------------------------------


def _clip_k(k, d):
    return max(0, min(_int(k, "k"), d))


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
    if x.is_cuda:
        with _on_device(x):
            _cuda().topk(_dev(x), k, _dev(idx), _dev(vals), _stream(x), _torch_alloc(x.device))
    else:
        xn = _np(x)
        _cpu.topk(xn, xn.view(np.uint32), k, idx.numpy(), vals.numpy())
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
    key = _seed(seed)
    if device.type == "cuda":
        with _on_device(idx):
            _cuda().randomk_indices(d, k, key, _dev(idx), _stream(idx), _torch_alloc(idx.device))
    else:
        sh_hi, sh_lo = _cpu.randomk_shifts(d)
        T = [np.uint64(_cpu.randomk_threshold(d, k, b)) for b in (1.0, 4.0, float("inf"))]
        _cpu.randomk(key, d, k, sh_hi, sh_lo, T[0], T[1], T[2], idx.numpy())
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
        if x.is_cuda:
            with _on_device(x):
                _cuda().gather(_dev(x), _dev(idx), _dev(vals), _stream(x))
        else:
            _cpu.gather_values(_np(x), idx.numpy(), vals.numpy())
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
    if indices.numel() == 0:
        return result
    if indices.is_cuda:
        with _on_device(indices):
            _cuda().scatter(_dev(indices), _dev(values), _dev(out), accumulate, _stream(indices))
    else:
        fn = _cpu.scatter_add if accumulate else _cpu.scatter_set
        bad = fn(_np(indices), _np(values), _np(out))
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
    # an input aliasing out must be consumed by the first pass
    if len(xs) > 4:
        ptr = out.data_ptr()
        for i in range(4, len(xs)):
            if xs[i].data_ptr() == ptr:
                xs[0], xs[i] = xs[i], xs[0]
                weights[0], weights[i] = weights[i], weights[0]
                break
    if out.is_cuda:
        with _on_device(out):
            _cuda().weighted_sum([_dev(t) for t in xs], weights, _dev(out), _stream(out))
        return result
    arrs = [_np(t) for t in xs]
    on = _np(out)
    w = [np.float32(v) for v in weights]
    which = 0 if d > _cpu.CHUNK else 1  # parallel / serial kernel
    n = len(arrs)
    first = min(4, n)
    _cpu.WSUM[first][which](*_interleave(arrs[:first], w[:first]), on)
    j = first
    while j < n:
        m = min(3, n - j)
        _cpu.WSUM[m + 1][which](on, np.float32(1.0), *_interleave(arrs[j : j + m], w[j : j + m]), on)
        j += m
    return result


def _interleave(arrs, ws):
    r = []
    for a, w in zip(arrs, ws):
        r += [a, w]
    return r
