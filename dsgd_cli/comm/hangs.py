"""What a worker knows when a collective makes no progress: `CommTimeout`, and the collective
counts each worker publishes to the rendezvous store (`CollectiveCounts`), from which the
worker that timed out names the members that never entered the collective."""

from __future__ import annotations

import threading
from typing import Any, Sequence

import torch.distributed as dist


class CommTimeout(RuntimeError):
    """An operation made no progress for the run's `timeout`: a peer is gone or stuck.
    `behind`: for a collective, the members that had not entered it (known from the
    collective counts in the store), lowest first."""

    def __init__(self, message: str, behind: Sequence[int] = ()):
        super().__init__(message)
        self.behind = list(behind)


# A collective a worker entered: its group's name (the same on every member), the group's
# ranks, and how many collectives on that group this worker has entered, this one included.
Entered = tuple[str, tuple[int, ...], int]


class CollectiveCounts:
    """How many collectives this worker has entered on each group, each count one number in
    the rendezvous store: when a collective makes no progress, the members whose count is
    lower never entered it, and are named.

    Entering a collective only counts, in memory: a store round trip per collective would
    slow every step. A thread of the worker publishes the counts that changed every
    `PUBLISH_EVERY_S`; the member that timed out publishes its own and waits that long again
    before it reads the others', so every member that had entered the collective by then has
    published it, even one stuck in it, and one that is busy elsewhere (not entering) has
    published the count it stopped at."""

    PUBLISH_EVERY_S = 0.25

    def __init__(self, rank: int, namespace: str):
        self.rank, self.namespace = rank, namespace
        self._counts: dict[str, int] = {}
        self._changed: set[str] = set()
        self._lock = threading.Lock()  # background threads enter collectives too
        self._publishing = threading.Lock()  # one publisher at a time: counts land in order
        self._closed = threading.Event()
        self._publisher: threading.Thread | None = None
        self._store: Any = None
        self._usable = True  # until the store fails: then nothing is published

    def _key(self, group: str, rank: int) -> str:
        return f"dsgd/collectives/{self.namespace}/{group}/{rank}"

    def _default_store(self) -> Any:
        if not self._usable:
            return None
        if self._store is None and dist.is_initialized():
            self._store = dist.distributed_c10d._get_default_store()
        return self._store

    def enter(self, group: str, ranks: tuple[int, ...]) -> Entered:
        """Count one more collective on the group named `group`."""
        with self._lock:
            count = self._counts.get(group, 0) + 1
            self._counts[group] = count
            self._changed.add(group)
            if self._publisher is None:
                self._publisher = threading.Thread(target=self._publish_until_closed,
                                                   daemon=True, name="dsgd-collective-counts")
                self._publisher.start()
        return group, ranks, count

    def _publish_until_closed(self) -> None:
        while not self._closed.wait(self.PUBLISH_EVERY_S):
            self.publish()

    def publish(self) -> None:
        """Write the counts that changed since the last time into the store."""
        with self._publishing:
            with self._lock:
                changed = {group: self._counts[group] for group in self._changed}
                self._changed.clear()
            store = self._default_store()
            if store is None:
                return
            try:
                for group, count in changed.items():
                    store.set(self._key(group, self.rank), str(count))
            except RuntimeError:  # the store is gone (with torchrun): the collective says why
                self._usable = False

    def behind(self, group: str, ranks: tuple[int, ...], count: int) -> list[int]:
        """The members of the group that had entered fewer than `count` collectives on it;
        none when the store cannot say (it went with torchrun)."""
        self.publish()
        self._closed.wait(2 * self.PUBLISH_EVERY_S)  # for the others' publishers
        store = self._default_store()
        if store is None:
            return []
        late = []
        try:
            for rank in ranks:
                key = self._key(group, rank)
                if rank != self.rank and (not store.check([key]) or int(store.get(key)) < count):
                    late.append(rank)
        except (RuntimeError, ValueError):  # DistStoreError is a RuntimeError
            return []
        return late

    def close(self) -> None:
        self._closed.set()
