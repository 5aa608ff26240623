"""Young and Daly's checkpoint interval against a sweep of `failures.checkpoint_every`.

Young (1974) and Daly (2006): a job that checkpoints every tau seconds at a cost of delta
each, under failures with mean time between them M, has its best goodput near
tau = sqrt(2 * delta * M) (Daly's higher-order estimate: sqrt(2 * delta * M) - delta).

The sweep drives the restart arithmetic that an allreduce run under `failures:` uses
(`dsgd_cli.emulation.failures.RestartTimeline`: seeded failures per node, roll back to the
last checkpoint, restart, redo) with steps of known modeled duration, as the compute model
makes them: the allreduce run's modeled timeline without its training, so that many seeds and
intervals fit on 2 shared cores. `--launch` adds a consistency check of a real run: one small
`dsgd run` of allreduce under seeded failures, whose steps recorded down must be its
failures and whose steps executed must be the 60 counted plus its lost steps. `--backup`
validates the `continue` mode: backup workers (4 workers, b = 1, rank 2 twice as slow) with
node 3 down for a while; the update rate during the outage must be that of the remaining
workers (their slowest), and before it that of the fastest three. `--plot DB` draws the
goodput and the time to a target of each run recorded in DB (examples/failures.yaml's),
side by side, into `--output`.

    python benchmarks/failures.py [--seeds 20] [--steps 20000] [--launch] [--backup]
    python benchmarks/failures.py --plot failures.db --target test_accuracy=0.55 -o failures.png
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dsgd_cli.emulation.failures import RestartTimeline  # noqa: E402
from dsgd_cli.spec.failures_spec import parse_failures  # noqa: E402
from results_row import print_rows  # noqa: E402


def goodput(every: int, seed: int, *, steps: int, step_seconds: float, write: float,
            restart: float, mtbf: float, nodes: int) -> float:
    """Useful modeled time over the run's modeled time, `steps` steps counted."""
    options = parse_failures({"mtbf": mtbf, "restart": restart, "checkpoint_every": every,
                              "checkpoint_seconds": write, "seed": seed}, "failures")
    timeline, now, step = RestartTimeline(options, nodes), 0.0, 0
    while step < steps:
        now += step_seconds
        step += 1
        decision = timeline.after_step(step, now)
        now += decision.skip_seconds
        if decision.rollback_to is not None:
            step = decision.rollback_to
    return steps * step_seconds / now


def sweep(args) -> tuple[str, str]:
    job_mtbf = args.mtbf / args.nodes  # the nodes' failures add up
    young = math.sqrt(2 * args.write * job_mtbf)
    daly = young - args.write
    print(f"step {args.step_seconds} s, checkpoint write {args.write} s, restart {args.restart} s, "
          f"{args.nodes} nodes of MTBF {args.mtbf} s (job {job_mtbf:g} s), {args.steps} steps, "
          f"{args.seeds} seeds; load average {os.getloadavg()[0]:.2f}")
    print(f"Young: tau = {young:.1f} s = {young / args.step_seconds:.0f} steps; "
          f"Daly: {daly:.1f} s = {daly / args.step_seconds:.0f} steps")
    center = young / args.step_seconds
    intervals = sorted({max(1, round(center * 2 ** (k / 4))) for k in range(-12, 13)})
    means = {}
    print(f"{'checkpoint_every':>16}  {'x Young':>8}  {'goodput':>8}  {'± s.e.':>7}")
    for every in intervals:
        values = [goodput(every, seed, steps=args.steps, step_seconds=args.step_seconds,
                          write=args.write, restart=args.restart, mtbf=args.mtbf,
                          nodes=args.nodes) for seed in range(args.seeds)]
        means[every] = statistics.fmean(values)
        error = statistics.stdev(values) / math.sqrt(len(values))
        print(f"{every:>16}  {every / center:>8.2f}  {means[every]:>8.4f}  {error:>7.4f}")
    best = max(means, key=means.get)
    nearest = min(intervals, key=lambda every: abs(every - center))
    print(f"best: every {best} steps ({best / center:.2f} x Young's interval), goodput "
          f"{means[best]:.4f}; at Young's ({nearest} steps): {means[nearest]:.4f} "
          f"({means[best] - means[nearest]:.4f} less)")
    return (f"Checkpoint interval against Young's ({args.nodes} nodes, job MTBF {job_mtbf:g} s, "
            f"checkpoint {args.write:g} s, restart {args.restart:g} s)",
            f"best mean goodput {means[best]:.4f} every {best} steps ({best / center:.2f}× "
            f"Young's); at Young's ({nearest} steps) {means[nearest]:.4f}; modeled, "
            f"{args.seeds} seeds")


def launch_check() -> tuple[str, str]:
    """One `dsgd run` of allreduce with seeded failures: its recorded failures and lost steps
    against its per-step records."""
    from dsgd_cli.results.store import Store

    with tempfile.TemporaryDirectory() as tmp:
        spec, db = Path(tmp) / "spec.yaml", Path(tmp) / "r.db"
        spec.write_text("""
defaults:
  task: {name: logreg}
  workers: 2
  epochs: 1
  steps_per_epoch: 60
  batch_size: 16
  log_interval: 1
  compute: {step_seconds: 0.02, time_scale: 2}
experiments:
  - name: allreduce
    aggregator: {name: allreduce}
    failures: {mtbf: 1.5s, restart: 0.5s, checkpoint_every: 8, checkpoint_seconds: 0.05s, seed: 3}
""")
        result = subprocess.run([sys.executable, "-m", "dsgd_cli", "run", str(spec), "--db", str(db)],
                                capture_output=True, text=True)
        if result.returncode:
            sys.exit(result.stdout + result.stderr)
        store = Store(str(db))
        (run,) = store.runs()
        summaries = {s.name: s.final for s in run.summaries}
        up = [r for r in store.metric_history(run.id, "up") if r.rank == 0]
        assert sum(r.value == 0 for r in up) == summaries["failures"]
        assert len(up) == 60 + summaries["lost_steps"]
        print(f"launched allreduce: {summaries['failures']:.0f} failures, "
              f"{summaries['lost_steps']:.0f} lost steps, goodput {summaries['goodput']:.3f}, "
              f"{sum(r.value == 0 for r in up)} steps recorded down, "
              f"{len(up)} steps executed for 60 counted")
        return ("A launched allreduce run under seeded failures (2 workers, 60 steps)",
                f"{summaries['failures']:.0f} failures, {summaries['lost_steps']:.0f} lost "
                f"steps, goodput {summaries['goodput']:.3f}; records consistent")


BACKUP_SPEC = """
defaults:
  task: {{name: logreg}}
  workers: 4
  epochs: 1
  steps_per_epoch: {steps}
  batch_size: 16
  log_interval: 1
  optimizer: {{name: sgd, lr: 0.1}}
  compute: {{step_seconds: {step}, time_scale: 5}}
  stragglers: {{ranks: [2], slowdown: {slowdown}}}
  aggregator: {{name: backup, backups: 1}}
experiments:
  - name: backup
    failures: {{restart: {outage}s, at: [{{node: 3, time: {fail_at}s}}]}}
"""


def backup_check(step: float = 0.02, slowdown: float = 2.0, fail_at: float = 0.3,
                 outage: float = 0.4) -> tuple[str, str]:
    """Backup workers under `continue`: updates per modeled second before, during and after
    node 3's outage, from rank 0's records (it applies every update, one per step)."""
    from dsgd_cli.results.store import Store

    with tempfile.TemporaryDirectory() as tmp:
        spec, db = Path(tmp) / "spec.yaml", Path(tmp) / "r.db"
        spec.write_text(BACKUP_SPEC.format(steps=60, step=step, slowdown=slowdown,
                                           outage=outage, fail_at=fail_at))
        result = subprocess.run([sys.executable, "-m", "dsgd_cli", "run", str(spec), "--db",
                                 str(db)], capture_output=True, text=True)
        if result.returncode:
            sys.exit(result.stdout + result.stderr)
        store = Store(str(db))
        (run,) = store.runs()
        summaries = {s.name: s.final for s in run.summaries}
        times = [r.seconds for r in store.metric_history(run.id, "updates_applied")
                 if r.rank == 0]
        down = [r for r in store.metric_history(run.id, "up") if r.rank == 3 and r.value == 0]
        windows = {"before": (0.0, fail_at), "during": (fail_at, fail_at + outage),
                   "after": (fail_at + outage, times[-1])}
        expected = {"before": 1 / step, "during": 1 / (slowdown * step), "after": 1 / step}
        print(f"backup, 4 workers, b = 1, steps of {step} s, rank 2 {slowdown:g}x slower; "
              f"node 3 down from {fail_at} s for {outage} s; load average "
              f"{os.getloadavg()[0]:.2f}")
        rates = []
        for name, (start, end) in windows.items():
            count = sum(1 for t in times if start < t <= end)
            print(f"  {name:>6}: {count} updates in {end - start:.3f} s = "
                  f"{count / (end - start):.1f}/s (expected {expected[name]:.1f}/s)")
            rates.append(f"{count / (end - start):.1f}/s {name} (expected "
                         f"{expected[name]:.0f}/s)")
        print(f"  rank 3 down for {len(down)} steps; failures {summaries['failures']:.0f}, "
              f"lost_seconds {summaries['lost_seconds']:.3f} (outage {outage} s), goodput "
              f"{summaries['goodput']:.3f}, wall_seconds {summaries['wall_seconds']:.3f}, "
              f"dropped_rank3 {summaries['dropped_rank3']:.0f}")
        return ("Backup workers through an outage (`continue`): updates per modeled second",
                ", ".join(rates) + f"; goodput {summaries['goodput']:.3f}")


def recorded_runs(db: str, target: str) -> list[dict]:
    """Each run's experiment, goodput (1 for a run without failures) and time to `target`
    (None where it was not reached), as `dsgd compare --target` reports them."""
    import json

    result = subprocess.run([sys.executable, "-m", "dsgd_cli", "compare", "--db", db,
                             "--metric", "goodput", "--target", target, "--format", "json"],
                            capture_output=True, text=True)
    if result.returncode:
        sys.exit(result.stdout + result.stderr)
    return [{"experiment": row["experiment"],
             "goodput": 1.0 if row.get("goodput") is None else row["goodput"],
             "time_to_target": row.get("time_to_target")} for row in json.loads(result.stdout)]


def plot_runs(db: str, target: str, output: str) -> tuple[str, str]:
    """Goodput and time to target per run, two bar charts side by side, into `output`."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = recorded_runs(db, target)
    if not runs:
        sys.exit(f"no recorded runs in {db}")
    names = [run["experiment"] for run in runs]
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 0.5 * len(runs) + 1.5),
                                         sharey=True)
    left.barh(names, [run["goodput"] for run in runs])
    left.set_xlim(0, 1)
    left.set_xlabel("goodput (useful fraction of modeled worker-time)")
    reached = [run["time_to_target"] or 0.0 for run in runs]
    right.barh(names, reached)
    for index, run in enumerate(runs):
        if run["time_to_target"] is None:
            right.text(0, index, " not reached", va="center")
    right.set_xlabel(f"modeled seconds to {target}")
    left.invert_yaxis()  # the runs in the order recorded, from the top
    figure.tight_layout()
    figure.savefig(output)
    for run in runs:
        shown = "not reached" if run["time_to_target"] is None else f"{run['time_to_target']:.2f} s"
        print(f"{run['experiment']:>24}  goodput {run['goodput']:.3f}  {target}: {shown}")
    print(f"wrote {output}")
    return (f"Goodput and time to {target} of the runs in {Path(db).name}",
            ", ".join(f"{run['experiment']} {run['goodput']:.3f}" for run in runs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--steps", type=int, default=20_000)
    parser.add_argument("--step-seconds", type=float, default=1.0)
    parser.add_argument("--write", type=float, default=10.0, help="checkpoint_seconds")
    parser.add_argument("--restart", type=float, default=60.0)
    parser.add_argument("--mtbf", type=float, default=8000.0, help="per node")
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--launch", action="store_true")
    parser.add_argument("--backup", action="store_true",
                        help="only the backup workers' outage check (continue mode)")
    parser.add_argument("--plot", metavar="DB",
                        help="only plot the goodput and time to --target of DB's runs")
    parser.add_argument("--target", default="test_accuracy=0.55", help="with --plot")
    parser.add_argument("-o", "--output", default="failures.png", help="with --plot")
    args = parser.parse_args()
    if args.plot:
        print_rows(plot_runs(args.plot, args.target, args.output))
        return
    if args.backup:
        print_rows(backup_check())
        return
    rows = [sweep(args)]
    if args.launch:
        rows.append(launch_check())
    print_rows(*rows)


if __name__ == "__main__":
    main()
