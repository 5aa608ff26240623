"""The 2025–2026 frontier at a CPU's scale (issue 50): DeMo, SparseLoCo, MuLoCo and DES-LOC,
each against its paper's baseline, from the example specs (examples/demo.yaml,
sparseloco.yaml, muloco.yaml, desloc.yaml: text_lm, 4 workers, an emulated 1 Gbit/s network
and a compute model).

Each spec runs with `dsgd run` (epochs and the compute model's time scale set on the command
line), then per comparison one markdown table: the final train and test loss, the bytes one
worker sends per step (the run's total over workers and steps) and per round, how many times fewer than the
baseline's, and the bytes (all workers) until the test loss first reached the worst final
test loss of the comparison (`dsgd compare --target`: "at equal loss"; test loss is evaluated
once per epoch).

    python benchmarks/frontier.py --text corpus.txt [--epochs 6] [--time-scale 3] [--only demo]
    python benchmarks/frontier.py --dbdir DIR --no-run     # tables from earlier runs in DIR

`--curve` adds, per comparison, the loss curve: at every evaluation (each epoch's end) each
run's test loss, its train loss (the last logged, a mean over the log interval and the
workers) and the bytes one worker has sent so far, so that loss reads against steps and
against bytes (the issue's DeMo against AdamW-DDP: `--only demo --curve`; more evaluations
with `--epochs 12 --steps-per-epoch 25`, the same 300 steps).
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from dsgd_cli.results.reader import Results
from results_row import print_rows

ROOT = Path(__file__).resolve().parent.parent
# spec -> (baseline experiment, round length of each experiment with rounds)
COMPARISONS = {
    "demo": ("adamw-ddp", {}),
    "sparseloco": ("diloco", {"diloco": 10, "sparseloco": 10, "sparseloco-3pct": 10, "diloco-topk": 10}),
    "muloco": ("diloco-adamw", {name: 10 for name in (
        "diloco-adamw", "muloco", "diloco-adamw-8bit", "muloco-8bit", "diloco-adamw-2bit", "muloco-2bit")}),
    "desloc": ("allreduce", {}),
}


def run(spec: str, db: Path, text: Path, epochs: int, time_scale: float,
        steps_per_epoch: int | None = None) -> None:
    data = Path(tempfile.mkdtemp(prefix="dsgd-frontier-"))
    shutil.copy(text, data / "tinyshakespeare.txt")  # the specs' file name
    env = {**os.environ, "DSGD_DATA": str(data)}
    cap = ["--set", f"steps_per_epoch={steps_per_epoch}"] if steps_per_epoch else []
    result = subprocess.run(
        [sys.executable, "-m", "dsgd_cli", "run", str(ROOT / "examples" / f"{spec}.yaml"),
         "--db", str(db), "--set", f"epochs={epochs}", "--set", f"compute.time_scale={time_scale}",
         *cap], env=env, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"dsgd run {spec} failed:\n{result.stderr}")


def bytes_to_target(db: Path, target: float) -> dict[str, float]:
    result = subprocess.run([sys.executable, "-m", "dsgd_cli", "compare", "--db", str(db),
                             "--target", f"test_loss={target}", "-f", "csv"],
                            capture_output=True, text=True, check=True)
    rows = csv.DictReader(io.StringIO(result.stdout))
    return {row["experiment"]: float(row["bytes_to_target"] or "nan") for row in rows}


def table(spec: str, db: Path) -> tuple[str, tuple[str, str]]:
    """The comparison's markdown table, and its row for benchmarks/RESULTS.md."""
    baseline, periods = COMPARISONS[spec]
    store = Results(str(db))
    runs = {run.experiment: run for run in store.runs()}
    finals = {name: {s.name: s.final for s in run.summaries} for name, run in runs.items()}
    for name, run in runs.items():  # bytes_sent is logged per interval: use the run's total
        steps = max(record.step for record in store.metric_history(run.id, "bytes_sent"))
        finals[name]["bytes_sent"] = finals[name]["total_bytes_sent"] / (run.config["workers"] * steps)
    target = max(f["test_loss"] for f in finals.values())
    reached = bytes_to_target(db, target)
    base = finals[baseline]["bytes_sent"]
    lines = [f"| run | train loss | test loss | bytes/step/worker | × fewer than {baseline} "
             f"| bytes/round/worker | bytes to test loss {target:.3f} |",
             "|---|---|---|---|---|---|---|"]
    for name, final in finals.items():
        per_step = final["bytes_sent"]
        per_round = f"{per_step * periods[name]:,.0f}" if name in periods else "—"
        lines.append(f"| {name} | {final['train_loss']:.3f} | {final['test_loss']:.3f} | "
                     f"{per_step:,.0f} | {base / per_step if per_step else float('inf'):.1f} | "
                     f"{per_round} | {reached.get(name, float('nan')) / 1e6:,.1f} MB |")
    headline = (f"{spec}: test loss; bytes per step per worker, times fewer than {baseline}",
                ", ".join(f"{name} {final['test_loss']:.3f}, "
                          f"{base / final['bytes_sent'] if final['bytes_sent'] else float('inf'):.1f}×"
                          for name, final in finals.items()))
    return "\n".join(lines), headline


def curve(db: Path) -> str:
    """The markdown table of every run's loss at each evaluation: step, then per run its test
    loss, train loss and MB sent per worker so far."""
    store = Results(str(db))
    runs = store.runs()
    columns = {}
    for run in runs:
        test = {step: value for step, value, _ in store.step_curves([run.id], "test_loss").get(run.id, [])}
        train = store.step_curves([run.id], "train_loss").get(run.id, [])
        sent = store.metric_history(run.id, "bytes_sent")  # per rank, per log interval
        columns[run.experiment] = {
            step: (loss,
                   next((value for at, value, _ in reversed(train) if at <= step), float("nan")),
                   sum(r.value for r in sent if r.step <= step) / run.config["workers"] / 1e6)
            for step, loss in test.items()}
    names = list(columns)
    lines = ["| step | " + " | ".join(f"{name} test | {name} train | {name} MB/worker"
                                       for name in names) + " |",
             "|---|" + "---|---|---|" * len(names)]
    for step in sorted({step for column in columns.values() for step in column}):
        cells = [columns[name].get(step) for name in names]
        lines.append(f"| {step} | " + " | ".join(
            "— | — | —" if cell is None else f"{cell[0]:.3f} | {cell[1]:.3f} | {cell[2]:,.1f}"
            for cell in cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--text", type=Path, help="a UTF-8 text file, in place of tiny Shakespeare")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--time-scale", type=float, default=3.0,
                        help="compute.time_scale: raise it on a loaded machine")
    parser.add_argument("--only", action="append", choices=sorted(COMPARISONS))
    parser.add_argument("--dbdir", type=Path, help="where the results databases go (or are)")
    parser.add_argument("--no-run", action="store_true", help="only print the tables")
    parser.add_argument("--curve", action="store_true",
                        help="also print each comparison's loss at every evaluation")
    parser.add_argument("--steps-per-epoch", type=int,
                        help="steps_per_epoch: more, shorter epochs give more evaluations")
    args = parser.parse_args()
    dbdir = args.dbdir or Path(tempfile.mkdtemp(prefix="dsgd-frontier-db-"))
    headlines = []
    for spec in args.only or list(COMPARISONS):
        db = dbdir / f"bench_{spec}.db"
        if not args.no_run:
            if args.text is None:
                sys.exit("--text is needed to run")
            run(spec, db, args.text, args.epochs, args.time_scale, args.steps_per_epoch)
        text, headline = table(spec, db)
        headlines.append(headline)
        print(f"\n{spec}:\n\n{text}")
        if args.curve:
            print(f"\n{spec}, loss at each evaluation:\n\n{curve(db)}")
    print_rows(*headlines)


if __name__ == "__main__":
    main()
