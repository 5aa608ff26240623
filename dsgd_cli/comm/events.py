"""The channel from workers to the launcher: one JSON-lines file per rank.

Workers append events and flush each one; the launcher tails the files, stores metrics as they
arrive and draws progress. A worker that dies keeps everything it flushed before.

Event types: `start` (total_steps), `metric` (name, value, step, epoch, seconds), `progress`
(done, total, unit, updates: what the progress bar shows, see `schedule.StopRule.progress_bar`),
`error` (reason, traceback, at, behind: the ranks that never entered the collective that
timed out, if that was the error), `diverged` (name, value: "nan", "inf" or "-inf", step, at),
`run` (run_id: a run over several machines), `stopped` (step: it saved a checkpoint there and
left, as the launcher asked), `done`. Every number in the files is finite: JSON has no NaN or
infinity.

The other way, the launcher asks the workers of a run that checkpoints to stop (it was
interrupted) by creating the file `stop_path(launch_dir)`. Workers also watch that their
launcher is alive (its pid is in $DSGD_LAUNCHER_PID): one killed outright can neither read
their events nor stop them, so they leave.
"""

from __future__ import annotations

import json
import math
import os
import threading
from pathlib import Path
from typing import Any

from dsgd_cli.emulation.clock import Clock

LAUNCHER_PID = "DSGD_LAUNCHER_PID"


def launcher_gone() -> bool:
    """Whether the `dsgd run` that started this worker has died (killed, crashed). A process
    that took over its pid counts as alive: the worker then carries on as if it were."""
    pid = int(os.environ.get(LAUNCHER_PID, "0"))
    if not pid:
        return False  # started by hand
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # another user's process under that pid
        return False
    return False


def experiment_dir(launch_dir: str | Path, index: int) -> Path:
    """Where the workers of a launch write the events of its `index`-th experiment."""
    return Path(launch_dir) / str(index)


def stop_path(launch_dir: str | Path) -> Path:
    """Exists once the launcher asks the workers to checkpoint and stop."""
    return Path(launch_dir) / "stop"


def events_path(directory: str | Path, rank: int) -> Path:
    return Path(directory) / f"rank{rank}.jsonl"


class EventWriter:
    """A worker's events. A metric's `seconds` is the modeled time of `clock` (the worker's,
    `ctx.clock`, which the training loop starts at the run's common start); without one, real
    seconds since the writer was made."""

    def __init__(self, path: str | Path, rank: int, clock: Clock | None = None):
        self.rank = rank
        self._file = open(path, "a", buffering=1)  # line buffered
        self._lock = threading.Lock()  # a background evaluation thread writes too
        self.clock = clock if clock is not None else Clock()

    def seconds(self) -> float:
        return self.clock.elapsed()

    def continue_from(self, seconds: float) -> None:
        """A resumed run: its clock goes on from where the checkpoint's stopped."""
        self.clock.start(seconds)

    def write(self, kind: str, **fields: Any) -> None:
        fields.update(type=kind, rank=self.rank)
        line = json.dumps(_finite(fields), allow_nan=False) + "\n"
        with self._lock:
            self._file.write(line)

    def metric(self, name: str, value: float, *, step: int | None = None,
               epoch: int | None = None, per_rank: bool = True) -> None:
        """A value that is not finite is dropped: it is no measurement, and a training loss that
        diverges is reported by the worker as a `diverged` event."""
        value = float(value)
        if not math.isfinite(value):
            return
        self.write("metric", name=name, value=value, step=step, epoch=epoch,
                   seconds=self.seconds(), per_rank=per_rank)

    def close(self) -> None:
        with self._lock:
            if not self._file.closed:
                self._file.close()


def _finite(value: Any) -> Any:
    """`value` with every non-finite float in it replaced by its name ("nan", "inf", "-inf")."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value


class EventReader:
    """Reads the complete lines appended to a file since the last call."""

    def __init__(self, path: str | Path, offset: int = 0):
        self.path = Path(path)
        self._offset = offset
        self._partial = b""

    @property
    def offset(self) -> int:
        """Where the lines read so far end: a reader made with it goes on from there."""
        return self._offset - len(self._partial)

    def read(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as file:
                file.seek(self._offset)
                chunk = file.read()
        except FileNotFoundError:
            return []
        self._offset += len(chunk)
        lines = (self._partial + chunk).split(b"\n")
        self._partial = lines.pop()  # an unfinished line waits for the next call
        return [json.loads(line) for line in lines if line.strip()]
