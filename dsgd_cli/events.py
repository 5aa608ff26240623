"""The channel from workers to the launcher: one JSON-lines file per rank.

Workers append events and flush each one; the launcher tails the files, stores metrics as they
arrive and draws progress. A worker that dies keeps everything it flushed before.

Event types: `start` (total_steps), `metric` (name, value, step, epoch, seconds),
`error` (reason, traceback), `done`.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any


def events_path(directory: str | Path, rank: int) -> Path:
    return Path(directory) / f"rank{rank}.jsonl"


class EventWriter:
    def __init__(self, path: str | Path, rank: int):
        self.rank = rank
        self._file = open(path, "a", buffering=1)  # line buffered
        self._started = time.perf_counter()

    def seconds(self) -> float:
        return time.perf_counter() - self._started

    def write(self, kind: str, **fields: Any) -> None:
        fields.update(type=kind, rank=self.rank)
        self._file.write(json.dumps(fields) + "\n")

    def metric(self, name: str, value: float, *, step: int | None = None,
               epoch: int | None = None, per_rank: bool = True) -> None:
        self.write("metric", name=name, value=float(value), step=step, epoch=epoch,
                   seconds=self.seconds(), per_rank=per_rank)

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


class EventReader:
    """Reads the complete lines appended to a file since the last call."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._offset = 0
        self._partial = b""

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
