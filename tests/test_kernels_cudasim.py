"""CUDA kernels of numba_kernels under numba's CUDA simulator.

numba reads NUMBA_ENABLE_CUDASIM when it is imported, so the checks run in
subprocesses with the variable set (the script is below; it runs the checks
named on its command line): two at once, each keeping one core busy.  Each
pytest test then reports one named check.  Under the simulator there are no
CUDA torch tensors, so the script calls the backend functions of
``numba_kernels._cuda`` on CPU tensors (which stand in for CUDA tensors there)
and compares with NumPy references and with the CPU kernels -- the random
decisions must be bit-identical.  Sizes stay small: the simulator runs every
GPU thread as a Python thread.  ``shared_cases_match_cpu`` runs the cases of
``numba_kernels/crosscheck.py``, the same that ``benchmarks/gpu_check.py`` runs on a GPU at
real sizes, and fails when a kernel of ``numba_kernels._cuda`` is launched by none of them.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = r'''
import json, sys, traceback, warnings
sys.setswitchinterval(5e-5)  # the simulator's barrier polling is GIL-bound
warnings.simplefilter("ignore", RuntimeWarning)  # uint64 wrap-around in NumPy scalars
import numpy as np
import torch
from numba import cuda
import numba_kernels as nk
from numba_kernels import _host, _random, _cuda as C

assert C.SIM, "not running under the CUDA simulator"


# The simulator's shared arrays, looked up under a lock (numba_kernels/crosscheck.py says why).
from numba_kernels import crosscheck
crosscheck.fix_simulator_shared_arrays()
results = {}
selected = set(sys.argv[1:])


def check(fn):
    if fn.__name__ not in selected:
        return fn
    try:
        fn()
        results[fn.__name__] = "ok"
    except Exception:
        results[fn.__name__] = traceback.format_exc()
    return fn


def rand(d, seed=0):
    return np.random.default_rng(seed).standard_normal(d).astype(np.float32)


def T(a):
    return torch.from_numpy(np.ascontiguousarray(a))


MASK64 = (1 << 64) - 1


def ref_hash(seed, idx):
    def mix(z):
        z &= MASK64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
        return z ^ (z >> 31)
    key = mix(seed + 0x9E3779B97F4A7C15)
    return np.array([mix(key + (int(i) + 1) * 0x9E3779B97F4A7C15) for i in idx], np.uint64)


@cuda.jit
def k_rng(key, base, out_u, out_h):
    i = cuda.grid(1)
    if i < out_u.size:
        out_u[i] = C._uniform(key, base + i)
        out_h[i] = C._hash64(key, base + i)


@check
def rng_bit_identical():
    for seed, base in ((0, 0), (12345, 2**40 - 7), (-3, 2**62)):
        key = _random.seed_key(seed)
        n = 300
        u = np.empty(n, np.float32)
        h = np.empty(n, np.uint64)
        k_rng[5, 64](key, np.int64(base), u, h)
        idx = np.arange(base, base + n, dtype=np.uint64)
        ref = ref_hash(seed, idx)
        np.testing.assert_array_equal(h, ref)
        np.testing.assert_array_equal(u, (ref >> np.uint64(40)).astype(np.float32) / np.float32(2**24))
        cpu = np.array([_random.uniform(key, int(i)) for i in idx], np.float32)
        np.testing.assert_array_equal(u, cpu)


@check
def qsgd_matches_cpu():
    for d, bs, levels in ((1, 0, 4), (9, 8, 127), (100, 100, 1), (1003, 100, 4),
                          (1003, 0, 127), (1003, 8, 2), (400, 300, 16)):
        x = rand(d, d + bs)
        if d > 20:
            x[10:20] = 0.0
        seed = 77 + d
        bsz = d if bs <= 0 else min(bs, d)
        nb = -(-d // bsz)
        norms = np.empty(nb, np.float32)
        q = np.empty(d, np.int8)
        C.qsgd_quantize(T(x), levels, bsz, _random.seed_key(seed), T(norms), T(q))
        cn, cq = nk.qsgd_quantize(T(x), levels, bs, seed)
        np.testing.assert_array_equal(norms, cn.numpy())
        np.testing.assert_array_equal(q, cq.numpy())
        out = np.empty(d, np.float32)
        C.qsgd_dequantize(T(norms), T(q), levels, bsz, T(out))
        np.testing.assert_array_equal(out, nk.qsgd_dequantize(cn, cq, levels, bs).numpy())


@check
def terngrad_matches_cpu():
    for d in (1, 9, 1003):
        x = rand(d, d)
        scale = np.empty(1, np.float32)
        t = np.empty(d, np.int8)
        C.terngrad_quantize(T(x), _random.seed_key(5), T(scale), T(t))
        cs, ct = nk.terngrad_quantize(T(x), 5)
        assert scale[0] == cs.item() == np.abs(x).max()
        np.testing.assert_array_equal(t, ct.numpy())
        out = np.empty(d, np.float32)
        C.scale_int8(T(t), T(scale), T(out))
        np.testing.assert_array_equal(out, scale[0] * t.astype(np.float32))


@check
def sign_pack_unpack_vote():
    for d in (1, 7, 8, 9, 100, 1003):
        x = rand(d, d)
        x[0] = 0.0
        p = np.empty((d + 7) // 8, np.uint8)
        C.sign_pack(T(x), T(p))
        np.testing.assert_array_equal(p, np.packbits(x >= 0, bitorder="little"))
        out = np.empty(d, np.float32)
        C.sign_unpack(T(p), torch.tensor([1.5]), T(out))
        np.testing.assert_array_equal(out, np.where(x >= 0, 1.5, -1.5).astype(np.float32))
        for n in (1, 2, 5):
            xs = np.stack([rand(d, 100 * d + w) for w in range(n)])
            P = np.packbits(xs >= 0, axis=1, bitorder="little")
            out = np.empty(d, np.float32)
            C.sign_vote(T(P), T(out))
            ref = np.where(2 * (xs >= 0).sum(0) >= n, 1.0, -1.0).astype(np.float32)
            np.testing.assert_array_equal(out, ref)
            np.testing.assert_array_equal(out, nk.sign_vote(T(P), d).numpy())


@check
def pack_codes_matches_cpu():
    for bits in (1, 2, 3, 6, 8):
        for d in (1, 7, 8, 9, 100, 1003):
            rng = np.random.default_rng(d * 8 + bits)
            q = rng.integers(-(1 << (bits - 1)), 1 << (bits - 1), d).astype(np.int8)
            packed = np.empty((d * bits + 7) // 8, np.uint8)
            C.pack_codes(T(q), bits, T(packed))
            np.testing.assert_array_equal(packed, nk.pack_codes(T(q), bits).numpy())
            out = np.empty(d, np.int8)
            C.unpack_codes(T(packed), bits, T(out))
            np.testing.assert_array_equal(out, q)


@check
def dequantize_add_matches_cpu():
    for levels, d, bs in ((16, 1003, 512), (16, 100, 8), (3, 77, 0), (127, 530, 104), (1, 45, 0)):
        bits = nk.code_bits(levels)
        norms, q = nk.qsgd_quantize(T(rand(d, levels)), levels, bs, 7)
        packed = nk.pack_codes(q, bits)
        base = rand(d, d)
        cpu = nk.dequantize_add(norms, packed, bits, levels, bs, T(base.copy())).numpy()
        nb, size = _host.buckets(d, bs)
        out = base.copy()
        C.dequantize_add(norms, packed, bits, levels, size, T(out))
        np.testing.assert_array_equal(out, cpu)


@check
def scatter_gather():
    rng = np.random.default_rng(1)
    d = 500
    idx = rng.choice(d, 120, replace=False).astype(np.int64)
    vals = rand(120, 2)
    out = np.zeros(d, np.float32)
    C.scatter(T(idx), T(vals), T(out), False)
    ref = np.zeros(d, np.float32)
    ref[idx] = vals
    np.testing.assert_array_equal(out, ref)
    dup = np.concatenate([rng.integers(0, d, 300), [-1, d, d + 7]]).astype(np.int64)
    dv = rand(dup.size, 3)
    base = rand(d, 4)
    out = base.copy()
    C.scatter(T(dup), T(dv), T(out), True)  # duplicates via atomics, out-of-range skipped
    ref = base.astype(np.float64)
    np.add.at(ref, dup[:300], dv[:300])
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    g = np.empty(120, np.float32)
    C.gather(T(base), T(idx), T(g))
    np.testing.assert_array_equal(g, base[idx])


@check
def weighted_sum():
    d = 777
    for n in (1, 2, 3, 4, 5, 7):
        xs = [rand(d, 10 * n + j) for j in range(n)]
        ws = list(np.random.default_rng(n).standard_normal(n))
        ref = sum(np.float64(w) * x for w, x in zip(ws, xs))
        out = np.empty(d, np.float32)
        C.weighted_sum([T(x) for x in xs], ws, T(out))
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
        xs2 = [x.copy() for x in xs]
        C.weighted_sum([T(x) for x in xs2], ws, T(xs2[0]))  # out aliases the first input
        np.testing.assert_allclose(xs2[0], ref, rtol=1e-5, atol=1e-5)


def ref_topk(x, k):
    return np.sort(np.argsort(-np.abs(x).astype(np.float64), kind="stable")[:k])


def run_topk(x, k):
    idx = np.empty(k, np.int64)
    vals = np.empty(k, np.float32)
    C.topk(T(x), k, T(idx), T(vals))
    return idx, vals


@check
def topk_exact():
    for d in (2, 9, 1003):
        x = rand(d, d)
        for k in sorted({1, d // 2 or 1, d - 1}):
            idx, vals = run_topk(x, k)
            np.testing.assert_array_equal(idx, ref_topk(x, k))
            np.testing.assert_array_equal(vals, x[idx])
            np.testing.assert_array_equal(idx, nk.topk(T(x), k)[0].numpy())
    x = np.random.default_rng(0).integers(-2, 3, 600).astype(np.float32)  # ties
    for k in (5, 300):
        np.testing.assert_array_equal(run_topk(x, k)[0], ref_topk(x, k))


@check
def topk_sampled_threshold_and_retry():
    small, sample, est = _host.TOPK_SMALL, _host.TOPK_SAMPLE, _host.estimate_threshold
    try:
        _host.TOPK_SMALL, _host.TOPK_SAMPLE = 64, 128  # exercise sample/count/compact
        for d, k in ((1003, 1), (1003, 40), (2000, 700)):
            x = rand(d, k) * np.exp(rand(d, k + 1))
            idx, vals = run_topk(x, k)
            np.testing.assert_array_equal(idx, ref_topk(x, k))
            np.testing.assert_array_equal(vals, x[idx])
        calls = []

        def too_high(sample, k, d, boost):  # first estimate is far too high
            calls.append(boost)
            return np.uint32(0x7F000000) if len(calls) == 1 else est(sample, k, d, boost)

        _host.estimate_threshold = too_high
        x = rand(1003, 9)
        idx, _ = run_topk(x, 50)
        np.testing.assert_array_equal(idx, ref_topk(x, 50))
        assert len(calls) >= 2, calls
    finally:
        _host.TOPK_SMALL, _host.TOPK_SAMPLE, _host.estimate_threshold = small, sample, est


@check
def randomk_matches_cpu():
    cases = ((2, 1, 0), (9, 3, 1), (9, 8, 2), (1003, 1, 3), (1003, 300, 4), (1003, 300, 5), (1003, 1002, 6))
    for d, k, seed in cases:
        idx = np.empty(k, np.int64)
        C.randomk_indices(d, k, _random.seed_key(seed), T(idx))
        cpu = nk.randomk_indices(d, k, seed, "cpu").numpy()
        np.testing.assert_array_equal(idx, cpu)
        assert len(np.unique(idx)) == k and np.all(np.diff(idx) > 0)


@check
def segments_match_cpu():
    # A bucket of tensors, empty ones included, in one launch per kernel: each segment as the
    # CPU kernels compute it (dyadic inputs: every float64 sum of squares is exact, so the
    # norms agree whatever the order of the additions).
    from numba_kernels import _dispatch
    sizes = [5, 0, 70, 9, 0, 33]
    x = T((np.random.default_rng(3).integers(-255, 256, sum(sizes)) / 64).astype(np.float32))
    table = nk.Segments(sizes)
    seeds = [101 + s for s in range(len(sizes))]
    levels = [4, 1, 127, 16, 2, 8]

    def both(fn):
        _dispatch.SIMULATE_CUDA = False
        cpu = fn()
        _dispatch.SIMULATE_CUDA = True
        try:
            gpu = fn()
        finally:
            _dispatch.SIMULATE_CUDA = False
        for a, b in zip(cpu if isinstance(cpu, tuple) else (cpu,), gpu if isinstance(gpu, tuple) else (gpu,)):
            np.testing.assert_array_equal(a.numpy(), b.numpy())
        return cpu

    for bucket_size in (8, 0, 20):
        norms, q = both(lambda: nk.qsgd_quantize_segments(x, table, levels, bucket_size, seeds))
        bits = [nk.code_bits(v) for v in levels]
        packed = both(lambda: nk.pack_codes_segments(q, table, bits))
        both(lambda: nk.dequantize_segments(norms, packed, table, bits, levels, bucket_size))
        both(lambda: nk.dequantize_segments(norms, packed, table, bits, levels, bucket_size,
                                            out=torch.ones(x.numel()), add=True))
    scales, t = both(lambda: nk.terngrad_quantize_segments(x, table, seeds))
    both(lambda: nk.terngrad_packed_segments(x, table, seeds))
    signs = both(lambda: nk.sign_pack_segments(x, table))
    both(lambda: nk.sign_unpack_segments(signs, table, scales, -scales))
    rows = torch.stack([signs, signs, both(lambda: nk.sign_pack_segments(-x, table))])
    both(lambda: nk.sign_vote_segments(rows, table))


@check
def fused_segments_match_cpu():
    # The fused QSGD kernel (one warp per bucket: norm, codes and packing in one pass) gives
    # the two CPU kernels' bits: buckets of 8 and 16 elements (every bucket on a byte at any
    # width) and of 512 (two rounds of the lanes' groups of 8), segments shorter than a bucket
    # and empty ones; and a bucket size the fused kernel does not take (20 at 3 bits).
    from numba_kernels import _cuda, _dispatch
    sizes = [5, 0, 70, 9, 0, 600, 33]
    x = T((np.random.default_rng(4).integers(-255, 256, sum(sizes)) / 64).astype(np.float32))
    table = nk.Segments(sizes)
    seeds = [201 + s for s in range(len(sizes))]
    levels = [4, 1, 127, 16, 2, 2, 8]
    launches = []
    real = _cuda._Kernel.__getitem__

    def counted(kernel, config):
        if kernel.name == "_k_seg_qsgd_packed":
            launches.append(config)
        return real(kernel, config)

    _cuda._Kernel.__getitem__ = counted
    for bucket_size in (8, 16, 512, 20):
        _dispatch.SIMULATE_CUDA = False
        cpu = nk.qsgd_packed_segments(x, table, levels, bucket_size, seeds)
        _dispatch.SIMULATE_CUDA = True
        try:
            gpu = nk.qsgd_packed_segments(x, table, levels, bucket_size, seeds)
        finally:
            _dispatch.SIMULATE_CUDA = False
        for a, b in zip(cpu, gpu):
            np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert len(launches) == 3, launches  # 20 codes of 3 bits do not end on a byte


@check
def declared_signatures_refuse_other_types():
    # Under the simulator each launch of a declared kernel checks its arguments against the
    # signature, as a GPU's dispatcher would: an int32 table where int64 is declared fails.
    from numba_kernels import _cuda
    x = np.zeros(8, np.float32)
    try:
        _cuda.KERNELS["_k_seg_maxabs"][1, 32, 0](x, np.zeros(1, np.int32), np.zeros(1, np.float32))
    except TypeError as error:
        assert "_k_seg_maxabs" in str(error) and "int64" in str(error), error
    else:
        raise AssertionError("an int32 table was accepted")
    _cuda.KERNELS["_k_seg_maxabs"][1, 32, 0](x, np.zeros(1, np.int64), np.zeros(1, np.float32))


@check
def shared_cases_match_cpu():
    # numba_kernels/crosscheck.py: every case benchmarks/gpu_check.py runs on a GPU, here
    # under the simulator, and together they launch every kernel of numba_kernels._cuda.
    with crosscheck.launched_kernels() as launched:
        outcomes = crosscheck.run_cases("simulator")
    wrong = [f"{o.case}: {o.detail}" for o in outcomes if not o.ok]
    assert not wrong, wrong
    missed = crosscheck.all_kernels() - launched
    assert not missed, f"kernels no case of numba_kernels/crosscheck.py launches: {sorted(missed)}"
    assert {"_k_seg_qsgd_packed", "_k_wsum4", "_k_copy", "_k_sample"} <= launched
    # a difference in the last bit is reported as one
    a = torch.ones(4)
    b = a.clone()
    b[2] = float(np.nextafter(np.float32(1), np.float32(2)))
    verdict, detail = crosscheck.compare((a,), (b,), crosscheck.CASES[0], ())
    assert verdict == "differs" and "1 of 4" in detail and "1 ulp" in detail, (verdict, detail)


print("RESULTS " + json.dumps(results))
'''

CHECKS = [
    "rng_bit_identical",
    "qsgd_matches_cpu",
    "terngrad_matches_cpu",
    "sign_pack_unpack_vote",
    "pack_codes_matches_cpu",
    "dequantize_add_matches_cpu",
    "scatter_gather",
    "weighted_sum",
    "topk_exact",
    "topk_sampled_threshold_and_retry",
    "randomk_matches_cpu",
    "segments_match_cpu",
    "fused_segments_match_cpu",
    "declared_signatures_refuse_other_types",
    "shared_cases_match_cpu",
]
# The checks split in two groups of about equal running time, one subprocess each.
GROUPS = [
    ["qsgd_matches_cpu", "topk_exact", "sign_pack_unpack_vote", "pack_codes_matches_cpu",
     "terngrad_matches_cpu", "scatter_gather", "fused_segments_match_cpu"],
    ["randomk_matches_cpu", "topk_sampled_threshold_and_retry", "rng_bit_identical",
     "weighted_sum", "dequantize_add_matches_cpu", "segments_match_cpu",
     "declared_signatures_refuse_other_types"],
]
GROUPS[0].append("shared_cases_match_cpu")
assert sorted(sum(GROUPS, [])) == sorted(CHECKS)


@pytest.fixture(scope="module")
def sim_results():
    if importlib.util.find_spec("numba_cuda") is None and importlib.util.find_spec("numba.cuda") is None:
        pytest.skip("numba CUDA support is not installed")
    env = dict(os.environ)
    env["NUMBA_ENABLE_CUDASIM"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", SCRIPT, *group], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, env=env, cwd=ROOT,
        )
        for group in GROUPS
    ]
    results = {}
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=600)
            lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULTS ")]
            assert proc.returncode == 0 and lines, f"simulator run failed:\n{stdout}\n{stderr}"
            results.update(json.loads(lines[-1][len("RESULTS ") :]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results


@pytest.mark.parametrize("name", CHECKS)
def test_cuda_simulator(sim_results, name):
    assert name in sim_results, f"check {name} did not run"
    assert sim_results[name] == "ok", sim_results[name]
