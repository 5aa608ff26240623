"""The training metrics of one log interval: summed over its steps, written as per-step means
when it ends."""

from __future__ import annotations

import math

import torch

from dsgd_cli.comm.communicator import Traffic
from dsgd_cli.comm.events import EventWriter


class IntervalMetrics:
    """Sums over the steps of one log interval; `log()` is the plugins' MetricsLogger.

    Its attributes are exactly the sums, so that `state()` can save them in a checkpoint.
    """

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.steps = 0
        self.loss = 0.0  # the sum of the losses read on the host
        # On a GPU: the steps' losses not read yet, on the device (`read_losses`)
        self.device_losses: list[torch.Tensor] = []
        self.step_seconds = 0.0
        self.comm_seconds = 0.0
        self.bytes_sent = 0
        self.bytes_received = 0
        # On a cluster: bytes sent per link level, and the most one step sent per second on
        # each (a modeled rate), over the interval.
        self.sent_by_level: dict[str, int] = {}
        self.peak_rate_by_level: dict[str, float] = {}
        self.custom: dict[str, list[float]] = {}
        # On a GPU, the sums after each step whose loss is still on the device, by step count:
        # a divergence found when the losses are read keeps the steps before it (`_keep`).
        self.marks: dict[int, tuple] = {0: self._mark()}

    def log(self, name: str, value: float) -> None:
        self.custom.setdefault(name, []).append(float(value))

    def add_loss(self, loss: torch.Tensor) -> None:
        """Keep a step's loss where it is, to be read with the interval's others; before the
        step's `add`."""
        self.device_losses.append(loss)

    def read_losses(self) -> tuple[int, float] | None:
        """Read the losses kept on the device (one synchronisation) into the sum; the first
        that is not finite, as (its step's index in this interval, its value), else None."""
        if not self.device_losses:
            return None
        first = self.steps - len(self.device_losses)
        values = torch.stack(self.device_losses).double().tolist()
        self.device_losses = []
        for index, value in enumerate(values):
            if not math.isfinite(value):
                self.loss += sum(values[:index])
                self._keep(first + index)
                return first + index, value
        self.loss += sum(values)
        self.marks = {self.steps: self._mark()}
        return None

    def add(self, loss: float | None, step_seconds: float, traffic: Traffic) -> None:
        """Count one training step; `loss` None when it was kept with `add_loss`."""
        self.steps += 1
        if loss is not None:
            self.loss += loss
        self.step_seconds += step_seconds
        self.comm_seconds += traffic.seconds
        self.bytes_sent += traffic.bytes_sent
        self.bytes_received += traffic.bytes_received
        self._add_levels(traffic)
        for level, sent in (traffic.sent_by_level or {}).items():
            rate = sent / step_seconds if step_seconds > 0 else 0.0
            self.peak_rate_by_level[level] = max(self.peak_rate_by_level.get(level, 0.0), rate)
        if loss is None:
            self.marks[self.steps] = self._mark()

    def _mark(self) -> tuple:
        return (self.step_seconds, self.comm_seconds, self.bytes_sent, self.bytes_received,
                dict(self.sent_by_level), dict(self.peak_rate_by_level),
                {name: len(values) for name, values in self.custom.items()})

    def _keep(self, steps: int) -> None:
        """Go back to the sums after the interval's first `steps` steps (their losses are
        summed already), forgetting the steps after them, where they were marked."""
        mark = self.marks.get(steps)
        if mark is None:
            return
        (self.step_seconds, self.comm_seconds, self.bytes_sent, self.bytes_received,
         levels, peaks, lengths) = mark
        self.sent_by_level, self.peak_rate_by_level = dict(levels), dict(peaks)
        self.custom = {name: values[:lengths[name]] for name, values in self.custom.items()
                       if lengths.get(name)}
        self.steps = steps
        self.marks = {steps: mark}

    def add_bytes(self, traffic: Traffic) -> None:
        """Count bytes sent and received after the interval's last step, in that step (the
        aggregator's finish(), its background threads)."""
        self.bytes_sent += traffic.bytes_sent
        self.bytes_received += traffic.bytes_received
        self._add_levels(traffic)

    def _add_levels(self, traffic: Traffic) -> None:
        for level, sent in (traffic.sent_by_level or {}).items():
            self.sent_by_level[level] = self.sent_by_level.get(level, 0) + sent

    def flush(self, events: EventWriter, step: int, epoch: int, lr: float) -> None:
        """Write the interval's per-step means at `step` (`lr` as it is now) and start a new
        interval; nothing when no step was counted since the last flush."""
        if self.steps == 0:
            return
        self.read_losses()
        n = self.steps
        per_step = {
            "train_loss": self.loss / n,
            "lr": lr,
            "step_seconds": self.step_seconds / n,
            "comm_seconds": self.comm_seconds / n,
            "compute_seconds": (self.step_seconds - self.comm_seconds) / n,
            "bytes_sent": self.bytes_sent / n,
            "bytes_received": self.bytes_received / n,
        }
        per_step.update({f"bytes_sent_{level}": sent / n
                         for level, sent in self.sent_by_level.items()})
        per_step.update({f"peak_rate_{level}": rate
                         for level, rate in self.peak_rate_by_level.items()})
        per_step.update({name: sum(v) / len(v) for name, v in self.custom.items()})
        for name, value in per_step.items():
            events.metric(name, value, step=step, epoch=epoch)
        self.reset()

    def state(self) -> dict:
        """The sums so far, for a checkpoint inside the interval."""
        self.read_losses()
        state = {key: value for key, value in vars(self).items()
                 if key not in ("device_losses", "marks")}
        return {**state, "custom": {k: list(v) for k, v in self.custom.items()},
                "sent_by_level": dict(self.sent_by_level),
                "peak_rate_by_level": dict(self.peak_rate_by_level)}

    def restore(self, state: dict) -> None:
        vars(self).update(state)
        self.device_losses = []
        self.marks = {self.steps: self._mark()}
