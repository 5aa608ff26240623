"""The emulated load imbalance (the spec's `stragglers`): fixed slow ranks, and random slow
steps drawn from the run's seed. With a compute model the padding applies a step's factor
(compute.py); without one the worker sleeps the missing compute time (`Straggling.delay`)."""

from __future__ import annotations

import random
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from dsgd_cli.spec.experiment_options import Stragglers


class Straggling:
    """How many times slower than its natural speed a worker computes at each step: the
    experiment's `stragglers` (a section as stored, a mapping, is read first), or None."""

    def __init__(self, stragglers: Stragglers | Mapping[str, Any] | None, rank: int,
                 seed: int):
        if isinstance(stragglers, Mapping):
            stragglers = Stragglers.read(stragglers)
        slow = stragglers is not None and rank in stragglers.ranks
        self.fixed = stragglers.slowdown if slow else 1.0
        self.random = None if stragglers is None else stragglers.random
        self.rank, self.seed = rank, seed

    @property
    def active(self) -> bool:
        return self.fixed > 1 or (self.random is not None and self.random.probability > 0
                                  and self.random.slowdown > 1)

    def factor(self, step: int) -> float:
        """The slowdown of `step`: the same seed, rank and step always give the same one."""
        factor = self.fixed
        if self.random is not None:
            draw = random.Random(f"stragglers:{self.seed}:{self.rank}:{step}").random()
            if draw < self.random.probability:
                factor *= self.random.slowdown
        return factor

    @staticmethod
    def delay(factor: float, recent_compute: Sequence[float]) -> float:
        """Seconds to sleep so a step computes `factor` times its natural time: the median of
        the worker's recent forward+backward times (robust to the slow first steps)."""
        if factor <= 1 or not recent_compute:
            return 0.0
        return (factor - 1) * statistics.median(recent_compute)
