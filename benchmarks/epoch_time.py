"""What an epoch of `examples/cifar10.yaml` and `examples/transformer.yaml` costs on this
machine, and so how long their full runs would take.

Each example experiment runs through `dsgd run` (torchrun, its workers, its aggregator) for
`--steps` steps of one epoch, with the example's model, batch and workers, on data of the
full size in the data set's own format. Without `--data` the data is generated: random
CIFAR-10 images (50,000 train, 10,000 test, written as CIFAR's python batches) and a text of
1,115,394 characters over 65 symbols (tiny Shakespeare's size): the time of a step does not
depend on what the pixels or characters are, but the accuracy does, so no accuracy is
reported for generated data. With `--data DIR` (holding `cifar-10-batches-py/` and
`tinyshakespeare.txt`) the real data is used.

Printed per experiment: the mean `step_seconds` (and its compute and communication parts),
the seconds of one end-of-epoch evaluation on the whole test set, and from them the time of an
epoch (steps per epoch × step + evaluation) and of the example's full run.

    python benchmarks/epoch_time.py [--steps 20] [--data DIR] [-e allreduce ...]
"""

from __future__ import annotations

import argparse
import math
import os
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import yaml
from results_row import print_rows

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = {"cifar10": ROOT / "examples" / "cifar10.yaml",
            "transformer": ROOT / "examples" / "transformer.yaml"}


def generate(directory: Path) -> None:
    """Full-size stand-ins for CIFAR-10 and tiny Shakespeare, in their own formats."""
    rng = np.random.default_rng(0)
    cifar = directory / "cifar-10-batches-py"
    cifar.mkdir(parents=True, exist_ok=True)
    for name, count in [*((f"data_batch_{i}", 10_000) for i in range(1, 6)), ("test_batch", 10_000)]:
        batch = {b"data": rng.integers(0, 256, (count, 3072), dtype=np.uint8),
                 b"labels": [int(v) for v in rng.integers(0, 10, count)]}
        with open(cifar / name, "wb") as file:
            pickle.dump(batch, file, protocol=2)
    alphabet = np.array(list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ .,;:!?'-\n&3"))
    text = "".join(alphabet[rng.integers(0, len(alphabet), 1_115_394)])
    (directory / "tinyshakespeare.txt").write_text(text)


def measured_spec(example: Path, steps: int, only: list[str] | None) -> tuple[dict, dict]:
    """The example cut to `steps` steps of one epoch (its schedule shortened to fit), and the
    example as written."""
    spec = yaml.safe_load(example.read_text())
    full = yaml.safe_load(example.read_text())
    defaults = spec["defaults"]
    defaults.update(epochs=1, steps_per_epoch=steps, log_interval=steps // 2,
                    lr_schedule={"name": "constant", "warmup_steps": 1}, target_accuracy=None)
    if only:
        spec["experiments"] = [e for e in spec["experiments"] if e["name"] in only]
    return spec, full


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--data", type=Path)
    parser.add_argument("-e", "--experiment", action="append")
    parser.add_argument("--example", choices=sorted(EXAMPLES), action="append")
    args = parser.parse_args()
    from dsgd_cli.spec.experiments import load_spec
    from dsgd_cli.results.store import Store

    headline = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data = args.data
        if data is None:
            data = tmp / "data"
            generate(data)
        env = {**os.environ, "DSGD_DATA": str(data.resolve())}
        os.environ["DSGD_DATA"] = env["DSGD_DATA"]
        for name in args.example or sorted(EXAMPLES):
            spec, full = measured_spec(EXAMPLES[name], args.steps, args.experiment)
            path = tmp / f"{name}.yaml"
            path.write_text(yaml.safe_dump(spec))
            (full_path := tmp / f"{name}-full.yaml").write_text(yaml.safe_dump(full))
            db = tmp / f"{name}.db"
            result = subprocess.run([sys.executable, "-m", "dsgd_cli", "run", str(path),
                                     "--db", str(db)], capture_output=True, text=True, env=env)
            if result.returncode != 0:
                raise SystemExit(result.stdout + result.stderr)
            configs = {e.name: e.config for e in load_spec(full_path)}
            store = Store(str(db))
            print(f"\n{name} ({'generated' if args.data is None else 'real'} data), "
                  f"{args.steps} steps per experiment")
            print("experiment | s/step | compute | comm | eval s | steps/epoch | s/epoch | "
                  "epochs | full run")
            for run in store.runs():
                config = configs[run.experiment]
                mean = lambda metric: float(np.mean(
                    [m.value for m in store.metric_history(run.id, metric)]))
                step, compute, comm = (mean(m) for m in ("step_seconds", "compute_seconds",
                                                        "comm_seconds"))
                final = {s.name: s.final for s in run.summaries}
                train_seconds = args.steps * step
                evaluation = max(0.0, final["wall_seconds"] - train_seconds)
                per_epoch = _steps_per_epoch(config)
                epoch = per_epoch * step + evaluation
                total = epoch * config["epochs"]
                print(f"{run.experiment} | {step:.3f} | {compute:.3f} | {comm:.3f} | "
                      f"{evaluation:.1f} | {per_epoch} | {epoch:.0f} | {config['epochs']} | "
                      f"{total / 3600:.1f} h")
                headline.append(f"{run.experiment} {epoch:.0f} s ({step:.3f} s/step; "
                                f"{config['epochs']} epochs {total / 3600:.1f} h)")
    print_rows((f"Time per epoch of the examples on this machine ({args.steps} steps each, "
                f"{'generated' if args.data is None else 'real'} data)", "; ".join(headline)))


def _steps_per_epoch(config: dict) -> int:
    from dsgd_cli.spec.experiments import build_plugin

    examples = build_plugin("task", config["task"]).train_examples()
    return math.ceil(examples // config["workers"] / config["batch_size"])


if __name__ == "__main__":
    main()
