"""The emulated cluster against arithmetic, then the papers' comparisons at 16 to 32 workers.

Two tables, each from real `dsgd run` launches (torchrun, gloo on CPU, every worker a process;
docs/cluster.md, "An emulated cluster"):

1. validation: with `compute.step_seconds: T` and batch B, n workers of allreduce must record
   n·B/T samples per second; with one worker at slowdown 2, half of it; backup with one
   backup worker and that straggler, n·B/T again (its n − 1 fast workers never wait; with
   the straggler's half rate, (n − 1/2)·B/T, within 5% of n·B/T from 16 workers on, less
   the straggler's last step over a short run); over an emulated link
   (10 Mbit/s, 1 ms) allreduce's step must last T + the ring all-reduce's time
   (2(n−1)·latency + 2(n−1)/n·bytes/bandwidth). Each row: measured, expected, ratio.
2. comparisons: `examples/scale.yaml` (a heavy-tailed step time; a slow network) at each
   worker count: samples per second, modeled seconds to the target accuracy, final accuracy,
   each as a ratio to the scenario's allreduce, and the run's overrun.

Every row shows `overrun_steps` (the fraction of steps whose real work overran its modeled
time by more than 5%): a row above 5% does not show the modeled cluster's timing.

    python benchmarks/scale.py [--workers 16 32] [--only validation|compare] [-e NAME]...
                               [--time-scale 8] [--steps N [--batch B]] [--compare-time-scale S]
                               [--ring-max M] [--timeout S] [--db FILE] [--plot speedup.png]

Every comparison row also shows `comm_overrun` (the fraction of transfers whose real time
overran the modeled one): at hundreds of workers on a few cores, raise the time scale (or
lower `--ring-max`) until it is small. A collective's real time includes waiting for its
last member, so under the heavy tail allreduce's `comm_overrun` is high whatever the time
scale; with `--steps`, its recorded rate is checked against arithmetic instead.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

from results_row import print_rows

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "examples" / "scale.yaml"
T, BATCH, EPOCHS, STEPS_PER_EPOCH = 0.05, 16, 4, 12  # 48 steps per worker
MLP_PARAMETERS = 40 * 100 + 100 + 100 * 100 + 100 + 100 * 10 + 10  # mnist1d_mlp, hidden 100
BANDWIDTH, LATENCY = 10e6 / 8, 0.001
SCALE_BATCH = 32  # examples/scale.yaml's batch_size


def dsgd_run(spec: Path, db: Path, *options: str) -> None:
    result = subprocess.run([sys.executable, "-m", "dsgd_cli", "run", str(spec), "--db", str(db),
                             *options], capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(result.stdout[-3000:] + result.stderr[-3000:])


def finals(db: Path) -> dict[str, dict]:
    """Per experiment of the database's newest runs: its final values and configuration."""
    from dsgd_cli.results.store import Store

    runs = {}
    for run in Store(str(db)).runs():
        runs[run.experiment] = {"config": run.config, "status": run.status,
                                **{s.name: s.final for s in run.summaries}}
    return runs


def validation(workers: int, directory: Path, time_scale: float) -> list[tuple]:
    spec = directory / f"validation{workers}.yaml"
    spec.write_text(textwrap.dedent(f"""
        defaults:
          task: {{name: logreg, samples: 16384}}  # 32 batches per worker at 32 workers
          workers: {workers}
          batch_size: {BATCH}
          epochs: {EPOCHS}
          steps_per_epoch: {STEPS_PER_EPOCH}
          log_interval: 4
          compute: {{step_seconds: {T}, time_scale: {time_scale:g}}}
        experiments:
          - {{name: allreduce, aggregator: allreduce}}
          - {{name: allreduce-straggler, aggregator: allreduce,
              stragglers: {{ranks: [3], slowdown: 2}}}}
          - {{name: backup-straggler, aggregator: {{name: backup, backups: 1}},
              stragglers: {{ranks: [3], slowdown: 2}}}}
          - {{name: allreduce-network, task: mnist1d_mlp, aggregator: allreduce,
              network: {{bandwidth: 10Mbit, latency: 1ms}}}}
    """))
    db = directory / f"validation{workers}.db"
    dsgd_run(spec, db)
    runs = finals(db)
    full = workers * BATCH / T
    ring = (2 * (workers - 1) * LATENCY
            + 2 * (workers - 1) / workers * MLP_PARAMETERS * 4 / BANDWIDTH)
    # Backup's exact arithmetic: its fast workers' steps at T, the straggler's at 2T, the run
    # ending when the straggler's last step is done.
    steps = backup_steps(db)
    duration = max(steps[r] * T * (2 if r == 3 else 1) for r in steps)
    backup_rate = sum(steps.values()) * BATCH / duration
    rows = [
        ("allreduce", "samples/s", runs["allreduce"]["samples_per_second"], full),
        ("allreduce, 1 straggler x2", "samples/s",
         runs["allreduce-straggler"]["samples_per_second"], full / 2),
        ("backup b=1, 1 straggler x2", "samples/s",
         runs["backup-straggler"]["samples_per_second"], full),
        ("  the same, its step counts", "samples/s",
         runs["backup-straggler"]["samples_per_second"], backup_rate),
        ("allreduce, 10 Mbit/s 1 ms", "step s", runs["allreduce-network"]["step_seconds"],
         T + ring),
    ]
    overruns = [runs[name].get("overrun_steps", float("nan")) for name in
                ("allreduce", "allreduce-straggler", "backup-straggler", "backup-straggler",
                 "allreduce-network")]
    return [(workers, *row, overrun) for row, overrun in zip(rows, overruns)]


def backup_steps(db: Path) -> dict[int, int]:
    """Steps per rank of the backup run."""
    from dsgd_cli.results.store import Store

    store = Store(str(db))
    (run,) = [run for run in store.runs() if run.experiment == "backup-straggler"]
    return {m.rank: m.step for m in store.metric_history(run.id, "step_seconds")}


def comparisons(workers: int, db: Path, only: list[str], steps: int | None = None,
                time_scale: float | None = None, batch: int | None = None,
                ring_max: int | None = None, timeout: float | None = None) -> dict[str, dict]:
    """The spec's runs at `workers`; with `steps`, that many steps per worker of batch
    `batch` (instead of the spec's budget of 51,200 samples: under two steps at 1,024
    workers) on a data set just large enough, evaluated at the end; with `time_scale`, that
    `compute.time_scale`; with `ring_max` and `timeout`, those `compute.ring_max` and
    `timeout`."""
    selected = [option for name in only for option in ("-e", name)]
    if steps is not None:
        batch = batch or SCALE_BATCH
        samples = -(-workers * batch * steps * 5 // 4)  # mnist1d trains on 80%
        selected += ["--set", "budget=null", "--set", "epochs=1",
                     "--set", f"steps_per_epoch={steps}", "--set", f"batch_size={batch}",
                     "--set", f"task.num_samples={samples}"]
    if time_scale is not None:
        selected += ["--set", f"compute.time_scale={time_scale:g}"]
    if ring_max is not None:
        selected += ["--set", f"compute.ring_max={ring_max}"]
    if timeout is not None:
        selected += ["--set", f"timeout={timeout:g}"]
    dsgd_run(SPEC, db, "--workers", str(workers), *selected)
    return finals(db)


def allreduce_arithmetic(run: dict, steps: int) -> float:
    """What a synchronous allreduce run of `steps` steps must record as samples per second
    on its modeled cluster: each step lasts the slowest worker's modeled compute (the same
    per-worker draws the workers make) plus one ring all-reduce of the gradient after it.
    A collective's real time includes the wait for its last member, which the model
    includes too, so `comm_overrun` cannot judge allreduce under a heavy tail: this can."""
    from dsgd_cli.emulation.compute import variation_factor

    config = run["config"]
    compute, link, n = config["compute"], config["network"], config["workers"]
    gradient_bytes = MLP_PARAMETERS * 4
    ring = 2 * (n - 1) * link["latency_s"]
    if link["bytes_per_second"] is not None:
        ring += 2 * (n - 1) / n * gradient_bytes / link["bytes_per_second"]
    seconds = sum(max(compute["step_seconds"] * variation_factor(compute["variation"],
                                                                 config["seed"], rank, step)
                      for rank in range(n)) + ring
                  for step in range(steps))
    return n * config["batch_size"] * steps / seconds


def print_validation(rows: list[tuple]) -> None:
    print(f"{'n':>3}  {'run':<28} {'figure':<9} {'measured':>10} {'expected':>10} "
          f"{'ratio':>6} {'overrun':>8}")
    for n, name, figure, measured, expected, overrun in rows:
        print(f"{n:>3}  {name:<28} {figure:<9} {measured:>10.4g} {expected:>10.4g} "
              f"{measured / expected:>6.3f} {overrun:>8.1%}")


def print_comparisons(workers: int, runs: dict[str, dict]) -> dict[str, float]:
    """The table of one worker count; returns each experiment's speed-up over its allreduce."""
    print(f"\n{workers} workers: ratios to the scenario's allreduce")
    print(f"{'experiment':<16} {'samples/s':>10} {'x':>6} {'to target s':>12} {'x':>6} "
          f"{'accuracy':>9} {'diff':>6} {'overrun':>8} {'comm overrun':>12}")
    speedups = {}
    for name, run in runs.items():
        base = runs.get(name.split("-")[0] + "-allreduce", run)
        rate, to_target = run["samples_per_second"], run.get("time_to_accuracy")
        base_target = base.get("time_to_accuracy")
        speedups[name] = rate / base["samples_per_second"]
        target_ratio = (f"{base_target / to_target:>6.2f}" if to_target and base_target
                        else f"{'-':>6}")
        print(f"{name:<16} {rate:>10.0f} {speedups[name]:>6.2f} "
              f"{to_target if to_target else float('nan'):>12.3f} {target_ratio} "
              f"{run['test_accuracy']:>9.3f} {run['test_accuracy'] - base['test_accuracy']:>+6.3f} "
              f"{run.get('overrun_steps', float('nan')):>8.1%} "
              f"{run.get('comm_overrun', float('nan')):>12.1%}")
    return speedups


def plot(path: str, samples_per_second: dict[int, dict[str, float]]) -> None:
    """Samples per second against n, relative to each algorithm's rate at the smallest n."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = sorted(samples_per_second)
    names = sorted({name for runs in samples_per_second.values() for name in runs})
    figure, axes = plt.subplots(figsize=(7, 4.5))
    for name in names:
        points = [(n, samples_per_second[n][name]) for n in counts if name in samples_per_second[n]]
        first_n, first = points[0]
        axes.plot([n for n, _ in points], [rate / first * first_n for _, rate in points],
                  marker="o", label=name)
    axes.plot(counts, counts, color="grey", linestyle=":", label="linear")
    axes.set_xlabel("workers")
    axes.set_ylabel(f"speed-up (samples/s relative to {counts[0]} workers × {counts[0]})")
    axes.legend(fontsize=7, ncol=2)
    figure.tight_layout()
    figure.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[16])
    parser.add_argument("--only", choices=["validation", "compare"])
    parser.add_argument("-e", dest="experiments", action="append", default=[],
                        help="experiments of examples/scale.yaml to compare (default: all)")
    parser.add_argument("--time-scale", type=float, default=8,
                        help="the validation runs' compute.time_scale (default 8)")
    parser.add_argument("--steps", type=int,
                        help="the comparisons' budget in steps per worker (default: the spec's "
                             "51,200 samples)")
    parser.add_argument("--batch", type=int,
                        help="with --steps, the comparisons' batch per worker (default 32)")
    parser.add_argument("--compare-time-scale", type=float,
                        help="the comparisons' compute.time_scale (default: the spec's 10)")
    parser.add_argument("--ring-max", type=int,
                        help="the comparisons' compute.ring_max (default 64): lower it when "
                             "comm_overrun is high")
    parser.add_argument("--timeout", type=float,
                        help="the comparisons' timeout in seconds (default: the spec's 600)")
    parser.add_argument("--db", help="keep the comparisons' runs in this database")
    parser.add_argument("--plot", help="write speed-up against workers to this image")
    args = parser.parse_args()
    headline = []
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        if args.only != "compare":
            rows = [row for n in args.workers
                    for row in validation(n, directory, args.time_scale)]
            print_validation(rows)
            for n in args.workers:
                mine = [row for row in rows if row[0] == n]
                headline.append((
                    f"Emulated cluster against arithmetic, {n} workers, time scale "
                    f"{args.time_scale:g}: measured / expected",
                    ", ".join(f"{name.strip()} {measured / expected:.3f}"
                              for _, name, _, measured, expected, _ in mine)
                    + f"; `overrun_steps` at most {max(row[-1] for row in mine):.1%}"))
        if args.only != "validation":
            rates = {}
            for n in args.workers:
                db = Path(args.db).with_suffix(f".{n}.db") if args.db else directory / f"{n}.db"
                runs = comparisons(n, db, args.experiments, args.steps,
                                   args.compare_time_scale, args.batch, args.ring_max,
                                   args.timeout)
                speedups = print_comparisons(n, runs)
                arithmetic = ""
                if args.steps and "tail-allreduce" in runs:
                    measured = runs["tail-allreduce"]["samples_per_second"]
                    expected = allreduce_arithmetic(runs["tail-allreduce"], args.steps)
                    print(f"tail-allreduce against arithmetic: {measured:.0f} samples/s "
                          f"recorded, {expected:.0f} expected, ratio {measured / expected:.3f}")
                    arithmetic = f"; tail-allreduce recorded {measured / expected:.3f} of its arithmetic"
                worst = max((run.get("overrun_steps", 0.0) for run in runs.values()), default=0.0)
                headline.append((
                    f"Samples/s / the scenario's allreduce, {n} workers (examples/scale.yaml)",
                    ", ".join(f"{name} {ratio:.2f}" for name, ratio in speedups.items()
                              if not name.endswith("-allreduce"))
                    + f"; `overrun_steps` at most {worst:.1%}{arithmetic}"))
                rates[n] = {name: run["samples_per_second"] for name, run in runs.items()}
            if args.plot:
                plot(args.plot, rates)
    print_rows(*headline)


if __name__ == "__main__":
    main()
