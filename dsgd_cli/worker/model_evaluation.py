"""Test-set evaluation: a model on a slice of data, and, under a budget, the average model at
evenly spaced points of the run without stopping training.
"""

from __future__ import annotations

import copy
import queue
import threading
from typing import Callable

import torch
from torch import nn

from dsgd_cli.api import flatten, unflatten_into
from dsgd_cli.comm.communicator import Comm

EVAL_BATCH = 1024


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


def model_tensors(model: nn.Module) -> list[torch.Tensor]:
    """What makes up a model for averaging: its parameters and floating-point buffers."""
    return [p.detach() for p in model.parameters()] + [
        b for b in model.buffers() if b.dtype.is_floating_point]


class BackgroundEvaluation:
    """The average model at scheduled points, evaluated while training goes on.

    At each point every worker snapshots its model (`snapshot`, from the training loop, between
    steps) and hands it to its evaluation thread; the threads average the snapshots with an
    all-reduce on a group of their own, and rank 0's evaluates the average on the whole test
    set. Training never waits for it, so asynchronous algorithms stay asynchronous. Every
    worker must take the same number of snapshots (the schedule guarantees it).

    A point's metrics are written by rank 0 once every snapshot has arrived, so their
    `seconds` say when the average model existed. `reached_at` is the first point whose
    accuracy met `target`, in seconds of training: the latest of the workers' snapshot times.
    """

    def __init__(self, comm: Comm, task, model: nn.Module, test_x, test_y,
                 write: Callable[[dict, int, int], None], target: float | None,
                 live_only: bool = False):
        """`live_only` (under `failures`): the average is over the snapshots of workers
        that were up, not over a down worker's stale model (`snapshot`'s `live`)."""
        self.comm, self.task = comm, task
        self.live_only = live_only
        self.test_x, self.test_y = test_x, test_y
        self.write, self.target = write, target
        self.average = copy.deepcopy(model)  # only this thread touches it
        self.group = comm.new_group(range(comm.world_size), backend="gloo")
        self.reached_at: float | None = None
        self.error: BaseException | None = None
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, daemon=True, name="dsgd-evaluation")
        self._thread.start()

    def snapshot(self, model: nn.Module, step: int, epoch: int, train_seconds: float,
                 live: float = 1.0) -> None:
        """Queue this worker's model as it is now, `train_seconds` after training started;
        `live` 0 for a worker down for the step just done."""
        self._check()
        flat = flatten(model_tensors(model)).to("cpu", copy=True)
        self._queue.put((flat, live, step, epoch, train_seconds))

    def close(self) -> None:
        """Wait until every queued snapshot is evaluated."""
        self._queue.put(None)
        self._thread.join()
        self._check()

    def _check(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"background evaluation failed: {self.error!r}") from self.error

    def _run(self) -> None:
        try:
            with self.comm.untracked():
                while (item := self._queue.get()) is not None:
                    self._evaluate(*item)
        except BaseException as error:  # raised in the training loop by _check
            self.error = error

    def _evaluate(self, flat, live, step, epoch, train_seconds) -> None:
        flat = self._average(flat, live)
        latest = torch.tensor([train_seconds], dtype=torch.float64)
        self.comm.all_reduce(latest, "max", group=self.group)
        if self.comm.rank != 0:
            return
        tensors = model_tensors(self.average)
        device = tensors[0].device if tensors else torch.device("cpu")
        unflatten_into(flat.to(device), tensors)
        loss, correct, count = evaluate(self.task, self.average, self.test_x, self.test_y)
        accuracy = correct / count
        self.write({"test_loss": loss / count, "test_accuracy": accuracy}, step, epoch)
        if self.target is not None and self.reached_at is None and accuracy >= self.target:
            self.reached_at = float(latest)

    def _average(self, flat: torch.Tensor, live: float) -> torch.Tensor:
        """The average of the workers' snapshots (with `live_only`, of the live ones')."""
        if self.live_only:
            weighted = torch.cat([flat * live, flat.new_tensor([live])])
            self.comm.all_reduce(weighted, "sum", group=self.group)
            count = round(float(weighted[-1]))
            if count > 0:
                return weighted[:-1] / count
        self.comm.all_reduce(flat, "avg", group=self.group)
        return flat
