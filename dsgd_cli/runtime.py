"""The worker process that torchrun starts, one per worker: `python -m dsgd_cli.runtime`.

It owns the order of the training loop (DESIGN.md principle 4); the aggregator plugin owns the
algorithm through its hooks. Every metric goes to this rank's event file (see events.py).
"""

from __future__ import annotations

import copy
import json
import math
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from dsgd_cli.api import TaskData, WorkerContext, flatten, unflatten_into
from dsgd_cli.comm import Comm
from dsgd_cli.events import EventWriter, events_path
from dsgd_cli.spec import build_plugin, network_model

EVAL_BATCH = 1024


class IntervalMetrics:
    """Sums over the steps of one log interval; `log()` is the plugins' MetricsLogger."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.steps = 0
        self.loss = 0.0
        self.step_seconds = 0.0
        self.comm_seconds = 0.0
        self.bytes_sent = 0
        self.bytes_received = 0
        self.custom: dict[str, list[float]] = {}

    def log(self, name: str, value: float) -> None:
        self.custom.setdefault(name, []).append(float(value))


@dataclass
class Shard:
    """This rank's share of the training set: a seeded permutation per epoch, split evenly
    (the remainder is dropped so every worker runs the same number of steps)."""

    num_examples: int
    rank: int
    world_size: int
    seed: int
    size: int = field(init=False)

    def __post_init__(self):
        self.size = self.num_examples // self.world_size

    def indices(self, epoch: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        order = torch.randperm(self.num_examples, generator=generator)
        return order[self.rank * self.size: (self.rank + 1) * self.size]


def evaluate(task, model, x, y) -> tuple[float, float, float]:
    """(summed loss, correct, count) of `model` on (x, y)."""
    loss_sum, correct = 0.0, 0
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for start in range(0, len(y), EVAL_BATCH):
            output = model(x[start: start + EVAL_BATCH])
            target = y[start: start + EVAL_BATCH]
            loss_sum += float(task.loss(output, target)) * len(target)
            correct += task.count_correct(output, target)
    model.train(was_training)
    return loss_sum, float(correct), float(len(y))


class Worker:
    def __init__(self, config: dict, events: EventWriter, rank: int, world_size: int,
                 device: torch.device):
        self.config, self.events = config, events
        self.rank, self.world_size, self.device = rank, world_size, device
        seed = config["seed"]
        self.task = build_plugin("task", config["task"])
        data: TaskData = self.task.load_data(seed)
        self.train_x, self.train_y = data.train_x.to(device), data.train_y.to(device)
        self.test_x, self.test_y = data.test_x.to(device), data.test_y.to(device)
        torch.manual_seed(seed)  # the same initial model on every worker
        self.model = self.task.build_model().to(device)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = build_plugin("optimizer", config["optimizer"]).build(params)
        self.comm = Comm(rank, world_size, network_model(config))
        self.interval = IntervalMetrics()
        self.aggregator = build_plugin("aggregator", config["aggregator"])
        self.ctx = WorkerContext(
            rank=rank, world_size=world_size, device=device, model=self.model,
            optimizer=self.optimizer, comm=self.comm, metrics=self.interval, seed=seed,
            compressor=build_plugin("compressor", config["compressor"]), config=config)
        self.ctx.compressor.setup(self.ctx)
        self.aggregator.setup(self.ctx)
        torch.manual_seed(seed * 7919 + rank)  # per-worker randomness (dropout, compressors)
        self.shard = Shard(len(self.train_y), rank, world_size, seed)
        stragglers = config.get("stragglers") or {}
        self.slowdown = stragglers["slowdown"] if rank in stragglers.get("ranks", []) else 1.0

    def steps_per_epoch(self) -> int:
        steps = math.ceil(self.shard.size / self.config["batch_size"])
        cap = self.config["steps_per_epoch"]
        return min(steps, cap) if cap else steps

    def train(self) -> None:
        config, events = self.config, self.events
        batch, epochs = config["batch_size"], config["epochs"]
        steps_per_epoch = self.steps_per_epoch()
        events.write("start", total_steps=epochs * steps_per_epoch)
        step, samples, total_sent, reached_at = 0, 0, 0, None
        last_compute = 0.0
        started = time.perf_counter()
        train_seconds = 0.0
        for epoch in range(epochs):
            order = self.shard.indices(epoch)
            for b in range(steps_per_epoch):
                index = order[b * batch: (b + 1) * batch].to(self.device)
                x, y = self.train_x[index], self.train_y[index]
                if self.slowdown > 1:  # an emulated slower machine: stretch its compute
                    time.sleep((self.slowdown - 1) * last_compute)
                step_start = time.perf_counter()
                self.optimizer.zero_grad(set_to_none=True)
                self.aggregator.before_forward(step)
                loss = self.task.loss(self.model(x), y)
                loss.backward()
                last_compute = time.perf_counter() - step_start
                self.aggregator.after_backward(step)
                self.optimizer.step()
                self.aggregator.after_step(step)
                step_seconds = time.perf_counter() - step_start
                traffic = self.comm.take_traffic()
                total_sent += traffic.bytes_sent
                samples += len(y)
                train_seconds += step_seconds
                self._accumulate(loss.detach(), step_seconds, traffic)
                step += 1
                if step % config["log_interval"] == 0 or b == steps_per_epoch - 1:
                    self._flush_interval(step, epoch)
            accuracy = self._evaluate(epoch, step)
            target = config["target_accuracy"]
            if target is not None and reached_at is None and accuracy >= target:
                reached_at = time.perf_counter() - started
        self.aggregator.finish()
        total_sent += self.comm.take_traffic().bytes_sent  # what finish() drained
        if self.aggregator.asynchronous:  # the workers meet for the first time
            self._evaluate(epochs - 1, step, final=True)
        self._report_run(started, train_seconds, samples, total_sent, reached_at)
        if config["save_dir"]:
            self._save_model(Path(config["save_dir"]) / config["name"].replace("/", "_"))

    def _save_model(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        state = self.aggregator.evaluation_model().state_dict()
        torch.save({k: v.detach().cpu() for k, v in state.items()}, directory / f"rank{self.rank}.pt")

    def _accumulate(self, loss: torch.Tensor, step_seconds: float, traffic) -> None:
        interval = self.interval
        interval.steps += 1
        interval.loss += float(loss)
        interval.step_seconds += step_seconds
        interval.comm_seconds += traffic.seconds
        interval.bytes_sent += traffic.bytes_sent
        interval.bytes_received += traffic.bytes_received

    def _flush_interval(self, step: int, epoch: int) -> None:
        interval, events = self.interval, self.events
        if interval.steps == 0:
            return
        n = interval.steps
        per_step = {
            "train_loss": interval.loss / n,
            "lr": self.optimizer.param_groups[0]["lr"],
            "step_seconds": interval.step_seconds / n,
            "comm_seconds": interval.comm_seconds / n,
            "compute_seconds": (interval.step_seconds - interval.comm_seconds) / n,
            "bytes_sent": interval.bytes_sent / n,
            "bytes_received": interval.bytes_received / n,
        }
        per_step.update({name: sum(v) / len(v) for name, v in interval.custom.items()})
        for name, value in per_step.items():
            events.metric(name, value, step=step, epoch=epoch)
        interval.reset()

    def _all_sum(self, values: list[float]) -> list[float]:
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        with self.comm.untracked():
            self.comm.all_reduce(tensor, "sum")
        return tensor.tolist()

    def _evaluate(self, epoch: int, step: int, final: bool = False) -> float:
        """Test metrics of the epoch; returns the test accuracy (average model if models differ).

        Asynchronous algorithms evaluate only each worker's own model until `final`: the
        average model needs every worker, and not waiting for each other is their point.
        """
        model = self.aggregator.evaluation_model()
        if self.aggregator.models_identical:
            # Every worker evaluates its slice of the test set; the sums are combined.
            loss, correct, count = self._all_sum(list(evaluate(
                self.task, model, self.test_x[self.rank::self.world_size],
                self.test_y[self.rank::self.world_size])))
            self._epoch_metrics({"test_loss": loss / count, "test_accuracy": correct / count},
                                step, epoch)
            return correct / count

        # Models differ: each worker's own model on the whole test set, then the average model.
        own_loss, own_correct, count = evaluate(self.task, model, self.test_x, self.test_y)
        if self.aggregator.asynchronous:  # per rank; the run's final value is their mean
            self.events.metric("test_loss_workers", own_loss / count, step=step, epoch=epoch)
            self.events.metric("test_accuracy_workers", own_correct / count, step=step,
                               epoch=epoch)
            if not final:
                return own_correct / count
        average = copy.deepcopy(model)
        tensors = [t.detach() for t in average.parameters()] + [
            b for b in average.buffers() if b.dtype.is_floating_point]
        flat = flatten(tensors)
        own_flat = flat.clone()
        with self.comm.untracked():
            self.comm.all_reduce(flat, "avg")
        unflatten_into(flat, tensors)
        param_count = sum(p.numel() for p in average.parameters())
        distance = float((own_flat[:param_count] - flat[:param_count]).norm())
        loss, correct, avg_count = evaluate(self.task, average,
                                            self.test_x[self.rank::self.world_size],
                                            self.test_y[self.rank::self.world_size])
        loss, correct, avg_count, own_loss, own_correct, distance = self._all_sum(
            [loss, correct, avg_count, own_loss, own_correct, distance])
        n = self.world_size
        metrics = {"test_loss": loss / avg_count, "test_accuracy": correct / avg_count,
                   "consensus_distance": distance / n}
        if not self.aggregator.asynchronous:
            metrics["test_loss_workers"] = own_loss / (n * count)
            metrics["test_accuracy_workers"] = own_correct / (n * count)
        self._epoch_metrics(metrics, step, epoch)
        return correct / avg_count

    def _epoch_metrics(self, values: dict[str, float], step: int, epoch: int) -> None:
        if self.rank == 0:
            for name, value in values.items():
                self.events.metric(name, value, step=step, epoch=epoch, per_rank=False)

    def _report_run(self, started, train_seconds, samples, total_sent, reached_at) -> None:
        wall = time.perf_counter() - started
        # Run totals: samples and bytes over all workers.
        samples, total_sent = self._all_sum([samples, total_sent])
        # The slowest worker's training time; the time by which every worker had seen the
        # target accuracy (workers of asynchronous algorithms each judge their own model).
        latest = torch.tensor([train_seconds, math.inf if reached_at is None else reached_at],
                              dtype=torch.float64, device=self.device)
        with self.comm.untracked():
            self.comm.all_reduce(latest, "max")
        slowest_train_seconds, reached_by_all = latest.tolist()
        if self.rank == 0:
            self.events.metric("wall_seconds", wall, per_rank=False)
            self.events.metric("samples_per_second", samples / slowest_train_seconds,
                               per_rank=False)
            self.events.metric("total_bytes_sent", total_sent, per_rank=False)
            if reached_by_all != math.inf:
                self.events.metric("time_to_accuracy", reached_by_all, per_rank=False)


def main(argv: list[str] | None = None) -> None:
    config_path, events_dir = (argv or sys.argv[1:])[:2]
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    events = EventWriter(events_path(events_dir, rank), rank)
    try:
        with open(config_path) as file:
            config = json.load(file)
        if torch.cuda.is_available():
            device = torch.device("cuda", local_rank)
            torch.cuda.set_device(device)
            backend = "nccl"
        else:
            device, backend = torch.device("cpu"), "gloo"
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=config.get("timeout_s", 600)))
        Worker(config, events, rank, world_size, device).train()
        dist.barrier()  # nobody tears down its connections while a peer still needs them
        events.write("done")
        exit_code = 0
    except Exception as error:
        events.write("error", reason=f"{type(error).__name__}: {error}",
                     traceback=traceback.format_exc(), at=time.time())
        exit_code = 1
    events.close()
    sys.stdout.flush()
    sys.stderr.flush()
    # Leave without tearing down the process group: after a failure the peers may be gone and
    # a clean shutdown could block on them, and gloo's teardown can abort the process
    # ("terminate called without an active exception") after a run that succeeded.
    os._exit(exit_code)

if __name__ == "__main__":
    main()
