"""dsgd `allreduce` against torch DDP: same model, data, batch, 2 workers, in one run.

Both are launched with torchrun on this machine. Throughput is samples per second of the
training loop (evaluation excluded), summed over workers, using the slowest worker's time —
how dsgd computes its `samples_per_second`. End to end is the wall time of the whole command:
`dsgd run` of a one-experiment spec against `torchrun` of the DDP script, which also
evaluates on the test set after every epoch, as dsgd does, and runs with the malloc settings
dsgd gives its workers (`torchrun.MALLOC_SETTINGS`), so that the comparison is of the training
code. Prints both and the ratios dsgd / DDP.

    python benchmarks/overhead.py [--workers 2] [--epochs 3] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dsgd_cli.launch.torchrun import MALLOC_SETTINGS
from results_row import print_rows

CASES = [
    ("mnist1d_cnn", {"name": "mnist1d_cnn"}),
    ("mnist1d_mlp", {"name": "mnist1d_mlp"}),
    ("mnist1d_mlp (hidden 1024)", {"name": "mnist1d_mlp", "hidden": 1024}),
]


def ddp_worker(config_path: str, out_path: str) -> None:
    """Runs under torchrun: plain DDP training of the same task, timed like dsgd's loop."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from dsgd_cli.spec.experiments import build_plugin
    from dsgd_cli.spec.sharding import Shard

    config = json.loads(Path(config_path).read_text())
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    task = build_plugin("task", config["task"])
    data = task.load_data(config["seed"])
    torch.manual_seed(config["seed"])
    model = DistributedDataParallel(task.build_model())
    optimizer = build_plugin("optimizer", config["optimizer"]).build(model.parameters())
    shard = Shard(len(data.train_y), rank, world, config["seed"])
    batch = config["batch_size"]
    steps = -(-shard.size // batch)
    samples, seconds = 0, 0.0
    for epoch in range(config["epochs"]):
        order = shard.indices(epoch)
        for b in range(steps):
            index = order[b * batch: (b + 1) * batch]
            x, y = data.train_x[index], data.train_y[index]
            start = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            loss = task.loss(model(x), y)
            loss.backward()
            optimizer.step()
            float(loss.detach())  # dsgd reads the loss every step too
            seconds += time.perf_counter() - start
            samples += len(y)
        evaluate(task, model.module, data, rank, world)
    totals = torch.tensor([samples, seconds], dtype=torch.float64)
    dist.all_reduce(totals[:1])
    dist.all_reduce(totals[1:], dist.ReduceOp.MAX)
    if rank == 0:
        Path(out_path).write_text(json.dumps({"samples_per_second": float(totals[0] / totals[1])}))
    del model  # DDP's reducer before the process group: tearing down in the other order can abort
    dist.barrier()
    dist.destroy_process_group()


def evaluate(task, model, data, rank: int, world: int) -> float:
    """Test accuracy, each worker on its slice of the test set, as dsgd evaluates."""
    import torch
    import torch.distributed as dist

    with torch.no_grad():
        x, y = data.test_x[rank::world], data.test_y[rank::world]
        counts = torch.tensor([float(task.count_correct(model(x), y)), float(len(y))])
    dist.all_reduce(counts)
    return float(counts[0] / counts[1])


def spec_config(task: dict, workers: int, epochs: int) -> dict:
    return {"task": task, "workers": workers, "epochs": epochs, "batch_size": 32, "seed": 0,
            "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9}}


def run_ddp(config: dict, tmp: Path) -> tuple[float, float]:
    """(samples per second, wall seconds of the whole torchrun command)."""
    config_path, out_path = tmp / "ddp.json", tmp / "ddp-out.json"
    config_path.write_text(json.dumps(config))
    started = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                             f"--nproc-per-node={config['workers']}", __file__, "--ddp-worker",
                             str(config_path), str(out_path)], capture_output=True, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", **MALLOC_SETTINGS})
    wall = time.perf_counter() - started
    if result.returncode != 0:
        raise SystemExit(f"DDP run failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return json.loads(out_path.read_text())["samples_per_second"], wall


def run_dsgd(config: dict, tmp: Path, index: int) -> tuple[float, float]:
    """(samples per second, wall seconds of the whole `dsgd run` command)."""
    import yaml

    from dsgd_cli.results.store import Store

    spec = tmp / f"spec{index}.yaml"
    db = tmp / f"bench{index}-{time.monotonic_ns()}.db"
    experiment = {"name": "bench", **config, "aggregator": {"name": "allreduce"}}
    spec.write_text(yaml.safe_dump({"experiments": [experiment]}))
    started = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "dsgd_cli", "run", str(spec), "--db", str(db)],
                            capture_output=True, text=True)
    wall = time.perf_counter() - started
    if result.returncode != 0:
        raise SystemExit(f"dsgd run failed:\n{result.stdout}\n{result.stderr}")
    (run,) = Store(str(db)).runs()
    return {s.name: s.final for s in run.summaries}["samples_per_second"], wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5, help="alternating runs of each; medians are compared")
    args = parser.parse_args()
    print(f"dsgd allreduce vs torch DDP, {args.workers} workers (gloo, CPU), batch 32 per worker, "
          f"{args.epochs} epochs, median of {args.repeats} alternating runs [min-max]")
    print(f"{'model':28s} {'DDP samples/s':>22s} {'dsgd samples/s':>22s} {'dsgd/DDP':>9s} "
          f"{'DDP wall s':>18s} {'dsgd wall s':>18s} {'wall dsgd/DDP':>14s}")
    speed_ratios, wall_ratios = [], []
    with tempfile.TemporaryDirectory() as directory:
        tmp = Path(directory)
        for label, task in CASES:
            config = spec_config(task, args.workers, args.epochs)
            ddp, ours, ddp_wall, our_wall = [], [], [], []
            for repeat in range(args.repeats):  # alternate so drift in machine load hits both
                speed, wall = run_ddp(config, tmp)
                ddp.append(speed)
                ddp_wall.append(wall)
                speed, wall = run_dsgd(config, tmp, repeat)
                ours.append(speed)
                our_wall.append(wall)
            speed_ratios.append(f"{label} {statistics.median(ours) / statistics.median(ddp):.3f}")
            wall_ratios.append(f"{label} {statistics.median(our_wall) / statistics.median(ddp_wall):.3f}")
            print(f"{label:28s} {_spread(ddp):>22s} {_spread(ours):>22s} "
                  f"{statistics.median(ours) / statistics.median(ddp):9.3f} "
                  f"{_spread(ddp_wall, 2):>18s} {_spread(our_wall, 2):>18s} "
                  f"{statistics.median(our_wall) / statistics.median(ddp_wall):14.3f}", flush=True)
    print_rows((f"dsgd `allreduce` / torch DDP, training samples/s ({args.workers} workers, gloo)",
                ", ".join(speed_ratios) + f" (medians of {args.repeats})"),
               ("dsgd `allreduce` / torch DDP, the whole command's wall time",
                ", ".join(wall_ratios) + f" (medians of {args.repeats})"))


def _spread(values: list[float], digits: int = 0) -> str:
    return (f"{statistics.median(values):.{digits}f} "
            f"[{min(values):.{digits}f}-{max(values):.{digits}f}]")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--ddp-worker":
        ddp_worker(sys.argv[2], sys.argv[3])
    else:
        main()
