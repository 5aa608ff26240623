"""How long the commands that do not train take to start and answer, against the floor: the
Python interpreter starting and exiting (`python -c pass`).

A results database of `--runs` recorded runs (2,000 by default, each with a few metrics and
tags) is filled once in a temporary directory; then each command runs `--repeat` times, the
commands interleaved, and the median and range of their wall times are printed. The target of
the issue that asked for it: at most 0.5 s each.

    python benchmarks/commands.py [--runs 2000] [--repeat 7]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dsgd_cli.results.store import MetricRow, Store
from results_row import print_rows

DSGD = [sys.executable, "-m", "dsgd_cli"]


def fill(db: Path, runs: int) -> None:
    store = Store(str(db))
    for index in range(runs):
        config = {"name": f"sweep[optimizer.lr={index}]", "workers": 2, "epochs": 1,
                  "task": {"name": "mnist1d_mlp"}, "optimizer": {"name": "sgd", "lr": index / runs},
                  "aggregator": {"name": "allreduce"}, "compressor": {"name": "none"}}
        run_id = store.create_run(config["name"], config, "spec.yaml",
                                  [("aggregator", "allreduce", "dsgd", "0.1.0")])
        store.add_metrics(run_id, [MetricRow("train_loss", 2.0 - step / 10, step=step, rank=rank)
                                   for step in range(1, 6) for rank in (0, 1)]
                          + [MetricRow("test_accuracy", 0.5 + index / (2 * runs), epoch=0),
                             MetricRow("wall_seconds", 1.0), MetricRow("samples_per_second", 1e4)])
        store.finish_run(run_id, "completed")
    store.tag_run(1, ["baseline"])


def seconds(command: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2000)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        db = Path(directory) / "results.db"
        fill(db, args.runs)
        commands = {
            "python -c pass (the floor)": [sys.executable, "-c", "pass"],
            "dsgd --help": [*DSGD, "--help"],
            "dsgd plugins": [*DSGD, "plugins"],
            "dsgd runs": [*DSGD, "runs", "--db", str(db)],
            "dsgd compare": [*DSGD, "compare", "--db", str(db)],
            "dsgd compare --by optimizer.lr --baseline 1": [
                *DSGD, "compare", "--db", str(db), "--by", "optimizer.lr", "--baseline", "1"],
            "dsgd show 1": [*DSGD, "show", "1", "--db", str(db)],
        }
        times: dict[str, list[float]] = {name: [] for name in commands}
        for _ in range(args.repeat):
            for name, command in commands.items():
                times[name].append(seconds(command))
    print(f"{args.runs} runs recorded; {args.repeat} runs of each command, seconds")
    print(f"{'command':46} {'median':>7} {'min':>6} {'max':>6}")
    for name, values in times.items():
        print(f"{name:46} {statistics.median(values):7.3f} {min(values):6.3f} {max(values):6.3f}")
    print_rows((f"Commands that do not train, median wall seconds over {args.runs:,} recorded runs",
                ", ".join(f"`{name}` {statistics.median(values):.3f}"
                          for name, values in times.items())))


if __name__ == "__main__":
    main()
