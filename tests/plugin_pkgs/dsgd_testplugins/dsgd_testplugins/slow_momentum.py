"""A third-party aggregator with state of its own, to show that it resumes from checkpoints
without writing `state_dict()`: periodic model averaging with slow momentum (Wang et al.,
"SlowMo", ICLR 2020), in its simplest form. Every `every` steps the workers average their
models, x̄; the slow momentum u <- beta u + (anchor - x̄) and the model anchor - u, the new
anchor, follow. Its counter and its two vectors are plain attributes: the default
`state_dict()` saves them.

For failure tests: with DSGD_TESTPLUGINS_FAIL_AT=<step> in the environment, rank 1 raises
at that step (a resumed run is started without it).
"""

import os
from dataclasses import dataclass

from dsgd_cli.api import Aggregator, AggregatorOptions, flatten, option, unflatten_into


@dataclass
class SlowMomentumOptions(AggregatorOptions):
    every: int = option(3, min=1, help="steps between model averages")
    beta: float = option(0.5, min=0.0, max=1.0, help="slow momentum")


class SlowMomentumAverage(Aggregator):
    Options = SlowMomentumOptions
    models_identical = False

    def setup(self, ctx):
        super().setup(ctx)
        self.steps_since_average = 0
        self.anchor = flatten([p.detach() for p in ctx.parameters()])
        self.momentum = self.anchor.new_zeros(self.anchor.shape)

    def after_step(self, step):
        fail_at = os.environ.get("DSGD_TESTPLUGINS_FAIL_AT")
        if fail_at is not None and self.ctx.rank == 1 and step == int(fail_at):
            raise RuntimeError(f"injected failure at step {step}")
        self.steps_since_average += 1
        if self.steps_since_average < self.options.every:
            return
        self.steps_since_average = 0
        params = [p.detach() for p in self.ctx.parameters()]
        average = flatten(params)
        self.ctx.comm.all_reduce(average, op="avg")
        self.momentum.mul_(self.options.beta).add_(self.anchor - average)
        self.anchor = self.anchor - self.momentum
        unflatten_into(self.anchor, params)
