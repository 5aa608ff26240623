"""A worker's test-set evaluations during a run: when they happen, what they measure, and when
the target accuracy was first reached.

When: without a budget at the end of every epoch; under a budget the average model at the
budget's evaluation points, in the background (`evaluation.BackgroundEvaluation`), and once
more after the last step; for asynchronous algorithms, the average model after the last step.

What, by the aggregator's kind:
* models identical on every worker: each worker evaluates its slice of the test set and the
  sums are combined;
* models that differ: each worker's own model on the whole test set, then the average model
  and the consensus distance (how far the workers' models are from it);
* asynchronous algorithms: each worker's own model only, as long as training runs (the
  average model needs every worker, and not waiting for each other is their point); the
  average model once, after training.
"""

from __future__ import annotations

import copy
import math

import torch

from dsgd_cli.api import Aggregator, RunLength, flatten, unflatten_into
from dsgd_cli.comm.communicator import Comm
from dsgd_cli.worker.model_evaluation import BackgroundEvaluation, evaluate, model_tensors
from dsgd_cli.comm.events import EventWriter
from dsgd_cli.worker.schedule import StopRule, evaluation_points
from dsgd_cli.spec.resolved import ResolvedExperiment


def all_sum(comm: Comm, values: list[float]) -> list[float]:
    """Each value summed over all workers (in float64), kept out of the training's traffic."""
    tensor = torch.tensor(values, dtype=torch.float64, device=comm.device)
    with comm.untracked():
        comm.all_reduce(tensor, "sum")
    return tensor.tolist()


class WorkerEvaluation:
    """This worker's evaluations; `reached_at` is the seconds of training after which the
    target accuracy was first met, or None (a resumed run restores it)."""

    def __init__(self, experiment: ResolvedExperiment, task, aggregator: Aggregator,
                 comm: Comm, test_x, test_y, events: EventWriter, stop_rule: StopRule,
                 length: RunLength):
        self.task, self.aggregator, self.comm, self.events = task, aggregator, comm, events
        self.test_x, self.test_y = test_x, test_y
        self.stop_rule, self.length = stop_rule, length
        self.target = experiment.target_accuracy
        self.reached_at: float | None = None
        self.under_failures = experiment.failures is not None
        self.points = evaluation_points(experiment.budget)  # those not yet passed
        self.background = None
        if experiment.budget is not None:
            self.background = BackgroundEvaluation(
                comm, task, aggregator.evaluation_model(), test_x, test_y, self._report,
                self.target, live_only=self.under_failures)

    def _seconds(self) -> float:
        """Modeled seconds of training so far (the loop sets `length.started_at` at the common
        start)."""
        return self.length.elapsed()

    def after_step(self, step: int, epoch: int, end_of_epoch: bool, done: bool) -> None:
        """Evaluate what is due after `step` steps, `done` when it was this worker's last."""
        if self.background is not None:
            # Every point this worker has passed (all of them once it stops).
            progress = math.inf if done else self.stop_rule.progress()
            while self.points and self.points[0] <= progress:
                self.points.pop(0)
                self.background.snapshot(self.aggregator.evaluation_model(), step, epoch,
                                         self._seconds(), self._live())
        elif end_of_epoch:
            accuracy = self._evaluate(step, epoch)
            if self.target is not None and self.reached_at is None and accuracy >= self.target:
                self.reached_at = self._seconds()

    def after_training(self, step: int, epoch: int) -> None:
        """The evaluations at the end of the run, after the aggregator's `finish()`."""
        if self.background is not None:
            self.background.close()
            # Rank 0 judged the average model; the others pass 0 to the report's maximum.
            self.reached_at = self.background.reached_at if self.comm.rank == 0 else 0.0
        if self.aggregator.asynchronous:  # the workers meet for the first time
            self._evaluate(step, epoch, final=True)
        elif self.background is not None:
            self._evaluate(step, epoch)

    def _evaluate(self, step: int, epoch: int, final: bool = False) -> float:
        """Test metrics at `step`; returns the test accuracy: the average model's, or for an
        asynchronous algorithm before `final`, this worker's own model's."""
        model = self.aggregator.evaluation_model()
        if self.aggregator.asynchronous:
            own = evaluate(self.task, model, self.test_x, self.test_y)
            loss, correct, count = own
            # Per rank; the run's final value is their mean.
            self.events.metric("test_loss_workers", loss / count, step=step, epoch=epoch)
            self.events.metric("test_accuracy_workers", correct / count, step=step, epoch=epoch)
            if not final:
                return correct / count
            return self._average_model(model, own, step, epoch)
        if self.aggregator.models_identical:
            return self._identical_models(model, step, epoch)
        own = evaluate(self.task, model, self.test_x, self.test_y)
        return self._average_model(model, own, step, epoch)

    def _identical_models(self, model, step: int, epoch: int) -> float:
        """Each worker evaluates its slice of the test set; the sums are combined."""
        loss, correct, count = all_sum(self.comm, list(evaluate(
            self.task, model, *self._slice())))
        self._report({"test_loss": loss / count, "test_accuracy": correct / count}, step, epoch)
        return correct / count

    def _average_model(self, model, own: tuple[float, float, float], step: int,
                       epoch: int) -> float:
        """The average of the workers' models on the test set (each worker its slice), the
        consensus distance, and, unless asynchronous, the mean of the own models' metrics
        (`own`: this worker's model's sums on the whole test set)."""
        own_loss, own_correct, count = own
        average = copy.deepcopy(model)
        tensors = model_tensors(average)
        flat = flatten(tensors)
        own_flat = flat.clone()
        with self.comm.untracked():
            n, live = self._average_of_live_models(flat)
        unflatten_into(flat, tensors)
        # The distance counts parameters only: they come first in `model_tensors`.
        param_count = sum(p.numel() for p in average.parameters())
        distance = float((own_flat[:param_count] - flat[:param_count]).norm())
        loss, correct, avg_count = evaluate(self.task, average, *self._slice())
        # One all-reduce for all six sums, the own model's too even when unused; a down
        # worker's own model counts in none of them (it helps evaluate the average's slice).
        loss, correct, avg_count, own_loss, own_correct, distance = all_sum(
            self.comm, [loss, correct, avg_count, own_loss * live, own_correct * live,
                        distance * live])
        metrics = {"test_loss": loss / avg_count, "test_accuracy": correct / avg_count,
                   "consensus_distance": distance / n}
        if not self.aggregator.asynchronous:
            metrics["test_loss_workers"] = own_loss / (n * count)
            metrics["test_accuracy_workers"] = own_correct / (n * count)
        self._report(metrics, step, epoch)
        return correct / avg_count

    def _live(self) -> float:
        """1, or 0 for a worker that was down for the step just done (`failures` under
        `continue`): its model is stale, and stays out of the average model."""
        return 1.0 if getattr(getattr(self.aggregator, "ctx", None), "up", True) else 0.0

    def _average_of_live_models(self, flat) -> tuple[int, float]:
        """Replace `flat` (this worker's model) by the average of the live workers' models,
        every worker's without failures; returns how many models it averaged, and this
        worker's weight in it (1 or 0)."""
        if self.under_failures:
            live = self._live()
            weighted = torch.cat([flat * live, flat.new_tensor([live])])
            self.comm.all_reduce(weighted, "sum")
            count = round(float(weighted[-1]))
            if count > 0:
                flat.copy_(weighted[:-1] / count)
                return count, live
            # nobody up (workers not in step each judge it alone): every model, as it is
        self.comm.all_reduce(flat, "avg")
        return self.comm.world_size, 1.0

    def _slice(self):
        """This worker's slice of the test set: every world_size-th example from its rank."""
        rank, world_size = self.comm.rank, self.comm.world_size
        return self.test_x[rank::world_size], self.test_y[rank::world_size]

    def _report(self, values: dict[str, float], step: int, epoch: int) -> None:
        """Metrics of the whole run, written once, by rank 0."""
        if self.comm.rank == 0:
            if self.task.reports_perplexity and "test_loss" in values:
                values = {**values, "test_perplexity": math.exp(min(values["test_loss"], 700.0))}
            for name, value in values.items():
                self.events.metric(name, value, step=step, epoch=epoch, per_rank=False)
