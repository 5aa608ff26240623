"""Learning-rate schedules: the warm-up every schedule has, and the decay a schedule adds."""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

from dsgd_cli.options import option
from dsgd_cli.plugin_base.base import Plugin


@dataclass
class ScheduleOptions:
    """Options every schedule accepts: a linear warm-up. Subclass it for a schedule's own."""

    warmup_steps: int = option(0, min=0, help="steps of linear warm-up up to the peak lr")
    warmup_epochs: float = option(0.0, min=0.0, help="warm-up in epochs (instead of steps)")

    def __post_init__(self):
        if self.warmup_steps and self.warmup_epochs:
            raise ValueError("set warmup_steps or warmup_epochs, not both")


class LRSchedule(Plugin):
    """The learning rate of every step, from the peak lr (the optimizer's `lr`, times the
    spec's `lr_scaling`).

    Steps count from 1: `lr(s)` is what the s-th step of a worker applies, and what the `lr`
    metric recorded at step s shows. The base class does the warm-up: for s <= W (the warm-up
    steps) `lr(s) = peak × s / W`, so the first step trains at peak / W and the W-th at the
    peak; after it, `decay(s)` (the subclass's) gives the lr.

    `needs_total_steps`: the schedule's shape depends on the run's last step (cosine), so it
    cannot run under a `seconds` budget, whose last step is not known in advance.
    """

    Options: ClassVar[type] = ScheduleOptions
    needs_total_steps: ClassVar[bool] = False

    @staticmethod
    def warmup_length(options: ScheduleOptions, steps_per_epoch: int) -> int:
        """The warm-up in steps: `warmup_steps`, or `warmup_epochs` × steps per epoch,
        rounded to the nearest step."""
        if options.warmup_epochs:
            return round(options.warmup_epochs * steps_per_epoch)
        return options.warmup_steps

    @classmethod
    def check_run(cls, options: Any, total_steps: int | None, steps_per_epoch: int) -> None:
        """Raise ValueError if the schedule does not fit a run of `total_steps` steps per
        worker (None: not known in advance). Subclasses with options of their own that
        depend on the run's length extend it."""
        warmup = cls.warmup_length(options, steps_per_epoch)
        if total_steps is None:
            if cls.needs_total_steps:
                raise ValueError(f"schedule {cls.plugin_name!r} needs the run's length in "
                                 f"steps, which a seconds budget does not give")
            return
        if warmup > total_steps:
            given = (f"warmup_epochs: {options.warmup_epochs} ({warmup} steps)"
                     if options.warmup_epochs else f"warmup_steps: {warmup}")
            raise ValueError(f"the warm-up is longer than the run ({given}, the run has "
                             f"{total_steps} steps per worker)")

    def setup(self, peak: float, total_steps: int | None, steps_per_epoch: int) -> None:
        """Called once per worker before training: the peak lr, the run's steps per worker
        (None under a seconds budget) and the steps of an epoch."""
        self.peak, self.total_steps, self.steps_per_epoch = peak, total_steps, steps_per_epoch
        self.warmup_steps = self.warmup_length(self.options, steps_per_epoch)

    def lr(self, step: int) -> float:
        """The learning rate of the `step`-th step (from 1)."""
        if step <= self.warmup_steps:
            return self.peak * step / self.warmup_steps
        return self.decay(step)

    @abstractmethod
    def decay(self, step: int) -> float:
        """The learning rate of a step after the warm-up (`step` > `self.warmup_steps`)."""
