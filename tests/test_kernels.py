"""CPU kernels of numba_kernels against plain NumPy references.

The references below are written from the algorithm descriptions (QSGD,
TernGrad, sign packing, top-k, random-k, ...) and the documented
counter-based RNG; they do not call into numba_kernels.
"""

from __future__ import annotations


import numpy as np
import pytest
import torch


import numba_kernels as nk

SIZES = [0, 1, 7, 8, 9, 1000, 1003]
MASK64 = (1 << 64) - 1
GAMMA = 0x9E3779B97F4A7C15


# ---------------------------------------------------------------------------
# NumPy references
# ---------------------------------------------------------------------------


def _mix_int(z):
    z &= MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def ref_hash(seed, idx):
    """SplitMix64 element idx of the stream keyed by mix(seed + GAMMA)."""
    key = np.uint64(_mix_int((seed + GAMMA) & MASK64))
    with np.errstate(over="ignore"):
        z = key + (np.asarray(idx, np.uint64) + np.uint64(1)) * np.uint64(GAMMA)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def ref_uniform(seed, n):
    return (ref_hash(seed, np.arange(n)) >> np.uint64(40)).astype(np.float64) / 2.0**24


def ref_buckets(d, bucket_size):
    bs = d if bucket_size <= 0 or bucket_size > d else bucket_size
    return max(bs, 1), (-(-d // bs) if d else 0)


def ref_qsgd(x, levels, bucket_size, seed):
    d = x.size
    bs, nb = ref_buckets(d, bucket_size)
    norms = np.array(
        [np.sqrt(np.sum(x[b * bs : (b + 1) * bs].astype(np.float64) ** 2)) for b in range(nb)],
        dtype=np.float32,
    )
    q = np.zeros(d, np.int8)
    if d == 0:
        return norms, q
    u = ref_uniform(seed, d)
    b_of = np.arange(d) // bs
    nrm = norms[b_of]
    with np.errstate(divide="ignore"):
        scale = np.where(nrm > 0, np.float32(levels) / nrm, np.float32(0)).astype(np.float32)
    a = np.minimum(np.abs(x).astype(np.float64) * scale.astype(np.float64), levels)
    lvl = np.floor(a) + (u < a - np.floor(a))
    q = (np.sign(x) * lvl).astype(np.int8)
    return norms, q


def ref_terngrad(x, seed):
    if x.size == 0:
        return np.float32(0), np.zeros(0, np.int8)
    s = np.float32(np.max(np.abs(x)))
    u = ref_uniform(seed, x.size)
    keep = u * np.float64(s) < np.abs(x).astype(np.float64)
    return s, (np.sign(x) * keep).astype(np.int8)


def ref_topk(x, k):
    k = max(0, min(k, x.size))
    order = np.argsort(-np.abs(x).astype(np.float64), kind="stable")  # ties: lowest index
    return np.sort(order[:k])


def ref_randomk(d, k, seed):
    """k smallest unique keys (hash prefix | index bits)."""
    k = max(0, min(k, d))
    if k == 0:
        return np.zeros(0, np.int64)
    lo = max(0, (d - 1).bit_length())
    i = np.arange(d, dtype=np.uint64)
    keys = ((ref_hash(seed, i) >> np.uint64(lo + 1)) << np.uint64(lo)) | i
    return np.sort(np.argsort(keys, kind="stable")[:k]).astype(np.int64)


def t(a):
    return torch.from_numpy(np.ascontiguousarray(a))


def rand(d, seed=0):
    return np.random.default_rng(seed).standard_normal(d).astype(np.float32)


# ---------------------------------------------------------------------------
# QSGD
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("d", SIZES)
@pytest.mark.parametrize("bucket_size", [0, 1, 8, 100, 512])
@pytest.mark.parametrize("levels", [1, 4, 127])
def test_qsgd_matches_reference(d, bucket_size, levels):
    x = rand(d, d)
    norms, q = nk.qsgd_quantize(t(x), levels, bucket_size, seed=11)
    rn, rq = ref_qsgd(x, levels, bucket_size, 11)
    assert norms.dtype == torch.float32 and q.dtype == torch.int8
    assert norms.shape == rn.shape and q.shape == (d,)
    np.testing.assert_array_equal(norms.numpy(), rn)
    np.testing.assert_array_equal(q.numpy(), rq)
    assert np.abs(rq).max(initial=0) <= levels
    out = nk.qsgd_dequantize(norms, q, levels, bucket_size)
    bs, _ = ref_buckets(d, bucket_size)
    expect = rn[np.arange(d) // bs] * rq.astype(np.float32) / np.float32(levels)
    np.testing.assert_allclose(out.numpy(), expect, rtol=1e-6, atol=0)


def test_qsgd_large_bucket_two_pass_path():
    # buckets larger than the CPU chunk take the two-pass (norms, then quantise) path
    x = rand(200_003, 5)
    for bs in (0, 70_000):
        norms, q = nk.qsgd_quantize(t(x), 8, bs, seed=3)
        rn, rq = ref_qsgd(x, 8, bs, 3)
        np.testing.assert_allclose(norms.numpy(), rn, rtol=1e-6)
        assert (q.numpy() != rq).mean() < 1e-4  # identical up to norm rounding


def test_qsgd_zero_bucket_and_signs():
    x = np.zeros(20, np.float32)
    x[10:] = [1, -2, 3, -4, 0, 0, 5, -6, 7, -8]
    norms, q = nk.qsgd_quantize(t(x), 4, 10, seed=1)
    assert norms[0] == 0 and (q[:10] == 0).all()
    qn = q.numpy()[10:]
    assert ((np.sign(qn) == np.sign(x[10:])) | (qn == 0)).all()
    assert (qn[x[10:] == 0] == 0).all()


@pytest.mark.parametrize("levels", [1, 4, 16])
def test_qsgd_unbiased_and_variance_bound(levels):
    d, bs, n = 1003, 100, 3000
    x = rand(d, 1) * np.linspace(0.1, 3, d).astype(np.float32)
    xt = t(x)
    acc = np.zeros(d)
    acc2 = np.zeros(d)
    for s in range(n):
        norms, q = nk.qsgd_quantize(xt, levels, bs, seed=1000 + s)
        y = nk.qsgd_dequantize(norms, q, levels, bs).numpy().astype(np.float64)
        acc += y
        acc2 += y * y
    mean = acc / n
    var = acc2 / n - mean**2
    # exact per-element variance of the stochastic rounding
    nrm = ref_qsgd(x, levels, bs, 0)[0][np.arange(d) // bs].astype(np.float64)
    a = np.abs(x) / nrm * levels
    p = a - np.floor(a)
    var_true = (nrm / levels) ** 2 * p * (1 - p)
    tol = 6 * np.sqrt(var_true / n) + 1e-6
    assert np.all(np.abs(mean - x) <= tol), np.max(np.abs(mean - x) - tol)
    # QSGD bound E||Q(v) - v||^2 <= min(d/s^2, sqrt(d)/s) ||v||^2, per bucket
    for b in range(-(-d // bs)):
        sl = slice(b * bs, (b + 1) * bs)
        db = x[sl].size
        bound = min(db / levels**2, np.sqrt(db) / levels) * float(np.sum(x[sl].astype(np.float64) ** 2))
        assert var[sl].sum() <= bound * 1.05
        # the empirical total variance matches the exact one (wrong rounding
        # probabilities would break this even when the mean looks right)
        assert abs(var[sl].sum() - var_true[sl].sum()) <= 0.15 * var_true[sl].sum() + 1e-9


def test_qsgd_determinism_and_seed_dependence():
    x = t(rand(1003, 2))
    _, q1 = nk.qsgd_quantize(x, 4, 64, seed=7)
    _, q2 = nk.qsgd_quantize(x, 4, 64, seed=7)
    _, q3 = nk.qsgd_quantize(x, 4, 64, seed=8)
    assert torch.equal(q1, q2)
    assert not torch.equal(q1, q3)


def test_qsgd_validation():
    x = t(rand(10))
    for bad in (0, 128, -1):
        with pytest.raises(ValueError):
            nk.qsgd_quantize(x, bad, 4, 0)
    with pytest.raises(TypeError):
        nk.qsgd_quantize(x.double(), 4, 4, 0)
    with pytest.raises(ValueError):
        nk.qsgd_quantize(torch.randn(4, 4).t(), 4, 4, 0)
    norms, q = nk.qsgd_quantize(x, 4, 4, 0)
    with pytest.raises(ValueError):
        nk.qsgd_dequantize(norms[:-1], q, 4, 4)


# ---------------------------------------------------------------------------
# TernGrad
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("d", SIZES)
def test_terngrad_matches_reference(d):
    x = rand(d, d + 1)
    scale, tq = nk.terngrad_quantize(t(x), seed=5)
    rs, rt = ref_terngrad(x, 5)
    assert scale.shape == (1,) and scale.dtype == torch.float32 and tq.dtype == torch.int8
    assert scale.item() == rs
    np.testing.assert_array_equal(tq.numpy(), rt)
    out = nk.terngrad_dequantize(scale, tq)
    np.testing.assert_array_equal(out.numpy(), rs * rt.astype(np.float32))
    np.testing.assert_array_equal(nk.terngrad_dequantize(float(rs), tq).numpy(), out.numpy())


def test_terngrad_unbiased():
    d, n = 1003, 4000
    x = rand(d, 3)
    xt = t(x)
    acc = np.zeros(d)
    for s in range(n):
        scale, tq = nk.terngrad_quantize(xt, seed=s)
        acc += nk.terngrad_dequantize(scale, tq).numpy()
    s = np.abs(x).max().astype(np.float64)
    var = s * np.abs(x) - x.astype(np.float64) ** 2
    assert np.all(np.abs(acc / n - x) <= 6 * np.sqrt(var / n) + 1e-6)


def test_terngrad_zero_and_determinism():
    scale, tq = nk.terngrad_quantize(torch.zeros(9), seed=1)
    assert scale.item() == 0 and (tq == 0).all()
    x = t(rand(1000))
    assert torch.equal(nk.terngrad_quantize(x, 4)[1], nk.terngrad_quantize(x, 4)[1])
    assert not torch.equal(nk.terngrad_quantize(x, 4)[1], nk.terngrad_quantize(x, 5)[1])


# ---------------------------------------------------------------------------
# signs
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("d", SIZES + [64, 65, 100_003])
def test_sign_pack_unpack(d):
    x = rand(d, d)
    if d > 3:
        x[:3] = [0.0, -0.0, -1e-30]
    packed = nk.sign_pack(t(x))
    ref = np.packbits(x >= 0, bitorder="little")
    assert packed.dtype == torch.uint8 and packed.shape == ((d + 7) // 8,)
    np.testing.assert_array_equal(packed.numpy(), ref)
    out = nk.sign_unpack(packed, d, 2.5)
    np.testing.assert_array_equal(out.numpy(), np.where(x >= 0, 2.5, -2.5).astype(np.float32))
    out2 = nk.sign_unpack(packed, d, torch.tensor([0.5]), out=torch.empty(d))
    np.testing.assert_array_equal(out2.numpy(), np.where(x >= 0, 0.5, -0.5).astype(np.float32))


def ref_pack_codes(q, bits):
    """Each code's low `bits` bits, least significant first, as one little-endian bit stream."""
    codes = q.astype(np.int64) & ((1 << bits) - 1)
    stream = (codes[:, None] >> np.arange(bits)) & 1
    return np.packbits(stream.reshape(-1).astype(np.uint8), bitorder="little")


@pytest.mark.parametrize("d", SIZES + [64, 65, 100_003])
@pytest.mark.parametrize("bits", range(1, 9))
def test_pack_codes_round_trip(d, bits):
    rng = np.random.default_rng(d * 8 + bits)
    q = rng.integers(-(1 << (bits - 1)), 1 << (bits - 1), d).astype(np.int8)
    packed = nk.pack_codes(t(q), bits)
    assert packed.dtype == torch.uint8 and packed.numel() == nk.packed_size(d, bits)
    np.testing.assert_array_equal(packed.numpy(), ref_pack_codes(q, bits))
    np.testing.assert_array_equal(nk.unpack_codes(packed, d, bits).numpy(), q)
    out = torch.full((d,), 99, dtype=torch.int8)
    assert nk.unpack_codes(packed, d, bits, out=out) is out
    np.testing.assert_array_equal(out.numpy(), q)


@pytest.mark.parametrize("levels, bits", [(1, 2), (3, 3), (4, 4), (7, 4), (8, 5), (16, 6), (127, 8)])
def test_code_bits_hold_every_quantization_level(levels, bits):
    assert nk.code_bits(levels) == bits
    q = torch.arange(-levels, levels + 1, dtype=torch.int8)
    assert torch.equal(nk.unpack_codes(nk.pack_codes(q, bits), q.numel(), bits), q)


@pytest.mark.parametrize("d", SIZES + [70_001, 300_000])
@pytest.mark.parametrize("bucket_size", [0, 8, 512, 70_000, 100, 7])
@pytest.mark.parametrize("levels", [1, 3, 16, 127])
def test_dequantize_add_is_the_three_passes_in_one(d, bucket_size, levels):
    """out += codes · (norm / levels), decoded from the packed stream: bit for bit what
    unpacking, dequantizing and adding give (buckets of whole groups of 8 codes take the
    fused kernel, the others those three passes)."""
    bits = nk.code_bits(levels)
    x = torch.randn(d, generator=torch.Generator().manual_seed(d + levels))
    norms, q = nk.qsgd_quantize(x, levels, bucket_size, 11)
    base = torch.randn(d, generator=torch.Generator().manual_seed(bucket_size))
    expected = base + nk.qsgd_dequantize(norms, q, levels, bucket_size)
    out = base.clone()
    assert nk.dequantize_add(norms, nk.pack_codes(q, bits), bits, levels, bucket_size, out) is out
    assert torch.equal(out, expected)


def test_dequantize_add_decodes_terngrad_as_one_level_one_bucket():
    x = torch.randn(100_003, generator=torch.Generator().manual_seed(2))
    scale, ternary = nk.terngrad_quantize(x, 9)
    out = torch.ones(100_003)
    nk.dequantize_add(scale, nk.pack_codes(ternary, 2), 2, 1, 0, out)
    assert torch.equal(out, 1 + nk.terngrad_dequantize(scale, ternary))


def test_dequantize_add_validation():
    packed = nk.pack_codes(torch.zeros(16, dtype=torch.int8), 6)
    with pytest.raises(ValueError, match="expected 2 buckets"):
        nk.dequantize_add(torch.ones(3), packed, 6, 16, 8, torch.zeros(16))
    with pytest.raises(ValueError, match="expected 9"):
        nk.dequantize_add(torch.ones(1), packed, 6, 16, 0, torch.zeros(12))
    with pytest.raises(ValueError, match="float32"):
        nk.dequantize_add(torch.ones(1), packed, 6, 16, 0, torch.zeros(16, dtype=torch.float64))


def test_pack_codes_rejects_bad_widths_and_sizes():
    with pytest.raises(ValueError, match="bits must be in"):
        nk.pack_codes(torch.zeros(3, dtype=torch.int8), 9)
    with pytest.raises(ValueError, match="expected 3"):
        nk.unpack_codes(torch.zeros(2, dtype=torch.uint8), 8, 3)


@pytest.mark.parametrize("d", SIZES + [100_003])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 7, 16])
def test_sign_vote(d, n):
    rng = np.random.default_rng(d * 31 + n)
    xs = rng.standard_normal((n, d)).astype(np.float32)
    packed = torch.stack([nk.sign_pack(t(row)) for row in xs]) if d else torch.zeros(n, 0, dtype=torch.uint8)
    out = nk.sign_vote(packed, d)
    pos = (xs >= 0).sum(0)
    np.testing.assert_array_equal(out.numpy(), np.where(2 * pos >= n, 1.0, -1.0).astype(np.float32))


def test_sign_vote_tie_goes_positive():
    a = nk.sign_pack(torch.ones(9))
    b = nk.sign_pack(-torch.ones(9))
    assert (nk.sign_vote(torch.stack([a, b]), 9) == 1).all()
    assert (nk.sign_vote(torch.stack([a, b, b]), 9) == -1).all()


# ---------------------------------------------------------------------------
# top-k / random-k / scatter
# ---------------------------------------------------------------------------


def _ks(d):
    return sorted({0, 1, 3, d // 2, d - 1, d, d + 5, -2})


@pytest.mark.parametrize("d", SIZES)
def test_topk_exact(d):
    x = rand(d, d + 7)
    for k in _ks(d):
        idx, vals = nk.topk(t(x), k)
        ref = ref_topk(x, k)
        assert idx.dtype == torch.int64 and vals.dtype == torch.float32
        np.testing.assert_array_equal(idx.numpy(), ref)
        np.testing.assert_array_equal(vals.numpy(), x[ref])


@pytest.mark.parametrize("d,k", [(200_003, 1), (200_003, 2000), (200_003, 150_000), (1 << 20, 10_000)])
def test_topk_sampled_threshold_path(d, k):
    x = rand(d, k) * np.exp(rand(d, k + 1))  # heavy-ish tails
    idx, vals = nk.topk(t(x), k)
    np.testing.assert_array_equal(idx.numpy(), ref_topk(x, k))
    np.testing.assert_array_equal(vals.numpy(), x[idx.numpy()])


def test_topk_ties_and_specials():
    rng = np.random.default_rng(0)
    for d in (1003, 150_001):
        x = rng.integers(-3, 4, d).astype(np.float32)  # massive ties
        for k in (1, 10, d // 3, d // 2):
            idx, _ = nk.topk(t(x), k)
            np.testing.assert_array_equal(idx.numpy(), ref_topk(x, k))
    x = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1.0, -2.0], np.float32)
    idx, vals = nk.topk(t(x), 4)
    assert set(idx.tolist()) == {2, 3, 4, 6}  # NaN ranks as the largest magnitude
    z = torch.zeros(100)
    assert nk.topk(z, 10)[0].tolist() == list(range(10))


@pytest.mark.parametrize("d", SIZES + [200_003])
def test_randomk_reference_and_properties(d):
    x = rand(d, 3)
    for k in _ks(d):
        idx, vals = nk.randomk(t(x), k, seed=42)
        ref = ref_randomk(d, k, 42)
        np.testing.assert_array_equal(idx.numpy(), ref)
        np.testing.assert_array_equal(vals.numpy(), x[ref])
        kk = max(0, min(k, d))
        assert idx.numel() == kk and len(np.unique(idx.numpy())) == kk
        assert np.all(np.diff(idx.numpy()) > 0)
        # independent of x's values, same on every call
        assert torch.equal(nk.randomk_indices(d, k, 42, "cpu"), idx)
        assert torch.equal(nk.randomk(t(-x * 3), k, seed=42)[0], idx)
    if d >= 100:
        a = nk.randomk_indices(d, d // 10, 1)
        b = nk.randomk_indices(d, d // 10, 2)
        assert not torch.equal(a, b)


def test_randomk_uniform_and_unbiased():
    d, k, n = 1003, 50, 4000
    x = rand(d, 9)
    xt = t(x)
    acc = np.zeros(d)
    hits = np.zeros(d)
    for s in range(n):
        idx, vals = nk.randomk(xt, k, seed=s)
        dense = nk.scatter(idx, vals * (d / k), d).numpy()
        acc += dense
        hits[idx.numpy()] += 1
    p = k / d
    # inclusion frequencies ~ Binomial(n, k/d)
    assert np.all(np.abs(hits - n * p) <= 6 * np.sqrt(n * p * (1 - p)))
    chi2 = np.sum((hits - n * p) ** 2 / (n * p * (1 - p)))
    assert chi2 < d + 6 * np.sqrt(2 * d)
    var = x.astype(np.float64) ** 2 * (d / k - 1)
    assert np.all(np.abs(acc / n - x) <= 6 * np.sqrt(var / n) + 1e-6)


@pytest.mark.parametrize("d", SIZES)
def test_scatter(d):
    rng = np.random.default_rng(d)
    n = d // 2
    idx = np.sort(rng.choice(d, n, replace=False)).astype(np.int64) if d else np.zeros(0, np.int64)
    vals = rng.standard_normal(n).astype(np.float32)
    out = nk.scatter(t(idx), t(vals), d)
    ref = np.zeros(d, np.float32)
    ref[idx] = vals
    np.testing.assert_array_equal(out.numpy(), ref)
    # given out is zeroed first without accumulate
    out2 = nk.scatter(t(idx), t(vals), d, out=torch.full((d,), 7.0))
    np.testing.assert_array_equal(out2.numpy(), ref)
    # accumulate onto existing values, duplicates summed
    if d:
        dup = rng.integers(0, d, 3 * d).astype(np.int64)
        dv = rng.standard_normal(3 * d).astype(np.float32)
        base = rng.standard_normal(d).astype(np.float32)
        got = nk.scatter(t(dup), t(dv), d, out=t(base.copy()), accumulate=True)
        ref2 = base.astype(np.float64)
        np.add.at(ref2, dup, dv)
        np.testing.assert_allclose(got.numpy(), ref2, rtol=1e-5, atol=1e-5)


def test_scatter_out_of_range():
    with pytest.raises(IndexError):
        nk.scatter(torch.tensor([0, 5]), torch.ones(2), 5)
    with pytest.raises(IndexError):
        nk.scatter(torch.tensor([-1]), torch.ones(1), 5, accumulate=True)


# ---------------------------------------------------------------------------
# weighted sum
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("d", SIZES)
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8, 9])
def test_weighted_sum(d, n):
    rng = np.random.default_rng(d + n)
    xs = [rng.standard_normal(d).astype(np.float32) for _ in range(n)]
    ws = list(rng.standard_normal(n))
    ref = sum(np.float64(w) * x.astype(np.float64) for w, x in zip(ws, xs))
    out = nk.weighted_sum([t(x) for x in xs], ws)
    np.testing.assert_allclose(out.numpy(), ref, rtol=1e-5, atol=1e-5)
    # out aliasing an input (the first, or a later one)
    for j in sorted({0, n - 1}):
        ts = [t(x.copy()) for x in xs]
        got = nk.weighted_sum(ts, ws, out=ts[j])
        assert got.data_ptr() == ts[j].data_ptr()
        np.testing.assert_allclose(got.numpy(), ref, rtol=1e-5, atol=1e-5)


def test_weighted_sum_validation():
    with pytest.raises(ValueError):
        nk.weighted_sum([], [])
    with pytest.raises(ValueError):
        nk.weighted_sum([torch.ones(3), torch.ones(4)], [1, 1])
    with pytest.raises(ValueError):
        nk.weighted_sum([torch.ones(3)], [1, 2])


# ---------------------------------------------------------------------------
# misc
# ---------------------------------------------------------------------------


def test_empty_inputs():
    e = torch.zeros(0)
    norms, q = nk.qsgd_quantize(e, 4, 16, 0)
    assert norms.numel() == 0 and q.numel() == 0
    assert nk.qsgd_dequantize(norms, q, 4, 16).numel() == 0
    s, tq = nk.terngrad_quantize(e, 0)
    assert s.shape == (1,) and tq.numel() == 0
    assert nk.sign_pack(e).numel() == 0 and nk.sign_unpack(nk.sign_pack(e), 0).numel() == 0
    assert nk.sign_vote(torch.zeros(3, 0, dtype=torch.uint8), 0).numel() == 0
    i, v = nk.topk(e, 5)
    assert i.numel() == 0 and v.numel() == 0
    i, v = nk.randomk(e, 5, 0)
    assert i.numel() == 0 and v.numel() == 0
    assert nk.scatter(torch.zeros(0, dtype=torch.int64), e, 4).tolist() == [0, 0, 0, 0]
    assert nk.weighted_sum([e, e], [1.0, 2.0]).numel() == 0


def test_requires_grad_and_shaped_inputs():
    x = torch.randn(4, 25, requires_grad=True)
    norms, q = nk.qsgd_quantize(x, 4, 10, 0)
    assert q.shape == (100,) and norms.shape == (10,)
    idx, vals = nk.topk(x, 5)
    assert torch.equal(vals, x.detach().reshape(-1)[idx])


def test_derive_seed():
    a = nk.derive_seed(1, 2, 3)
    assert a == nk.derive_seed(1, 2, 3)
    assert len({a, nk.derive_seed(1, 2, 4), nk.derive_seed(1, 3, 2), nk.derive_seed(2, 2, 3)}) == 4
    assert 0 <= a < 2**64


# ---------------------------------------------------------------------------
# The tests' warm-up before they start workers
# ---------------------------------------------------------------------------


def _loaded_kernels() -> set[tuple[str, tuple]]:
    """(kernel, argument types) of every kernel this process has compiled or loaded."""
    from numba.core.dispatcher import Dispatcher

    from numba_kernels import _cpu

    dispatchers = []
    for value in vars(_cpu).values():
        value = getattr(value, "__wrapped__", value)  # a backend function's kernel
        if isinstance(value, Dispatcher):
            dispatchers.append(value)
        elif isinstance(value, dict):  # the copies per code width
            dispatchers += [v for v in value.values() if isinstance(v, Dispatcher)]
    return {(d.py_func.__qualname__, signature) for d in dispatchers for signature in d.overloads}


def _check_the_warm_up_covers_the_compressors() -> None:
    from importlib.metadata import entry_points

    from distributed import warm_numba_kernels

    warm_numba_kernels()
    warmed = _loaded_kernels()
    assert warmed  # the check below sees the kernels
    for entry in entry_points(group="dsgd.compressors"):
        compressor_class = entry.load()
        warm_up = getattr(compressor_class(compressor_class.Options()), "warm_up", None)
        if warm_up is not None:
            warm_up()
        assert _loaded_kernels() == warmed, f"{entry.name} loads kernels the warm-up did not"


def test_the_warm_up_before_workers_start_loads_every_compressors_kernels():
    """`distributed.run_workers` and `run_scenarios` warm the kernels up in the test process
    first, so that the workers of a fresh clone (numba's cache empty) load them rather than
    each compile them. A built-in compressor's own warm-up (what each worker runs) then loads
    nothing new. In a fresh process: this one may have loaded any kernel already."""
    import subprocess
    import sys
    from pathlib import Path

    tests = Path(__file__).resolve().parent
    check = (f"import sys; sys.path[:0] = [{str(tests)!r}, {str(tests.parent)!r}]; "
             "import test_kernels; test_kernels._check_the_warm_up_covers_the_compressors()")
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True,
                            cwd=tests.parent, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]


class _Stopped(Exception):
    pass


def test_the_test_helpers_warm_the_kernels_up_before_starting_workers(monkeypatch, tmp_path):
    import distributed

    events = []

    def start_nothing():
        events.append("workers start")
        raise _Stopped

    monkeypatch.setattr(distributed, "warm_numba_kernels", lambda: events.append("warm-up"))
    monkeypatch.setattr(distributed, "preloaded_context", start_nothing)
    with pytest.raises(_Stopped):
        distributed.run_workers(print, 2, preloaded=True)
    with pytest.raises(_Stopped):
        distributed.run_scenarios("test_kernels", 2, tmp_path, timeout=1)
    assert events == ["warm-up", "workers start"] * 2


def test_the_warm_up_waits_for_the_background_compilations(monkeypatch):
    """The test session starts compiling the kernels in background processes
    (`distributed.start_compiling_numba_kernels`); `warm_numba_kernels` loads them only once
    those have written numba's cache, instead of compiling them a second time beside them."""
    import distributed

    events = []

    class Compiling:
        def wait(self):
            events.append("compiled")

    monkeypatch.setattr(distributed, "_background_compiles", [Compiling(), Compiling()])
    monkeypatch.setattr(distributed, "warm_up_group", lambda index: events.append(f"load {index}"))
    distributed.warm_numba_kernels()
    assert events == ["compiled", "compiled", "load 0", "load 1"]
    assert distributed._background_compiles == []


def test_the_background_compilation_starts_only_where_the_cache_is_not_filled(monkeypatch,
                                                                              tmp_path):
    import os

    import distributed

    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path))
    assert not distributed._kernel_cache_is_filled()  # a fresh clone's: empty
    index = tmp_path / "numba_kernels_0" / "_cpu.topk-1.py311.nbi"
    index.parent.mkdir()
    index.touch()
    assert distributed._kernel_cache_is_filled()
    os.utime(index, (0, 0))  # written before the kernels' sources last changed
    assert not distributed._kernel_cache_is_filled()
