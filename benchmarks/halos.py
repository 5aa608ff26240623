"""HALoS's published cluster (issue 51): allreduce, diloco, async_local_sgd and halos on
examples/halos_env.yaml (4 regions × 4 workers, the paper's inter-region bandwidth matrix
and worker speeds, text_lm) to a common test loss, on the modeled clock.

Runs the spec's four experiments with `dsgd run` (length and time scale set on the command
line) into one database, then prints per algorithm: its steps per worker, its final and best
test loss, the modeled seconds until its test loss first reached the target (evaluated once
per epoch: the first epoch end at or below it; for async_local_sgd and halos, whose workers
never wait for an average model while training, the first epoch end of any worker whose own
model, the one its server last answered with, is at or below it, and the average model at
the end), the bytes its workers sent over inter-region
links (`total_bytes_sent_inter_region`) and in all, and how honest the emulation was
(`comm_overrun`: the fraction of communication operations whose real transfer ran past the
modeled end; `overrun_steps`: of steps whose real compute did). Then the ratios HALoS
publishes, time to target of synchronous training / HALoS (paper: up to 7.5×) and of
asynchronous local SGD / HALoS (paper: 2.1×), and DiLoCo / HALoS.

The target is by default the highest of the four runs' best test losses, the lowest loss all
four reach (`--target-loss` sets it). allreduce is by far the slowest in real time (each step
waited 0.11 modeled s on the inter-region ring, × the time scale): `--sync-epochs` gives it
fewer epochs than the others (0: as many).

    python benchmarks/halos.py --text tinyshakespeare.txt [--epochs 3] [--sync-epochs 1]
        [--steps-per-epoch 8] [--time-scale 200] [--target-loss 3.4] [--dbdir DIR]

The defaults took 12 minutes on 2 cores: allreduce 8 steps per worker, the others 24
(HALoS's periods scaled down in the spec: diloco and async_local_sgd H = 8, halos H = 2,
K = 8). The table from earlier runs:

    python benchmarks/halos.py --dbdir DIR --no-run     # the table from earlier runs in DIR
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dsgd_cli.results.reader import Results
from results_row import print_rows

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "examples" / "halos_env.yaml"
# algorithm -> the spec's experiment
EXPERIMENTS = {"allreduce": "halos-allreduce", "diloco": "halos-diloco",
               "async_local_sgd": "halos-async_local_sgd", "halos": "halos-halos"}
ASYNCHRONOUS = ("async_local_sgd", "halos")
PAPER = {"allreduce": 7.5, "async_local_sgd": 2.1}  # HALoS's published speed-ups to a target


def run(db: Path, text: Path, experiments: list[str], epochs: int, steps_per_epoch: int,
        time_scale: float) -> None:
    data = Path(tempfile.mkdtemp(prefix="dsgd-halos-"))
    shutil.copy(text, data / "tinyshakespeare.txt")  # the spec's file name
    env = {**os.environ, "DSGD_DATA": str(data)}
    command = [sys.executable, "-m", "dsgd_cli", "run", str(SPEC), "--db", str(db),
               "--set", f"epochs={epochs}", "--set", f"steps_per_epoch={steps_per_epoch}",
               "--set", f"compute.time_scale={time_scale}"]
    for name in experiments:
        command += ["-e", name]
    started = time.monotonic()
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    print(f"dsgd run {' '.join(experiments)}: {time.monotonic() - started:.0f} s real",
          file=sys.stderr)
    if result.returncode != 0:
        sys.exit(f"dsgd run failed:\n{result.stderr[-4000:]}")


def first_reach(history, target: float) -> float:
    """Modeled seconds of the first record at or below `target` (nan: never)."""
    for record in sorted(history, key=lambda r: (r.seconds if r.seconds is not None else math.inf)):
        if record.value <= target:
            return record.seconds if record.seconds is not None else math.nan
    return math.nan


def rows(db: Path) -> dict[str, dict]:
    """Per algorithm, the newest completed run's figures."""
    store = Results(str(db))
    runs = {}
    for run in store.runs():
        if run.status == "completed":
            runs[run.experiment] = run  # runs come oldest first: the newest wins
    table = {}
    for algorithm, experiment in EXPERIMENTS.items():
        run = runs.get(experiment)
        if run is None:
            continue
        finals = {s.name: s.final for s in run.summaries}
        # Synchronous runs evaluate the (average) model at each epoch's end. Asynchronous ones
        # evaluate each worker's own model there (`test_loss_workers`, at that worker's modeled
        # time: the model its server last answered, as the period divides an epoch), and the
        # average model once, at the end (`test_loss`).
        history = list(store.metric_history(run.id, "test_loss"))
        averages = list(history)  # the average model only (asynchronous: once, at the end)
        if algorithm in ASYNCHRONOUS:
            history += store.metric_history(run.id, "test_loss_workers")
        config = run.config
        table[algorithm] = {
            "run": run, "finals": finals, "history": history,
            "averages": averages,
            "steps": (config.get("epochs") or 0) * (config.get("steps_per_epoch") or 0) or None,
            "best": min((r.value for r in history), default=math.nan),
            "evaluations": len(history),
            "final": finals.get("test_loss", math.nan),
            "end": max((r.seconds for r in history if r.seconds is not None), default=math.nan),
        }
    return table


def fmt(value: float, spec: str) -> str:
    return "—" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def report(db: Path, target: float | None) -> tuple[str, tuple[str, str]]:
    table = rows(db)
    missing = [a for a in EXPERIMENTS if a not in table]
    if missing:
        sys.exit(f"no completed run of {', '.join(missing)} in {db}")
    given = target is not None
    if target is None:
        target = max(row["best"] for row in table.values())
    for row in table.values():
        row["reach"] = first_reach(row["history"], target)
        row["reach_average"] = first_reach(row["averages"], target)
    lines = [f"target test loss {target:.4f} ("
             + ("given" if given else "the highest of the four runs' best: all reach it") + ")",
             "",
             "| algorithm | steps/worker | final test loss | best test loss | evaluations | modeled s to target "
             "| the same, average model only | modeled s in all | inter-region MB | all MB | comm_overrun | overrun_steps | schedule_lag s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for algorithm, row in table.items():
        f = row["finals"]
        reach = fmt(row["reach"], ".2f") if not math.isnan(row["reach"]) else "not reached"
        lines.append(
            f"| {algorithm} | {row['steps']} | {row['final']:.4f} | {row['best']:.4f} | "
            f"{row['evaluations']} | {reach} | "
            f"{fmt(row['reach_average'], '.2f') if not math.isnan(row['reach_average']) else 'not reached'} | "
            f"{fmt(row['end'], '.2f')} | {fmt(f.get('total_bytes_sent_inter_region', math.nan) / 1e6, ',.1f')} | "
            f"{fmt(f.get('total_bytes_sent', math.nan) / 1e6, ',.1f')} | "
            f"{fmt(f.get('comm_overrun', math.nan), '.4f')} | "
            f"{fmt(f.get('overrun_steps', math.nan), '.4f')} | "
            f"{fmt(f.get('schedule_lag', math.nan), '.3f')} |")
    def ratio(algorithm: str, key: str) -> float:
        mine, halos = table[algorithm][key], table["halos"][key]
        return mine / halos if halos and not math.isnan(halos) and not math.isnan(mine) else math.nan

    def shown(value: float) -> str:
        return f"{value:.2f}×" if not math.isnan(value) else "not reached by both"

    ratios = {}
    lines += ["", "| time to target, against halos | measured | average model only | paper |",
              "|---|---|---|---|"]
    for algorithm in ("allreduce", "async_local_sgd", "diloco"):
        ratios[algorithm] = ratio(algorithm, "reach")
        paper = f"{PAPER[algorithm]}×" if algorithm in PAPER else "—"
        lines.append(f"| {algorithm} / halos | {shown(ratios[algorithm])} | "
                     f"{shown(ratio(algorithm, 'reach_average'))} | {paper} |")
    headline = (
        "HALoS's cluster (16 workers, 4 regions, text_lm): modeled time to a common test loss, "
        "against halos (paper: synchronous 7.5×, async local SGD 2.1×)",
        f"target test loss {target:.3f}: allreduce / halos {fmt(ratios['allreduce'], '.2f')}×, "
        f"async_local_sgd / halos {fmt(ratios['async_local_sgd'], '.2f')}×, "
        f"diloco / halos {fmt(ratios['diloco'], '.2f')}×; inter-region MB "
        + ", ".join(f"{a} {fmt(r['finals'].get('total_bytes_sent_inter_region', math.nan) / 1e6, ',.0f')}"
                    for a, r in table.items())
        + "; comm_overrun at most "
        + fmt(max(r["finals"].get("comm_overrun", 0.0) for r in table.values()), ".3f"))
    return "\n".join(lines), headline


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--text", type=Path, help="a UTF-8 text file, the spec's tiny Shakespeare")
    parser.add_argument("--epochs", type=int, default=3, help="epochs of diloco, async_local_sgd, halos")
    parser.add_argument("--sync-epochs", type=int, default=1,
                        help="epochs of allreduce (0: --epochs)")
    parser.add_argument("--steps-per-epoch", type=int, default=8,
                        help="steps per epoch (each epoch ends with one evaluation)")
    parser.add_argument("--time-scale", type=float, default=200.0,
                        help="compute.time_scale: raise it on a loaded machine")
    parser.add_argument("--target-loss", type=float,
                        help="the common test loss (default: the highest of the runs' best)")
    parser.add_argument("--only", action="append", choices=sorted(EXPERIMENTS),
                        help="run only these algorithms (the table needs all four in the database)")
    parser.add_argument("--dbdir", type=Path, help="where the results database goes (or is)")
    parser.add_argument("--no-run", action="store_true", help="only print the table")
    args = parser.parse_args()
    dbdir = args.dbdir or Path(tempfile.mkdtemp(prefix="dsgd-halos-db-"))
    dbdir.mkdir(parents=True, exist_ok=True)
    db = dbdir / "bench_halos.db"
    if not args.no_run:
        if args.text is None:
            sys.exit("--text is needed to run")
        chosen = args.only or list(EXPERIMENTS)
        sync_epochs = args.sync_epochs or args.epochs
        rest = [EXPERIMENTS[a] for a in chosen if a != "allreduce"]
        if "allreduce" in chosen and sync_epochs == args.epochs:
            rest = [EXPERIMENTS["allreduce"], *rest]  # one launch for all
        elif "allreduce" in chosen:
            run(db, args.text, [EXPERIMENTS["allreduce"]], sync_epochs, args.steps_per_epoch,
                args.time_scale)
        if rest:
            run(db, args.text, rest, args.epochs, args.steps_per_epoch, args.time_scale)
    print(f"database: {db}")
    text, headline = report(db, args.target_loss)
    print(f"\n{text}")
    print_rows(headline)


if __name__ == "__main__":
    main()
