"""A 24-point grid as one local `dsgd run` against the same points as a SLURM job array
(`dsgd submit --slurm`), each into a PostgreSQL database of its own: wall-clock seconds of each
and their ratio (the array should take at most 1.2x the local run on the same cores).

The grid: the README's comparison (allreduce, local_sgd, sgp, adpsgd on an emulated cluster) x
seeds 1, 2, 3 x 2 and 4 workers. `--epochs` shortens every point alike (fewer epochs make the
array's per-task start-up weigh more, so the ratio is the harder one).

    python benchmarks/slurm_sweep.py --db-local postgresql+psycopg://me@/a?host=/tmp/pg \\
        --db-array postgresql+psycopg://me@/b?host=/tmp/pg --concurrency 2 --cpus-per-task 1

SLURM's clients must reach a cluster (SLURM_CONF); `--start-slurm` starts the tests' one-machine
SLURM (tests/slurm_cluster.py) for the measurement and stops it after.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from results_row import print_rows

ROOT = Path(__file__).resolve().parent.parent
GRID = "grid: {seed: [1, 2, 3], workers: [2, 4]}"
SPEC = """\
defaults:
  task: {name: mnist1d_mlp}
  workers: 4
  epochs: EPOCHS
  optimizer: {name: sgd, lr: 0.1, momentum: 0.9}
  compute: {step_seconds: 0.01, time_scale: 8}
  network: {bandwidth: 100Mbit, latency: 1ms}
experiments:
  - {name: allreduce, aggregator: {name: allreduce}, GRID}
  - {name: local_sgd, aggregator: {name: local_sgd, period: 4}, GRID}
  - {name: sgp, aggregator: {name: sgp}, GRID}
  - {name: adpsgd, aggregator: {name: adpsgd}, GRID}
"""

def dsgd(*args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    import os

    result = subprocess.run([sys.executable, "-m", "dsgd_cli", *args], cwd=cwd, text=True,
                            capture_output=True, env={**os.environ, **(env or {})})
    if result.returncode != 0:
        raise SystemExit(f"dsgd {' '.join(args)} failed: {result.stderr[-2000:]}")
    return result


def completed_runs(url: str) -> int:
    from dsgd_cli.results.reader import Results

    return sum(run.status == "completed" for run in Results(url).runs())


def local_seconds(spec: Path, url: str) -> float:
    start = time.monotonic()
    dsgd("run", str(spec), "--db", url, cwd=spec.parent)
    return time.monotonic() - start


def array_seconds(spec: Path, url: str, args: argparse.Namespace, env: dict) -> float:
    start = time.monotonic()
    dsgd("submit", str(spec), "--slurm", "--db", url, "--concurrency", str(args.concurrency),
         "--cpus-per-task", str(args.cpus_per_task), "--log-dir", str(spec.parent / "logs"),
         cwd=spec.parent, env=env)
    while subprocess.run(["squeue", "--noheader"], capture_output=True, text=True,
                         env={**__import__("os").environ, **env}).stdout.strip():
        time.sleep(0.5)
    return time.monotonic() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--db-local", required=True, help="PostgreSQL URL for the local run")
    parser.add_argument("--db-array", required=True, help="PostgreSQL URL for the array")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--cpus-per-task", type=int, default=1)
    parser.add_argument("--start-slurm", action="store_true")
    args = parser.parse_args()

    cluster, env = None, {}
    if args.start_slurm:
        sys.path.insert(0, str(ROOT / "tests"))
        import slurm_cluster

        cluster = slurm_cluster.start()
        env = cluster.env()
    try:
        directory = Path(tempfile.mkdtemp(prefix="dsgd-slurm-sweep-"))
        spec = directory / "sweep.yaml"
        spec.write_text(SPEC.replace("EPOCHS", str(args.epochs)).replace("GRID", GRID))
        local = local_seconds(spec, args.db_local)
        array = array_seconds(spec, args.db_array, args, env)
    finally:
        if cluster is not None:
            cluster.stop()
    print(f"24 points, {args.epochs} epochs each; array: concurrency {args.concurrency}, "
          f"{args.cpus_per_task} CPU per task")
    local_runs, array_runs = completed_runs(args.db_local), completed_runs(args.db_array)
    print(f"local dsgd run: {local:.1f} s, {local_runs} runs completed")
    print(f"SLURM array:    {array:.1f} s, {array_runs} runs completed")
    print(f"array / local:  {array / local:.2f}")
    print_rows(("A 24-point grid as a SLURM job array / one local `dsgd run`",
                f"{array / local:.2f} ({array:.1f} s against {local:.1f} s, {array_runs} and "
                f"{local_runs} runs completed; goal ≤ 1.2)"))


if __name__ == "__main__":
    main()
