"""`slowmo`: SlowMo, slow momentum over a base algorithm (Wang, Tantia, Ballas, Rabbat,
"SlowMo: Improving Communication-Efficient Distributed SGD with Slow Momentum", ICLR 2020).

The base algorithm (`base`, an aggregator section: `local_sgd` or `sgp` with its own options)
trains for `period` (τ) steps from x_start; then, after hook step s with (s + 1) % τ == 0:

    x_avg = (1/n) Σ_i x_i                     an exact average
    u ← β u + (x_start − x_avg) / γ           γ: the inner learning rate of step s
    x ← x_start − α γ u                       the next x_start

with `slow_momentum` β and `slow_lr` α. With β = 0 and α = 1 the step gives x = x_avg: the
base with an exact average every τ steps. Over `sgp` the exact average is that of the push-sum
numerators, (1/n) Σ x_i (Σ w_i = n, so it is what push-sum converges to), and every worker
restarts push-sum from the new x with weight 1. The defaults are those of the authors' own
implementation (fairscale's SlowMo: τ = 48, β = 0.5, α = 1, local SGD averaging every 3).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsgd_cli.api import Aggregator, AggregatorOptions, build_plugin, flatten, option, unflatten_into
from plugins.aggregators.gossip.pushsum import PushSum

BASES = ("local_sgd", "sgp")  # synchronous bases whose models an exact average may replace


@dataclass
class SlowMoOptions(AggregatorOptions):
    period: int = option(48, min=1, help="base steps between slow momentum steps (τ)")
    slow_momentum: float = option(0.5, min=0.0, max=1.0, help="β")
    slow_lr: float = option(1.0, min=0.0, help="α")
    base: dict = option({"name": "local_sgd", "period": 3}, plugin="aggregator",
                        help="the base algorithm's aggregator section")

    def __post_init__(self):
        if self.base.get("name") not in BASES:
            raise ValueError(f"base: expected an aggregator among {', '.join(BASES)}, "
                             f"got {self.base.get('name')!r}")


class SlowMo(Aggregator):
    Options = SlowMoOptions
    models_identical = False  # they differ between averages

    @classmethod
    def check_world(cls, options, world_size):
        base = build_plugin("aggregator", options.base)
        type(base).check_world(base.options, world_size)  # sgp's graph must suit the workers

    def setup(self, ctx):
        super().setup(ctx)
        self.base = build_plugin("aggregator", self.options.base)
        self.base.setup(ctx)
        self.params = [p.detach() for p in ctx.parameters()]
        self.buffers = ctx.buffers() if self.options.sync_buffers else []
        self.start = flatten(self.params)            # x_start
        self.velocity = torch.zeros_like(self.start)  # u

    def before_forward(self, step):
        self.base.before_forward(step)

    def after_backward(self, step):
        self.base.after_backward(step)

    def after_step(self, step):
        self.base.after_step(step)
        if (step + 1) % self.options.period == 0:
            self.slow_momentum_step()

    def finish(self):
        self.base.finish()

    def slow_momentum_step(self) -> None:
        push_sum = self.base.state if isinstance(getattr(self.base, "state", None), PushSum) else None
        # the parameters first, then what else the base averages (buffers)
        average = push_sum.numerator.clone() if push_sum else flatten(self.params + self.buffers)
        self.ctx.comm.all_reduce(average, "avg")
        x_avg = average[:self.start.numel()].to(self.start.dtype)
        lr = self.ctx.optimizer.param_groups[0]["lr"]  # γ, the rate of the step just taken
        if lr > 0:
            o = self.options
            self.velocity.mul_(o.slow_momentum).add_((self.start - x_avg) / lr)
            self.start = self.start - o.slow_lr * lr * self.velocity
        else:  # with γ = 0 nothing trained: keep u, and x = x_avg
            self.start = x_avg.clone()
        average[:self.start.numel()] = self.start
        if push_sum:  # restart push-sum from the new model, weight 1
            push_sum.numerator.copy_(average)
            push_sum.weight = 1.0
            self.base.vector.write(average)
        else:
            unflatten_into(average, self.params + self.buffers)  # buffers: their average
