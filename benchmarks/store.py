"""How fast the reading commands answer on a database of a long project.

Fills a fresh SQLite database with 2,000 runs (5 aggregators x 4 compressors x 5 learning
rates x 20 seeds) of 10 metrics with 100 recorded points each (2,000,000 metric rows), then
times whole commands, as a user runs them (process start included), the median of
`--repeat` runs each:

    dsgd compare                                        (2,000 rows)
    dsgd compare --by aggregator,compressor             (20 groups, mean ± std)
    dsgd compare --target test_accuracy=0.9             (reads 200,000 history rows)
    dsgd plot --by aggregator,compressor -o FILE.png    (20 mean curves with bands)
    dsgd plot sweep[...] -o FILE.png                     (the 20 seeds of one grid point)

Baselines in the same run: the interpreter starting and exiting (`python -c pass`), and one
raw sqlite3 query per command reading the same rows (the summaries, or the history of one
metric), which is what a hand-written script would at least pay. Printed: seconds, and the
ratio to the raw query. The target of the issue that asked for it: each command under 1 s.

    python benchmarks/store.py [--db FILE] [--repeat 3]
"""

from __future__ import annotations

import argparse
import itertools
import math
import random
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dsgd_cli.results.store import MetricRow, Store
from results_row import print_rows

AGGREGATORS = ["allreduce", "local_sgd", "sgp", "adpsgd", "wagma"]
COMPRESSORS = ["none", "qsgd", "topk", "powersgd"]
LEARNING_RATES = [0.01, 0.02, 0.05, 0.1, 0.2]
SEEDS = range(20)
POINTS = 100
PER_RANK = ["train_loss", "lr", "step_seconds", "comm_seconds", "compute_seconds", "bytes_sent",
            "bytes_received"]
PER_RUN = ["test_accuracy", "test_loss", "consensus_distance"]


def fill(path: Path) -> int:
    store = Store(str(path))
    rng = random.Random(0)
    count = 0
    for aggregator, compressor, lr, seed in itertools.product(AGGREGATORS, COMPRESSORS,
                                                              LEARNING_RATES, SEEDS):
        config = {"name": "sweep", "task": {"name": "mnist1d_mlp"}, "workers": 4, "seed": seed,
                  "optimizer": {"name": "sgd", "lr": lr}, "aggregator": {"name": aggregator},
                  "compressor": {"name": compressor}, "epochs": 10, "batch_size": 32}
        name = f"sweep[aggregator.name={aggregator},compressor.name={compressor},optimizer.lr={lr},seed={seed}]"
        run_id = store.create_run(name, config, "spec.yaml", [])
        speed = rng.uniform(0.5, 2.0)
        rows = []
        for point in range(1, POINTS + 1):
            step, seconds = point * 10, point * 0.1 / speed
            progress = 1 - math.exp(-point / (30 * speed))
            for metric in PER_RANK:
                rows.append(MetricRow(metric, rng.random() + (1 - progress), step, point // 10,
                                      0, seconds))
            rows.append(MetricRow("test_accuracy", 0.95 * progress, step, point // 10, None, seconds))
            rows.append(MetricRow("test_loss", 2 * (1 - progress), step, point // 10, None, seconds))
            rows.append(MetricRow("consensus_distance", rng.random(), step, point // 10, None, seconds))
        rows += [MetricRow("wall_seconds", POINTS * 0.1 / speed),
                 MetricRow("samples_per_second", 1000 * speed),
                 MetricRow("total_bytes_sent", 1e6 * rng.random())]
        store.add_metrics(run_id, rows)
        store.finish_run(run_id, "completed")
        count += len(rows)
    return count


def timed(command: list[str], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        result = subprocess.run(command, capture_output=True, text=True)
        times.append(time.perf_counter() - started)
        if result.returncode != 0:
            sys.exit(f"{' '.join(command)} failed:\n{result.stderr}")
    return statistics.median(times)


def raw_query(db: Path, sql: str, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        with sqlite3.connect(db) as connection:
            connection.execute(sql).fetchall()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", type=Path, help="reuse (or create) this database file")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="dsgd-bench-store-"))
    db = args.db or workdir / "bench.db"
    if not db.exists():
        started = time.perf_counter()
        rows = fill(db)
        print(f"filled {db}: 2000 runs, {rows:,} metric rows in {time.perf_counter() - started:.0f} s")
    dsgd = [sys.executable, "-m", "dsgd_cli"]
    point = "sweep[aggregator.name=sgp,compressor.name=qsgd,optimizer.lr=0.05"
    summaries = "SELECT * FROM runs JOIN summaries ON summaries.run_id = runs.id"
    history = "SELECT run_id, step, seconds, value FROM metrics WHERE name = 'test_accuracy'"
    cases = [
        ("compare", ["compare"], summaries),
        ("compare --by", ["compare", "--by", "aggregator,compressor"], summaries),
        ("compare --target", ["compare", "--target", "test_accuracy=0.9"], history),
        ("plot --by -o", ["plot", "--by", "aggregator,compressor", "-o", str(workdir / "by.png")],
         history),
        ("plot 20 runs -o", ["plot", "--where", "aggregator=sgp", "--where", "compressor=qsgd",
                             "--where", "optimizer.lr=0.05", "-o", str(workdir / "runs.png")],
         history + f" AND run_id IN (SELECT id FROM runs WHERE experiment LIKE '{point}%')"),
    ]
    start = timed([sys.executable, "-c", "pass"], args.repeat)
    print(f"python start and exit: {start:.3f} s\n")
    print(f"{'command':<18} {'seconds':>8} {'raw query':>10} {'ratio':>7}  under 1 s")
    measured = []
    for label, command, sql in cases:
        seconds = timed(dsgd + command + ["--db", str(db)], args.repeat)
        measured.append(f"`{label}` {seconds:.2f}")
        floor = raw_query(db, sql, args.repeat)
        print(f"{label:<18} {seconds:>8.2f} {floor:>10.3f} {seconds / floor:>7.1f}  "
              f"{'yes' if seconds < 1 else 'NO'}")
    print_rows(("Reading commands on 2,000 runs × 10 metrics × 100 points, median seconds",
                ", ".join(measured) + f" (median of {args.repeat}; python start {start:.3f})"))


if __name__ == "__main__":
    main()
