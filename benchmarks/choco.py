"""Exact gossip (dpsgd) against CHOCO-SGD and DCD-PSGD with compressed messages, loss against
bytes, on the CHOCO-SGD paper's convex problem (Koloskova, Stich, Jaggi, ICML 2019, Fig. 3):
logistic regression on a ring of workers, data split at random or by label (`--split
by_label`: sorted by label and cut into contiguous parts, the paper's harder setting, where
each worker holds one class).

Compressors, as in the paper: top-1% (int32 index + float32 value per kept entry), random-1%
(values only, indices from a shared seed; unscaled, the contractive variant) and 4-bit QSGD
(7 levels; rescaled by 1/(1 + ω) for choco, unbiased for dcd). choco tunes γ with
`gamma: auto`; dcd runs at the same step size and at each smaller one of `--dcd-lr-divisors`.

All experiments go through one `dsgd run` (torchrun, gloo on CPU) into a temporary database.
Printed per experiment: the final training loss (mean over the workers' own models), the test
loss of the average model, the bytes all workers sent, and the bytes they had sent when the
training loss first came within 2% of dpsgd's final training loss (`dsgd compare --target`),
as a ratio to dpsgd's.

    python benchmarks/choco.py [--workers 8] [--epochs 10] [--features 200] [--lr 0.02]
                               [--split random|by_label] [--dcd-lr-divisors 10,100]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml
from results_row import print_rows

TOP1 = {"name": "topk", "ratio": 0.01}
RAND1 = {"name": "randomk", "ratio": 0.01, "unbiased": False}
QSGD4 = {"name": "qsgd", "levels": 7}  # ⌈log₂ 8⌉ + 1 = 4 bits per element


def experiments(lr: float, dcd_divisors: list[int]) -> list[dict]:
    ring = {"topology": "ring"}
    runs = [{"name": "dpsgd", "aggregator": {"name": "dpsgd", **ring}}]
    for label, compressor in [("top1", TOP1), ("rand1", RAND1),
                              ("qsgd4", {**QSGD4, "rescale": True})]:
        runs.append({"name": f"choco-{label}", "aggregator": {
            "name": "choco", "gamma": "auto", **ring, "compressor": compressor}})
    smaller = [(f"dcd-lr/{d}", {"optimizer": {"name": "sgd", "lr": lr / d}}) for d in dcd_divisors]
    for prefix, extra in [("dcd", {}), *smaller]:
        for label, compressor in [("top1", TOP1), ("rand1", RAND1), ("qsgd4", QSGD4)]:
            runs.append({"name": f"{prefix}-{label}", **extra, "aggregator": {
                "name": "dcd", **ring, "compressor": compressor}})
    return runs


def spec(args) -> dict:
    return {
        "defaults": {
            "task": {"name": "logreg", "samples": args.samples, "features": args.features},
            "workers": args.workers, "epochs": args.epochs, "batch_size": 32, "seed": 0,
            "data_split": args.split,
            "optimizer": {"name": "sgd", "lr": args.lr}, "log_interval": 16,
        },
        "experiments": experiments(args.lr, args.dcd_lr_divisors),
    }


def compare(db: Path, *options: str) -> dict[str, dict]:
    result = subprocess.run([sys.executable, "-m", "dsgd_cli", "compare", "--db", str(db),
                             "--format", "json", "--metric", "choco_gamma", *options],
                            capture_output=True, text=True, check=True)
    return {row["experiment"]: row for row in json.loads(result.stdout)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--samples", type=int, default=16384)
    parser.add_argument("--features", type=int, default=200)
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--split", choices=["random", "by_label"], default="random")
    parser.add_argument("--dcd-lr-divisors", default=[10], help="e.g. 10,100",
                        type=lambda text: [int(d) for d in text.split(",")])
    args = parser.parse_args()
    split = "at random" if args.split == "random" else "by label"
    print(f"logreg, d = {args.features}, {args.samples} examples split {split}, ring of "
          f"{args.workers} workers (gloo, CPU), batch 32, {args.epochs} epochs, sgd lr {args.lr}")
    with tempfile.TemporaryDirectory() as directory:
        tmp = Path(directory)
        (tmp / "spec.yaml").write_text(yaml.safe_dump(spec(args), sort_keys=False))
        db = tmp / "r.db"
        result = subprocess.run([sys.executable, "-m", "dsgd_cli", "run", str(tmp / "spec.yaml"),
                                 "--db", str(db)], capture_output=True, text=True)
        if result.returncode not in (0, 1):  # 1: a run failed or diverged, shown below
            raise SystemExit(result.stderr)
        target = compare(db)["dpsgd"]["train_loss"] * 1.02
        rows = compare(db, "--target", f"train_loss={target}")
    reference = rows["dpsgd"]["bytes_to_target"]
    print(f"target: training loss {target:.4f} (dpsgd's final + 2%)")
    print(f"{'experiment':18} {'status':10} {'train loss':>10} {'test loss':>10} {'MB sent':>9} "
          f"{'MB to target':>12} {'dpsgd / it':>10} {'gamma':>7}")
    for name, row in rows.items():
        to_target = row.get("bytes_to_target")
        ratio = f"{reference / to_target:10.1f}" if to_target else f"{'never':>10}"
        gamma = row.get("choco_gamma")
        print(f"{name:18} {row['status']:10} {_number(row['train_loss'], 10)} "
              f"{_number(row['test_loss'], 10)} {row['total_bytes_sent'] / 1e6:9.3f} "
              f"{_number(to_target and to_target / 1e6, 12)} {ratio} "
              f"{'' if gamma is None else f'{gamma:7.4f}'}")
    print_rows((f"CHOCO-SGD and DCD, logreg on a ring of {args.workers} (split {split}): D-PSGD's "
                "bytes to its loss / each one's",
                ", ".join(f"{name} " + (f"{reference / row['bytes_to_target']:.1f}×"
                                        if row.get("bytes_to_target") else "never")
                          for name, row in rows.items() if name != "dpsgd")))


def _number(value, width: int) -> str:
    return f"{value:{width}.4f}" if isinstance(value, (int, float)) else f"{'-':>{width}}"


if __name__ == "__main__":
    main()
