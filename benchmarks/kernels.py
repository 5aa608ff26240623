"""Benchmark numba_kernels against the same operations in plain torch ops.

For every kernel and size: median time over --repeats runs (after warm-up) of
the numba kernel and of a plain-torch implementation, throughput (GB/s of
input processed and elements/s), the ratio numba/torch and the ratio of the
kernel's input bandwidth (and read+write bandwidth) to a plain memory copy of
the same float32 tensor (``dst.copy_(src)``).  CPU always; CUDA too when
``torch.cuda.is_available()``.

    python benchmarks/kernels.py                       # 1M and 16M elements
    python benchmarks/kernels.py --sizes 1M --repeats 3

A second table times the segmented kernels on one bucket of CIFAR ResNet-20's 59 gradient
tensors (0.27M elements, the sizes of its parameters), one call for the bucket against one
call per tensor, as compressors made them before buckets (``--no-buckets`` leaves it out).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time

import torch


import numba

import numba_kernels as nk

LEVELS = 127
BUCKET = 512
WORKERS = 8  # sign_vote
N_AVG = 4  # weighted_sum inputs
K_FRAC = 0.01  # top-k / random-k / scatter density


def parse_size(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1:], 1)
    return int(float(s[:-1] if s[-1:] in "KMG" else s) * mult)


STAT = statistics.median


def timeit(fn, repeats, warmup, sync):
    for _ in range(warmup):
        fn()
    sync()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t0)
    return STAT(ts)


# ---------------------------------------------------------------------------
# plain-torch versions of each operation
# ---------------------------------------------------------------------------


def torch_qsgd(x, levels, bs, gen):
    xb = x.view(-1, bs)
    norms = torch.linalg.vector_norm(xb, dim=1)
    a = xb.abs() / norms.unsqueeze(1) * levels
    fl = a.floor()
    lvl = fl + (torch.rand(a.shape, generator=gen, device=x.device) < (a - fl))
    return norms, (lvl * xb.sign()).to(torch.int8).view(-1)


def torch_qsgd_dequant(norms, q, levels, bs):
    return (q.view(-1, bs).float() * (norms / levels).unsqueeze(1)).view(-1)


def torch_terngrad(x, gen):
    s = x.abs().max()
    keep = torch.rand(x.shape, generator=gen, device=x.device) * s < x.abs()
    return s, keep.to(torch.int8) * x.sign().to(torch.int8)


def torch_sign_pack(x, shifts):
    bits = (x >= 0).view(-1, 8).to(torch.uint8)
    return (bits << shifts).sum(1, dtype=torch.uint8)


def torch_sign_unpack(packed, shifts, scale):
    bits = (packed.unsqueeze(1) >> shifts) & 1
    return (bits.view(-1).float() * 2 - 1) * scale


def torch_sign_vote(P, shifts):
    n = P.shape[0]
    cnt = ((P.unsqueeze(-1) >> shifts) & 1).sum(0, dtype=torch.int32).view(-1)
    one = torch.ones((), device=P.device)
    return torch.where(2 * cnt >= n, one, -one)


def torch_pack_codes(q, bits, byte_shifts):
    """Eight codes of `bits` bits -> one int64 word per group -> its low `bits` bytes."""
    codes = (q.view(-1, 8).to(torch.int64) & ((1 << bits) - 1)) << (bits * byte_shifts)
    words = codes.sum(1)
    return ((words.unsqueeze(1) >> (8 * byte_shifts[:bits])) & 0xFF).to(torch.uint8).view(-1)


def torch_unpack_codes(packed, bits, byte_shifts):
    words = (packed.view(-1, bits).to(torch.int64) << (8 * byte_shifts[:bits])).sum(1)
    codes = (words.unsqueeze(1) >> (bits * byte_shifts)) & ((1 << bits) - 1)
    return (codes - ((codes & (1 << (bits - 1))) << 1)).to(torch.int8).view(-1)


def torch_topk(x, k):
    idx = torch.topk(x.abs(), k, sorted=False).indices.sort().values
    return idx, x[idx]


def torch_randomk(x, k, gen):
    idx = torch.randperm(x.numel(), generator=gen, device=x.device)[:k].sort().values
    return idx, x[idx]


def torch_scatter(idx, vals, out):
    out.zero_()
    out.index_copy_(0, idx, vals)
    return out


def torch_wsum(xs, ws):
    out = ws[0] * xs[0]
    for w, x in zip(ws[1:], xs[1:]):
        out = out + w * x
    return out


# ---------------------------------------------------------------------------


def cases(d, device):
    """(name, input bytes, output bytes, numba fn, torch fn)."""
    g = torch.Generator(device=device)
    g.manual_seed(0)
    x = torch.randn(d, device=device)
    k = max(1, int(d * K_FRAC))
    norms, q = nk.qsgd_quantize(x, LEVELS, BUCKET, 1)
    scale, t = nk.terngrad_quantize(x, 1)
    packed = nk.sign_pack(x)
    P = torch.stack([nk.sign_pack(torch.randn(d, device=device)) for _ in range(WORKERS)])
    shifts = torch.arange(8, dtype=torch.uint8, device=device)
    byte_shifts = torch.arange(8, dtype=torch.int64, device=device)
    # codes as TernGrad (2 bits) and 16-level QSGD (6 bits) send them
    # (codes, bits, their scales, levels, bucket size); TernGrad: one level, one bucket
    qsgd16_norms, qsgd16 = nk.qsgd_quantize(x, 16, BUCKET, 2)
    code_cases = [(t, 2, scale, 1, 0), (qsgd16, nk.code_bits(16), qsgd16_norms, 16, BUCKET)]
    out = torch.empty(d, device=device)
    idx, vals = nk.topk(x, k)
    xs = [torch.randn(d, device=device) for _ in range(N_AVG)]
    ws = [1.0 / N_AVG] * N_AVG
    nb = norms.numel()
    seed = iter(range(10**9))
    whole = nk.Segments([d], device)  # the tensor as a bucket of one segment
    f4 = 4 * d
    rows = [
        ("qsgd_quantize", f4, d + 4 * nb,
         lambda: nk.qsgd_quantize(x, LEVELS, BUCKET, next(seed)),
         lambda: torch_qsgd(x, LEVELS, BUCKET, g)),
        # QSGD as the compressor runs it: norms, codes and packing (one fused kernel on a GPU)
        (f"qsgd_packed({nk.code_bits(LEVELS)} bit)", f4, d * nk.code_bits(LEVELS) // 8 + 4 * nb,
         lambda: nk.qsgd_packed_segments(x, whole, LEVELS, BUCKET, [next(seed)]),
         lambda: torch_qsgd(x, LEVELS, BUCKET, g)),
        ("qsgd_dequantize", d + 4 * nb, f4,
         lambda: nk.qsgd_dequantize(norms, q, LEVELS, BUCKET, out=out),
         lambda: torch_qsgd_dequant(norms, q, LEVELS, BUCKET)),
        ("terngrad_quantize", f4, d,
         lambda: nk.terngrad_quantize(x, next(seed)),
         lambda: torch_terngrad(x, g)),
        ("terngrad_packed(2 bit)", f4, d // 4,
         lambda: nk.terngrad_packed_segments(x, whole, [next(seed)]),
         lambda: torch_terngrad(x, g)),
        ("terngrad_dequantize", d, f4,
         lambda: nk.terngrad_dequantize(scale, t, out=out),
         lambda: t.float() * scale),
        ("sign_pack", f4, d // 8,
         lambda: nk.sign_pack(x),
         lambda: torch_sign_pack(x, shifts)),
        ("sign_unpack", d // 8, f4,
         lambda: nk.sign_unpack(packed, d, 0.5, out=out),
         lambda: torch_sign_unpack(packed, shifts, 0.5)),
        (f"sign_vote(n={WORKERS})", WORKERS * d // 8, f4,
         lambda: nk.sign_vote(P, d, out=out),
         lambda: torch_sign_vote(P, shifts)),
        (f"topk(k={K_FRAC:g}d)", f4, 12 * k,
         lambda: nk.topk(x, k),
         lambda: torch_topk(x, k)),
        (f"randomk(k={K_FRAC:g}d)", f4, 12 * k,
         lambda: nk.randomk(x, k, next(seed)),
         lambda: torch_randomk(x, k, g)),
        (f"scatter(k={K_FRAC:g}d)", 12 * k, f4,
         lambda: nk.scatter(idx, vals, d, out=out),
         lambda: torch_scatter(idx, vals, out)),
        (f"weighted_sum(n={N_AVG})", N_AVG * f4, f4,
         lambda: nk.weighted_sum(xs, ws, out=out),
         lambda: torch_wsum(xs, ws)),
    ]
    for codes in code_cases:
        rows += _code_cases(*codes, byte_shifts, out)
    return rows


def _code_cases(q, bits, norms, levels, bucket, byte_shifts, out):
    d = q.numel()
    packed = nk.pack_codes(q, bits)
    q_out = torch.empty_like(q)
    torch_bucket = bucket or d
    return [
        (f"pack_codes({bits} bit)", d, packed.numel(),
         lambda: nk.pack_codes(q, bits),
         lambda: torch_pack_codes(q, bits, byte_shifts)),
        (f"unpack_codes({bits} bit)", packed.numel(), d,
         lambda: nk.unpack_codes(packed, d, bits, out=q_out),
         lambda: torch_unpack_codes(packed, bits, byte_shifts)),
        # out += decoded payload, as averaging gathered payloads does for each worker
        (f"dequantize_add({bits} bit)", packed.numel() + 4 * d, 4 * d,
         lambda: nk.dequantize_add(norms, packed, bits, levels, bucket, out),
         lambda: out.add_(torch_qsgd_dequant(norms, torch_unpack_codes(packed, bits, byte_shifts),
                                             levels, torch_bucket))),
    ]


RESNET20_SIZES = None  # filled on first use: the parameter sizes of CIFAR ResNet-20


def bucket_cases(device):
    """(name, bucket fn, per-tensor fn) on one bucket of ResNet-20's parameter sizes."""
    global RESNET20_SIZES
    if RESNET20_SIZES is None:
        from plugins.tasks.resnet import CifarResNet

        RESNET20_SIZES = [p.numel() for p in CifarResNet(20, 10, (0.5,) * 3, (0.25,) * 3).parameters()]
    sizes = RESNET20_SIZES
    table = nk.Segments(sizes, device)
    x = torch.randn(sum(sizes), device=device)
    parts = list(x.split(sizes))
    seeds = list(range(len(sizes)))
    bits = nk.code_bits(16)
    norms, q = nk.qsgd_quantize_segments(x, table, 16, BUCKET, seeds)
    packed = nk.pack_codes_segments(q, table, bits)
    q_parts = list(q.split(sizes))
    per_tensor = [nk.qsgd_quantize(t, 16, BUCKET, s) for t, s in zip(parts, seeds)]
    packed_parts = [nk.pack_codes(qq, bits) for _, qq in per_tensor]
    signs = nk.sign_pack_segments(x, table)
    sign_parts = [nk.sign_pack(t) for t in parts]
    ones, out = torch.ones(len(sizes), device=device), torch.zeros_like(x)
    out_parts = list(out.split(sizes))
    ks = [max(1, math.ceil(K_FRAC * n)) for n in sizes]
    return [
        ("qsgd_quantize", lambda: nk.qsgd_quantize_segments(x, table, 16, BUCKET, seeds),
         lambda: [nk.qsgd_quantize(t, 16, BUCKET, s) for t, s in zip(parts, seeds)]),
        (f"qsgd_packed({bits} bit)", lambda: nk.qsgd_packed_segments(x, table, 16, BUCKET, seeds),
         lambda: [nk.pack_codes(nk.qsgd_quantize(t, 16, BUCKET, s)[1], bits)
                  for t, s in zip(parts, seeds)]),
        ("terngrad_packed", lambda: nk.terngrad_packed_segments(x, table, seeds),
         lambda: [nk.pack_codes(nk.terngrad_quantize(t, s)[1], 2) for t, s in zip(parts, seeds)]),
        (f"pack_codes({bits} bit)", lambda: nk.pack_codes_segments(q, table, bits),
         lambda: [nk.pack_codes(qq, bits) for qq in q_parts]),
        (f"dequantize_add({bits} bit)",
         lambda: nk.dequantize_segments(norms, packed, table, bits, 16, BUCKET, out=out, add=True),
         lambda: [nk.dequantize_add(nn, pp, bits, 16, BUCKET, o)
                  for (nn, _), pp, o in zip(per_tensor, packed_parts, out_parts)]),
        ("terngrad_quantize", lambda: nk.terngrad_quantize_segments(x, table, seeds),
         lambda: [nk.terngrad_quantize(t, s) for t, s in zip(parts, seeds)]),
        ("sign_pack", lambda: nk.sign_pack_segments(x, table),
         lambda: [nk.sign_pack(t) for t in parts]),
        ("sign_unpack", lambda: nk.sign_unpack_segments(signs, table, ones, -ones, out=out),
         lambda: [nk.sign_unpack(p, t.numel(), 1.0, out=o)
                  for p, t, o in zip(sign_parts, parts, out_parts)]),
        (f"topk(k={K_FRAC:g}d)", lambda: nk.topk_segments(x, table, ks),
         lambda: [nk.topk(t, k) for t, k in zip(parts, ks)]),
        (f"randomk(k={K_FRAC:g}d)", lambda: nk.randomk_segments(x, table, ks, seeds),
         lambda: [nk.randomk(t, k, s) for t, k, s in zip(parts, ks, seeds)]),
    ]


def run_buckets(device, repeats, warmup):
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    rows = bucket_cases(device)
    print(f"\n== {device}: one bucket of ResNet-20's {len(RESNET20_SIZES)} tensors "
          f"({sum(RESNET20_SIZES):,} elements) ==")
    hdr = f"{'kernel':<22}{'bucket ms':>10}{'per-tensor ms':>14}{'per-tensor/bucket':>19}"
    print(hdr)
    print("-" * len(hdr))
    for name, bucket, per_tensor in rows:
        t_bucket = timeit(bucket, repeats, warmup, sync)
        t_tensors = timeit(per_tensor, repeats, warmup, sync)
        print(f"{name:<22}{t_bucket * 1e3:>10.3f}{t_tensors * 1e3:>14.3f}{t_tensors / t_bucket:>18.1f}x")


def run(device, sizes, repeats, warmup):
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    hdr = (f"{'kernel':<22}{'size':>6}{'numba ms':>10}{'torch ms':>10}{'numba GB/s':>11}"
           f"{'Gelem/s':>9}{'torch GB/s':>11}{'numba/torch':>12}{'in/copy':>9}{'rw/copy':>9}")
    print(f"\n== {device} ==")
    print(hdr)
    print("-" * len(hdr))
    for d in sizes:
        label = f"{d >> 20}M" if d % (1 << 20) == 0 else str(d)
        src = torch.randn(d, device=device)
        dst = torch.empty_like(src)
        t_copy = timeit(lambda: dst.copy_(src), repeats, warmup, sync)
        copy_bw = 4 * d / t_copy  # input bytes per second of a memcpy
        print(f"{'copy (dst.copy_(src))':<22}{label:>6}{t_copy * 1e3:>10.3f}{'':>10}{copy_bw / 1e9:>11.2f}"
              f"{d / t_copy / 1e9:>9.2f}")
        for name, bin_, bout, fn_nb, fn_t in cases(d, device):
            t_nb = timeit(fn_nb, repeats, warmup, sync)
            t_t = timeit(fn_t, repeats, warmup, sync)
            bw = bin_ / t_nb
            print(f"{name:<22}{label:>6}{t_nb * 1e3:>10.3f}{t_t * 1e3:>10.3f}{bw / 1e9:>11.2f}"
                  f"{d / t_nb / 1e9:>9.2f}{bin_ / t_t / 1e9:>11.2f}{t_t / t_nb:>11.1f}x"
                  f"{bw / copy_bw:>9.2f}{(bin_ + bout) / t_nb / (2 * copy_bw):>9.2f}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1M,16M", help="comma-separated element counts (K/M suffixes)")
    ap.add_argument("--repeats", type=int, default=9, help="timed runs per measurement (median)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--device", choices=["all", "cpu", "cuda"], default="all")
    ap.add_argument("--no-buckets", action="store_true", help="leave out the bucket table")
    ap.add_argument("--stat", choices=["median", "min"], default="median",
                    help="statistic over the repeats (min is more robust on a shared machine)")
    args = ap.parse_args(argv)
    global STAT
    STAT = min if args.stat == "min" else statistics.median
    sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    print(f"torch {torch.__version__} (threads {torch.get_num_threads()}), numba {numba.__version__} "
          f"(threads {numba.get_num_threads()}), cpus {os.cpu_count()}, "
          f"loadavg {os.getloadavg()[0]:.2f}, {args.stat} of {args.repeats} runs")
    print("GB/s = input bytes / time; numba/torch = speed-up; in/copy = input bandwidth / copy's; "
          "rw/copy = (input+output) bandwidth / copy's (read+write)")
    devices = [d for d in ("cpu", "cuda") if args.device in ("all", d)]
    for device in devices:
        if device == "cuda" and not torch.cuda.is_available():
            if args.device == "cuda":
                print("CUDA not available")
            continue
        run(device, sizes, args.repeats, args.warmup)
        if not args.no_buckets:
            run_buckets(device, args.repeats, args.warmup)
    print(f"\nloadavg at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
