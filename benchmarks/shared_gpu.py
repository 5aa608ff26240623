"""Eight workers sharing one GPU: examples/cifar10.yaml's four algorithms, written as markdown.

    python benchmarks/shared_gpu.py [-o shared_gpu.md] [--workers 8] [--epochs 3]
    python benchmarks/shared_gpu.py --try-on-cpu    # tiny, on the CPU: checks this script

Two parts (issue 46's goal for shared GPUs):

1. examples/cifar10.yaml's four algorithms (allreduce, local SGD, D-PSGD, PowerSGD), each
   with 8 workers for 3 epochs, on one GPU (`device: cuda`: worker i computes on GPU
   i mod G, all communicate over gloo): each experiment's seconds, samples per second, test
   accuracy and bytes, and the whole `dsgd run` timed all in (launches, data, evaluations),
   against the goal of 5 minutes. The schedule is the example's shortened to fit 3 epochs
   (a warm-up of 1 epoch, ÷10 after epoch 2), as its header says for a quick look.
2. The same spec with a `compute` model (`step_seconds` 0.05, `time_scale` `--time-scale`)
   and a modeled `network`, on the GPU and on the CPU, `--compare-steps` steps per epoch
   (the CPU cannot train 3 full epochs of 8 ResNet-20s in minutes): the bytes must be the
   same (they depend on the model alone); the modeled seconds within `--seconds-tolerance`
   (they are not exact: a padded step's sleep ends late by the scheduler's margin, and the
   optimizer's update and the aggregators' arithmetic take real time divided by the time
   scale; docs/cluster.md); the losses differ in the GPU's last bits, so they are compared
   within noise (a relative difference below `--loss-tolerance`).

Data: CIFAR-10's python batches from `--data-dir` or $DSGD_DATA/cifar-10-batches-py when
there; else (a machine that cannot download it) a generated set of its shape and size (50,000
and 10,000 uint8 images of 3×32×32, 10 classes: the speed does not depend on the pixels; the
accuracies then mean nothing). Part 2 uses a generated set of the same shape with a test set
of 1,000 images, so that the CPU's evaluations stay short.

`--try-on-cpu`: both parts on the CPU, 2 workers, 2 steps per epoch and a generated set of
512 + 128 images (about a minute): to check the script before carrying it to a GPU
machine; its figures mean nothing.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from gpu_check import generated_cifar  # noqa: E402

EXAMPLE = ROOT / "examples" / "cifar10.yaml"
GOAL_SECONDS = 300
#: part 2's modeled network: its transfer times absorb the real ones (docs/cluster.md)
NETWORK = {"bandwidth": "1Gbit", "latency": "100us"}


def spec(workers: int, epochs: int, device: str, data_dir: Path, steps: int | None = None,
         compute: dict | None = None) -> dict:
    """examples/cifar10.yaml with `workers`, `epochs` (the schedule shortened to fit: a
    warm-up of one epoch, the decay after the last but one), `device` and the data."""
    document = yaml.safe_load(EXAMPLE.read_text())
    defaults = document["defaults"]
    defaults["task"] = {**defaults["task"], "data_dir": str(data_dir)}
    defaults["workers"], defaults["epochs"], defaults["device"] = workers, epochs, device
    defaults["lr_schedule"] = {**defaults["lr_schedule"], "warmup_epochs": min(1, epochs - 1),
                               "milestone_epochs": [max(1, epochs - 1)]}
    if steps is not None:
        defaults["steps_per_epoch"] = steps
        defaults["log_interval"] = max(1, min(defaults.get("log_interval", steps), steps))
    if compute is not None:  # a modeled cluster: compute, and a network for the exchanges
        defaults["compute"] = compute
        defaults["network"] = NETWORK
    return document


def run_spec(document: dict, directory: Path, name: str, timeout: float):
    """`dsgd run` of the spec: (summaries by experiment, seconds all in, error or None, the
    run's notices)."""
    from dsgd_cli.results.store import Store

    path, db = directory / f"{name}.yaml", directory / f"{name}.db"
    path.write_text(yaml.safe_dump(document))
    started = time.perf_counter()
    try:
        run = subprocess.run([sys.executable, "-m", "dsgd_cli", "run", str(path), "--db", str(db)],
                             capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {}, time.perf_counter() - started, f"timed out after {timeout:.0f} s", []
    seconds = time.perf_counter() - started
    notices = [line.strip() for line in run.stderr.splitlines()
               if "GPU" in line or "share" in line or "turn" in line][:3]
    results = {}
    if db.exists():
        for record in Store(str(db)).runs():
            results[record.experiment] = {s.name: s.final for s in record.summaries}
    error = None
    if run.returncode != 0:
        error = (run.stderr.strip().splitlines() or ["?"])[-1]
    return results, seconds, error, notices


def _number(value, digits: int = 3) -> str:
    if value is None:
        return "–"
    if isinstance(value, float) and abs(value) < 1000:
        return f"{value:.{digits}g}"
    return f"{value:,.0f}"


def shared(args, data_dir: Path, directory: Path, device: str) -> list[str]:
    document = spec(args.workers, args.epochs, device, data_dir,
                    steps=args.steps if args.try_on_cpu else None)
    runs, seconds, error, notices = run_spec(document, directory, "shared", args.timeout)
    names = [e["name"] for e in document["experiments"]]
    rows = [f"`dsgd run` of examples/cifar10.yaml's {len(names)} algorithms, {args.workers} "
            f"workers each, {args.epochs} epochs, `device: {device}`: **{seconds:.0f} s all "
            f"in** (goal: under {GOAL_SECONDS} s{'' if seconds < GOAL_SECONDS else ', missed'}).",
            "", "| experiment | seconds | samples/s | test accuracy | bytes sent | "
            "workers per GPU |", "|---|---|---|---|---|---|"]
    for name in names:
        r = runs.get(name, {})
        rows.append(f"| {name} | {_number(r.get('wall_seconds'))} | "
                    f"{_number(r.get('samples_per_second'))} | "
                    f"{_number(r.get('test_accuracy'))} | {_number(r.get('total_bytes_sent'))} | "
                    f"{_number(r.get('workers_per_gpu'))} |")
    if notices:
        rows += ["", "The run said: " + " / ".join(f"`{n}`" for n in notices)]
    if error:
        rows += ["", f"failed: {error}"]
    return rows


def compared(args, directory: Path, devices: tuple[str, str]) -> list[str]:
    first, second = devices
    compute = {"step_seconds": 0.05, "time_scale": args.time_scale}
    data_dir = generated_cifar(directory / "compare", *((512, 128) if args.try_on_cpu
                                                        else (50_000, 1_000)))
    results, errors = {}, []
    for device, label in ((first, "a"), (second, "b")):
        document = spec(args.workers, args.epochs, device, data_dir,
                        steps=args.compare_steps, compute=compute)
        runs, seconds, error, _ = run_spec(document, directory, f"compare-{label}",
                                           args.timeout)
        results[label] = runs
        if error:
            errors.append(f"{device} failed: {error}")
    names = [e["name"] for e in spec(1, 2, "cpu", data_dir)["experiments"]]
    rows = [f"The same spec with `compute: {compute}` and `network: {NETWORK}`, "
            f"{args.compare_steps} steps per epoch, on `{first}` and on `{second}`. Equal: "
            f"the bytes. The modeled seconds (`compute_seconds`, `wall_seconds`) within "
            f"{args.seconds_tolerance:.0%}: they are not exact, by dsgd's design (a padded "
            f"step's sleep ends late by the scheduler's margin; the optimizer's update and "
            f"the aggregators' arithmetic take real time, divided by the time scale); the "
            f"train losses within {args.loss_tolerance:.0%} (the GPU's last bits). "
            f"`overrun_steps` above 0.05: the real compute did not fit the modeled step "
            f"(raise `--time-scale`).", "",
            f"| experiment | compute_seconds {first} / {second} | wall_seconds {first} / "
            f"{second} | bytes {first} / {second} | train_loss {first} / {second} | "
            f"overrun_steps | verdict |", "|---|---|---|---|---|---|---|"]
    for name in names:
        a, b = results["a"].get(name, {}), results["b"].get(name, {})
        pairs = {key: (a.get(key), b.get(key)) for key in
                 ("compute_seconds", "wall_seconds", "total_bytes_sent", "train_loss",
                  "overrun_steps")}
        if any(None in pairs[key] for key in ("compute_seconds", "wall_seconds",
                                              "total_bytes_sent", "train_loss")):
            verdict = "**missing**"
        else:
            verdict = ", ".join([
                "compute within tolerance" if _close(*pairs["compute_seconds"],
                                                     args.seconds_tolerance)
                else "**compute differs**",
                "seconds within tolerance" if _close(*pairs["wall_seconds"],
                                                     args.seconds_tolerance)
                else "**seconds differ**",
                "same bytes" if pairs["total_bytes_sent"][0] == pairs["total_bytes_sent"][1]
                else "**bytes differ**",
                "losses within noise" if _close(*pairs["train_loss"], args.loss_tolerance)
                else "**losses differ**"])
        shown = lambda key, digits=4: " / ".join(_number(v, digits) for v in pairs[key])  # noqa: E731
        rows.append(f"| {name} | {shown('compute_seconds', 6)} | {shown('wall_seconds', 6)} | "
                    f"{shown('total_bytes_sent')} | {shown('train_loss', 5)} | "
                    f"{shown('overrun_steps', 2)} | {verdict} |")
    if errors:
        rows += ["", *errors]
    return rows


def _close(a: float, b: float, tolerance: float) -> bool:
    return abs(a - b) <= tolerance * max(abs(a), abs(b), 1e-12)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-o", "--output", default="shared_gpu.md")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--compare-steps", type=int, default=10,
                        help="steps per epoch of part 2's GPU and CPU runs")
    parser.add_argument("--loss-tolerance", type=float, default=0.05,
                        help="largest relative difference of the two runs' train losses")
    parser.add_argument("--seconds-tolerance", type=float, default=0.05,
                        help="largest relative difference of the modeled seconds")
    parser.add_argument("--time-scale", type=float, default=4.0,
                        help="part 2's compute.time_scale (real seconds per modeled second)")
    parser.add_argument("--data-dir", help="holds cifar-10-batches-py/ (else $DSGD_DATA, else "
                                           "a generated set)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per `dsgd run`")
    parser.add_argument("--skip-compare", action="store_true", help="part 1 only")
    parser.add_argument("--try-on-cpu", action="store_true",
                        help="both parts on the CPU, tiny: checks this script (about a minute)")
    args = parser.parse_args()
    if args.try_on_cpu:
        args.workers, args.steps, args.compare_steps = min(args.workers, 2), 2, 2
        args.time_scale = max(args.time_scale, 10.0)  # two loaded cores
    import torch

    device = "cpu" if args.try_on_cpu else "cuda"
    report = [f"# dsgd: {args.workers} workers sharing one GPU, {time.strftime('%Y-%m-%d')}", ""]
    if torch.cuda.is_available():
        report.append(f"- card: {torch.cuda.get_device_name(0)} ({torch.cuda.device_count()} "
                      f"visible), torch {torch.__version__}")
    elif not args.try_on_cpu:
        report.append("No CUDA device: nothing to check (`--try-on-cpu` checks the script).")
        _write(args.output, report)
        print("\n".join(report))
        return
    else:
        report.append("- `--try-on-cpu`: both parts on the CPU, tiny; the figures mean nothing")
    with tempfile.TemporaryDirectory() as scratch:
        directory = Path(scratch)
        given = args.data_dir or os.environ.get("DSGD_DATA")
        if given and (Path(given) / "cifar-10-batches-py" / "test_batch").is_file():
            data_dir, source = Path(given) / "cifar-10-batches-py", f"CIFAR-10 from {given}"
        else:
            sizes = (512, 128) if args.try_on_cpu else (50_000, 10_000)
            data_dir = generated_cifar(directory / "data", *sizes)
            source = (f"a generated set of CIFAR-10's shape ({sizes[0]:,} + {sizes[1]:,} "
                      f"images; no CIFAR-10 here, so the accuracies mean nothing)")
        report += [f"- data: {source}", ""]
        parts = [("Examples/cifar10.yaml on one GPU", lambda: shared(args, data_dir, directory,
                                                                       device))]
        if not args.skip_compare:
            parts.append(("With a compute model: GPU against CPU", lambda: compared(
                args, directory, (device, "cpu"))))
        for title, part in parts:
            started = time.perf_counter()
            try:
                lines = part()
            except Exception as error:  # a part reports what failed and the next one runs
                lines = [f"failed: {type(error).__name__}: {error}"]
            report += [f"## {title} ({time.perf_counter() - started:.0f} s)", "", *lines, ""]
            _write(args.output, report)
    print("\n".join(report))


def _write(path: str, report: list[str]) -> None:
    Path(path).write_text("\n".join(report) + "\n")


if __name__ == "__main__":
    main()
