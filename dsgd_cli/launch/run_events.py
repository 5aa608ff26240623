"""What a run's workers said: their event files (comm/events.py), read as they grow and
decoded into the metric rows to store, the problems they reported, the ranks that finished or
stopped, the run id they were told, and the progress of the rank whose bar is shown.

The launcher reads a running experiment's files with `RunEvents`; `dsgd runs recover`
(unrecorded.py) reads the copies it kept with the same class, so both record the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from dsgd_cli.comm.events import EventReader, events_path
from dsgd_cli.results.store import MetricRow, finite_number


@dataclass
class Progress:
    """What the progress display is told about a run as it goes."""

    total_steps: int | None = None
    step: float = 0  # done, of total_steps, in `unit`
    train_loss: float | None = None
    test_accuracy: float | None = None
    unit: str | None = None  # None: workers that write no `progress` events count steps
    updates: int | None = None  # the run's updates, when the bar counts samples or seconds


class RunEvents:
    """A run's event files, one per rank, in `events_dir`, and what they said so far.

    `ranks`: the ranks whose files to read; None: every `rank*.jsonl` file found there, as
    they appear (a run over several machines has this machine's ranks, whichever the
    rendezvous gave). `offsets`: where to go on reading each rank's file from."""

    def __init__(self, events_dir: Path, ranks: Iterable[int] | None = None,
                 offsets: dict[int, int] | None = None):
        self.events_dir = Path(events_dir)
        self._offsets = offsets or {}
        self._find_files = ranks is None
        self.readers: dict[int, EventReader] = {}
        for rank in ranks or ():
            self._add_reader(rank)
        self.unstored: list[MetricRow] = []  # decoded, not yet in the database
        self.problems: list[dict] = []  # `error` and `diverged` events
        self.done_ranks: set[int] = set()
        self.stopped_ranks: set[int] = set()  # saved a checkpoint and left, as asked
        self.run_id: int | None = None  # from a `run` event: workers of another node learn it
        self.progress = Progress()

    def _add_reader(self, rank: int) -> None:
        path = events_path(self.events_dir, rank)
        self.readers[rank] = EventReader(path, offset=self._offsets.get(rank, 0))

    @property
    def offsets(self) -> dict[int, int]:
        """Where each rank's file was read to: what follows was never read."""
        return {rank: reader.offset for rank, reader in self.readers.items()}

    def read(self) -> bool:
        """Take in what the files gained since the last call; True when a `progress` event
        was among it."""
        if self._find_files:
            for path in self.events_dir.glob("rank*.jsonl"):
                rank = int(path.stem[len("rank"):])
                if rank not in self.readers:
                    self._add_reader(rank)
            self.readers = dict(sorted(self.readers.items()))
        lead = min(self.readers, default=0)  # whose progress is shown
        moved = False
        for reader in self.readers.values():
            for event in reader.read():
                moved = self.take(event, lead) or moved
        return moved

    def take(self, event: dict, lead: int | None = None) -> bool:
        """Take in one event; `lead`: the rank whose progress is followed. True when it was a
        `progress` event of that rank."""
        kind, rank = event["type"], event["rank"]
        if kind == "metric":
            self._take_metric(event, followed=rank == lead)
        elif kind == "start" and rank == lead:
            self.progress.total_steps = event["total_steps"]
        elif kind == "progress" and rank == lead:
            _take_progress(self.progress, event)
            return True
        elif kind == "run":
            self.run_id = event["run_id"]
        elif kind in ("error", "diverged"):
            self.problems.append(event)
        elif kind == "done":
            self.done_ranks.add(rank)
        elif kind == "stopped":
            self.stopped_ranks.add(rank)
        return False

    def _take_metric(self, event: dict, followed: bool) -> None:
        if not finite_number(event["value"]):
            return  # no number to store or show (NaN parses from JSON)
        rank = event["rank"]
        self.unstored.append(MetricRow(event["name"], event["value"], event["step"],
                                       event["epoch"], rank if event["per_rank"] else None,
                                       event["seconds"]))
        if followed:
            _update_progress(self.progress, event)


def _update_progress(progress: Progress, event: dict) -> None:
    """A metric of the followed rank: the bar's loss and accuracy (and step, when the
    workers write no `progress` events)."""
    if event["name"] == "train_loss":
        progress.train_loss = event["value"]
        if progress.unit is None:
            progress.step = event["step"]
    elif event["name"] == "test_accuracy" or (
            event["name"] == "test_accuracy_workers" and event["per_rank"]):
        progress.test_accuracy = event["value"]  # asynchronous runs: a worker's own model


def _take_progress(progress: Progress, event: dict) -> None:
    """A `progress` event: the bar's count, total and unit as the worker knows them."""
    progress.step, progress.total_steps = event["done"], event["total"]
    progress.unit, progress.updates = event["unit"], event.get("updates")
