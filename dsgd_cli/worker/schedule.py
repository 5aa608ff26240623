"""How long a worker trains, when it evaluates, and how slow it is made to be.

* `StopRule`: after which step this worker stops, and what the progress bar shows. Without a
  budget every worker runs `epochs × steps_per_epoch` steps. With `budget: {samples: N}` or
  `{seconds: T}`:
  - workers in step with each other (every algorithm whose `steps_may_differ` is False) stop
    after the same step: the samples budget is a step count, the first step after which the
    workers have trained on N samples (`sharding.samples_budget_steps`: an epoch's short last
    batch counts what it holds); for the seconds budget each step's "my time is up" flags are
    combined by a small non-blocking all-reduce whose result is read one step later, so all
    workers see the same answer at the same step without waiting;
  - workers that may run different numbers of steps (adpsgd, wagma, backup) each stop on their
    own: the samples of all workers are added up in a counter shared through the rendezvous
    store, and the seconds are measured from the common start;
  - an aggregator that `decides_stop` (backup) ends the run itself.
* `evaluation_points`: under a budget, where the average model is evaluated (see
  `evaluation.BackgroundEvaluation`), in the budget's unit.

The emulated load imbalance (`Straggling`) lives with the rest of the emulation, in
`dsgd_cli.emulation.stragglers`; it is imported here for code that finds it here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsgd_cli.api import Aggregator, RunLength
from dsgd_cli.comm.communicator import Comm
from dsgd_cli.emulation.clock import Clock
from dsgd_cli.emulation.stragglers import Straggling  # noqa: F401  (its former home)
from dsgd_cli.spec.resolved import Budget, ResolvedExperiment


def run_length(experiment: ResolvedExperiment, steps_per_epoch: int, comm: Comm,
               aggregator: Aggregator, clock: Clock) -> RunLength:
    """How long the run trains; a budget in seconds is measured on `clock` (the worker's)."""
    budget = experiment.budget
    if budget is None:
        return RunLength(steps=experiment.epochs * steps_per_epoch,
                         time_scale=clock.time_scale, clock=clock)
    counter = None
    if budget.samples is not None and (aggregator.steps_may_differ or aggregator.decides_stop):
        counter = comm.counter(f"{experiment.name}/samples")
    return RunLength(samples=budget.samples, seconds=budget.seconds,
                     samples_counter=counter, time_scale=clock.time_scale, clock=clock)


@dataclass
class Progress:
    """What the progress bar shows after a step: `done` of `total` (None: not known) in `unit`
    (steps, updates, samples or seconds), and the run's `updates` when the aggregator counts
    them and the bar counts something else."""

    done: float
    total: float | None
    unit: str
    updates: int | None = None


class StopRule:
    """`planned_steps`: the run's last step per worker when all go at the same speed
    (`learning_rate.total_steps`), None under a seconds budget."""

    def __init__(self, length: RunLength, aggregator: Aggregator, comm: Comm,
                 planned_steps: int | None):
        self.length, self.aggregator, self.comm = length, aggregator, comm
        self.independent = aggregator.steps_may_differ or aggregator.decides_stop
        # Workers in step stop after the same step: a samples budget is a step count.
        self.last_step = length.steps
        if length.samples is not None and not self.independent:
            self.last_step = planned_steps
        self.global_samples = 0  # the run's samples as this worker knows them
        self._flag_group = None
        self._pending = None  # the all-reduce of the previous step's flags
        if length.seconds is not None and not self.independent:
            self._flag_group = comm.new_group(range(comm.world_size), backend="gloo")

    def expected_steps(self) -> int | None:
        """Steps per worker when known in advance."""
        return self.last_step

    def after_resume(self, steps: int) -> bool:
        """A resumed run has done `steps` already (runs with a budget do not checkpoint):
        True when that was its last."""
        if self.aggregator.decides_stop:
            return self.aggregator.finished()
        return self.length.steps is not None and steps >= self.length.steps

    def after_step(self, steps: int, batch_samples: int) -> bool:
        """Count this step; True when this worker has done its last step."""
        length = self.length
        if length.samples_counter is not None:
            self.global_samples = length.samples_counter.add(batch_samples)
        else:  # in step: every worker has processed as many samples as this one
            self.global_samples += batch_samples * self.comm.world_size
        if self.aggregator.decides_stop:
            return self.aggregator.finished()
        if self.last_step is not None:
            return steps >= self.last_step
        if length.samples is not None:  # workers on their own: the shared count
            return self.global_samples >= length.samples
        if self._flag_group is None:
            return length.spent()
        return self._agreed_time_is_up()

    def _agreed_time_is_up(self) -> bool:
        agreed = False
        if self._pending is not None:
            agreed = float(self._pending.wait()) > 0
        flag = torch.tensor([1.0 if self.length.spent() else 0.0])
        with self.comm.untracked():
            self._pending = self.comm.all_reduce(flag, "max", group=self._flag_group,
                                                 async_op=True)
        if agreed:  # every worker stops now; let the last flags land before leaving
            self._pending.wait()
        return agreed

    def progress(self) -> float:
        """How much of the budget is spent, in its unit (samples or seconds)."""
        if self.length.samples is not None:
            return float(self.global_samples)
        return self.length.elapsed()

    def progress_bar(self, steps: int) -> Progress:
        """The run's progress after this worker's `steps`-th step, in the unit whose total is
        known: its steps (or the run's updates, for an aggregator that counts them) when the
        run's length is a step count; otherwise the budget's samples or seconds, as this
        worker knows them."""
        updates = self.aggregator.updates_done() if self.aggregator.decides_stop else None
        if self.last_step is not None:
            if updates is not None:
                return Progress(updates, self.last_step, "updates")
            return Progress(steps, self.last_step, "steps")
        if self.length.samples is not None:
            return Progress(self.global_samples, self.length.samples, "samples", updates)
        return Progress(round(self.length.elapsed(), 1), self.length.seconds, "seconds", updates)


def evaluation_points(budget: Budget | None) -> list[float]:
    """Evenly spaced points of the budget, before its end (the final evaluation covers that)."""
    if budget is None:
        return []
    total = budget.samples if budget.samples is not None else budget.seconds
    count = budget.evaluations
    return [total * k / count for k in range(1, count)]
