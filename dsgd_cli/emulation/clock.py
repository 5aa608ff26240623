"""`Clock`: one worker's emulated time, and the only conversion between real and modeled
seconds (and rates).

The emulation runs the modeled cluster `time_scale` times slower than it would run (the
spec's `compute.time_scale`, 1 without a compute model): a modeled second lasts `time_scale`
real seconds. A real duration measured with `time.perf_counter` is converted with
`to_modeled`; a modeled duration the worker must wait for (padding, a plugin's patience) with
`to_real`. `elapsed()` is the modeled time since the run's common start, which `start`
sets; `skip` moves it forward without waiting (modeled time lost while nothing ran, such as
a failed worker's restart).
"""

from __future__ import annotations

import time
from typing import Callable


class Clock:
    """Modeled time for one worker. `time_scale`: real seconds per modeled second (>= 1 in a
    spec; any positive number here). `now` and `sleep` are the real clock and the real sleep
    (tests pass fakes); `started_at` is the real time (a `now()` reading) at which modeled
    time was 0, by default the clock's creation."""

    def __init__(self, time_scale: float = 1.0, *, started_at: float | None = None,
                 now: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], None] = time.sleep):
        if not time_scale > 0:
            raise ValueError(f"a time scale is a positive number, got {time_scale!r}")
        self.time_scale = time_scale
        self._now, self._sleep = now, sleep
        self._origin = now() if started_at is None else started_at
        self.skipped = 0.0  # modeled seconds added by `skip`, in all

    # -- conversions ----------------------------------------------------------------------

    def to_modeled(self, real_seconds: float) -> float:
        """A real duration as modeled seconds."""
        return real_seconds / self.time_scale

    def to_real(self, modeled_seconds: float) -> float:
        """A modeled duration as real seconds."""
        return modeled_seconds * self.time_scale

    def to_real_rate(self, per_modeled_second: float) -> float:
        """A modeled rate (bytes per modeled second) as a rate per real second: a real second
        holds `1 / time_scale` modeled seconds."""
        return per_modeled_second / self.time_scale

    def modeled_since(self, real_started: float) -> float:
        """Modeled seconds since `real_started`, a reading of the real clock
        (`time.perf_counter()`)."""
        return self.to_modeled(self._now() - real_started)

    def real_deadline(self, modeled_seconds: float) -> float:
        """The real clock's reading `modeled_seconds` from now: for a timeout that is modeled,
        waited for in real time."""
        return self._now() + self.to_real(modeled_seconds)

    # -- the run's modeled time -----------------------------------------------------------

    @property
    def started_at(self) -> float:
        """The real clock's reading at which modeled time was 0 (moved back by `skip`)."""
        return self._origin

    def start(self, modeled_seconds: float = 0.0) -> None:
        """The run's common start: `elapsed()` is `modeled_seconds` now (more than 0 for a
        resumed run, which goes on from where its checkpoint stopped)."""
        self._origin = self._now() - self.to_real(modeled_seconds)

    def elapsed(self) -> float:
        """Modeled seconds since the common start."""
        return self.to_modeled(self._now() - self._origin)

    def skip(self, modeled_seconds: float) -> None:
        """Move modeled time forward by `modeled_seconds` without waiting: `elapsed()` is that
        much later from now on, and the deadlines of budgets in seconds that much nearer."""
        if modeled_seconds < 0:
            raise ValueError(f"the clock only goes forward, not by {modeled_seconds!r}")
        self._origin -= self.to_real(modeled_seconds)
        self.skipped += modeled_seconds

    def sleep(self, modeled_seconds: float) -> None:
        """Wait `modeled_seconds` of modeled time (in real time: `to_real` of it)."""
        if modeled_seconds > 0:
            self._sleep(self.to_real(modeled_seconds))

    def sleep_until(self, modeled_time: float) -> None:
        """Wait until `elapsed()` reaches `modeled_time` (at once when it has)."""
        self.sleep(modeled_time - self.elapsed())
