"""`diloco`: DiLoCo (Douillard et al., "DiLoCo: Distributed Low-Communication Training of
Language Models", 2023), as torchft's `DiLoCo` runs it.

Every worker keeps θ_global, the parameters at the start of the round, and takes `period` (H)
steps with the experiment's own (inner) optimizer. After hook step s with (s + 1) % H == 0:

    Δ = (1/n) Σ_i (θ_global − θ_i)          pseudo-gradients, summed and divided by n
    θ_i ← θ_global                          every worker resets
    θ_global ← outer_optimizer.step(Δ)      Δ as the gradient; all workers compute the same
    θ_i ← θ_global

The inner optimizer's state (Adam moments) is kept across rounds, the outer optimizer's
(Nesterov momentum) persists across rounds, and steps after the last full round are not
averaged (no partial round at the end of a run).

The outer optimizer works on a copy of the parameters (θ_global), never on the model, so the
model's gradients and the inner optimizer are untouched; it is built through the optimizer
registry from the `outer_optimizer` section, so any optimizer plugin can be the outer one.

Under `failures` (failure_mode "continue", docs/failures.md) the outer average is over the
live workers: a worker down at any step of a round contributes nothing to that round's
average (it sends [0, 0] where a live one sends [Δ_i, 1]; the sum is divided by the live
count; nobody live: θ_global stays). Every worker, down or not, takes part in every outer
all-reduce, so θ_global and the outer optimizer are the same on all of them: a rejoiner takes
θ_global as its model, and starts its inner optimizer afresh (its state was lost with it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dsgd_cli.api import (Aggregator, AggregatorOptions, ErrorFeedback, build_optimizer,
                          compressed_average, flatten, option)

# The paper's outer optimizer (Douillard et al., 2023, section 3).
PAPER_OUTER_OPTIMIZER = {"name": "sgd", "lr": 0.7, "momentum": 0.9, "nesterov": True}


@dataclass
class DiLoCoOptions(AggregatorOptions):
    period: int = option(500, min=1, help="inner steps per round (H; the paper's 500)")
    outer_optimizer: dict = option(PAPER_OUTER_OPTIMIZER, plugin="optimizer",
                                   help="the optimizer plugin section of the outer step")
    sync_buffers: bool = option(False, help="average buffers (batch-norm statistics) at each "
                                            "round; false keeps them local, as torchft does")


class OuterParameters:
    """θ_global of a group of the model's parameters, and the outer optimizer over it."""

    def __init__(self, params: list[torch.Tensor], section: dict[str, Any]):
        self.params = params
        self.globals = [p.detach().clone() for p in params]
        # torch refuses an optimizer over nothing: a streaming fragment may hold no parameter
        self.optimizer = build_optimizer(section, self.globals) if params else None

    def pseudo_gradients(self) -> list[torch.Tensor]:
        """Δ_i = θ_global − θ_i of this worker."""
        return [g - p.detach() for g, p in zip(self.globals, self.params)]

    def outer_step(self, averaged: list[torch.Tensor]) -> None:
        """θ_global ← the outer optimizer's step with the averaged Δ as gradient."""
        if self.optimizer is None:
            return
        for global_, delta in zip(self.globals, averaged):
            global_.grad = delta
        self.optimizer.step()
        for global_ in self.globals:
            global_.grad = None

    def state_dict(self) -> dict[str, Any]:
        return {"globals": [g.clone() for g in self.globals],
                "optimizer": self.optimizer.state_dict() if self.optimizer else None}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        for global_, saved in zip(self.globals, state["globals"]):
            global_.copy_(saved)
        if self.optimizer is not None:
            self.optimizer.load_state_dict(state["optimizer"])

    @torch.no_grad()
    def set_model(self, alpha: float = 0.0, local: list[torch.Tensor] | None = None) -> None:
        """θ_i ← (1 − alpha) θ_global + alpha · local (alpha 0: θ_global)."""
        for param, global_, *own in zip(self.params, self.globals, *([local] if local else [])):
            if alpha == 0.0:
                param.copy_(global_)
            else:
                param.copy_(torch.lerp(global_, own[0], alpha))


class DeltaExchange:
    """Averages pseudo-gradients over all workers through the run's compressor: uncompressed,
    one all-reduce of their sum, divided by the number of workers; compressed, the
    `compressed_average` through the compressor, with error feedback when asked for or required."""

    def __init__(self, ctx, error_feedback: bool):
        self.ctx = ctx
        compressor = ctx.compressor
        self.compressed = compressor is not None and not compressor.identity
        needs_memory = error_feedback or getattr(compressor, "requires_error_feedback", False)
        self.memory = ErrorFeedback() if self.compressed and needs_memory else None

    def state_dict(self) -> dict[str, Any]:
        return {"memory": self.memory.state_dict() if self.memory is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.memory is not None and state["memory"] is not None:
            self.memory.load_state_dict(state["memory"])

    def live_average(self, deltas: list[torch.Tensor], keys: list[str], step: int,
                     live: bool) -> list[torch.Tensor] | None:
        """The average of the live workers' Δ (`live`: this worker's counts this round), or
        None when no worker's does. One all-reduce of [Δ · live, live] uncompressed;
        compressed, the compressed average of Δ · live scaled by n / (live count)."""
        weight = 1.0 if live else 0.0
        deltas = [delta * weight for delta in deltas]
        if self.compressed:
            if not live and self.memory is not None:
                self.memory = ErrorFeedback()  # the residual was lost with the failed node
            averaged = compressed_average(self.ctx.compressor, self.ctx.comm, deltas, keys,
                                          step, self.memory)
            count = torch.tensor([weight], device=self.ctx.device)
            self.ctx.comm.all_reduce(count, "sum")
            live_count = float(count.item())
            if live_count == 0:
                return None
            return [a * (self.ctx.world_size / live_count) for a in averaged]
        flat = torch.cat([flatten(deltas), torch.tensor([weight], dtype=deltas[0].dtype,
                                                        device=deltas[0].device)])
        self.ctx.comm.all_reduce(flat, "sum")
        live_count = float(flat[-1].item())
        if live_count == 0:
            return None
        return split_like(flat[:-1].div_(live_count), deltas)

    def average(self, deltas: list[torch.Tensor], keys: list[str], step: int) -> list[torch.Tensor]:
        if self.compressed:
            return compressed_average(self.ctx.compressor, self.ctx.comm, deltas, keys, step,
                                      self.memory)
        flat = flatten(deltas)
        self.ctx.comm.all_reduce(flat, "sum")
        return split_like(flat.div_(self.ctx.world_size), deltas)


def split_like(flat: torch.Tensor, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Consecutive slices of `flat`, shaped like `tensors`."""
    pieces, offset = [], 0
    for tensor in tensors:
        pieces.append(flat[offset: offset + tensor.numel()].view_as(tensor))
        offset += tensor.numel()
    return pieces


def parameter_names(ctx) -> list[str]:
    """The names of `ctx.parameters()`, in model order: the compressor's keys."""
    return [name for name, p in ctx.model.named_parameters() if p.requires_grad]


class DiLoCo(Aggregator):
    Options = DiLoCoOptions
    models_identical = False  # they differ inside a round
    supports_compression = True
    failure_mode = "continue"  # the outer average over the live workers

    def setup(self, ctx):
        super().setup(ctx)
        self.outer = OuterParameters(ctx.parameters(), self.outer_optimizer_section())
        self.keys = parameter_names(ctx)
        self.exchange = DeltaExchange(ctx, self.options.error_feedback)
        self.rounds = 0
        self.under_failures = ctx.under_failures
        self.missed_round = False  # this worker was down at a step of the current round

    def after_step(self, step):
        if not getattr(self.ctx, "up", True):
            self.missed_round = True
        if (step + 1) % self.options.period == 0:
            self.round(step)

    def worker_rejoined(self, rank, step, source):
        if rank == self.ctx.rank:  # θ_global is the same on every worker: no transfer needed
            self.outer.set_model()
            self.ctx.optimizer.state.clear()

    def outer_optimizer_section(self) -> dict:
        """The outer optimizer's section; a variant may derive it from its own options
        (sparseloco: plain SGD at its `outer_lr`)."""
        return self.options.outer_optimizer

    def round(self, step: int) -> None:
        averaged = self.average_deltas(self.outer.pseudo_gradients(), step)
        if averaged is not None:
            self.outer.outer_step(averaged)
        self.outer.set_model()
        if self.options.sync_buffers:
            average_buffers(self.ctx)
        self.rounds += 1
        self.ctx.metrics.log("outer_rounds", self.rounds)

    def average_deltas(self, deltas: list[torch.Tensor], step: int) -> list[torch.Tensor] | None:
        """The workers' average Δ, the outer step's gradient (None: no live worker's counts).
        A variant that sends Δ its own way (sparseloco) overrides this."""
        if self.under_failures:
            averaged = self.exchange.live_average(deltas, self.keys, step,
                                                  live=not self.missed_round)
            self.missed_round = False
            return averaged
        return self.exchange.average(deltas, self.keys, step)


def average_buffers(ctx) -> None:
    buffers = ctx.buffers()
    if not buffers:
        return
    flat = flatten([b.detach() for b in buffers])
    ctx.comm.all_reduce(flat, "avg")
    for buffer, value in zip(buffers, split_like(flat, buffers)):
        buffer.copy_(value)
