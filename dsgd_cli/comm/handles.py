"""A non-blocking operation in flight (`Handle`) and its timing against the network model:
it never completes before its modeled end, and a real transfer that kept its caller waiting
past that end is counted as overrun (`comm_overrun`, `comm_overrun_time`)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable, Sequence

from dsgd_cli.comm.hangs import CommTimeout, Entered
from dsgd_cli.units import readable_duration

if TYPE_CHECKING:
    from dsgd_cli.comm.communicator import Comm

# A modeled operation overran when its real transfer took this fraction longer than modeled.
COMM_OVERRUN_TOLERANCE = 0.05


class Handle:
    """A non-blocking operation in flight. `wait()` returns its result."""

    def __init__(self, comm: "Comm", works: Sequence[Any], issued_at: float, emulated_s: float,
                 result: Any = None, on_complete: Callable[[], Any] | None = None,
                 blocking: bool = False, operation: str = "communication",
                 entered: Entered | None = None, done_at: float | None = None):
        self._comm = comm
        self._operation = operation  # what failed, in an error: "recv from rank 2"
        self._entered = entered  # a collective's, to name who never entered it
        self._works = works
        self._issued_at = issued_at
        self._emulated_s = emulated_s
        self._result = result
        self._on_complete = on_complete
        self._done = False
        self._tracked = comm._tracking() and comm._counting_seconds()
        self._modeled = comm._tracking() and emulated_s > 0  # its time is the model's
        self._done_at = done_at  # when its transfer ended, if it ended as it was issued
        self._blocking = blocking  # the caller has been blocked since the operation was issued

    def is_completed(self) -> bool:
        if self._done:
            return True
        real_done = all(work is None or work.is_completed() for work in self._works)
        return real_done and time.perf_counter() >= self._issued_at + self._emulated_s

    def wait(self) -> Any:
        if self._done:
            return self._result
        started = self._issued_at if self._blocking else time.perf_counter()
        # Since when the caller has been held up by this transfer: its issue when it blocked
        # (or moved as it was issued), else this wait.
        waited_from = self._issued_at if self._done_at is not None else started
        try:
            for work in self._works:
                if work is not None:
                    work.wait()
        except RuntimeError as error:
            raise self._comm._failure(self._operation, error, self._entered) from error
        if self._modeled:
            # Overran: the real transfer kept the caller waiting past the modeled end. A
            # transfer waited for late (a send waited at the end of a round) had all the time
            # until the wait; when it was done by then, the model's time is what was recorded.
            real_end = self._done_at or time.perf_counter()
            modeled_end = max(self._issued_at + self._emulated_s, waited_from)
            overran = real_end > modeled_end + self._emulated_s * COMM_OVERRUN_TOLERANCE
            # What it added to the caller's recorded time (`comm_overrun_time`); a background
            # thread's wait holds up no step.
            added = real_end - modeled_end if overran and self._tracked else 0.0
            self._comm._note_modeled(overran, added)
        self._wait_for_modeled_end()
        if self._on_complete is not None:
            self._result = self._on_complete()
        self._done = True
        if self._tracked:
            self._comm._add(seconds=time.perf_counter() - started)
        return self._result

    def _wait_for_modeled_end(self) -> None:
        """Sleep until the modeled transfer ends. That wait is real and no real wait may last
        the run's `timeout`: a transfer modeled that long (a link of a few bits per second)
        fails now, as a real one would once the timeout is up, instead of sleeping for days
        outside any collective, where no backend's timeout can end it."""
        timeout = self._comm.timeout_s
        if self._emulated_s >= timeout:
            raise CommTimeout(f"{self._operation}: its modeled transfer lasts "
                              f"{readable_duration(self._emulated_s)} of real time, not less "
                              f"than the spec's timeout ({timeout:g} s)")
        _sleep_until(self._issued_at + self._emulated_s)


def _sleep_until(deadline: float) -> None:
    remaining = deadline - time.perf_counter()
    if remaining > 0:
        time.sleep(remaining)
