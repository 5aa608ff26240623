"""Aggregators that misbehave on purpose, to test how dsgd names the cause of a failure.

`Misbehave` is `allreduce` whose rank `rank` does `action` in the hook `hook` (at step `step`
for the per-step hooks): leave with code 0 (`sys.exit(0)` or `os._exit(0)`), or sleep for
`seconds` (never joining the next collective).
`BadBound` and `BadType` declare defaults their own options refuse.
"""

import os
import sys
import time
from dataclasses import dataclass
from typing import Literal

from dsgd_cli.api import option
from plugins.aggregators.allreduce import AllReduce, AllReduceOptions


@dataclass
class MisbehaveOptions(AllReduceOptions):
    rank: int = option(1, min=0, help="the rank that misbehaves")
    step: int = option(1, min=0, help="the step at which it does (per-step hooks)")
    hook: Literal["setup", "after_backward", "finish"] = option(
        "after_backward", help="the hook in which it misbehaves")
    action: Literal["sys_exit", "os_exit", "sleep"] = option(
        "sys_exit", help="what it does there")
    seconds: float = option(60.0, min=0.0, help="how long `sleep` sleeps")


class Misbehave(AllReduce):
    Options = MisbehaveOptions

    def setup(self, ctx):
        super().setup(ctx)
        if self.options.hook == "setup":
            self._misbehave()

    def after_backward(self, step):
        if self.options.hook == "after_backward" and step == self.options.step:
            self._misbehave()
        super().after_backward(step)

    def finish(self):
        if self.options.hook == "finish":
            self._misbehave()
        super().finish()

    def _misbehave(self):
        if self.ctx.rank != self.options.rank:
            return
        action = self.options.action
        if action == "sys_exit":
            sys.exit(0)
        elif action == "os_exit":
            os._exit(0)
        else:
            time.sleep(self.options.seconds)


@dataclass
class BadBoundOptions(AllReduceOptions):
    period: int = option(-3, min=1, help="a default below its own minimum")


class BadBound(AllReduce):
    Options = BadBoundOptions


@dataclass
class BadTypeOptions(AllReduceOptions):
    period: int = option("four", help="a string as the default of an integer")


class BadType(AllReduce):
    Options = BadTypeOptions
