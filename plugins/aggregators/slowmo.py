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
push-sum converges to), and every worker restarts push-sum from the new x with weight 1. A
skipped round does not skip its graph: SGP's time-varying graph advances by rounds run, so the
round after a slow step takes the graph the skipped round would have had, as in fairscale,
whose gossiper moves to the next graph inside each round (`SGP.skip_round`). The
defaults are those of the authors' own implementation (fairscale's SlowMo: τ = 48, β = 0.5,
α = 1, local SGD averaging every 3).

Under `failures` (failure_mode "continue", docs/failures.md) the averages are over the live
workers: a worker down at the step of an average contributes nothing to it. Over `local_sgd`
each average, the base's and the slow step's, is Σ_live x_i / (live count) (one all-reduce
of [x_i · live_i, live_i]); over `sgp` a down worker holds no mass, so the slow step's average
is Σ x_i / Σ w_i, the de-biased average of the mass that survived, and push-sum restarts from
the new x with weight 1 on the live workers only. Every worker, down or not, takes part in
every slow all-reduce and computes the same slow update, so x_start and u are the same on all
of them: a rejoiner already holds the live workers' slow momentum state. It takes its model
from the live worker `source` (over `local_sgd` one message from it; over `sgp` half of its
(x, w), as sgp does) and starts its inner optimizer afresh (its state was lost with it).
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
    failure_mode = "continue"  # the averages over the live workers

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
        self.under_failures = ctx.under_failures

    def before_forward(self, step):
        self.base.before_forward(step)

    def after_backward(self, step):
        self.base.after_backward(step)

    def after_step(self, step):
        if (step + 1) % self.options.period != 0:
            if self.under_failures and self.push_sum() is None:
                self.local_sgd_live_step(step)
            else:
                self.base.after_step(step)
            return
        # The slow step's exact average replaces the base's exchange of this step. Local SGD's
        # after_step is only its average; SGP's is the optimizer's update of the numerator,
        # kept, then a push-sum round, skipped (a round keeps Σ x_i, so x_avg is unchanged),
        # and the next round takes this one's graph.
        if self.push_sum() is not None:
            self.base.skip_round(step)
        self.slow_momentum_step(step)

    def finish(self):
        self.base.finish()

    def worker_left(self, rank, step):
        self.base.worker_left(rank, step)  # over sgp: the mass it held is lost with it

    def worker_rejoined(self, rank, step, source):
        if self.push_sum() is not None:
            self.base.worker_rejoined(rank, step, source)  # half of source's (x, w)
        elif self.ctx.rank in (rank, source):
            tensors = [p.detach() for p in self.ctx.parameters()] + self.ctx.buffers()
            if self.ctx.rank == source:
                self.ctx.comm.send(flatten(tensors), rank)
            else:
                model = flatten(tensors)
                self.ctx.comm.recv(model, source)
                unflatten_into(model, tensors)
        if rank == self.ctx.rank:
            self.ctx.optimizer.state.clear()  # the inner optimizer's state was lost with it

    def up(self) -> bool:
        """Whether this worker computed the step just taken (always, without failures)."""
        return getattr(self.ctx, "up", True)

    def local_sgd_live_step(self, step: int) -> None:
        """The `local_sgd` base's step under failures: its average, over the live workers."""
        if (step + 1) % self.base.options.period == 0:
            tensors = [t.detach() for t in self.base.tensors]
            average = self.live_average(flatten(tensors))
            if average is not None:
                unflatten_into(average, tensors)

    def live_average(self, flat: torch.Tensor) -> torch.Tensor | None:
        """The average of `flat` over the workers up at this step, or None when none is: one
        all-reduce of [flat · live, live]."""
        live = 1.0 if self.up() else 0.0
        message = torch.cat([flat * live, flat.new_tensor([live])])
        self.ctx.comm.all_reduce(message, "sum")
        count = float(message[-1])
        return message[:-1] / count if count > 0 else None

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
        average = self.exact_average(push_sum, buffers)
        if average is None:  # nobody live: nothing to step from
            return
        x_avg = average[:self.start.numel()].to(self.start.dtype)
        self.start = self.slow_update(x_avg, self.learning_rates())
        average[:self.start.numel()] = self.start
        if push_sum is not None:  # restart push-sum from the new model, weight 1
            if self.ctx.rank in self.base.down:
                return  # a down worker holds no mass until it rejoins
            push_sum.numerator.copy_(average)
            push_sum.weight = 1.0
            self.base.vector.write(average)
        else:
            unflatten_into(average, self.params + buffers)  # buffers: their average

    def exact_average(self, push_sum: PushSum | None, buffers: list) -> torch.Tensor | None:
        """The slow step's x_avg (and the buffers' average after it): over everyone, or under
        failures over the live workers (None when none is)."""
        if push_sum is None:
            flat = flatten(self.params + buffers)
            if self.under_failures:
                return self.live_average(flat)
            self.ctx.comm.all_reduce(flat, "avg")
            return flat
        if not self.under_failures:
            average = push_sum.numerator.clone()
            self.ctx.comm.all_reduce(average, "avg")
            return average
        # Σ x_i / Σ w_i: a down worker holds (0, 0); without failures Σ w_i = n
        message = torch.cat([push_sum.numerator, push_sum.numerator.new_tensor([push_sum.weight])])
        self.ctx.comm.all_reduce(message, "sum")
        weight = float(message[-1])
        return message[:-1] / weight if weight > 0 else None

    def slow_update(self, x_avg: torch.Tensor, lr: torch.Tensor) -> torch.Tensor:
        """u ← β u + (x_start − x_avg) / γ; returns the next x_start, x_start − α γ u.
        Where γ = 0 nothing trained: u stays, and x = x_avg."""
        o = self.options
        trained = lr > 0
        rate = torch.where(trained, lr, torch.ones_like(lr))  # no division by 0 below
        velocity = self.velocity * o.slow_momentum + (self.start - x_avg) / rate
        self.velocity = torch.where(trained, velocity, self.velocity)
        return torch.where(trained, self.start - o.slow_lr * rate * self.velocity, x_avg)
