"""One check of dsgd on a GPU machine, written as markdown: run it where a GPU is lent.

    python benchmarks/gpu_check.py [-o gpu_check.md] [--quick]

In order, each part timed and kept short (the whole check is designed for under 5 minutes on
one recent card):

1. the versions (Python, torch and its CUDA, numba, numba-cuda, numpy), the card, and dsgd's
   own pre-launch check of numba.cuda (numba_kernels/cuda_check.py);
2. every CUDA kernel against the CPU kernel, bit for bit, at 1M and 16M elements (1M with
   `--quick`; random decisions included: the same seeds give the same draws on both): the
   cases of numba_kernels/crosscheck.py, one per public function whose CUDA backend
   launches kernels (per-tensor and `*_segments`), the same cases the simulator tests run
   (tests/test_kernels_cudasim.py checks that together they launch every kernel);
3. the kernel table, `benchmarks/kernels.py --device cuda` (each numba kernel against plain
   torch and a device copy's bandwidth);
4. a 1-GPU `allreduce` run of CIFAR ResNet-20, batch 128, no augmentation, against a
   hand-written torch loop on the same data: samples per second of each and their ratio;
5. each compressor's samples per second with `allreduce` on the same setting, as a ratio of
   plain `allreduce`'s;
6. the shared-GPU example: 4 workers on one GPU (`device: cuda`), with a compute model, its
   modeled seconds and bytes against the same spec's on the CPU. The larger one, 8 workers
   of examples/cifar10.yaml's four algorithms for 3 epochs, is benchmarks/shared_gpu.py
   (minutes of its own).

`--try-on-cpu` checks the script on a machine without a GPU: part 2 runs the same cases
under numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1, in a process of its own) at 1,003
elements, parts 4 to 6 on the CPU, tiny; parts 1 and 3 report what there is.

CIFAR-10 cannot be downloaded on a machine without a registry: the check generates a set of
its shape (uint8 images, 10 classes) in a temporary directory; speed does not depend on the
pixels. What it lacks to import (sqlalchemy, greenlet, mnist1d, plotext, dsgd itself) must be
installed from wheels carried to it: docs/install.md says which.
"""

from __future__ import annotations

import argparse
import os
import pickle
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
SIZES = (1 << 20, 16 << 20)
SIMULATOR_SIZES = (1003,)  # --try-on-cpu: the simulator runs each GPU thread as a Python thread
BATCH = 128
COMPRESSORS = ("fp16", "bf16", "qsgd", "dqsgd", "terngrad", "sign", "ef_sign", "onebit", "topk",
               "randomk", "powersgd")


def versions() -> list[str]:
    from numba_kernels import cuda_check

    lines = [f"- Python {platform.python_version()}, torch {torch.__version__} "
             f"(CUDA {torch.version.cuda}), {cuda_check.versions()}"]
    if torch.cuda.is_available():
        lines.append(f"- card: {torch.cuda.get_device_name(0)} "
                     f"({torch.cuda.device_count()} visible)")
    problem = cuda_check.problem()
    lines.append(f"- dsgd's pre-launch check: {problem or 'numba.cuda compiles and runs kernels'}")
    return lines


def kernel_bits(sizes=SIZES, simulator: bool = False) -> list[str]:
    """Every CUDA kernel the compressors and aggregators call against the CPU kernel, bit for
    bit: the cases of numba_kernels/crosscheck.py (the same the simulator tests run), in a
    process of their own. `simulator`: under numba's CUDA simulator, on CPU tensors (numba
    reads NUMBA_ENABLE_CUDASIM when it is imported, hence the process)."""
    env = dict(os.environ)
    command = [sys.executable, "-m", "numba_kernels.crosscheck",
               "--sizes", ",".join(str(n) for n in sizes)]
    if simulator:
        env["NUMBA_ENABLE_CUDASIM"] = "1"
        command += ["--device", "simulator"]
    else:
        env.pop("NUMBA_ENABLE_CUDASIM", None)
        command += ["--device", "cuda"]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env,
                                cwd=ROOT)
    except subprocess.TimeoutExpired:
        return ["failed: the comparison ran past 240 s"]
    lines = result.stdout.strip().splitlines()
    if result.returncode not in (0, 1) or not lines:
        return [f"failed (exit {result.returncode}):", "```",
                *(result.stderr.strip().splitlines()[-15:]), "```"]
    return lines


def kernel_table(quick: bool) -> list[str]:
    sizes = "1M,16M" if quick else "1M,16M,64M"
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kernels.py"),
                             "--device", "cuda", "--sizes", sizes, "--repeats", "5"],
                            capture_output=True, text=True, timeout=240)
    return ["```", (result.stdout + result.stderr).strip(), "```"]


def generated_cifar(directory: Path, train: int = 50_000, test: int = 10_000) -> Path:
    """CIFAR-10's layout and shape (python pickles of uint8 images, 10 classes)."""
    folder = directory / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    generator = np.random.default_rng(0)
    per_file = train // 5
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    for name in names:
        count = test if name == "test_batch" else per_file
        batch = {b"data": generator.integers(0, 256, (count, 3 * 32 * 32), dtype=np.uint8),
                 b"labels": generator.integers(0, 10, count).tolist()}
        with open(folder / name, "wb") as file:
            pickle.dump(batch, file)
    return folder


def hand_loop(data_dir: Path, steps: int, device: str = "cuda") -> float:
    """Samples per second of the loop a researcher would write: ResNet-20, SGD, the same
    data on the GPU, no augmentation, no synchronisation but at the end."""
    from plugins.tasks.cifar import CIFAR10, read
    from plugins.tasks.resnet import CifarResNet

    data = read(data_dir, CIFAR10)
    x, y = data.train_x.to(device), data.train_y.to(device)
    torch.manual_seed(0)
    model = CifarResNet(20, 10, CIFAR10.mean, CIFAR10.std).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step(i: int) -> None:
        index = torch.arange(i * BATCH, (i + 1) * BATCH, device=device) % len(y)
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(x[index]), y[index]).backward()
        optimizer.step()

    synchronize = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for i in range(20):  # cuDNN's autotuning and the allocator, before the clock
        step(i)
    synchronize()
    started = time.perf_counter()
    for i in range(steps):
        step(i)
    synchronize()
    return steps * BATCH / (time.perf_counter() - started)


def dsgd_runs(specs: dict[str, dict], directory: Path) -> dict[str, dict]:
    """Run each spec (name -> its document) with `dsgd run`; each run's final summaries, by
    "name/experiment" (or "name": {"error": ...} when the command failed)."""
    import yaml

    from dsgd_cli.results.store import Store

    results = {}
    for name, document in specs.items():
        spec, db = directory / f"{name}.yaml", directory / f"{name}.db"
        spec.write_text(yaml.safe_dump(document))
        run = subprocess.run([sys.executable, "-m", "dsgd_cli", "run", str(spec), "--db", str(db)],
                             capture_output=True, text=True, timeout=300)
        if run.returncode != 0:
            results[name] = {"error": (run.stderr.strip().splitlines() or ["?"])[-1]}
            continue
        for record in Store(str(db)).runs():
            results[f"{name}/{record.experiment}"] = {s.name: s.final for s in record.summaries}
    return results


def one_gpu_runs(data_dir: Path, directory: Path, steps: int, compressors: tuple[str, ...],
                 device: str = "cuda") -> list[str]:
    spec = {"defaults": {"task": {"name": "cifar10_resnet", "depth": 20, "augment": False,
                                  "data_dir": str(data_dir)},
                         "workers": 1, "batch_size": BATCH, "steps_per_epoch": steps,
                         "log_interval": steps, "device": device},
            "experiments": [{"name": "allreduce"}] + [
                {"name": c, "aggregator": {"name": "allreduce", "compressor": {"name": c}}}
                for c in compressors]}
    hand = hand_loop(data_dir, steps, device)
    runs = dsgd_runs({"one": spec}, directory)
    plain = runs.get("one/allreduce", {}).get("samples_per_second")
    rows = [f"| run (1 worker, ResNet-20, batch {BATCH}, {steps} steps) | samples/s | ratio |",
            "|---|---|---|", f"| hand-written torch loop | {hand:,.0f} | 1.00 of the loop |"]
    if plain is None:
        rows.append(f"| dsgd `allreduce` | failed: {runs.get('one', {}).get('error')} | |")
        return rows
    rows.append(f"| dsgd `allreduce` | {plain:,.0f} | {plain / hand:.2f} of the loop |")
    for compressor in compressors:
        value = runs.get(f"one/{compressor}", {}).get("samples_per_second")
        shown = f"{value:,.0f} | {value / plain:.2f} of allreduce" if value else "failed |"
        rows.append(f"| `allreduce` + `{compressor}` | {shown} |")
    return rows


def shared_gpu(directory: Path, devices: tuple[str, str] = ("cuda", "cpu")) -> list[str]:
    """4 workers on one GPU and on the CPU, one spec with a compute model: the same modeled
    seconds and bytes (they depend on the model and the compute model alone); the losses
    differ in the last bits (the GPU's arithmetic), so they are shown, not compared."""
    def spec(device: str) -> dict:
        return {"defaults": {"task": "mnist1d_mlp", "workers": 4, "steps_per_epoch": 40,
                             "compute": {"step_seconds": 0.01}, "device": device},
                "experiments": [{"name": "allreduce"},
                                {"name": "local_sgd", "aggregator": {"name": "local_sgd",
                                                                     "period": 4}},
                                {"name": "sgp", "aggregator": {"name": "sgp"}}]}

    runs = dsgd_runs({device: spec(device) for device in dict.fromkeys(devices)}, directory)
    first, second = devices
    rows = [f"| experiment | {first}: wall_seconds, bytes | {second}: wall_seconds, bytes | "
            f"train_loss {first} / {second} |", "|---|---|---|---|"]
    for name in ("allreduce", "local_sgd", "sgp"):
        a, b = runs.get(f"{first}/{name}", {}), runs.get(f"{second}/{name}", {})
        rows.append(f"| {name} | {a.get('wall_seconds')}, {a.get('total_bytes_sent')} | "
                    f"{b.get('wall_seconds')}, {b.get('total_bytes_sent')} | "
                    f"{a.get('train_loss')} / {b.get('train_loss')} |")
    for device in dict.fromkeys(devices):
        if "error" in runs.get(device, {}):
            rows.append(f"\n{device} failed: {runs[device]['error']}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-o", "--output", default="gpu_check.md")
    parser.add_argument("--quick", action="store_true", help="fewer sizes, steps, compressors")
    parser.add_argument("--try-on-cpu", action="store_true",
                        help="part 2 under numba's CUDA simulator at a small size, parts 4 to "
                             "6 on the CPU, tiny: to check this script here before carrying "
                             "it to a GPU machine (its figures mean nothing)")
    args = parser.parse_args()
    report = [f"# dsgd GPU check, {time.strftime('%Y-%m-%d')}", "", *versions(), ""]
    if not torch.cuda.is_available() and not args.try_on_cpu:
        report.append("No CUDA device: nothing else to check.")
        _write(args.output, report)
        print("\n".join(report))
        return
    device = "cpu" if args.try_on_cpu else "cuda"
    steps = 3 if args.try_on_cpu else 40 if args.quick else 150
    compressors = COMPRESSORS[:2] if args.try_on_cpu else COMPRESSORS[:3] if args.quick \
        else COMPRESSORS
    if args.try_on_cpu:
        parts = [("Kernels, CUDA (the simulator) against CPU",
                  lambda: kernel_bits(SIMULATOR_SIZES, simulator=True))]
    else:
        parts = [("Kernels, CUDA against CPU", lambda: kernel_bits(SIZES[:1] if args.quick
                                                                   else SIZES)),
                 ("Kernel table", lambda: kernel_table(args.quick))]
    with tempfile.TemporaryDirectory() as scratch:
        directory = Path(scratch)
        data_dir = generated_cifar(directory, *((512, 128) if args.try_on_cpu else ()))
        parts += [("One GPU: dsgd against a hand loop, and each compressor",
                   lambda: one_gpu_runs(data_dir, directory, steps, compressors, device)),
                  ("Four workers sharing one GPU", lambda: shared_gpu(
                      directory, ("cpu", "cpu") if args.try_on_cpu else ("cuda", "cpu")))]
        for title, part in parts:
            started = time.perf_counter()
            try:
                lines = part()
            except Exception as error:  # a check reports what failed and goes on
                lines = [f"failed: {type(error).__name__}: {error}"]
            report += [f"## {title} ({time.perf_counter() - started:.0f} s)", "", *lines, ""]
            _write(args.output, report)  # what is done so far survives a timeout
    print("\n".join(report))


def _write(path: str, report: list[str]) -> None:
    Path(path).write_text("\n".join(report) + "\n")
    os.sync()


if __name__ == "__main__":
    main()
