"""allreduce against each gossip aggregator (dpsgd, sgp, osgp, adpsgd) on one task, one run each.

All experiments go through `dsgd run` (torchrun, gloo on CPU) with the same task, workers,
batch, optimizer and emulated network, into a temporary database read back with
`dsgd_cli.results.store.Store`. Printed per algorithm, and as a ratio to allreduce:

* time per epoch: rank 0's wall time (training and evaluation) divided by the epochs;
* bytes sent per worker per step: the run's total bytes / (workers * steps);
* final test accuracy of the average model, and the mean over the workers' own models.

    python benchmarks/gossip.py [--workers 4] [--epochs 10] [--bandwidth 10Mbit] [--latency 1ms]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml
from results_row import print_rows

ALGORITHMS = [
    ("allreduce", {"name": "allreduce"}),
    ("dpsgd", {"name": "dpsgd", "topology": "ring"}),
    ("sgp", {"name": "sgp", "topology": "time_varying_exponential"}),
    ("osgp", {"name": "osgp", "topology": "time_varying_exponential", "tau": 4}),
    ("adpsgd", {"name": "adpsgd", "topology": "ring"}),
]


def spec(args) -> dict:
    return {
        "defaults": {
            "task": {"name": args.task},
            "workers": args.workers,
            "epochs": args.epochs,
            "batch_size": 32,
            "seed": 0,
            "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
            "network": {"bandwidth": args.bandwidth, "latency": args.latency},
            "log_interval": 8,
        },
        "experiments": [{"name": name, "aggregator": aggregator} for name, aggregator in ALGORITHMS],
    }


def measure(db: Path, workers: int, epochs: int) -> dict[str, dict[str, float]]:
    from dsgd_cli.results.store import Store

    store = Store(str(db))
    results = {}
    for run in store.runs():
        if run.status != "completed":
            raise SystemExit(f"{run.experiment}: {run.status}: {run.reason}")
        final = {s.name: s.final for s in run.summaries}
        steps = max(m.step for m in store.metric_history(run.id, "train_loss"))
        results[run.experiment] = {
            "epoch_s": final["wall_seconds"] / epochs,
            "bytes": final["total_bytes_sent"] / (workers * steps),
            "accuracy": final["test_accuracy"],
            "workers_accuracy": final.get("test_accuracy_workers", final["test_accuracy"]),
        }
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="mnist1d_cnn")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--bandwidth", default="10Mbit")
    parser.add_argument("--latency", default="1ms")
    args = parser.parse_args()
    print(f"{args.task}, {args.workers} workers (gloo, CPU), batch 32 per worker, {args.epochs} "
          f"epochs, emulated network {args.bandwidth} per link, {args.latency} per message")
    with tempfile.TemporaryDirectory() as directory:
        tmp = Path(directory)
        (tmp / "spec.yaml").write_text(yaml.safe_dump(spec(args), sort_keys=False))
        db = tmp / "bench.db"
        result = subprocess.run([sys.executable, "-m", "dsgd_cli", "run", str(tmp / "spec.yaml"),
                                 "--db", str(db)], capture_output=True, text=True)
        if result.returncode != 0:
            raise SystemExit(result.stderr)
        results = measure(db, args.workers, args.epochs)
    base = results["allreduce"]
    print(f"{'algorithm':10s} {'s/epoch':>8s} {'bytes/worker/step':>18s} {'accuracy':>9s} "
          f"{'workers acc':>11s} {'time ratio':>11s} {'bytes ratio':>12s} {'acc ratio':>10s}")
    for name, _ in ALGORITHMS:
        r = results[name]
        print(f"{name:10s} {r['epoch_s']:8.2f} {r['bytes']:18.0f} {r['accuracy']:9.3f} "
              f"{r['workers_accuracy']:11.3f} {r['epoch_s'] / base['epoch_s']:11.2f} "
              f"{r['bytes'] / base['bytes']:12.2f} {r['accuracy'] / base['accuracy']:10.2f}")
    others = [name for name, _ in ALGORITHMS if name != "allreduce"]
    ratio = lambda key: ", ".join(f"{results[n][key] / base[key]:.2f}" for n in others)
    print_rows((f"Gossip against allreduce ({args.task}, {args.workers} workers, {args.bandwidth}, "
                f"{args.latency}): time per epoch / allreduce's",
                ", ".join(f"{n} {results[n]['epoch_s'] / base['epoch_s']:.2f}" for n in others)
                + f"; bytes {ratio('bytes')}; accuracy {ratio('accuracy')}"))


if __name__ == "__main__":
    main()
