"""Writes tests/fixtures/compressor_reference.json: what every built-in compressor computes on
fixed inputs, recorded from the per-tensor code before compression moved to buckets (issue 47),
so that tests/test_compressor_buckets.py can check the bucketed code gives the same bits.

    python tests/make_compressor_reference.py          # rewrite the fixture
    python tests/make_compressor_reference.py --check  # compare the current code with it

The inputs are multiples of 2^-10 below 4 in magnitude: every sum of them that torch takes
(ef_sign's and onebit's means) is exact in float32 whatever the order of the additions, so the
recorded bits do not depend on the machine's vector width. Each result is recorded as the
SHA-256 of its bytes, shape and dtype. PowerSGD's products and QR do depend on the BLAS: its
results are recorded as numbers and compared within float tolerance.

It uses only the per-tensor API (`compress`, `decompress`, `combine`, `compressed_average`),
which exists before and after the change.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dsgd_cli.api import ErrorFeedback, compressed_average  # noqa: E402
from dsgd_cli.spec.experiments import build_plugin  # noqa: E402

FIXTURE = ROOT / "tests" / "fixtures" / "compressor_reference.json"

# name, options: every built-in compressor, and the options that take other code paths
CONFIGS = {
    "none": {"name": "none"},
    "fp16": {"name": "fp16"},
    "bf16": {"name": "bf16"},
    "qsgd": {"name": "qsgd", "levels": 16, "bucket_size": 512},
    "qsgd-b100-l4": {"name": "qsgd", "levels": 4, "bucket_size": 100},  # buckets not of 8
    "qsgd-whole": {"name": "qsgd", "levels": 127, "bucket_size": 0},
    "qsgd-rescale": {"name": "qsgd", "levels": 8, "bucket_size": 64, "rescale": True},
    "dqsgd": {"name": "dqsgd"},
    "dqsgd-b100": {"name": "dqsgd", "bucket_size": 100, "variance_budget": 0.1},
    "terngrad": {"name": "terngrad"},
    "sign": {"name": "sign"},
    "ef_sign": {"name": "ef_sign"},
    "onebit": {"name": "onebit"},
    "topk": {"name": "topk", "ratio": 0.05},
    "randomk": {"name": "randomk", "ratio": 0.05},
    "randomk-biased": {"name": "randomk", "ratio": 0.1, "unbiased": False},
    "powersgd": {"name": "powersgd", "rank": 2},
    "powersgd-cold": {"name": "powersgd", "rank": 1, "warm_start": False},
}
SHAPES = [(0,), (1,), (7,), (13, 5), (3, 4, 2), (40, 24), (700,), (300, 3), (9, 1)]
POWERSGD_SHAPES = [(13, 5), (7,), (3, 4, 2), (40, 24)]


class Recorder:
    def log(self, name, value):
        pass


def make(options: dict, rank: int):
    compressor = build_plugin("compressor", dict(options))
    compressor.setup(SimpleNamespace(seed=11, rank=rank, world_size=2, metrics=Recorder()))
    return compressor


def inputs(rank: int, step: int, shapes) -> list[torch.Tensor]:
    """Multiples of 2^-10 in (-4, 4), zeros and ties included."""
    generator = torch.Generator().manual_seed(1000 * rank + step)
    return [torch.randint(-4095, 4096, shape, generator=generator).float() / 1024
            for shape in shapes]


class OneWorker:
    world_size = 1

    def all_reduce(self, tensor, op="sum"):
        pass

    def all_gather(self, tensor):
        return [tensor.clone()]


class TwoAlike:
    """Two workers that send the same payloads: the sum doubles, the gather repeats."""

    world_size = 2

    def all_reduce(self, tensor, op="sum"):
        tensor.mul_(2)

    def all_gather(self, tensor):
        return [tensor.clone(), tensor.clone()]


def residuals_per_tensor(memory, keys, shapes) -> list:
    """Each tensor's residual: kept per tensor (before issue 47) or as the tensor's part of
    its bucket's one flat residual (after)."""
    if all(key in memory.residuals for key in keys):
        return [memory.residuals[key] for key in keys]
    [flat] = memory.residuals.values()
    sizes = [torch.Size(shape).numel() for shape in shapes]
    parts = flat.split(sizes)
    # before, an empty tensor sent nothing and kept no residual
    return [part.view(shape) if part.numel() else None for part, shape in zip(parts, shapes)]


def digest(t: torch.Tensor) -> str:
    t = t.detach().contiguous()
    head = f"{tuple(t.shape)}|{t.dtype}|".encode()
    return hashlib.sha256(head + t.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()[:24]


def record(name: str, options: dict) -> dict:
    """{record name: digest or list of numbers}."""
    exact = not options["name"].startswith("powersgd")
    shapes = SHAPES if exact else POWERSGD_SHAPES
    keys = [f"param{i}" for i in range(len(shapes))]
    out: dict = {}

    def put(label, tensor):
        out[label] = digest(tensor) if exact else [round(v, 7) for v in tensor.reshape(-1).tolist()]

    # error feedback over two steps, one worker
    compressor, memory = make(options, rank=0), ErrorFeedback()
    for step in range(2):
        averages = compressed_average(compressor, OneWorker(), inputs(0, step, shapes), keys,
                                      step, memory)
        residuals = residuals_per_tensor(memory, keys, shapes)
        for key, average, residual in zip(keys, averages, residuals):
            put(f"ef/{step}/{key}/average", average)
            put(f"ef/{step}/{key}/residual", residual if residual is not None else torch.zeros(0))
    if not exact:
        return out
    # two workers sending alike, no memory
    averages = compressed_average(make(options, rank=1), TwoAlike(), inputs(1, 5, shapes), keys, 5)
    for key, average in zip(keys, averages):
        put(f"two/{key}/average", average)
    # two workers with their own data: each one's decompressed payload and the combination
    first, second = make(options, rank=0), make(options, rank=1)
    for key, x0, x1 in zip(keys, inputs(0, 7, shapes), inputs(1, 7, shapes)):
        if not x0.numel():
            continue
        p0, p1 = first.compress(x0, key, 7), second.compress(x1, key, 7)
        put(f"pair/{key}/own0", first.decompress(p0, x0))
        put(f"pair/{key}/own1", second.decompress(p1, x1))
        for i, t in enumerate(p0.tensors):
            put(f"pair/{key}/payload0/{i}", t)
        if not first.summable:
            put(f"pair/{key}/combined", first.combine([p0, p1], x0))
    return out


def compute() -> dict:
    torch.set_num_threads(1)
    return {name: record(name, options) for name, options in CONFIGS.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare, do not write")
    args = parser.parse_args()
    results = compute()
    if not args.check:
        FIXTURE.write_text(json.dumps(results, indent=0, sort_keys=True) + "\n")
        print(f"wrote {FIXTURE}")
        return
    expected = json.loads(FIXTURE.read_text())
    bad, largest = [], 0.0
    for name, records in expected.items():
        for label, value in records.items():
            got = results[name].get(label)
            if isinstance(value, list) and isinstance(got, list) and len(got) == len(value):
                difference = max((abs(a - b) for a, b in zip(got, value)), default=0.0)
                largest = max(largest, difference)
                if difference > 1e-5:
                    bad.append(f"{name}: {label} (differs by {difference:.3g})")
            elif got != value:
                bad.append(f"{name}: {label}")
    print("\n".join(bad) if bad else "all equal (PowerSGD's numbers within "
          f"{largest:.3g} of the recorded ones)")


if __name__ == "__main__":
    main()
