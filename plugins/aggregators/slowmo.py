"""`slowmo`: SlowMo, slow momentum over a base algorithm (Wang, Tantia, Ballas, Rabbat,
"SlowMo: Improving Communication-Efficient Distributed SGD with Slow Momentum", ICLR 2020).

The base algorithm (`base`, an aggregator section: `local_sgd` or `sgp` with its own options)
trains for `period` (τ) steps from x_start; then, after hook step s with (s + 1) % τ == 0:

    x_avg = (1/n) Σ_i x_i                     an exact average
    u ← β u + (x_start − x_avg) / γ           γ: the inner learning rate of step s
    x ← x_start − α γ u                       the next x_start

with `slow_momentum` β and `slow_lr` α, and γ per parameter: its param group's rate. With
β = 0 and α = 1 the step gives x = x_avg: the base with an exact average every τ steps. On a
slow step the exact average replaces the base's exchange of that step (local SGD's average,
SGP's push-sum round), as in the authors' implementation: the model travels once. Over `sgp`
the exact average is that of the push-sum numerators, (1/n) Σ x_i (Σ w_i = n, so it is what
push-sum converges to), and every worker restarts push-sum from the new x with weight 1. The
defaults are those of the authors' own implementation (fairscale's SlowMo: τ = 48, β = 0.5,
α = 1, local SGD averaging every 3).
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
        if (step + 1) % self.options.period != 0:
            self.base.after_step(step)
            return
        # The slow step's exact average replaces the base's exchange of this step. Local SGD's
        # after_step is only its average; SGP's is the optimizer's update of the numerator,
        # kept, then a push-sum round, skipped: a round keeps Σ x_i, so x_avg is unchanged.
        push_sum = self.push_sum()
        if push_sum is not None:
            push_sum.apply_update(self.base.vector.read() - self.base.before)
        self.slow_momentum_step(step)

    def finish(self):
        self.base.finish()

    def push_sum(self) -> PushSum | None:
        return self.base.state if isinstance(getattr(self.base, "state", None), PushSum) else None

    def averaged_buffers(self, step: int) -> list:
        """The buffers the slow step averages: its own (`sync_buffers`), or local SGD's where
        the base would have averaged them at this step (the slow step replaces that average)."""
        if self.options.sync_buffers or self.push_sum() is not None:
            return self.buffers
        base = self.base.options
        base_would_average = base.sync_buffers and (step + 1) % base.period == 0
        return self.ctx.buffers() if base_would_average else []

    def learning_rates(self) -> torch.Tensor:
        """γ for every element of x_start: the rate of its parameter's group in the step just
        taken (0 for a parameter in no group: it did not train)."""
        rate_of = {id(p): group["lr"] for group in self.ctx.optimizer.param_groups
                   for p in group["params"]}
        return torch.cat([torch.full((p.numel(),), float(rate_of.get(id(p), 0.0)),
                                     dtype=self.start.dtype, device=self.start.device)
                          for p in self.ctx.parameters()])  # self.params: in the same order

    def slow_momentum_step(self, step: int) -> None:
        push_sum = self.push_sum()
        buffers = self.averaged_buffers(step)
        # the parameters first, then what else the base averages (buffers)
        if push_sum is not None:
            average = push_sum.numerator.clone()
        else:
            average = flatten(self.params + buffers)
        self.ctx.comm.all_reduce(average, "avg")
        x_avg = average[:self.start.numel()].to(self.start.dtype)
        self.start = self.slow_update(x_avg, self.learning_rates())
        average[:self.start.numel()] = self.start
        if push_sum is not None:  # restart push-sum from the new model, weight 1
            push_sum.numerator.copy_(average)
            push_sum.weight = 1.0
            self.base.vector.write(average)
        else:
            unflatten_into(average, self.params + buffers)  # buffers: their average

    def slow_update(self, x_avg: torch.Tensor, lr: torch.Tensor) -> torch.Tensor:
        """u ← β u + (x_start − x_avg) / γ; returns the next x_start, x_start − α γ u.
        Where γ = 0 nothing trained: u stays, and x = x_avg."""
        o = self.options
        trained = lr > 0
        rate = torch.where(trained, lr, torch.ones_like(lr))  # no division by 0 below
        velocity = self.velocity * o.slow_momentum + (self.start - x_avg) / rate
        self.velocity = torch.where(trained, velocity, self.velocity)
        return torch.where(trained, self.start - o.slow_lr * rate * self.velocity, x_avg)
