"""A complete third-party aggregator: average the models every `every` steps.

The same code is the worked example of dsgd's docs/writing-plugins.md (tests/test_docs.py checks it).
"""

from dataclasses import dataclass

from dsgd_cli.api import Aggregator, AggregatorOptions, flatten, option, unflatten_into


@dataclass
class ModelAverageOptions(AggregatorOptions):
    every: int = option(1, min=1, help="steps between model averages")


class ModelAverage(Aggregator):
    Options = ModelAverageOptions
    models_identical = False  # the models drift apart between averages

    def after_step(self, step):
        if (step + 1) % self.options.every == 0:
            params = [p.detach() for p in self.ctx.parameters()]
            flat = flatten(params)
            self.ctx.comm.all_reduce(flat, op="avg")  # counted in bytes_sent and comm_seconds
            unflatten_into(flat, params)
            self.ctx.metrics.log("averages", 1.0)
