"""`streaming_diloco`: Streaming DiLoCo (Douillard et al., "Streaming DiLoCo with overlapping
communication", 2025), as torchft's streaming fragments run it.

The model's parameters are split, in model order, into `fragments` (F) contiguous groups
(numpy's `array_split` rule: the first len % F groups are one parameter longer). With
T = H / F, inner step n = s + 1 (s the 0-based hook step) lies in segment k = (n − 1) // T,
which belongs to fragment k mod F. For that fragment:

* after step n with n mod T == (T − delay) mod T, its pseudo-gradient Δ = θ_global − θ_local is
  computed and its all-reduce starts, without blocking: it overlaps the next `delay` steps;
* after step n with n mod T == 0 the averaged Δ is applied: the local values are saved, the
  fragment is reset to θ_global, the fragment's own outer optimizer steps with Δ as gradient
  (the new θ_global), and the fragment becomes (1 − alpha) · θ_global + alpha · θ_local.

So fragment f is applied after steps (f + 1)·T + m·H, and each step sends at most one
fragment: the peak bandwidth is about 1/F of `diloco`'s. An exchange still in flight when the
run ends is completed and not applied (no partial round).

Under `failures` (failure_mode "continue", docs/failures.md) each fragment's outer average is
over the live workers, as `diloco`'s is: a worker down at any step of a fragment's round (the
H steps up to its send) contributes nothing to it ([0, 0] where a live one sends [Δ, 1]); a
rejoiner takes θ_global for every fragment and starts its inner optimizer afresh.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dsgd_cli.api import Aggregator, Handle, flatten, option
from plugins.aggregators.diloco import (DeltaExchange, DiLoCoOptions, OuterParameters,
                                        average_buffers, parameter_names, split_like)


@dataclass
class StreamingDiLoCoOptions(DiLoCoOptions):
    fragments: int = option(2, min=1, help="parameter fragments synchronised in turn (F)")
    delay: int = option(0, min=0, help="inner steps a fragment's exchange overlaps (< H / F)")
    alpha: float = option(0.0, min=0.0, max=1.0,
                          help="weight of the local values when a fragment is merged")

    def __post_init__(self):
        if self.period % self.fragments:
            raise ValueError(f"period: expected a multiple of fragments ({self.fragments}), "
                             f"got {self.period}")
        segment = self.period // self.fragments
        if self.delay >= segment:
            raise ValueError(f"delay: expected a value < period / fragments ({segment}), "
                             f"got {self.delay}")
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"alpha: expected a value in [0, 1], got {self.alpha}")


def split_in_fragments(items: list, fragments: int) -> list[list]:
    """`items` in `fragments` contiguous groups, the first len % F one longer (array_split)."""
    size, longer = divmod(len(items), fragments)
    groups, start = [], 0
    for index in range(fragments):
        end = start + size + (1 if index < longer else 0)
        groups.append(items[start:end])
        start = end
    return groups


@dataclass
class _Pending:
    """A fragment's exchange, started and not yet applied."""

    fragment: int
    deltas: list[torch.Tensor]        # shaped like the fragment's parameters
    handle: Handle | None = None      # the uncompressed all-reduce of their sum, in flight
    flat: torch.Tensor | None = None  # its buffer
    averaged: list[torch.Tensor] | None = None  # known at once when compressed
    counts_live: bool = False  # under failures: `flat` ends with the count of live workers

    def wait(self, world_size: int) -> list[torch.Tensor]:
        """The averaged Δ; [] when no worker was live (the outer step then leaves θ_global)."""
        if self.averaged is None:
            self.handle.wait()
            if not self.counts_live:
                self.averaged = split_like(self.flat.div_(world_size), self.deltas)
            else:
                live = float(self.flat[-1])
                self.averaged = (split_like(self.flat[:-1].div_(live), self.deltas)
                                 if live > 0 else [])
        return self.averaged


class StreamingDiLoCo(Aggregator):
    Options = StreamingDiLoCoOptions
    models_identical = False
    supports_compression = True
    failure_mode = "continue"  # each fragment's outer average over the live workers

    def setup(self, ctx):
        super().setup(ctx)
        o = self.options
        self.segment = o.period // o.fragments  # T
        params, names = ctx.parameters(), parameter_names(ctx)
        self.groups = split_in_fragments(list(range(len(params))), o.fragments)
        self.outer = [OuterParameters([params[i] for i in group], o.outer_optimizer)
                      for group in self.groups]
        self.keys = [[names[i] for i in group] for group in self.groups]
        self.exchange = DeltaExchange(ctx, o.error_feedback)
        self.pending: _Pending | None = None
        self.under_failures = ctx.under_failures
        self.missed = [False] * o.fragments  # per fragment: this worker was down this round

    def worker_rejoined(self, rank, step, source):
        if rank == self.ctx.rank:  # θ_global is the same on every worker: no transfer needed
            for outer in self.outer:
                outer.set_model()
            self.ctx.optimizer.state.clear()

    def fragment_of(self, n: int) -> int:
        return ((n - 1) // self.segment) % self.options.fragments

    def after_step(self, step):
        if not getattr(self.ctx, "up", True):
            self.missed = [True] * self.options.fragments
        n = step + 1
        if n % self.segment == (self.segment - self.options.delay) % self.segment:
            self.send(self.fragment_of(n), step)
        if n % self.segment == 0:
            self.apply()
            if self.options.sync_buffers and n % self.options.period == 0:
                average_buffers(self.ctx)

    def send(self, fragment: int, step: int) -> None:
        deltas = self.outer[fragment].pseudo_gradients()
        pending = _Pending(fragment, deltas)
        if self.under_failures:
            self.send_live(pending, step)
        elif not deltas:  # a fragment without parameters (more fragments than parameters)
            pending.averaged = []
        elif self.exchange.compressed:  # the compressors' exchange blocks: no overlap
            pending.averaged = self.exchange.average(deltas, self.keys[fragment], step)
        else:
            pending.flat = flatten(deltas)
            pending.handle = self.ctx.comm.all_reduce(pending.flat, "sum", async_op=True)
        self.pending = pending

    def send_live(self, pending: _Pending, step: int) -> None:
        """`send` under failures: the average over the workers live all the fragment's round."""
        live, self.missed[pending.fragment] = not self.missed[pending.fragment], False
        deltas = pending.deltas
        if not deltas:
            pending.averaged = []
        elif self.exchange.compressed:
            pending.averaged = self.exchange.live_average(
                deltas, self.keys[pending.fragment], step, live) or []
        else:
            weight = torch.tensor([1.0 if live else 0.0], dtype=deltas[0].dtype,
                                  device=deltas[0].device)
            pending.flat = torch.cat([flatten(deltas) * weight, weight])
            pending.counts_live = True
            pending.handle = self.ctx.comm.all_reduce(pending.flat, "sum", async_op=True)
        self.pending = pending

    def apply(self) -> None:
        pending, self.pending = self.pending, None
        outer = self.outer[pending.fragment]
        averaged = pending.wait(self.ctx.world_size)
        local = [p.detach().clone() for p in outer.params]
        outer.outer_step(averaged)
        outer.set_model(self.options.alpha, local)
        self.ctx.metrics.log("fragment_applied", pending.fragment)

    def finish(self):
        if self.pending is not None and self.pending.handle is not None:
            self.pending.handle.wait()  # completed, never applied: no partial round
        self.pending = None

    def state_dict(self) -> dict[str, Any]:
        """The fragments' outer states and residuals, and an exchange in flight (waited for)."""
        pending = None
        if self.pending is not None:
            pending = (self.pending.fragment, self.pending.wait(self.ctx.world_size))
        return {"outer": [outer.state_dict() for outer in self.outer],
                "exchange": self.exchange.state_dict(), "pending": pending}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for outer, saved in zip(self.outer, state["outer"]):
            outer.load_state_dict(saved)
        self.exchange.load_state_dict(state["exchange"])
        self.pending = None
        if state["pending"] is not None:
            fragment, averaged = state["pending"]
            averaged = [a.to(self.ctx.device) for a in averaged]
            self.pending = _Pending(fragment, averaged, averaged=averaged)
