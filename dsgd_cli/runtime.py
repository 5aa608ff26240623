"""The worker process that torchrun starts, one per worker: `python -m dsgd_cli.runtime`.

It owns the order of the training loop (README, "Writing a plugin"); the aggregator plugin owns the
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
from collections import deque
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from dsgd_cli import checkpoint
from dsgd_cli.api import TaskData, WorkerContext, flatten, unflatten_into
from dsgd_cli.comm import DEFAULT_TIMEOUT_S, Comm
from dsgd_cli.evaluation import BackgroundEvaluation, evaluate, model_tensors
from dsgd_cli.events import EventWriter, events_path, experiment_dir, stop_path
from dsgd_cli.schedule import StopRule, Straggling, evaluation_points, run_length
from dsgd_cli.spec import build_plugin, network_model


class Diverged(Exception):
    """The training loss became NaN or infinite."""

    def __init__(self, step: int, value: float):
        super().__init__(f"train_loss is {value} at step {step}")
        self.step, self.value = step, value


class Stopped(Exception):
    """The launcher asked the workers to stop (the run was interrupted); this one saved a
    checkpoint after `step` and leaves."""

    def __init__(self, step: int):
        super().__init__(f"stopped after step {step}")
        self.step = step


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

    def state(self) -> dict:
        """The sums so far, for a checkpoint inside the interval."""
        return {**vars(self), "custom": {k: list(v) for k, v in self.custom.items()}}

    def restore(self, state: dict) -> None:
        vars(self).update(state)


_loaded: dict[str, TaskData] = {}  # the last data set loaded in this process


def load_data(task, options: dict, seed: int) -> TaskData:
    """The task's data; consecutive experiments of a launch with the same task options and
    seed reuse the tensors (they are never modified: workers index and copy them)."""
    key = json.dumps([options, seed], sort_keys=True)
    if key not in _loaded:
        _loaded.clear()
        _loaded[key] = task.load_data(seed)
    return _loaded[key]


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
        if self.size == 0:
            raise ValueError(f"{self.num_examples} training examples cannot be shared by "
                             f"{self.world_size} workers: each needs at least one")

    def indices(self, epoch: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        order = torch.randperm(self.num_examples, generator=generator)
        return order[self.rank * self.size: (self.rank + 1) * self.size]


class Worker:
    def __init__(self, config: dict, events: EventWriter, rank: int, world_size: int,
                 device: torch.device, namespace: str = "", stop_file: Path | None = None):
        self.config, self.events = config, events
        self.stop_file, self.namespace = stop_file, namespace
        self.stop_at: int | None = None  # the step all workers stop after, once asked
        self.rank, self.world_size, self.device = rank, world_size, device
        seed = config["seed"]
        self.task = build_plugin("task", config["task"])
        data = load_data(self.task, config["task"], seed)
        self.train_x, self.train_y = data.train_x.to(device), data.train_y.to(device)
        self.test_x, self.test_y = data.test_x.to(device), data.test_y.to(device)
        torch.manual_seed(seed)  # the same initial model on every worker
        self.model = self.task.build_model().to(device)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = build_plugin("optimizer", config["optimizer"]).build(params)
        # Checkpoints: the run's directory (set by the launcher when the spec asks for
        # them), and the state to continue from when the run resumes.
        self.checkpoints = config.get("checkpoint_dir")
        self.checkpoint_every = config.get("checkpoint_every") if self.checkpoints else None
        resumed = None
        if config.get("resume_step") is not None:
            resumed = checkpoint.load(self.checkpoints, config["resume_step"], rank)
            self.model.load_state_dict(resumed["model"])
            self.optimizer.load_state_dict(resumed["optimizer"])
        self.comm = Comm(rank, world_size, network_model(config), device,
                         timeout_s=config.get("timeout", DEFAULT_TIMEOUT_S), namespace=namespace)
        self.interval = IntervalMetrics()
        self.shard = Shard(len(self.train_y), rank, world_size, seed)
        self.aggregator = build_plugin("aggregator", config["aggregator"])
        self.ctx = WorkerContext(
            rank=rank, world_size=world_size, device=device, model=self.model,
            optimizer=self.optimizer, comm=self.comm, metrics=self.interval, seed=seed,
            compressor=build_plugin("compressor", config["compressor"]), config=config)
        self.ctx.length = run_length(config, self.steps_per_epoch(), self.comm, self.aggregator)
        # Every rank creates the same process groups in the same order: the runtime's first.
        self.stop_rule = StopRule(self.ctx.length, self.aggregator, self.comm)
        self.ctx.compressor.setup(self.ctx)
        self.aggregator.setup(self.ctx)
        if resumed is not None:  # the plugins set up from the restored model, then their state
            self.ctx.compressor.load_state_dict(resumed["compressor"])
            self.aggregator.load_state_dict(resumed["aggregator"])
        self.evaluation = None
        if config.get("budget") is not None:
            self.evaluation = BackgroundEvaluation(
                self.comm, self.task, self.aggregator.evaluation_model(), self.test_x,
                self.test_y, self._scheduled_metrics, config["target_accuracy"])
        torch.manual_seed(seed * 7919 + rank)  # per-worker randomness (dropout, compressors)
        self.straggling = Straggling(config.get("stragglers"), rank, seed)
        self.recent_compute: deque[float] = deque(maxlen=16)  # forward+backward seconds
        self.resumed = None
        if resumed is not None:
            checkpoint.set_rng_state(resumed["rng"], device)
            self.resumed = resumed["progress"]

    def steps_per_epoch(self) -> int:
        steps = math.ceil(self.shard.size / self.config["batch_size"])
        cap = self.config["steps_per_epoch"]
        return min(steps, cap) if cap else steps

    def train(self) -> None:
        config, events = self.config, self.events
        batch = config["batch_size"]
        steps_per_epoch = self.steps_per_epoch()
        budgeted = config.get("budget") is not None
        points = evaluation_points(config.get("budget"))
        events.write("start", total_steps=self.stop_rule.expected_steps(batch))
        step, samples, total_sent, reached_at = 0, 0, 0, None
        train_seconds, elapsed = 0.0, 0.0
        if self.resumed is not None:  # go on where the checkpoint left off
            step, samples, total_sent = (self.resumed[k] for k in ("step", "samples", "total_sent"))
            train_seconds, elapsed = self.resumed["train_seconds"], self.resumed["elapsed"]
            reached_at = self.resumed["reached_at"]
            events.continue_from(self.resumed["seconds"])
            self.interval.restore(self.resumed["interval"])
        with self.comm.untracked():
            self.comm.barrier()  # a common start: budgets in seconds count from here
        started = time.perf_counter() - elapsed
        self.ctx.length.started_at = started
        done = self.stop_rule.after_resume(step) if self.resumed is not None else False
        order_epoch = None
        while not done:
            epoch, b = divmod(step, steps_per_epoch)
            if epoch != order_epoch:
                order, order_epoch = self.shard.indices(epoch), epoch
            index = order[b * batch: (b + 1) * batch].to(self.device)
            x, y = self.train_x[index], self.train_y[index]
            try:
                loss, step_seconds = self._step(step, x, y)
            except Diverged:
                self._flush_interval(step, epoch)  # the steps before it are sound: keep them
                raise
            traffic = self.comm.take_traffic()
            total_sent += traffic.bytes_sent
            samples += len(y)
            train_seconds += step_seconds
            self._accumulate(loss, step_seconds, traffic)
            step += 1
            done = self.stop_rule.after_step(step, len(y))
            end_of_epoch = b == steps_per_epoch - 1
            every = self.checkpoint_every
            stopping = bool(every) and not done and self._asked_to_stop(step)
            checkpointing = bool(every) and not done and (step % every == 0 or stopping)
            if step % config["log_interval"] == 0 or end_of_epoch or done:
                self._flush_interval(step, epoch)
            if budgeted:
                # Every point this worker has passed (all of them once it stops).
                progress = math.inf if done else self.stop_rule.progress()
                while points and points[0] <= progress:
                    points.pop(0)
                    self.evaluation.snapshot(self.aggregator.evaluation_model(), step, epoch,
                                             time.perf_counter() - started)
            elif end_of_epoch:
                accuracy = self._evaluate(epoch, step)
                target = config["target_accuracy"]
                if target is not None and reached_at is None and accuracy >= target:
                    reached_at = time.perf_counter() - started
            if checkpointing:  # after the step's metrics and evaluation: resumes repeat neither
                self._save_checkpoint(step, {
                    "step": step, "samples": samples, "total_sent": total_sent,
                    "train_seconds": train_seconds, "elapsed": time.perf_counter() - started,
                    "seconds": events.seconds(), "reached_at": reached_at,
                    "interval": self.interval.state()})
            if stopping:
                raise Stopped(step)
        self.aggregator.finish()
        total_sent += self.comm.take_traffic().bytes_sent  # what finish() drained
        if self.evaluation is not None:
            self.evaluation.close()
            reached_at = self.evaluation.reached_at if self.rank == 0 else 0.0
        if self.aggregator.asynchronous:  # the workers meet for the first time
            self._evaluate(epoch, step, final=True)
        elif budgeted:
            self._evaluate(epoch, step)
        self._report_run(started, train_seconds, samples, total_sent, reached_at)
        if config["save_dir"]:
            self._save_model(Path(config["save_dir"]) / config["name"].replace("/", "_"))

    def _step(self, step: int, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
        """One training step in the loop's order; returns (loss, seconds)."""
        started = time.perf_counter()
        if self.straggling.active:
            # An emulated slower machine, counted in the step's (compute) time.
            factor = self.straggling.factor(step)
            self.interval.log("slowdown", factor)
            time.sleep(Straggling.delay(factor, self.recent_compute))
        self.optimizer.zero_grad(set_to_none=True)
        self.aggregator.before_forward(step)
        compute_started = time.perf_counter()
        loss = self.task.loss(self.model(x), y)
        value = float(loss.detach())
        if not math.isfinite(value):
            raise Diverged(step, value)
        loss.backward()
        self.recent_compute.append(time.perf_counter() - compute_started)
        self.ctx.loss = loss.detach()
        self.aggregator.after_backward(step)
        self.optimizer.step()
        self.aggregator.after_step(step)
        return value, time.perf_counter() - started

    def _asked_to_stop(self, step: int) -> bool:
        """Whether this worker stops after `step`, `step` steps done. Once the launcher asks,
        the first worker to notice proposes to stop two steps later and the others take its
        proposal from the rendezvous store: workers in step are at most one step apart, so
        all of them can still stop after that same step, none waiting for a peer that left."""
        if self.stop_at is None:
            if self.stop_file is None or not self.stop_file.exists():
                return False
            store = dist.distributed_c10d._get_default_store()
            key = f"dsgd/stop_at/{self.namespace}"
            self.stop_at = int(store.compare_set(key, "", str(step + 2)))
        return step >= self.stop_at

    def _save_checkpoint(self, step: int, progress: dict) -> None:
        state = {"progress": progress, "model": self.model.state_dict(),
                 "optimizer": self.optimizer.state_dict(),
                 "aggregator": self.aggregator.state_dict(),
                 "compressor": self.ctx.compressor.state_dict(),
                 "rng": checkpoint.rng_state(self.device)}
        checkpoint.save(self.checkpoints, step, self.rank, state, self.world_size)

    def _scheduled_metrics(self, values: dict[str, float], step: int, epoch: int) -> None:
        for name, value in values.items():
            self.events.metric(name, value, step=step, epoch=epoch, per_rank=False)

    def _save_model(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        state = self.aggregator.evaluation_model().state_dict()
        torch.save({k: v.detach().cpu() for k, v in state.items()}, directory / f"rank{self.rank}.pt")

    def _accumulate(self, loss: float, step_seconds: float, traffic) -> None:
        interval = self.interval
        interval.steps += 1
        interval.loss += loss
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
        asynchronous = self.aggregator.asynchronous
        if self.aggregator.models_identical and not asynchronous:
            # Every worker evaluates its slice of the test set; the sums are combined.
            loss, correct, count = self._all_sum(list(evaluate(
                self.task, model, self.test_x[self.rank::self.world_size],
                self.test_y[self.rank::self.world_size])))
            self._epoch_metrics({"test_loss": loss / count, "test_accuracy": correct / count},
                                step, epoch)
            return correct / count

        # Models differ: each worker's own model on the whole test set, then the average model.
        own_loss, own_correct, count = evaluate(self.task, model, self.test_x, self.test_y)
        if asynchronous:  # per rank; the run's final value is their mean
            self.events.metric("test_loss_workers", own_loss / count, step=step, epoch=epoch)
            self.events.metric("test_accuracy_workers", own_correct / count, step=step,
                               epoch=epoch)
            if not final:
                return own_correct / count
        average = copy.deepcopy(model)
        tensors = model_tensors(average)
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
        # target accuracy (workers of asynchronous algorithms each judge their own model;
        # under a budget rank 0 judged the average model and the others pass 0).
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


def _shared_run_id(config: dict, namespace: str) -> int:
    """The id of the run, which only node rank 0's launcher knows (it created the run): its
    workers put it in the rendezvous store, the other machines' read it from there."""
    store = dist.distributed_c10d._get_default_store()
    key = f"dsgd/run_id/{namespace}"
    if config.get("run_id") is not None and int(os.environ.get("LOCAL_RANK", "0")) == 0:
        store.set(key, str(config["run_id"]))
    return int(store.get(key))


def device_and_backend(local_rank: int, kind: str | None = None) -> tuple[torch.device, str]:
    """The launcher's choice (`launcher.choose_device`, in the plan); for a worker started
    by hand, CUDA when it is there."""
    kind = kind or ("cuda" if torch.cuda.is_available() else "cpu")
    if kind == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        return device, "nccl"
    return torch.device("cpu"), "gloo"


def main(argv: list[str] | None = None) -> None:
    """A worker of one launch: runs the launch's experiments (a JSON list) one after another
    in one process group, each from a fresh start. The first that fails ends the process: the
    launcher records it and launches the rest anew."""
    plan_path, events_dir = (argv or sys.argv[1:])[:2]
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    plan = wait_for_plan(Path(plan_path))
    configs = plan["experiments"]
    exit_code = 0
    for index, config in enumerate(configs):
        directory = experiment_dir(events_dir, index)
        directory.mkdir(parents=True, exist_ok=True)
        events = EventWriter(events_path(directory, rank), rank)
        exit_code = run_experiment(config, events, rank, world_size, local_rank,
                                   namespace=str(index), stop_file=stop_path(events_dir),
                                   device_kind=plan.get("device"))
        events.close()
        if exit_code:
            break
    sys.stdout.flush()
    sys.stderr.flush()
    # Leave without tearing down the process group: after a failure the peers may be gone and
    # a clean shutdown could block on them, and gloo's teardown can abort the process
    # ("terminate called without an active exception") after a run that succeeded.
    os._exit(max(exit_code, 0))


def wait_for_plan(path: Path) -> dict:
    """The launch's plan. torchrun may start before the launcher has validated the spec (so
    that starting and importing overlap the validation): the plan then appears, whole, once
    the spec is valid. A launcher that is gone will not write it."""
    launcher = int(os.environ.get("DSGD_LAUNCHER_PID", "0"))
    while not path.exists():
        if launcher and not _alive(launcher):
            sys.exit(f"dsgd: the launcher (pid {launcher}) is gone")
        time.sleep(0.01)
    return json.loads(path.read_text())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's (the pid was reused)
        return True
    return True


def run_experiment(config: dict, events: EventWriter, rank: int, world_size: int,
                   local_rank: int, namespace: str = "", stop_file: Path | None = None,
                   device_kind: str | None = None) -> int:
    """Train one experiment, reporting to `events`; returns the process exit code, or -1 when
    it stopped as the launcher asked (the process then leaves, with code 0)."""
    try:
        device, backend = device_and_backend(local_rank, device_kind)
        if not dist.is_initialized():
            torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
            dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(
                seconds=config.get("timeout", DEFAULT_TIMEOUT_S)))
        if config.get("nnodes", 1) > 1:
            events.write("run", run_id=_shared_run_id(config, namespace))
        worker = Worker(config, events, rank, world_size, device, namespace, stop_file)
        worker.train()
        with worker.comm.untracked():  # nobody tears down its links while a peer needs them
            worker.comm.barrier()
        worker.comm.close()
        events.write("done")
        return 0
    except Stopped as stopped:
        events.write("stopped", step=stopped.step)
        return -1
    except Diverged as diverged:
        events.write("diverged", step=diverged.step, name="train_loss",
                     value=str(diverged.value), at=time.time())
    except Exception as error:
        events.write("error", reason=f"{type(error).__name__}: {error}",
                     traceback=traceback.format_exc(), at=time.time())
    return 1


if __name__ == "__main__":
    main()
