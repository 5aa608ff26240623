"""`dsgd advise` against measurement: predict from runs at small worker counts, then run at
the larger ones and compare.

For each of allreduce, local_sgd, sgp and wagma it records runs at n = 2, 4, 8 (`--fit`) with
the same budget of training samples, asks `dsgd advise` for the time to `--target` at
n = 16 (and whatever else `--check` lists), runs the algorithms at those counts, and prints
per algorithm and count the predicted time (with its interval) against the measured one, and
whether the predicted ranking of the algorithms matches the measured ranking.

Time per step is only a property of a cluster when the cluster is modelled: pass
`--compute '{...}'` to add a `compute:` section (the emulated cluster's compute model, where
this dsgd has it) to every experiment. Without it the runs are plain runs, whose step times
on one machine are those of n processes sharing its cores, and the advice predicts that.

    python benchmarks/advise.py [--fit 2,4,8] [--check 16] [--samples 64000]
                                [--target test_accuracy=0.6] [--db FILE] [--compute YAML]
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

ALGORITHMS = {
    "allreduce": {"name": "allreduce"},
    "local_sgd": {"name": "local_sgd", "period": 4},
    "sgp": {"name": "sgp"},
    "wagma": {"name": "wagma", "tau": 10},
}
DSGD = [sys.executable, "-m", "dsgd_cli"]


def spec(prefix: str, counts: list[int], args: argparse.Namespace) -> dict:
    defaults = {"task": {"name": args.task}, "batch_size": 32, "seed": 0,
                "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
                "budget": {"samples": args.samples, "evaluations": args.evaluations},
                "log_interval": 5}
    if args.compute:
        defaults["compute"] = yaml.safe_load(args.compute)
    return {"defaults": defaults,
            "experiments": [{"name": f"{prefix}-{name}", "aggregator": aggregator,
                             "grid": {"workers": counts}}
                            for name, aggregator in ALGORITHMS.items()]}


def dsgd(*args: str) -> str:
    result = subprocess.run([*DSGD, *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"dsgd {' '.join(args)}: exit {result.returncode}\n{result.stderr}")
    return result.stdout


def run(document: dict, directory: Path, db: Path) -> None:
    path = directory / f"{document['experiments'][0]['name']}.yaml"
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    dsgd("run", str(path), "--db", str(db))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fit", default="2,4,8", help="worker counts the advice learns from")
    parser.add_argument("--check", default="16", help="worker counts it predicts, then measured")
    parser.add_argument("--samples", type=int, default=64000, help="samples budget of every run")
    parser.add_argument("--evaluations", type=int, default=32)
    parser.add_argument("--task", default="mnist1d_mlp")
    parser.add_argument("--target", default="test_accuracy=0.6")
    parser.add_argument("--compute", help="a compute: section (YAML) for every experiment")
    parser.add_argument("--db", type=Path, help="keep the runs in this database")
    parser.add_argument("--no-run", action="store_true",
                        help="only predict and compare, from the runs already in --db")
    args = parser.parse_args()
    if args.no_run and not args.db:
        parser.error("--no-run needs --db")
    fit = [int(n) for n in args.fit.split(",")]
    check = [int(n) for n in args.check.split(",")]
    with tempfile.TemporaryDirectory() as scratch:
        directory = Path(scratch)
        db = args.db or directory / "bench.db"
        if not args.no_run:
            run(spec("fit", fit, args), directory, db)
        selection = [arg for name in ALGORITHMS for arg in ("-e", f"fit-{name}")]
        advice = json.loads(dsgd("advise", "--db", str(db), "--target", args.target,
                                 *selection, "--by", "aggregator",
                                 "--workers", ",".join(map(str, check)), "-f", "json"))
        if not args.no_run:
            run(spec("check", check, args), directory, db)
        measured = measure(db, args.target)
        overruns = overrun_steps(db) if args.compute else {}
    headline = report(advice, measured, check, args)
    if overruns:  # how far the emulated cluster's timing can be trusted (docs/cluster.md)
        worst = max(overruns, key=overruns.get)
        print(f"overrun_steps (steps whose real work overran the model by > 5%): at most "
              f"{overruns[worst]:.1%} ({worst}); " + ", ".join(
                  f"{name} {value:.1%}" for name, value in overruns.items()))
    print_rows(*headline)


def measure(db: Path, target: str) -> dict[str, tuple[float | None, float | None]]:
    """Per checked run (by experiment name): its time to target as `dsgd advise` counts it
    (mean step seconds × steps to target) and the clock time `compare --target` shows."""
    from dsgd_cli.results.advice import observe
    from dsgd_cli.results.analysis import parse_target
    from dsgd_cli.results.reader import Results

    store = Results(str(db))
    runs = [run for run in store.runs(details=False) if run.experiment.startswith("check-")]
    clock = {row["experiment"]: row["time_to_target"] for row in json.loads(dsgd(
        "compare", "--db", str(db), "--target", target, "-f", "json",
        *[arg for name in ALGORITHMS for arg in ("-e", f"check-{name}")]))}
    return {run.experiment: (seen.time_to_target, clock.get(run.experiment))
            for run, seen in zip(runs, observe(store, runs, parse_target(target)))}


def overrun_steps(db: Path) -> dict[str, float]:
    """Per run of an emulated cluster: its recorded `overrun_steps`."""
    rows = json.loads(dsgd("compare", "--db", str(db), "--metric", "overrun_steps", "-f", "json"))
    return {row["experiment"]: row["overrun_steps"] for row in rows
            if row.get("overrun_steps") is not None}


def report(advice: list[dict], measured: dict[str, tuple[float | None, float | None]],
           check: list[int], args: argparse.Namespace) -> list[tuple[str, str]]:
    """Prints the table; returns one row for benchmarks/RESULTS.md per checked count."""
    headline = []
    print(f"{args.task}, samples budget {args.samples}, target {args.target}; fitted on "
          f"n = {args.fit}{', compute model ' + args.compute if args.compute else ' (plain runs)'}")
    print("predicted and measured: seconds in training steps to the target (mean step_seconds "
          "x steps); clock: the run's recorded training seconds to it")
    print(f"{'algorithm':10s} {'n':>3s} {'predicted':>9s} {'interval':>13s} {'measured':>8s} "
          f"{'pred/meas':>9s} {'clock':>6s} {'fit err':>7s}  advice")
    for n in check:
        predicted: dict[str, float | None] = dict.fromkeys(ALGORITHMS)
        actual: dict[str, float | None] = dict.fromkeys(ALGORITHMS)
        for name in ALGORITHMS:
            row = next((r for r in advice if r["aggregator"] == name
                        and r["workers"] in (n, None)), None)
            if row is None:
                print(f"{name:10s} {n:3d}  (no runs)")
                continue
            steps_time, clock = measured.get(f"check-{name}[workers={n}]", (None, None))
            predicted[name], actual[name] = row["time_to_target"], steps_time
            interval = (f"{row['time_low']:.2f}-{row['time_high']:.2f}"
                        if row["time_low"] is not None else "")
            ratio = (f"{predicted[name] / actual[name]:.2f}"
                     if predicted[name] and actual[name] else "")
            fit_error = f"{row['fit_error']:.2f}" if row["fit_error"] is not None else ""
            print(f"{name:10s} {n:3d} {_seconds(predicted[name]):>9s} {interval:>13s} "
                  f"{_seconds(actual[name]):>8s} {ratio:>9s} {_seconds(clock):>6s} "
                  f"{fit_error:>7s}  {row['advice'] or ''}")
        ranked = sorted((k for k in predicted if predicted[k] is not None), key=predicted.get)
        truth = sorted((k for k in actual if actual[k] is not None), key=actual.get)
        ratios = ", ".join(f"{name} {predicted[name] / actual[name]:.2f}" for name in ALGORITHMS
                           if predicted[name] and actual[name])
        figure = (f"`dsgd advise` at {n} workers"
                  f"{' on the emulated cluster' if args.compute else ' (plain runs)'}: "
                  f"predicted / measured time to {args.target}")
        if not ranked or not truth:
            print(f"n = {n}: no ranking to compare ({'no predictions' if not ranked else 'no run reached the target'})")
            headline.append((figure, (ratios or "nothing to compare") + "; no ranking to compare"))
            continue
        headline.append((figure, f"{ratios}; ranking "
                         f"{'the same' if ranked == truth else 'different'}, best "
                         f"{'the same' if ranked[0] == truth[0] else 'differs'}"))
        print(f"n = {n}: predicted ranking {' < '.join(ranked)}; measured {' < '.join(truth)}"
              f"{' (the others never reached it)' if len(truth) < len(ALGORITHMS) else ''}: "
              f"{'the same' if ranked == truth else 'different'}, "
              f"best {'the same' if ranked[0] == truth[0] else 'differs'}")
    return headline


def _seconds(value: float | None) -> str:
    return "never" if value is None else f"{value:.2f}"


if __name__ == "__main__":
    main()
