"""The emulated cluster: each worker's step lasts a modeled time, whatever its real compute
took, and a time scale stretches the modeled times so the machine's real work fits in them.

The spec's `compute` section:

    compute:
      step_seconds: 0.05                                # modeled forward+backward of one step
      variation: {distribution: lognormal, sigma: 0.3}  # optional per-step random factor
      time_scale: 4                                     # real seconds per modeled second

A step's modeled compute is `step_seconds × straggler factor × variation draw ÷ speed`; the draw
comes from (seed, rank, step), so the same seed gives the same timeline, and `speed` is the
relative speed of the worker's node (`cluster.speed`, 1 without it). The worker pads its real
forward and backward to `time_scale` times that (it sleeps the rest), and the network
emulation stretches every link's time by the same `time_scale`, so the real timeline is the
modeled one, `time_scale` times slower. Every time dsgd records is then real time divided by
`time_scale`. Where the real work does not fit, the step lasts longer than modeled: the
overrun is measured (`emulation_overrun`) and never hidden.
"""

from __future__ import annotations

import dataclasses
import math
import random
import statistics
import time
from collections import deque
from typing import Any, Callable

from dsgd_cli.errors import SpecError
from dsgd_cli.options import as_float, show
from dsgd_cli.spec.specfile import check_keys

MAX_STEP_SECONDS = 24 * 3600.0
MAX_TIME_SCALE = 100_000.0
# A step overran when its real work took more than this fraction longer than modeled; a run
# where more than OVERRUN_ADVICE_STEPS of all steps overran gets the advice to raise the
# time scale.
STEP_OVERRUN_TOLERANCE = 0.05
OVERRUN_ADVICE_STEPS = 0.05

# Each distribution's options: name -> (option, lower bound, upper bound).
DISTRIBUTIONS: dict[str, tuple[str, float, float]] = {
    # factor = exp(sigma · Z), Z standard normal: median 1, mean exp(sigma² / 2); heavy tail.
    "lognormal": ("sigma", 0.0, 5.0),
    # factor = 1 + E, E exponential of mean `tail`: never below 1, mean 1 + tail; the long
    # but light tail of step times Chen et al. (2016) measured.
    "shifted_exponential": ("tail", 0.0, 1000.0),
}


def _number(raw: dict, key: str, path: str, low: float, high: float, low_open: bool) -> float:
    value = raw[key]
    number = as_float(value)
    if number is None or not (math.isfinite(number) and number <= high
                              and (number > low if low_open else number >= low)):
        bound = f"> {low:g}" if low_open else f">= {low:g}"
        raise SpecError(f"expected a number {bound} and <= {high:g}, got {show(value)}",
                        path=f"{path}.{key}")
    return number


def parse_compute(raw: Any, path: str) -> dict[str, Any] | None:
    """`{step_seconds: T, variation: {...}, time_scale: k}` → the resolved section, or None."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise SpecError("expected a mapping with keys step_seconds, variation, time_scale",
                        path=path)
    check_keys(raw, path, {"step_seconds", "variation", "time_scale"})
    if "step_seconds" not in raw:
        raise SpecError("required: the modeled seconds of one step, such as 0.05",
                        path=f"{path}.step_seconds")
    return {
        "step_seconds": _number(raw, "step_seconds", path, 0.0, MAX_STEP_SECONDS, low_open=True),
        "variation": parse_variation(raw.get("variation"), f"{path}.variation"),
        "time_scale": _number({"time_scale": raw.get("time_scale", 1)}, "time_scale", path,
                              1.0, MAX_TIME_SCALE, low_open=False),
    }


def parse_variation(raw: Any, path: str) -> dict[str, Any] | None:
    if raw is None:
        return None
    names = ", ".join(DISTRIBUTIONS)
    if not isinstance(raw, dict):
        raise SpecError("expected a mapping such as {distribution: lognormal, sigma: 0.3}",
                        path=path)
    distribution = raw.get("distribution")
    if not isinstance(distribution, str) or distribution not in DISTRIBUTIONS:
        raise SpecError(f"expected one of {names}, got {show(distribution)}",
                        path=f"{path}.distribution")
    option, low, high = DISTRIBUTIONS[distribution]
    check_keys(raw, path, {"distribution", option})
    if option not in raw:
        raise SpecError(f"required for {distribution}", path=f"{path}.{option}")
    return {"distribution": distribution,
            option: _number(raw, option, path, low, high, low_open=False)}


def time_scale(config: dict) -> float:
    """Real seconds per modeled second: 1 without a compute model."""
    compute = config.get("compute")
    return 1.0 if compute is None else compute["time_scale"]


def real_network(network, scale: float):
    """The emulated link (a `comm.NetworkModel`, or None) in real time: every duration
    `scale` times longer."""
    if network is None or scale == 1:
        return network
    return dataclasses.replace(network, latency_s=network.latency_s * scale,
                               bytes_per_second=network.bytes_per_second / scale)


def overrun_steps(run) -> float | None:
    """The fraction of a recorded run's steps (a `results.RunRecord` with its summaries) that
    overran their modeled time; None for a run without a compute model."""
    return next((s.final for s in run.summaries if s.name == "overrun_steps"), None)


def overrun_advice(run) -> str | None:
    """What to tell the user about a recorded run whose real work did not fit its modeled
    time (more than OVERRUN_ADVICE_STEPS of its steps overran); None when it fit."""
    overran = overrun_steps(run)
    if overran is None or overran <= OVERRUN_ADVICE_STEPS:
        return None
    return (f"{overran:.0%} of steps overran their modeled time by more than "
            f"{STEP_OVERRUN_TOLERANCE:.0%}, so its times are not the modeled cluster's: raise "
            f"compute.time_scale (now {time_scale(run.config):g})")


def variation_factor(variation: dict | None, seed: int, rank: int, step: int) -> float:
    """The random factor of one step of one worker; the same arguments give the same one."""
    if variation is None:
        return 1.0
    draw = random.Random(f"compute:{seed}:{rank}:{step}")
    if variation["distribution"] == "lognormal":
        return math.exp(variation["sigma"] * draw.gauss(0.0, 1.0))
    tail = variation["tail"]
    return 1.0 + (draw.expovariate(1.0 / tail) if tail > 0 else 0.0)


def mean_factor(variation: dict | None) -> float:
    """The mean of `variation_factor` over steps (README documents these)."""
    if variation is None:
        return 1.0
    if variation["distribution"] == "lognormal":
        return math.exp(variation["sigma"] ** 2 / 2)
    return 1.0 + variation["tail"]


class PaddedCompute:
    """Pads one worker's forward and backward to their modeled duration.

    `start(step, slowdown)` comes right before the forward pass, `finish()` right after
    backward. The real budget of the window is `time_scale × step_seconds × slowdown ×
    variation`. Most of the padding is slept before the forward pass, so that the backward
    pass, and the communication it starts (allreduce's buckets), ends where the modeled
    compute ends; what is left is slept after backward. How much to sleep first is a guess
    from the recent real forward/backward times, deliberately high: sleeping too little
    first costs only a little early communication, sleeping too much is an overrun.

    Communication a plugin blocks on inside the window is not compute: the window is extended
    by it (`blocked` reads the Comm's blocked seconds of this step).
    """

    def __init__(self, compute: dict, seed: int, rank: int, blocked: Callable[[], float],
                 speed: float = 1.0):
        self.step_seconds = compute["step_seconds"]
        self.speed = speed  # the node's relative compute speed: 0.5 takes twice as long
        self.variation = compute["variation"]
        self.scale = compute["time_scale"]
        self.seed, self.rank = seed, rank
        self.blocked = blocked
        # Real seconds from the end of the sleep ahead to the end of backward, recent steps.
        self.recent: deque[float] = deque(maxlen=16)
        self._budget = self._opened = self._blocked_at_open = self._ahead = 0.0
        self.steps = self.overran_steps = 0  # for the run's report

    def modeled_seconds(self, step: int, slowdown: float = 1.0) -> float:
        """The modeled compute of `step`."""
        return (self.step_seconds * slowdown
                * variation_factor(self.variation, self.seed, self.rank, step) / self.speed)

    def start(self, step: int, slowdown: float = 1.0) -> None:
        self._budget = self.scale * self.modeled_seconds(step, slowdown)
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
