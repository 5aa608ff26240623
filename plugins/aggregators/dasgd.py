"""`dasgd`: local SGD with delayed averaging (DaSGD).

Every `period` steps a worker snapshots its model x(t) and starts a non-blocking all-reduce of
it; local steps go on meanwhile. `delay` steps later the average arrives and replaces the
snapshot's part of the model, keeping the local progress made since:

    x_i(t + d) <- avg_j x_j(t) + (x_i(t + d) - x_i(t))

so communication hides behind `delay` steps of computation. With `delay: 0` the average is
applied at once, which is `local_sgd` with the same period. Averages still in flight at the end
of training are applied in `finish()`.

As in the DaSGD paper, an average is applied within the period that started it: `delay <
period`. The next snapshot then already contains the previous average, so the workers' models
contract towards each other. With `delay >= period` averages would overlap, each one undoing
corrections made after its snapshot, and the models stop agreeing (they swing or diverge even
with zero gradients); the options reject it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from dsgd_cli.api import Aggregator, AggregatorOptions, Handle, flatten, option, unflatten_into


@dataclass
class DaSGDOptions(AggregatorOptions):
    period: int = option(4, min=1, help="local steps between the starts of two averages (H)")
    delay: int = option(1, min=0, help="steps between starting an average and applying it "
                                       "(d, less than period)")

    def __post_init__(self):
        if self.delay >= self.period:
            raise ValueError(f"delay: expected a value < period ({self.period}): an average is "
                             f"applied within its period, got {self.delay}")


@dataclass
class _InFlight:
    apply_at: int           # the step after which the average is applied
    snapshot: torch.Tensor  # x_i(t), as sent
    average: torch.Tensor   # the all-reduce buffer: avg_j x_j(t) once `handle` completes
    handle: Handle


class _Completed:
    """A restored average: its all-reduce completed before the checkpoint."""

    def __init__(self, average: torch.Tensor):
        self.average = average

    def wait(self) -> torch.Tensor:
        return self.average


class DaSGD(Aggregator):
    Options = DaSGDOptions
    models_identical = False

    def setup(self, ctx):
        super().setup(ctx)
        self.tensors = [t.detach() for t in ctx.parameters()]
        if self.options.sync_buffers:
            self.tensors += ctx.buffers()
        self.in_flight: deque[_InFlight] = deque()

    def after_step(self, step):
        if (step + 1) % self.options.period == 0:
            snapshot = flatten(self.tensors)
            average = snapshot.clone()
            handle = self.ctx.comm.all_reduce(average, "avg", async_op=True)
            self.in_flight.append(_InFlight(step + self.options.delay, snapshot, average, handle))
        while self.in_flight and self.in_flight[0].apply_at <= step:
            self._apply(self.in_flight.popleft())

    def state_dict(self) -> dict:
        """The averages started and not yet applied, with their snapshots: a checkpoint waits
        for their all-reduces to complete."""
        return {"in_flight": [(p.apply_at, p.snapshot.clone(), p.handle.wait().clone())
                              for p in self.in_flight]}

    def load_state_dict(self, state: dict) -> None:
        device = self.ctx.device
        self.in_flight = deque(
            _InFlight(apply_at, snapshot.to(device), average.to(device), _Completed(average.to(device)))
            for apply_at, snapshot, average in state["in_flight"])

    def finish(self):
        while self.in_flight:
            self._apply(self.in_flight.popleft())

    def _apply(self, pending: _InFlight) -> None:
        average = pending.handle.wait()
        current = flatten(self.tensors)
        unflatten_into(average + (current - pending.snapshot), self.tensors)
