"""`local_sgd`: H local optimizer steps, then average the models, x_i ← (1/n) Σ_j x_j."""

from __future__ import annotations

from dataclasses import dataclass

from dsgd_cli.api import Aggregator, AggregatorOptions, flatten, option, unflatten_into


@dataclass
class LocalSGDOptions(AggregatorOptions):
    period: int = option(4, min=1, help="local steps between model averages (H)")


class LocalSGD(Aggregator):
    Options = LocalSGDOptions
    models_identical = False  # they differ between averages

    def setup(self, ctx):
        super().setup(ctx)
        self.tensors = ctx.parameters() + (ctx.buffers() if self.options.sync_buffers else [])

    def after_step(self, step):
        if (step + 1) % self.options.period == 0:
            self.average()

    def average(self) -> None:
        flat = flatten([t.detach() for t in self.tensors])
        self.ctx.comm.all_reduce(flat, "avg")
        unflatten_into(flat, [t.detach() for t in self.tensors])
