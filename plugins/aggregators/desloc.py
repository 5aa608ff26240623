"""`desloc`: DES-LOC, Desynced Low Communication adaptive optimizers (ICLR 2026).

Every worker runs the experiment's own Adam-family optimizer on its own model (local Adam),
and three things are averaged over the workers, each on its own schedule. After hook step s,
with n = s + 1 the step as the metrics count it:

    n % K_x == 0:   x ← (1/N) Σ_i x_i        the parameters (and buffers, with sync_buffers)
    n % K_u == 0:   u ← (1/N) Σ_i u_i        Adam's first moment (exp_avg)
    n % K_v == 0:   v ← (1/N) Σ_i v_i        Adam's second moment (exp_avg_sq)

K_x is `period`, K_u `first_moment_period` (default 3·K_x), K_v `second_moment_period`
(default 6·K_x). What is due at one step travels in one all-reduce. With K_u = K_v = ∞ it is
local Adam with periodic model averaging (`local_sgd`); the moments change slowly, so they
can be averaged less often than the parameters, which is what saves bytes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from dsgd_cli.api import Aggregator, AggregatorOptions, flatten, option, unflatten_into

MOMENTS = ("exp_avg", "exp_avg_sq")  # u and v, as torch's Adam, AdamW and dsgd's lamb name them


@dataclass
class DESLOCOptions(AggregatorOptions):
    period: int = option(16, min=1, help="K_x: steps between averages of the parameters")
    first_moment_period: int | None = option(None, min=1, help="K_u: steps between averages of "
                                                               "Adam's first moment (default 3·K_x)")
    second_moment_period: int | None = option(None, min=1, help="K_v: steps between averages of "
                                                                "Adam's second moment (default 6·K_x)")


def refuse(optimizer: torch.optim.Optimizer) -> None:
    raise ValueError(f"desloc averages Adam's moments exp_avg and exp_avg_sq, which "
                     f"{type(optimizer).__name__} does not keep: use adam, adamw or lamb")


class DESLOC(Aggregator):
    """DES-LOC: local Adam; the parameters, the first and the second moments averaged over
    the workers every K_x, K_u and K_v steps."""

    Options = DESLOCOptions
    models_identical = False  # they differ between parameter averages

    @classmethod
    def resolve_options(cls, options, compressor, task, world_size, seed):
        """The moment periods left open are 3·K_x and 6·K_x, recorded as such."""
        return dataclasses.replace(
            options,
            first_moment_period=options.first_moment_period or 3 * options.period,
            second_moment_period=options.second_moment_period or 6 * options.period)

    def setup(self, ctx):
        super().setup(ctx)
        self.options = self.resolve_options(self.options, None, None, ctx.world_size, ctx.seed)
        if not all("betas" in group for group in ctx.optimizer.param_groups):
            refuse(ctx.optimizer)  # SGD, LARS, Muon's matrices: no second moment
        self.params = ctx.parameters()
        self.buffers = ctx.buffers() if self.options.sync_buffers else []

    @torch.no_grad()
    def after_step(self, step):
        n, o = step + 1, self.options
        due = []
        if n % o.period == 0:
            due += [p.detach() for p in self.params] + [b.detach() for b in self.buffers]
        for name, period in zip(MOMENTS, (o.first_moment_period, o.second_moment_period)):
            if n % period == 0:
                due += self.moments(name)
        if due:
            flat = flatten(due)
            self.ctx.comm.all_reduce(flat, "avg")
            unflatten_into(flat, due)

    def moments(self, name: str) -> list[torch.Tensor]:
        """The optimizer's `name` state of every parameter; zeros (averaged, then dropped)
        for a parameter it has not stepped yet, so every worker sends the same shapes."""
        states = [self.ctx.optimizer.state[p] for p in self.params]
        if not any(name in state for state in states):
            refuse(self.ctx.optimizer)
        return [state[name] if name in state else torch.zeros_like(p)
                for p, state in zip(self.params, states)]
