"""Built-in learning-rate schedules: constant, step decay and cosine decay, each after an
optional linear warm-up (the base class's; Goyal et al., 2017, "Accurate, Large Minibatch SGD").

Steps count from 1, as the recorded metrics do: `lr(s)` is the rate of a worker's s-th step.
"""

import math
from dataclasses import dataclass

from dsgd_cli.api import LRSchedule, ScheduleOptions, option


class Constant(LRSchedule):
    """`constant`: the peak lr after the warm-up."""

    def decay(self, step: int) -> float:
        return self.peak


@dataclass
class StepOptions(ScheduleOptions):
    milestones: list[int] = option([], help="steps after which the lr is multiplied by factor")
    milestone_epochs: list[float] = option([], help="milestones in epochs (instead of steps)")
    factor: float = option(0.1, min=0.0, help="what the lr is multiplied by at each milestone")

    def __post_init__(self):
        super().__post_init__()
        if self.milestones and self.milestone_epochs:
            raise ValueError("set milestones or milestone_epochs, not both")
        for name in ("milestones", "milestone_epochs"):
            values = getattr(self, name)
            if any(value <= 0 for value in values) or values != sorted(set(values)):
                raise ValueError(f"{name}: expected increasing positive values, got {values}")


class StepDecay(LRSchedule):
    """`step`: the peak lr, multiplied by `factor` after each milestone: a step s > m has
    been through milestone m (as torch's MultiStepLR, milestone m decays from step m + 1)."""

    Options = StepOptions

    @staticmethod
    def milestone_steps(options: StepOptions, steps_per_epoch: int) -> list[int]:
        if options.milestone_epochs:
            return [round(epochs * steps_per_epoch) for epochs in options.milestone_epochs]
        return list(options.milestones)

    @classmethod
    def check_run(cls, options, total_steps, steps_per_epoch) -> None:
        super().check_run(options, total_steps, steps_per_epoch)
        warmup = cls.warmup_length(options, steps_per_epoch)
        for milestone in cls.milestone_steps(options, steps_per_epoch):
            if milestone < warmup:
                raise ValueError(f"milestone at step {milestone} falls inside the warm-up "
                                 f"({warmup} steps)")

    def setup(self, peak, total_steps, steps_per_epoch) -> None:
        super().setup(peak, total_steps, steps_per_epoch)
        self.milestones = self.milestone_steps(self.options, steps_per_epoch)

    def decay(self, step: int) -> float:
        passed = sum(1 for milestone in self.milestones if step > milestone)
        return self.peak * self.options.factor ** passed


@dataclass
class CosineOptions(ScheduleOptions):
    final_lr: float = option(0.0, min=0.0, help="the lr of the run's last step")


class Cosine(LRSchedule):
    """`cosine` (Loshchilov and Hutter, 2017, without restarts): from the peak at the end of
    the warm-up (step W) to `final_lr` at the run's last step T:
    lr(s) = final + (peak − final) · (1 + cos(π · (s − W) / (T − W))) / 2."""

    Options = CosineOptions
    needs_total_steps = True

    def decay(self, step: int) -> float:
        final, warmup, total = self.options.final_lr, self.warmup_steps, self.total_steps
        progress = min(1.0, (step - warmup) / (total - warmup))  # step > warmup, so total > warmup
        return final + (self.peak - final) * (1 + math.cos(math.pi * progress)) / 2
