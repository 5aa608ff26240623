"""Failures on the modeled clock: the seeded failure schedule of the spec's `failures:`
section (parsed and checked in `dsgd_cli.spec.failures_spec`), the `restart` emulation of a synchronous job and the `continue` emulation of an algorithm that
goes on without its failed workers (docs/failures.md).

The processes stay up: a failure is an event on the modeled timeline. Under `restart` (the
aggregators' default, `Aggregator.failure_mode`), every worker rolls back to the last emulated
checkpoint, the modeled clock skips the restart time, and the steps since that checkpoint are
redone. Nothing here reads the real clock: the runtime passes modeled times in, so that the
arithmetic (`RestartTimeline`) is testable and benchmarkable without training.
"""

from __future__ import annotations

import copy
import heapq
import math
import random
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

from dsgd_cli.spec.failures_spec import failure_domains, failure_mode, node_of

# -- the schedule -------------------------------------------------------------------------

def _node_stream(mtbf: float, seed: int, node: int) -> Iterator[tuple[float, int]]:
    """One node's failures, (time, node): exponential gaps of mean `mtbf`, from the node's own
    generator, so that a node's times do not depend on how many nodes there are."""
    generator = random.Random(seed * 1_000_003 + node)
    time = 0.0
    while True:
        time += generator.expovariate(1.0 / mtbf)
        yield time, node


def failure_times(options: dict[str, Any], nodes: int) -> Iterator[tuple[float, int]]:
    """Every failure of the run, as (modeled time, node), in time order (then node order):
    the seeded exponential ones of each node and the fixed ones of `at`. Endless with
    `mtbf`; the same on every worker."""
    streams = [iter(sorted((f["time"], f["node"]) for f in options["at"]))]
    if options["mtbf"] is not None:
        for node in range(nodes):
            streams.append(_node_stream(options["mtbf"], options["seed"], node))
    return heapq.merge(*streams)


def first_failures(options: dict[str, Any], nodes: int, count: int) -> list[tuple[float, int]]:
    times = failure_times(options, nodes)
    return [next(times) for _ in range(count)]


# -- the restart arithmetic ---------------------------------------------------------------

@dataclass
class Decision:
    """What the runtime does at a step boundary."""

    checkpoint: bool = False  # snapshot now
    rollback_to: int | None = None  # a failure struck: go back to this step's snapshot
    skip_seconds: float = 0.0  # modeled time the clock skips (restart or checkpoint write)
    struck: tuple[float, int] | None = None  # (time, node) of the failure


class RestartTimeline:
    """The `restart` policy on one worker's modeled timeline, driven by `after_step`.

    A failure takes effect at the first step boundary at or after the time it strikes
    (failures are quantized to steps: the step during which it strikes is lost whole). Then
    every worker rolls back to the last checkpoint and the clock skips `restart`; the failures
    that strike while the job is down are part of that same restart. A checkpoint is written
    every `checkpoint_every` steps and costs `checkpoint_seconds`. `lost_seconds` is this
    worker's modeled time not spent on work that counted: the rolled-back work (from the end of
    the checkpoint rolled back to until the failure's step boundary), the restarts and the
    checkpoint writes.
    """

    def __init__(self, options: dict[str, Any], nodes: int, start: float = 0.0,
                 start_step: int = 0):
        self.options = options
        self._times = failure_times(options, nodes)
        self._next = next(self._times, None)
        self._skip_before(start)  # a resumed run: the failures before it are behind it
        # The start of training is the first checkpoint, written for free.
        self.saved_step, self.saved_at = start_step, start
        self.failures = 0
        self.checkpoints = 0
        self.lost_steps = 0
        self.lost_seconds = 0.0

    def next_failure(self) -> tuple[float, int] | None:
        return self._next

    def after_step(self, step: int, now: float) -> Decision:
        """`step` steps are done at modeled time `now` (the same on every worker)."""
        if self._next is not None and self._next[0] <= now:
            struck = self._next
            restart = self.options["restart"]
            self.failures += 1
            self.lost_steps += step - self.saved_step
            self.lost_seconds += (now - self.saved_at) + restart
            self._skip_until(now + restart)
            self.saved_at = now + restart  # work from here on counts again
            return Decision(rollback_to=self.saved_step, skip_seconds=restart, struck=struck)
        every = self.options["checkpoint_every"]
        if every and step % every == 0 and step > self.saved_step:
            cost = self.options["checkpoint_seconds"]
            self.checkpoints += 1
            self.lost_seconds += cost
            self.saved_step, self.saved_at = step, now + cost
            return Decision(checkpoint=True, skip_seconds=cost)
        return Decision()

    def _skip_until(self, time: float) -> None:
        """Drop the failures that strike at or before `time` (the job is down)."""
        while self._next is not None and self._next[0] <= time:
            self._next = next(self._times, None)

    def _skip_before(self, start: float) -> None:
        """Drop the failures that strike before `start`. One at `start` itself (time 0 for a
        fresh run) strikes during the first step: it is the run's."""
        while self._next is not None and self._next[0] < start:
            self._next = next(self._times, None)


# -- the runtime --------------------------------------------------------------------------

@contextmanager
def off_the_clock(clock: Any) -> Iterator[None]:
    """The emulation's own bookkeeping (taking and restoring snapshots, a rejoiner's state
    transfer; for agreeing on a boundary's time see `_agreed_time`) is no work of the modeled
    cluster: the real time it takes does not move the worker's modeled clock, so that a
    checkpoint costs `checkpoint_seconds` and no more, whatever the machine's load."""
    modeled = clock.elapsed()
    try:
        yield
    finally:
        clock.start(modeled)  # elapsed() reads what it read before the bookkeeping


class FailureEmulation:
    """`restart` failures in one worker's training loop (training.py calls `after_step` at
    each step boundary). Every worker takes the same decisions: the boundary's time is agreed
    by an all-reduce (max) of the workers' modeled clocks, untracked, so that a failure that
    strikes close to a boundary is seen on the same side of it by all of them. The
    agreement and the snapshots are kept off the modeled clock (`_agreed_time`,
    `off_the_clock`): a checkpoint costs `checkpoint_seconds`, exactly."""

    def __init__(self, worker: Any, start: float, step: int = 0, samples: int = 0):
        """`start`: the modeled time training starts at, after `step` steps (a resumed run)."""
        experiment = worker.experiment
        self.worker = worker
        self.timeline = RestartTimeline(experiment.failures, failure_domains(experiment),
                                        start, step)
        self._snapshot = self._take(step, samples, start)

    def before_step(self, step: int) -> bool:
        """Whether this worker computes step `step`: always under `restart`."""
        return True

    def after_step(self, step: int, samples: int) -> tuple[int, int] | None:
        """Apply what a failure or a checkpoint does after `step` steps; return the (step,
        samples) to go back to after a failure, else None. Logs `up` (0 for a struck step)."""
        worker = self.worker
        back_to = None
        decision = self.timeline.after_step(step, _agreed_time(worker))
        with off_the_clock(worker.ctx.clock):
            if decision.checkpoint:
                self._snapshot = self._take(step, samples, self.timeline.saved_at)
            if decision.rollback_to is not None:
                back_to = self._restore()
        worker.interval.log("up", 0.0 if back_to is not None else 1.0)
        worker.ctx.clock.skip(decision.skip_seconds)
        return back_to

    def totals(self) -> dict[str, float]:
        timeline = self.timeline
        return {"failures": timeline.failures, "lost_seconds": timeline.lost_seconds,
                "lost_steps": timeline.lost_steps, "checkpoints": timeline.checkpoints}

    def _take(self, step: int, samples: int, seconds: float) -> dict[str, Any]:
        """The snapshot of this worker after `step` steps; `seconds`: the modeled time its
        write ends (work from then on is lost by a rollback to it)."""
        from dsgd_cli.worker import checkpoint

        worker = self.worker
        # state_dict() waits for the aggregator's communication in flight (DaSGD's delayed
        # average), as a checkpoint does: the snapshot is the state at this boundary.
        return copy.deepcopy({
            "step": step, "samples": samples, "seconds": seconds,
            "model": worker.model.state_dict(),
            "optimizer": worker.optimizer.state_dict(),
            "aggregator": worker.aggregator.state_dict(),
            "compressor": worker.ctx.compressor.state_dict(),
            "rng": checkpoint.rng_state(worker.device)})

    def _restore(self) -> tuple[int, int]:
        from dsgd_cli.worker import checkpoint

        worker, saved = self.worker, copy.deepcopy(self._snapshot)
        worker.aggregator.state_dict()  # completes what is in flight before it is replaced
        worker.model.load_state_dict(saved["model"])
        worker.optimizer.load_state_dict(saved["optimizer"])
        worker.ctx.compressor.load_state_dict(saved["compressor"])
        worker.aggregator.load_state_dict(saved["aggregator"])
        checkpoint.set_rng_state(saved["rng"], worker.device)
        reached_at = worker.evaluation.reached_at
        if reached_at is not None and reached_at > saved["seconds"]:
            worker.evaluation.reached_at = None  # the target was met by work that was lost
        return saved["step"], saved["samples"]


# -- continue ---------------------------------------------------------------------------

class OutageSchedule:
    """The `continue` policy's outages: a node that fails at T is down from T until
    T + restart; a failure of a node that is already down is part of the same outage. Driven
    by `advance(now)` with a modeled time that never goes back; the same on every worker."""

    def __init__(self, options: dict[str, Any], nodes: int):
        self.restart = options["restart"]
        self._times = failure_times(options, nodes)
        self._next = next(self._times, None)
        self.down_until = [-math.inf] * nodes
        self.outages = [0] * nodes  # per node: outages that began by the last `advance`

    def advance(self, now: float) -> None:
        """Take in the failures that strike at or before `now`."""
        while self._next is not None and self._next[0] <= now:
            self._take_next()

    def skip_before(self, start: float) -> None:
        """A resumed run: take in the failures that struck before `start`, so that an outage
        they began may still be going on at it. One at `start` itself (time 0 for a fresh run)
        is left for `advance`: it belongs to the run."""
        while self._next is not None and self._next[0] < start:
            self._take_next()

    def _take_next(self) -> None:
        time, node = self._next
        if time >= self.down_until[node]:
            self.down_until[node] = time + self.restart
            self.outages[node] += 1
        self._next = next(self._times, None)

    def down_nodes(self, now: float) -> set[int]:
        return {node for node, until in enumerate(self.down_until) if now < until}

    def next_recovery(self, now: float) -> float:
        """The earliest time after `now` at which a node that is down at `now` is back."""
        return min(until for until in self.down_until if now < until)


class ContinueEmulation:
    """`continue` failures in one worker's training loop: training.py asks `before_step`
    whether this worker computes the next step.

    A step that starts (at its boundary's modeled time) while this worker's node is down is a
    down step: the runtime runs no forward, backward or optimizer step, but still calls the
    aggregator's hooks with `ctx.up` False, so that the worker reaches every collective the
    algorithm's structure requires (nothing deadlocks) and the aggregator makes it contribute
    nothing. Every worker calls `worker_rejoined` and then `worker_left` when it sees ranks
    come back or go down; the rejoiner takes its model, and the state the algorithm needs,
    from the lowest rank that stays up (or, when every such rank fails at that boundary,
    from the lowest that was up for the step before).

    Workers in step agree on each boundary's time, as under `restart` (an untracked
    all-reduce of their clocks' maximum; `_agreed_time`); the hooks run off the clock.
    Workers that do not run in step (backup) cannot meet at a collective every step; each
    one reads the seeded schedule, which every worker computes alike, against its own
    modeled clock. That is consistent because nothing in such an algorithm waits for one
    given worker: whether a worker's step counts is decided by that worker's own time
    alone, and two workers of one node see an outage begin within one step of each other.
    """

    def __init__(self, worker: Any, start: float):
        experiment = worker.experiment
        aggregator = type(worker.aggregator)
        self.worker = worker
        self.workers = experiment.workers
        self.nodes = failure_domains(experiment)
        self.node = node_of(worker.rank, self.workers, self.nodes)
        self.in_step = not (aggregator.asynchronous or aggregator.steps_may_differ
                            or aggregator.decides_stop)
        self.schedule = OutageSchedule(experiment.failures, self.nodes)
        self.schedule.skip_before(start)  # a resumed run: the outages before it are behind it
        self._outages_before = list(self.schedule.outages)
        self.down_ranks: set[int] = set()
        self.lost_seconds = 0.0
        self.down_steps = 0
        self._down_since: float | None = None  # start of this worker's current down step

    def before_step(self, step: int) -> bool:
        """Decide whether this worker's node is up for step `step` (0-based, the steps done
        so far), tell the aggregator who left and who is back, and log `up`."""
        worker = self.worker
        now = self._now()
        self._close_down_step(now)
        now = self._wait_while_everyone_is_down(now)
        down = self._down_ranks(now)
        was_up = [rank for rank in range(self.workers) if rank not in self.down_ranks]
        stays_up = [rank for rank in was_up if rank not in down]
        # The source: the lowest rank that stays up, else one up for the step just done that
        # fails at this boundary. Rejoins come first, so that such a source still holds its
        # state when it hands it over.
        source = (stays_up or was_up)[0]
        back, left = sorted(self.down_ranks - down), sorted(down - self.down_ranks)
        if back or left:
            with off_the_clock(worker.ctx.clock):  # a rejoiner's state transfer is free
                for rank in back:
                    worker.aggregator.worker_rejoined(rank, step, source)
                for rank in left:
                    worker.aggregator.worker_left(rank, step)
        self.down_ranks = down
        up = worker.rank not in down
        worker.ctx.up = up
        worker.interval.log("up", 1.0 if up else 0.0)
        if not up:
            self.down_steps += 1
            self._down_since = now
        return up

    def after_step(self, step: int, samples: int) -> None:
        """Nothing is rolled back under `continue`."""
        return None

    def totals(self) -> dict[str, float]:
        self._close_down_step(self.worker.ctx.clock.elapsed())
        first_of_node = self.worker.rank % (self.workers // self.nodes) == 0
        counted = self.schedule.outages[self.node] - self._outages_before[self.node]
        # node_failures: summed over the workers, each node counted by its first rank
        return {"node_failures": counted if first_of_node else 0,
                "lost_seconds": self.lost_seconds, "down_steps": self.down_steps}

    def _down_ranks(self, now: float) -> set[int]:
        self.schedule.advance(now)
        nodes = self.schedule.down_nodes(now)
        return {rank for rank in range(self.workers)
                if node_of(rank, self.workers, self.nodes) in nodes}

    def _wait_while_everyone_is_down(self, now: float) -> float:
        """With every node down nobody can step: the clock skips to the first recovery,
        worker-seconds lost by every worker."""
        while len(self._down_ranks(now)) == self.workers:
            back = self.schedule.next_recovery(now)
            self.worker.ctx.clock.skip(back - now)
            self.lost_seconds += back - now
            now = back
        return now

    def _close_down_step(self, now: float) -> None:
        """A down step lasted until the boundary at `now`: its time is lost."""
        if self._down_since is not None:
            self.lost_seconds += max(0.0, now - self._down_since)
            self._down_since = None

    def _now(self) -> float:
        if not self.in_step:
            return self.worker.ctx.clock.elapsed()
        return _agreed_time(self.worker)


def _agreed_time(worker: Any) -> float:
    """The boundary's modeled time: the maximum of the workers' clocks, by an untracked
    all-reduce, which every worker's clock then reads. A worker that came first has waited
    for the others, as it would have at the algorithm's next collective; the all-reduce's
    own real time is no work of the modeled cluster, and every boundary starts the workers'
    clocks alike."""
    import torch

    clock = worker.ctx.clock
    now = torch.tensor([clock.elapsed()], dtype=torch.float64, device=worker.device)
    with worker.comm.untracked():
        worker.comm.all_reduce(now, "max")
    agreed = float(now.item())
    clock.start(agreed)
    return agreed


def emulate_failures(worker: Any, start: float, step: int = 0, samples: int = 0):
    """The emulation of the spec's `failures` for the run's aggregator's `failure_mode`."""
    if failure_mode(type(worker.aggregator)) == "continue":
        return ContinueEmulation(worker, start)
    return FailureEmulation(worker, start, step, samples)
