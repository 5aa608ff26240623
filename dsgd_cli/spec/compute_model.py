"""The emulated cluster: each worker's step lasts a modeled time, whatever its real compute
took, and a time scale stretches the modeled times so the machine's real work fits in them.

The spec's `compute` section:

    compute:
      step_seconds: 0.05                                # modeled forward+backward of one step
      variation: {distribution: lognormal, sigma: 0.3}  # optional per-step random factor
      time_scale: 4                                     # real seconds per modeled second
      ring_max: 64                                      # how the real all-reduce moves (below)

Here: the section's parsing and validation, and the advice to a user whose recorded run did
not fit its modeled time. What the model does at run time (each step padded to its modeled
time, the clock that turns real seconds into modeled ones, the network stretched into real
time) is the emulation's, `dsgd_cli.emulation`; its names are imported here too, for code
that finds them here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from dsgd_cli.emulation.compute import (  # noqa: F401  (their former home)
    STEP_OVERRUN_TOLERANCE, PaddedCompute, mean_factor, time_scale, variation_factor)
from dsgd_cli.emulation.network import GLOO_RING_MAX, real_network  # noqa: F401
from dsgd_cli.errors import SpecError
from dsgd_cli.options import as_float, option, show

MAX_STEP_SECONDS = 24 * 3600.0
MAX_TIME_SCALE = 100_000.0
MAX_RING = 1 << 20
# A run where more than OVERRUN_ADVICE_STEPS of all steps overran (by more than
# STEP_OVERRUN_TOLERANCE) gets the advice to raise the time scale.
OVERRUN_ADVICE_STEPS = 0.05

# Each distribution's options: name -> (option, lower bound, upper bound).
DISTRIBUTIONS: dict[str, tuple[str, float, float]] = {
    # factor = exp(sigma · Z), Z standard normal: median 1, mean exp(sigma² / 2); heavy tail.
    "lognormal": ("sigma", 0.0, 5.0),
    # factor = 1 + E, E exponential of mean `tail`: never below 1, mean 1 + tail; the long
    # but light tail of step times Chen et al. (2016) measured.
    "shifted_exponential": ("tail", 0.0, 1000.0),
}


@dataclass(frozen=True)
class ComputeOptions:
    """The `compute:` section: a modeled step time, an emulated cluster."""

    spec_section: ClassVar[bool] = True  # its errors say "unknown key" and "required"

    step_seconds: float = option(
        more_than=0, max=MAX_STEP_SECONDS, expect=f"a number > 0 and <= {MAX_STEP_SECONDS:g}",
        missing="the modeled seconds of one step, such as 0.05",
        help="modeled seconds of one step's forward and backward")
    variation: Any = option(None, help="{distribution: lognormal, sigma: 0.3} or "
                                       "{distribution: shifted_exponential, tail: 0.5}: a "
                                       "random factor on each step")
    time_scale: float = option(
        1.0, min=1, max=MAX_TIME_SCALE, expect=f"a number >= 1 and <= {MAX_TIME_SCALE:g}",
        help="real seconds per modeled second")
    # Only the real transport: the modeled network charges a ring all-reduce either way.
    ring_max: int = option(
        GLOO_RING_MAX, min=1, max=MAX_RING, expect=f"an integer between 1 and {MAX_RING}",
        help="the largest group whose real all-reduce is gloo's ring; larger groups go by "
             "recursive doubling (far fewer messages; lower it when comm_overrun is high)")

    def __post_init__(self):
        object.__setattr__(self, "variation", parse_variation(self.variation, "variation"))


def parse_variation(raw: Any, path: str) -> dict[str, Any] | None:
    """`{distribution: name, <its option>: value}`, checked against `DISTRIBUTIONS`."""
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
    option_name, low, high = DISTRIBUTIONS[distribution]
    allowed = ("distribution", option_name)
    for key in raw:
        if key not in allowed:
            raise SpecError(f"unknown key (expected one of {', '.join(sorted(allowed))})",
                            path=f"{path}.{key}")
    if option_name not in raw:
        raise SpecError(f"required for {distribution}", path=f"{path}.{option_name}")
    value = as_float(raw[option_name])
    if value is None or not low <= value <= high:  # NaN and infinities fail too
        raise SpecError(f"expected a number >= {low:g} and <= {high:g}, "
                        f"got {show(raw[option_name])}", path=f"{path}.{option_name}")
    return {"distribution": distribution, option_name: value}


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
