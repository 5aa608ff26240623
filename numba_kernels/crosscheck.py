"""Every CUDA kernel against the CPU kernel, bit for bit: one list of cases for all checkers.

``CASES`` calls each public function of numba_kernels whose CUDA backend launches kernels
(the per-tensor functions and the segmented ``*_segments`` ones the compressors call) on
the same inputs twice: once on the CPU kernels, once on the CUDA kernels, and compares
every output bit for bit. The same cases run

* under numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``: CPU tensors stand in for CUDA
  tensors and go to the CUDA backend), at small sizes: tests/test_kernels_cudasim.py, which
  also checks that the cases launch every kernel of ``numba_kernels._cuda`` (a kernel no
  case reaches fails that test), and ``benchmarks/gpu_check.py --try-on-cpu``;
* on a GPU, at real sizes (1M and 16M elements): ``benchmarks/gpu_check.py``.

Run it alone with ``python -m numba_kernels.crosscheck --device cuda --sizes 1M,16M`` (or
``NUMBA_ENABLE_CUDASIM=1 python -m numba_kernels.crosscheck --device simulator``): it
prints a markdown table.

The inputs are chosen so that the comparison is exact whatever order a GPU adds in: the
quantisers get dyadic values (multiples of 1/64 below 4 in magnitude: every float64 sum of
their squares is exact, so each bucket's norm is the same on both), scatter's duplicate
indices add dyadic values, weighted sums have power-of-two weights (products exact, so a
fused multiply-add rounds as a multiply and an add do). One case more has weights of 1/3:
a GPU may fuse its multiply-adds there, and the report says by how many ulps it differs.
``topk_segments`` on a GPU is ``torch.topk`` per segment, which may pick another index
among equal magnitudes: a difference limited to such ties is reported as ``ties``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
import time
from typing import Callable

import numpy as np
import torch

from . import _dispatch, _host
from . import _dispatch as nk

#: the sizes a GPU check uses (elements); the simulator's are `SIMULATOR_SIZES`
GPU_SIZES = (1 << 20, 16 << 20)
SIMULATOR_SIZES = (1003,)

#: small segments (empty ones, one shorter than a byte, one of 600: two rounds of the fused
#: QSGD kernel's lanes at buckets of 512) around two large ones that take the rest
_SMALL_SEGMENTS = (5, 0, 70, 9, 0, 600, 33)
_LEVELS = (4, 1, 127, 16, 2, 8)


@dataclasses.dataclass
class Outcome:
    case: str
    size: int
    verdict: str  # "same", "ties" (top-k's pick among equal magnitudes) or "differs"
    detail: str = ""
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.verdict in ("same", "ties")


class Side:
    """Where one run of a case computes: ``cpu`` (the CPU kernels), ``cuda`` (a GPU's
    kernels on CUDA tensors) or ``simulator`` (the CUDA kernels under numba's simulator, on
    CPU tensors)."""

    def __init__(self, kind: str):
        if kind not in ("cpu", "cuda", "simulator"):
            raise ValueError(f"unknown side {kind!r}")
        self.kind = kind
        self.device = "cuda" if kind == "cuda" else "cpu"

    def put(self, value):
        if isinstance(value, torch.Tensor):
            return value.to(self.device)
        if isinstance(value, (list, tuple)):
            return type(value)(self.put(v) for v in value)
        return value

    @contextlib.contextmanager
    def active(self):
        before = _dispatch.SIMULATE_CUDA
        _dispatch.SIMULATE_CUDA = self.kind == "simulator"
        try:
            yield
        finally:
            _dispatch.SIMULATE_CUDA = before

    def segments(self, n: int) -> nk.Segments:
        return nk.Segments(segment_sizes(n), self.device)


def segment_sizes(n: int) -> list[int]:
    """A bucket of ``n`` elements cut as the compressors cut a model's: small and empty
    segments around two large ones."""
    small = sum(_SMALL_SEGMENTS)
    if n < small + 2:
        raise ValueError(f"the cases need at least {small + 2} elements, got {n}")
    first = (n - small) // 2
    a, b, c, d, e, f, g = _SMALL_SEGMENTS
    return [a, b, c, first, d, e, f, n - small - first, g]


class Inputs:
    """The inputs of one size, made once on the CPU (each side gets copies)."""

    def __init__(self, n: int):
        self.n = n
        rng = np.random.default_rng(n)
        self.dyadic = torch.from_numpy((rng.integers(-255, 256, n) / 64).astype(np.float32))
        self.normal = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
        self.heavy = torch.from_numpy(
            (rng.standard_normal(n) * np.exp(rng.standard_normal(n))).astype(np.float32))
        self.rng = rng
        self.count = len(segment_sizes(n))
        self.seeds = [101 + 7 * s for s in range(self.count)]
        self.levels = [_LEVELS[s % len(_LEVELS)] for s in range(self.count)]
        self.bits = [_host.code_bits(v) for v in self.levels]
        self.k = max(1, n // 100)
        self.ks = [max(1, size // 100) for size in segment_sizes(n)]

    def workers(self, count: int) -> list[torch.Tensor]:
        """``count`` (at most 5) workers' tensors, made once."""
        if not hasattr(self, "_workers"):
            generator = np.random.default_rng(self.n + 1)
            self._workers = [torch.from_numpy(generator.standard_normal(self.n, np.float32))
                             for _ in range(5)]
        return self._workers[:count]


@dataclasses.dataclass
class Case:
    """``prepare(inputs)`` gives the arguments (on the CPU, computed once); ``run(side,
    *arguments)`` calls the function on that side (the arguments moved to its device) and
    returns its outputs."""

    name: str
    prepare: Callable
    run: Callable
    ties_ok: bool = False  # topk_segments on a GPU: torch's pick among equal magnitudes


def _qsgd_codes(i: Inputs, bucket_size: int):
    norms, q = nk.qsgd_quantize(i.dyadic, 16, bucket_size, 7)
    return norms, q


def _segment_codes(i: Inputs, bucket_size: int):
    table = nk.Segments(segment_sizes(i.n))
    norms, q = nk.qsgd_quantize_segments(i.dyadic, table, i.levels, bucket_size, i.seeds)
    return norms, q, nk.pack_codes_segments(q, table, i.bits)


def _sign_rows(i: Inputs, workers: int):
    return torch.stack([nk.sign_pack_segments(x, nk.Segments(segment_sizes(i.n)))
                        for x in i.workers(workers)])


def _scatter_inputs(i: Inputs, accumulate: bool):
    rng = np.random.default_rng(i.n + 2)
    if accumulate:  # duplicates (the CPU refuses indices out of range; a GPU skips them)
        idx = rng.integers(0, i.n, 3 * i.k)
        values = rng.integers(-255, 256, idx.size) / 64
    else:
        idx = rng.choice(i.n, i.k, replace=False)
        values = rng.standard_normal(idx.size)
    return (torch.from_numpy(idx.astype(np.int64)), torch.from_numpy(values.astype(np.float32)),
            i.dyadic.clone())


def _topk_small(n: int):
    """Below the sampled path's threshold (the simulator's sizes), lower it so that the
    sampled path (sample, count, compaction) runs there too."""
    if n > _host.TOPK_SMALL:
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def lowered():
        small, sample = _host.TOPK_SMALL, _host.TOPK_SAMPLE
        _host.TOPK_SMALL, _host.TOPK_SAMPLE = max(16, n // 16), 128
        try:
            yield
        finally:
            _host.TOPK_SMALL, _host.TOPK_SAMPLE = small, sample

    return lowered()


def _topk(side: Side, x, k):
    with _topk_small(x.numel()):
        return nk.topk(x, k)


def _exact_candidates(i: Inputs):
    """A top-k whose sampled threshold leaves exactly k candidates (the selection is then a
    copy): the kernel's sample positions hold the largest magnitudes, the others small ones,
    and k is where the host's margin over the sample's k-th largest gives back k."""
    from . import _random

    n = min(i.n, 4096)
    with _topk_small(n):
        s = _host.TOPK_SAMPLE
        st = n // s
        positions = [j * st + int(_random.hash64_py(_random.SAMPLE_KEY, j) % np.uint64(st))
                     for j in range(s)]
        magnitudes = np.linspace(1e-3, 1e-2, n, dtype=np.float32)
        magnitudes[positions] = 1000.0 + np.arange(s, 0, -1, dtype=np.float32)
        x = torch.from_numpy(magnitudes * np.where(np.arange(n) % 2, -1, 1).astype(np.float32))
        keys = x.abs().view(torch.int32).numpy().astype(np.uint32)
        sample = keys[positions]
        for k in range(1, n):
            t = _host.estimate_threshold(sample, k, n, 1.0)
            if t and int((keys >= t).sum()) == k:
                return x, k
    raise RuntimeError("no k leaves exactly k candidates")


CASES: list[Case] = [
    # per-tensor functions
    Case("qsgd_quantize (16 levels, buckets of 512)", lambda i: (i.dyadic,),
         lambda s, x: nk.qsgd_quantize(x, 16, 512, 7)),
    Case("qsgd_quantize (127 levels, one bucket)", lambda i: (i.dyadic,),
         lambda s, x: nk.qsgd_quantize(x, 127, 0, 8)),
    Case("qsgd_dequantize", lambda i: _qsgd_codes(i, 512),
         lambda s, norms, q: nk.qsgd_dequantize(norms, q, 16, 512)),
    Case("terngrad_quantize", lambda i: (i.dyadic,),
         lambda s, x: nk.terngrad_quantize(x, 9)),
    Case("terngrad_dequantize", lambda i: nk.terngrad_quantize(i.dyadic, 9),
         lambda s, scale, t: nk.terngrad_dequantize(scale, t)),
    Case("sign_pack", lambda i: (i.normal,), lambda s, x: nk.sign_pack(x)),
    Case("sign_unpack", lambda i: (nk.sign_pack(i.normal), i.n),
         lambda s, packed, d: nk.sign_unpack(packed, d, 0.375)),
    Case("sign_vote (5 workers)",
         lambda i: (torch.stack([nk.sign_pack(x) for x in i.workers(5)]), i.n),
         lambda s, rows, d: nk.sign_vote(rows, d)),
    *[Case(f"pack_codes, unpack_codes ({bits} bits)",
           lambda i, bits=bits: (torch.from_numpy(np.random.default_rng(bits).integers(
               -(1 << (bits - 1)), 1 << (bits - 1), i.n).astype(np.int8)),),
           lambda s, q, bits=bits: (lambda p: (p, nk.unpack_codes(p, q.numel(), bits)))(
               nk.pack_codes(q, bits)))
      for bits in (1, 2, 3, 6, 8)],
    Case("dequantize_add (16 levels)",
         lambda i: (*_qsgd_codes(i, 512), i.normal),
         lambda s, norms, q, base: nk.dequantize_add(
             norms, nk.pack_codes(q, 5), 5, 16, 512, base.clone())),
    Case("topk (1%)", lambda i: (i.heavy, i.k), _topk),
    Case("topk (every element a candidate)",
         lambda i: (i.heavy[:min(i.n, _host.TOPK_SMALL)].clone(), max(1, min(i.n, 4096) // 3)),
         lambda s, x, k: nk.topk(x, k)),
    Case("topk (exactly k candidates)", _exact_candidates, _topk),
    Case("randomk (1%)", lambda i: (i.normal, i.k), lambda s, x, k: nk.randomk(x, k, 11)),
    Case("randomk_indices (half)", lambda i: (i.n,),
         lambda s, d: nk.randomk_indices(d, d // 2, 12, s.device)),
    Case("scatter", lambda i: _scatter_inputs(i, False),
         lambda s, idx, values, base: nk.scatter(idx, values, base.numel())),
    Case("scatter (accumulate, duplicates)", lambda i: _scatter_inputs(i, True),
         lambda s, idx, values, base: nk.scatter(idx, values, base.numel(), out=base.clone(),
                                                 accumulate=True)),
    *[Case(f"weighted_sum ({n} tensors)", lambda i, n=n: (i.workers(n),),
           lambda s, xs, n=n: nk.weighted_sum(xs, [0.5, 0.25, 0.125, 2.0, 0.0625][:n]))
      for n in (1, 2, 3, 4, 5)],
    Case("weighted_sum (3 tensors, weights 1/3)", lambda i: (i.workers(3),),
         lambda s, xs: nk.weighted_sum(xs, [1 / 3] * 3)),
    # the segmented functions the compressors call, one bucket per call
    *[Case(f"qsgd_quantize_segments (buckets of {b or 'a segment'})",
           lambda i: (i.dyadic, i.levels, i.seeds),
           lambda s, x, levels, seeds, b=b: nk.qsgd_quantize_segments(
               x, s.segments(x.numel()), levels, b, seeds))
      for b in (512, 0)],
    Case("pack_codes_segments", lambda i: (_segment_codes(i, 512)[1], i.bits),
         lambda s, q, bits: nk.pack_codes_segments(q, s.segments(q.numel()), bits)),
    *[Case(f"qsgd_packed_segments (buckets of {b or 'a segment'})",
           lambda i: (i.dyadic, i.levels, i.seeds),
           lambda s, x, levels, seeds, b=b: nk.qsgd_packed_segments(
               x, s.segments(x.numel()), levels, b, seeds))
      for b in (512, 0, 20)],
    Case("dequantize_segments", lambda i: (*_segment_codes(i, 512)[::2], i.bits, i.levels, i.n),
         lambda s, norms, packed, bits, levels, n: nk.dequantize_segments(
             norms, packed, s.segments(n), bits, levels, 512)),
    Case("dequantize_segments (add)",
         lambda i: (*_segment_codes(i, 512)[::2], i.bits, i.levels, i.normal),
         lambda s, norms, packed, bits, levels, base: nk.dequantize_segments(
             norms, packed, s.segments(base.numel()), bits, levels, 512, out=base.clone(),
             add=True)),
    Case("terngrad_quantize_segments", lambda i: (i.dyadic, i.seeds),
         lambda s, x, seeds: nk.terngrad_quantize_segments(x, s.segments(x.numel()), seeds)),
    Case("terngrad_packed_segments", lambda i: (i.dyadic, i.seeds),
         lambda s, x, seeds: nk.terngrad_packed_segments(x, s.segments(x.numel()), seeds)),
    Case("sign_pack_segments", lambda i: (i.normal,),
         lambda s, x: nk.sign_pack_segments(x, s.segments(x.numel()))),
    Case("sign_unpack_segments",
         lambda i: (_sign_rows(i, 1)[0], i.n,
                    torch.linspace(0.25, 2.0, i.count), -torch.linspace(0.5, 1.5, i.count)),
         lambda s, packed, n, high, low: nk.sign_unpack_segments(packed, s.segments(n), high,
                                                                 low)),
    Case("sign_vote_segments (5 workers)", lambda i: (_sign_rows(i, 5), i.n),
         lambda s, rows, n: nk.sign_vote_segments(rows, s.segments(n))),
    Case("topk_segments (1%)", lambda i: (i.heavy, i.ks),
         lambda s, x, ks: nk.topk_segments(x, s.segments(x.numel()), ks), ties_ok=True),
    Case("randomk_segments (1%)", lambda i: (i.normal, i.ks, i.seeds),
         lambda s, x, ks, seeds: nk.randomk_segments(x, s.segments(x.numel()), ks, seeds)),
]




# ---------------------------------------------------------------------------
# comparison
# ---------------------------------------------------------------------------


def _outputs(result) -> tuple[torch.Tensor, ...]:
    return tuple(result) if isinstance(result, (tuple, list)) else (result,)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns, for an exact comparison (NaN and -0.0 included)."""
    return t.view(torch.int32) if t.dtype == torch.float32 else t


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """The largest distance in float32 steps between same-signed elements of ``a`` and ``b``
    (-1 where a sign differs)."""
    ia, ib = a.view(torch.int32).long(), b.view(torch.int32).long()
    if ((ia < 0) != (ib < 0)).any():
        return -1
    return int((ia - ib).abs().max())


def compare(cpu, gpu, case: Case, args) -> tuple[str, str]:
    """(verdict, detail) of the CPU's outputs against the GPU's (both on the CPU)."""
    cpu, gpu = _outputs(cpu), _outputs(gpu)
    if len(cpu) != len(gpu):
        return "differs", f"{len(cpu)} outputs against {len(gpu)}"
    details = []
    for n, (a, b) in enumerate(zip(cpu, gpu)):
        if a.dtype != b.dtype or a.shape != b.shape:
            return "differs", f"output {n}: {a.dtype} {tuple(a.shape)} against {b.dtype} " \
                              f"{tuple(b.shape)}"
        if torch.equal(_bits(a), _bits(b)):
            continue
        if case.ties_ok and _same_up_to_ties(cpu, gpu, args):
            return "ties", "differs only among equal magnitudes (torch.topk's pick)"
        wrong = int((_bits(a) != _bits(b)).sum())
        detail = f"output {n}: {wrong:,} of {a.numel():,} elements differ"
        if a.dtype == torch.float32:
            ulps = _ulps(a, b)
            detail += f" (by at most {ulps} ulp)" if ulps >= 0 else " (signs too)"
        details.append(detail)
    return ("differs", "; ".join(details)) if details else ("same", "")


def _same_up_to_ties(cpu, gpu, args) -> bool:
    """topk_segments: each segment's kept magnitudes are the same multiset, and each kept
    value is the input's at its index."""
    x, ks = args[0], args[1]
    (_, cv), (gi, gv) = cpu, gpu
    if not torch.equal(_bits(x[gi]), _bits(gv)):
        return False
    o = 0
    for k in nk.Segments(segment_sizes(x.numel())).k_starts(ks)[3]:
        a, b = cv[o:o + k].abs().sort().values, gv[o:o + k].abs().sort().values
        if not torch.equal(a, b):
            return False
        o += k
    return True


def run_case(case: Case, inputs: Inputs, other: Side) -> Outcome:
    """``case`` on the CPU kernels and on ``other``'s, compared."""
    started = time.perf_counter()
    cpu_side = Side("cpu")
    with cpu_side.active():
        args = case.prepare(inputs)
        cpu = case.run(cpu_side, *args)
    try:
        with other.active():
            gpu = case.run(other, *other.put(args))
        if other.kind == "cuda":
            torch.cuda.synchronize()
        gpu = tuple(t.cpu() for t in _outputs(gpu))
    except Exception as error:  # one failing kernel is reported, the others still run
        return Outcome(case.name, inputs.n, "differs", f"failed: {type(error).__name__}: "
                       f"{str(error).splitlines()[0] if str(error) else ''}",
                       time.perf_counter() - started)
    verdict, detail = compare(cpu, gpu, case, args)
    return Outcome(case.name, inputs.n, verdict, detail, time.perf_counter() - started)


def run_cases(kind: str, sizes=None, names=None) -> list[Outcome]:
    """Every case (or those named) at each size, CPU against ``kind`` (``cuda`` or
    ``simulator``)."""
    side = Side(kind)
    if kind == "simulator":
        from . import _cuda

        if not _cuda.SIM:
            raise RuntimeError("the simulator side needs NUMBA_ENABLE_CUDASIM=1 before numba "
                               "is imported")
        fix_simulator_shared_arrays()
    sizes = sizes or (SIMULATOR_SIZES if kind == "simulator" else GPU_SIZES)
    outcomes = []
    for n in sizes:
        inputs = Inputs(n)
        for case in CASES:
            if names is None or case.name in names:
                outcomes.append(run_case(case, inputs, side))
    return outcomes


def markdown(outcomes: list[Outcome]) -> list[str]:
    rows = ["| function (its CUDA kernels against the CPU's) | elements | CUDA = CPU | s |",
            "|---|---|---|---|"]
    shown = {"same": "yes", "ties": "yes, up to ties", "differs": "**no**"}
    for o in outcomes:
        verdict = shown[o.verdict] + (f": {o.detail}" if o.detail else "")
        rows.append(f"| {o.case} | {o.size:,} | {verdict} | {o.seconds:.2f} |")
    same = sum(o.ok for o in outcomes)
    rows += ["", f"{same} of {len(outcomes)} comparisons bit for bit (or up to ties)."]
    return rows


# ---------------------------------------------------------------------------
# the simulator: its shared arrays, and which kernels the cases launch
# ---------------------------------------------------------------------------


_FIXED = False


def fix_simulator_shared_arrays() -> None:
    """The simulator's `cuda.shared.array` looks up a block's array by the calling line and
    creates it if absent, without a lock: two threads of a block that get there at once each
    make their own, and one of them computes with memory the others never see (a NaN norm,
    a wrong top-k). The same lookup, under a lock. Also polls its barriers more often (they
    are GIL-bound)."""
    global _FIXED
    if _FIXED:
        return
    import threading

    from numba.core import types
    from numba.cuda.simulator import kernelapi
    from numba.np import numpy_support

    sys.setswitchinterval(5e-5)
    lock = threading.Lock()
    simulator_array = kernelapi.FakeCUDAShared.array

    def array(self, shape, dtype, alignment=None):
        if shape == 0 or alignment is not None:  # dynamic shared memory: no lookup
            return simulator_array(self, shape, dtype, alignment)
        caller = sys._getframe(1)
        key = (caller.f_code.co_filename, caller.f_lineno)
        if isinstance(dtype, types.Type):
            dtype = numpy_support.as_dtype(dtype)
        with lock:
            arrays = self.__dict__.setdefault("arrays_by_line", {})
            if key not in arrays:
                arrays[key] = np.empty(shape, dtype)
            return arrays[key]

    kernelapi.FakeCUDAShared.array = array
    _FIXED = True


def all_kernels() -> set[str]:
    """Every kernel of ``numba_kernels._cuda`` (under the simulator): the declared ones
    (``KERNELS``) and the others, device functions left out."""
    from numba.cuda.simulator.kernel import FakeCUDAKernel

    from . import _cuda

    found = set(_cuda.KERNELS)
    for name, value in vars(_cuda).items():
        if isinstance(value, FakeCUDAKernel) and not value._device:
            found.add(value.fn.__name__)
    return found


@contextlib.contextmanager
def launched_kernels():
    """Under the simulator: the set of kernel names launched inside the block."""
    from numba.cuda.simulator.kernel import FakeCUDAKernel

    from . import _cuda

    names: set[str] = set()
    fake, declared = FakeCUDAKernel.__getitem__, _cuda._Kernel.__getitem__

    def fake_item(self, config):
        names.add(self.fn.__name__)
        return fake(self, config)

    def declared_item(self, config):
        names.add(self.name)
        return declared(self, config)

    FakeCUDAKernel.__getitem__, _cuda._Kernel.__getitem__ = fake_item, declared_item
    try:
        yield names
    finally:
        FakeCUDAKernel.__getitem__, _cuda._Kernel.__getitem__ = fake, declared


def _size(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20}.get(text[-1:], 1)
    return int(float(text.rstrip("KM")) * scale)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "simulator"), default="cuda")
    parser.add_argument("--sizes", help="comma-separated, e.g. 1M,16M (default: 1M,16M on a "
                                        "GPU, 1003 under the simulator)")
    args = parser.parse_args(argv)
    sizes = tuple(_size(s) for s in args.sizes.split(",")) if args.sizes else None
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device")
        return 2
    if args.device == "simulator":
        import warnings

        warnings.simplefilter("ignore", RuntimeWarning)  # uint64 wrap-around in NumPy scalars
        run_cases("simulator", sizes[:1] if sizes else None, names=[CASES[0].name])  # warm
        with launched_kernels() as names:
            outcomes = run_cases("simulator", sizes)
        missed = sorted(all_kernels() - names)
    else:
        outcomes, missed = run_cases("cuda", sizes), []
    lines = markdown(outcomes)
    if missed:
        lines.append(f"Kernels no case launched: {', '.join(missed)}.")
    print("\n".join(lines))
    return 0 if all(o.ok for o in outcomes) and not missed else 1


if __name__ == "__main__":
    sys.exit(main())
