"""A third-party learning-rate schedule: exponential decay after the warm-up."""

from dataclasses import dataclass

from dsgd_cli.api import LRSchedule, ScheduleOptions, option


@dataclass
class ExponentialOptions(ScheduleOptions):
    gamma: float = option(0.5, min=0.0, max=1.0, help="factor per step after the warm-up")


class Exponential(LRSchedule):
    """lr(s) = peak × gamma^(s − W) after a warm-up of W steps."""

    Options = ExponentialOptions

    def decay(self, step: int) -> float:
        return self.peak * self.options.gamma ** (step - self.warmup_steps)
