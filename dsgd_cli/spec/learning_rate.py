"""The learning rate of each step: the spec's `lr_scaling` applied to the optimizer's `lr`, then
its `lr_schedule` plugin, set on the optimizer before every step.

What a step is: each worker counts its own steps, 1, 2, … (the `step` of its metrics). For
algorithms whose workers are in step that is the run's step. For those whose workers may run
different numbers of steps (adpsgd, wagma, backup) each worker follows the schedule at its
own pace, and a worker that runs past the run's nominal last step stays at the schedule's
value there (cosine's `final_lr`).

The run's last step T, which cosine decays towards: `epochs × steps per epoch`; under a
`samples` budget the step after which the workers, all going at the same speed, have trained on
the budget's samples (`sharding.samples_budget_steps`: ⌈samples / (workers × batch_size)⌉ when
every batch is full); under a `seconds` budget it is not known, and only schedules that do not
need it are accepted.
"""

from __future__ import annotations

import math
from typing import Any

from dsgd_cli.spec.resolved import read_key
from dsgd_cli.spec.sharding import samples_budget_steps

# lr_scaling: the factor the optimizer's lr is multiplied by, for n workers (Goyal et al.
# 2017's linear scaling rule; the square-root rule of Krizhevsky 2014 / Hoffer et al. 2017).
SCALINGS = {"none": lambda n: 1.0, "linear": lambda n: float(n), "sqrt": math.sqrt}
DEFAULT_SCHEDULE = {"name": "constant", "warmup_steps": 0, "warmup_epochs": 0.0}


def total_steps(config: dict[str, Any], shard_size: int, steps_per_epoch: int) -> int | None:
    """`last_step` of a configuration as stored."""
    budget = read_key(config, "budget")
    return _last_step(budget is not None, budget and budget.samples, read_key(config, "epochs"),
                      read_key(config, "workers"), read_key(config, "batch_size"), shard_size,
                      steps_per_epoch)


def last_step(experiment: Any, shard_size: int, steps_per_epoch: int) -> int | None:
    """The run's last step per worker, None under a seconds budget (see the module's text);
    `experiment` the resolved experiment (or the checked `ExperimentOptions`), `shard_size`
    each worker's share of the training set."""
    budget = experiment.budget
    return _last_step(budget is not None, budget and budget.samples, experiment.epochs,
                      experiment.workers, experiment.batch_size, shard_size, steps_per_epoch)


def _last_step(budgeted: bool, samples: int | None, epochs: int, workers: int,
               batch_size: int, shard_size: int, steps_per_epoch: int) -> int | None:
    if not budgeted:
        return epochs * steps_per_epoch
    if samples is not None:
        return samples_budget_steps(samples, workers, shard_size, batch_size, steps_per_epoch)
    return None  # a seconds budget


class LearningRate:
    """Sets the optimizer's learning rate before each step. `base_lrs` are its param groups'
    rates as the optimizer plugin built them (before a checkpoint's are loaded: those are a
    step's scheduled rate). The first group's rate, scaled, is the schedule's peak; other
    groups keep their ratio to it."""

    def __init__(self, schedule, optimizer, base_lrs: list[float], scaling: str,
                 world_size: int, total: int | None, steps_per_epoch: int):
        self.schedule, self.optimizer = schedule, optimizer
        first = base_lrs[0]
        self.ratios = [lr / first if first else 1.0 for lr in base_lrs]
        schedule.check_run(schedule.options, total, steps_per_epoch)
        schedule.setup(first * SCALINGS[scaling](world_size), total, steps_per_epoch)
        self.total = total

    def apply(self, step: int) -> float:
        """Set the rate of the `step`-th step (from 1); returns the first group's."""
        if self.total is not None:
            step = min(step, self.total)  # asynchronous workers may run past the last step
        lr = self.schedule.lr(step)
        for group, ratio in zip(self.optimizer.param_groups, self.ratios):
            group["lr"] = lr if ratio == 1.0 else lr * ratio
        return lr
