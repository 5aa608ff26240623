"""An aggregator that raises on one rank at one step, to test failure handling."""

from dataclasses import dataclass

from dsgd_cli.api import AggregatorOptions, option
from plugins.aggregators.allreduce import AllReduce, AllReduceOptions


@dataclass
class CrashOptions(AllReduceOptions):
    rank: int = option(1, min=0, help="the rank that fails")
    step: int = option(5, min=0, help="the step at which it fails")


class CrashAt(AllReduce):
    Options = CrashOptions

    def after_step(self, step):
        if self.ctx.rank == self.options.rank and step == self.options.step:
            raise RuntimeError(f"injected failure at step {step}")


class NotAPlugin:
    """Registered as an aggregator, but derives from nothing dsgd knows."""
