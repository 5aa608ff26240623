"""The fixed cost per experiment of a sweep: one torchrun per experiment against shared launches.

A 20-point grid of 1-step `mnist1d_mlp` experiments with 2 workers (learning rates, one seed),
run by `dsgd run --isolate` (one torchrun, Python, torch and gloo start per experiment) and by
`dsgd run` (consecutive experiments share a launch), alternately, `--repeat` times each.

Printed per path: total wall time, and the fixed cost per experiment: (total wall time - the
runs' own training time, `wall_seconds`) / experiments. The target of the issue that asked for
it: at most 1 s per experiment on the shared path.

    python benchmarks/sweep.py [--points 20] [--repeat 1]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dsgd_cli.results.reader import Results
from results_row import print_rows

SPEC = """
defaults:
  task: {{name: mnist1d_mlp}}
  workers: 2
  steps_per_epoch: 1
experiments:
  - name: sweep
    grid: {{optimizer.lr: [{rates}]}}
"""


def sweep(spec: Path, db: Path, flags: list[str]) -> tuple[float, float]:
    """(total wall seconds, the runs' own training seconds summed)."""
    started = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "dsgd_cli", "run", str(spec), "--db", str(db),
                             *flags], capture_output=True, text=True)
    total = time.perf_counter() - started
    if result.returncode != 0:
        sys.exit(f"dsgd run {' '.join(flags)} failed:\n{result.stderr}")
    store = Results(str(db))
    finals = store.finals([run.id for run in store.runs(details=False)])
    return total, sum(metrics.get("wall_seconds", 0.0) for metrics in finals.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", type=int, default=20)
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="dsgd-bench-sweep-"))
    rates = ", ".join(f"{0.01 * (i + 1):.2f}" for i in range(args.points))
    spec = workdir / "sweep.yaml"
    spec.write_text(SPEC.format(rates=rates))
    paths = {"one launch per experiment (--isolate)": ["--isolate"], "shared launches": []}
    measured: dict[str, list[tuple[float, float]]] = {label: [] for label in paths}
    for repeat in range(args.repeat):
        for label, flags in paths.items():
            db = workdir / f"{label.split()[0]}-{repeat}.db"
            measured[label].append(sweep(spec, db, flags))
    print(f"{args.points}-point grid of 1-step mnist1d_mlp runs, 2 workers, "
          f"median of {args.repeat}\n")
    print(f"{'path':<40} {'total s':>8} {'per experiment s':>17}")
    overhead = {}
    for label, runs in measured.items():
        total = statistics.median(t for t, _ in runs)
        fixed = statistics.median((t - trained) / args.points for t, trained in runs)
        overhead[label] = fixed
        print(f"{label:<40} {total:>8.1f} {fixed:>17.2f}")
    isolated, shared = overhead.values()
    print(f"\nfixed cost per experiment, shared / isolated: {shared / isolated:.2f}; "
          f"target <= 1 s: {'met' if shared <= 1.0 else 'NOT met'}")
    totals = [statistics.median(t for t, _ in runs) for runs in measured.values()]
    print_rows((f"Fixed cost per experiment of a {args.points}-point sweep",
                f"shared launches {shared:.2f} s (target ≤ 1 s: {'met' if shared <= 1.0 else 'not met'}), "
                f"one torchrun each (`--isolate`) {isolated:.2f} s; totals {totals[1]:.1f} s and "
                f"{totals[0]:.1f} s"))


if __name__ == "__main__":
    main()
