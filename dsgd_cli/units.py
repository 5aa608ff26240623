"""Durations as a spec writes them: `2h`, `30min`, `120s`, `500ms`, `100us`, or a bare number
of seconds."""

from __future__ import annotations

import math
import re
from typing import Any

from dsgd_cli.errors import SpecError
from dsgd_cli.options import as_float, show

SECONDS_PER_UNIT = {"d": 86400.0, "h": 3600.0, "min": 60.0, "s": 1.0, "ms": 1e-3,
                    "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(d|h|min|s|ms|us|µs|ns)\s*$")
DURATION_EXAMPLES = "a duration such as 2h, 30min, 120s, 500ms or a number of seconds"


def parse_duration(value: Any, path: str, *, positive: bool = False) -> float:
    """`value` in seconds: a finite number >= 0 (> 0 with `positive`), or a string with a
    unit of SECONDS_PER_UNIT. SpecError(path) otherwise."""
    seconds = as_float(value)
    if seconds is None and isinstance(value, str):
        match = _DURATION.match(value)
        if match:
            seconds = float(match.group(1)) * SECONDS_PER_UNIT[match.group(2)]
    if seconds is None or not math.isfinite(seconds) or seconds < 0 or (positive and seconds == 0):
        bound = "> 0" if positive else ">= 0"
        raise SpecError(f"expected {DURATION_EXAMPLES} ({bound}), got {show(value)}", path=path)
    return seconds


_READABLE_UNITS = (("days", 86400.0), ("h", 3600.0), ("min", 60.0), ("s", 1.0), ("ms", 1e-3),
                   ("µs", 1e-6))


def readable_duration(seconds: float) -> str:
    """`seconds` in the largest unit that keeps it at least 1, to 3 significant digits, for
    messages: `3.2 days`, `20 s`, `500 µs`."""
    for unit, scale in _READABLE_UNITS:
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds:.3g} s"
