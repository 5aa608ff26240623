"""The compute model at run time: each step's forward and backward last their modeled time.

A step's modeled compute is `step_seconds × straggler factor × variation draw ÷ speed` (the
spec's `compute` section, parsed by `spec.compute_model`); the draw comes from (seed, rank,
step), so the same seed gives the same timeline, and `speed` is the worker's relative speed
(`cluster.speed`: its node's, or its own where the node's are given per worker; 1 without). The worker pads its real forward and backward
to that modeled time in real seconds (it sleeps the rest), and the network emulation
stretches every link's time the same way (network.py), so the real timeline is the modeled
one, `time_scale` times slower. Where the real work does not fit, the step lasts longer than
modeled: the overrun is measured (`emulation_overrun`) and never hidden.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable

from dsgd_cli.emulation.clock import Clock
from dsgd_cli.emulation.network import GLOO_RING_MAX

# A step overran when its real work took more than this fraction longer than modeled.
STEP_OVERRUN_TOLERANCE = 0.05


@dataclass(frozen=True)
class Compute:
    """The `compute` section as a run's configuration holds it (checked by
    `spec.compute_model.ComputeOptions`): the resolved experiment's `compute`."""

    step_seconds: float
    variation: dict[str, Any] | None  # {distribution: name, <its option>: value}
    time_scale: float
    ring_max: int = GLOO_RING_MAX  # groups above it all-reduce by messages in real (comm/by_messages.py)

    @classmethod
    def read(cls, section: Mapping[str, Any]) -> Compute:
        """The section as stored (a configuration's JSON)."""
        return cls(**section)


def time_scale(config: Mapping[str, Any]) -> float:
    """Real seconds per modeled second of a stored configuration: 1 without a compute model."""
    compute = config.get("compute")
    return 1.0 if compute is None else compute["time_scale"]


def experiment_time_scale(compute: Compute | None) -> float:
    """Real seconds per modeled second of an experiment (its `compute`): 1 without one."""
    return 1.0 if compute is None else compute.time_scale


def variation_factor(variation: dict | None, seed: int, rank: int, step: int) -> float:
    """The random factor of one step of one worker; the same arguments give the same one."""
    if variation is None:
        return 1.0
    draw = random.Random(f"compute:{seed}:{rank}:{step}")
    if variation["distribution"] == "lognormal":
        return math.exp(variation["sigma"] * draw.gauss(0.0, 1.0))
    tail = variation["tail"]
    return 1.0 + (draw.expovariate(1.0 / tail) if tail > 0 else 0.0)


def modeled_compute_seconds(step_seconds: float, variation: dict | None, seed: int, rank: int,
                            step: int, slowdown: float = 1.0, speed: float = 1.0) -> float:
    """The modeled compute of one step of one worker: `step_seconds × slowdown × variation ÷
    speed` (what `PaddedCompute` pads a step to, and `WorkerContext.modeled_step_seconds`)."""
    return step_seconds * slowdown * variation_factor(variation, seed, rank, step) / speed


def mean_factor(variation: dict | None) -> float:
    """The mean of `variation_factor` over steps (docs/cluster.md documents these)."""
    if variation is None:
        return 1.0
    if variation["distribution"] == "lognormal":
        return math.exp(variation["sigma"] ** 2 / 2)
    return 1.0 + variation["tail"]


class PaddedCompute:
    """Pads one worker's forward and backward to their modeled duration.

    `start(step, slowdown)` comes right before the forward pass, `finish()` right after
    backward. The real budget of the window is the modeled `step_seconds × slowdown ×
    variation ÷ speed` in real seconds (`clock.to_real`). Most of the padding is slept before
    the forward pass, so that the backward pass, and the communication it starts
    (allreduce's buckets), ends where the modeled compute ends; what is left is slept after
    backward. How much to sleep first is a guess from the recent real forward/backward
    times, deliberately high: sleeping too little first costs only a little early
    communication, sleeping too much is an overrun.

    Communication a plugin blocks on inside the window is not compute: the window is extended
    by it (`blocked` reads the Comm's blocked seconds of this step).

    `clock`: the worker's (`ctx.clock`); without one, a clock of the section's `time_scale`.
    """

    def __init__(self, compute: Compute | Mapping[str, Any], seed: int, rank: int,
                 blocked: Callable[[], float], speed: float = 1.0, clock: Clock | None = None):
        if isinstance(compute, Mapping):  # the section as stored
            compute = Compute.read(compute)
        self.step_seconds = compute.step_seconds
        self.speed = speed  # the worker's relative compute speed: 0.5 takes twice as long
        self.variation = compute.variation
        self.clock = clock if clock is not None else Clock(compute.time_scale)
        self.seed, self.rank = seed, rank
        self.blocked = blocked
        # Real seconds from the end of the sleep ahead to the end of backward, recent steps.
        self.recent: deque[float] = deque(maxlen=16)
        self._budget = self._opened = self._blocked_at_open = self._ahead = 0.0
        self.steps = self.overran_steps = 0  # for the run's report

    def modeled_seconds(self, step: int, slowdown: float = 1.0) -> float:
        """The modeled compute of `step`."""
        return modeled_compute_seconds(self.step_seconds, self.variation, self.seed, self.rank,
                                       step, slowdown, self.speed)

    def start(self, step: int, slowdown: float = 1.0) -> None:
        self._budget = self.clock.to_real(self.modeled_seconds(step, slowdown))
        self._opened = time.perf_counter()
        self._blocked_at_open = self.blocked()
        self._ahead = max(0.0, self._budget - self._expected_real())
        if self._ahead > 0:
            time.sleep(self._ahead)

    def _expected_real(self) -> float:
        """A high guess of the real time from the end of the sleep ahead to the end of
        backward (the sleep's own lateness included): twice the recent median, at least the
        recent maximum (a loaded machine's times jump around)."""
        if not self.recent:
            return self._budget  # the first step sleeps after its compute, all of it
        return max(2 * statistics.median(self.recent), max(self.recent))

    def finish(self) -> float:
        """Sleep out the rest of the window; returns its overrun: the real seconds it lasted
        beyond its budget, as a fraction of the budget."""
        now = time.perf_counter()
        blocked = self.blocked() - self._blocked_at_open
        self.recent.append(max(0.0, now - self._opened - self._ahead - blocked))
        deadline = self._opened + self._budget + blocked
        if now < deadline:
            time.sleep(deadline - now)
        overrun = max(0.0, now - deadline) / self._budget
        self.steps += 1
        self.overran_steps += overrun > STEP_OVERRUN_TOLERANCE
        return overrun

