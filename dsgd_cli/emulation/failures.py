"""Failures on the modeled clock: the spec's `failures:` section, the seeded failure schedule,
the `restart` emulation of a synchronous job and the `continue` emulation of an algorithm that
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
from typing import Any, ClassVar, Iterator

from dsgd_cli.errors import SpecError
from dsgd_cli.options import option, options_to_dict, parse_options, show
from dsgd_cli.units import parse_duration, readable_duration

FAILURE_MODES = ("restart", "continue")
# Without a compute model a step lasts the machine's real time, unknown before the run; the
# refusal of failures faster than steps counts such a step as this long. The shortest real
# steps are shorter (2 logreg workers: about 0.6 ms under diloco, 3 ms under allreduce, on a
# 2-core machine), but an mtbf this short on the real clock is no experiment.
UNMODELED_STEP_S = 0.01


@dataclass(frozen=True)
class FixedFailure:
    """One failure at a fixed modeled time: `{node: 1, time: 300s}`."""

    spec_section: ClassVar[bool] = True

    node: int = option(min=0, help="the node that fails (the worker without cluster.nodes)")
    time: Any = option(help="modeled time since the start of training, such as 300s")

    def __post_init__(self):
        object.__setattr__(self, "time", parse_duration(self.time, "time"))


@dataclass(frozen=True)
class FailureOptions:
    """The spec's `failures:` section. Durations are stored in seconds."""

    spec_section: ClassVar[bool] = True

    restart: Any = option(help="modeled time a failed node is away before it can rejoin")
    mtbf: Any = option(None, help="mean modeled time between failures of one node (of one "
                                  "worker without cluster.nodes), exponential; null: only `at`")
    checkpoint_every: int | None = option(
        None, min=1, max=2**31 - 1,
        help="steps between the emulated checkpoints a restart rolls back to "
             "(null: back to the start)")
    checkpoint_seconds: Any = option(0.0, help="modeled cost of writing one checkpoint")
    seed: int = option(0, min=0, max=2**32 - 1, help="same seed, same failure times")
    at: list[Any] = option([], help="failures at fixed times: [{node: 1, time: 300s}]")

    def __post_init__(self):
        convert = object.__setattr__
        if self.mtbf is not None:
            convert(self, "mtbf", parse_duration(self.mtbf, "mtbf", positive=True))
        convert(self, "restart", parse_duration(self.restart, "restart"))
        convert(self, "checkpoint_seconds",
                parse_duration(self.checkpoint_seconds, "checkpoint_seconds"))
        fixed = []
        for index, entry in enumerate(self.at):
            if not isinstance(entry, dict):
                raise SpecError(f"expected a mapping with keys node, time, got {show(entry)}",
                                path=f"at[{index}]")
            parsed = parse_options(FixedFailure, entry, f"at[{index}]")  # a path in the section
            fixed.append({"node": parsed.node, "time": parsed.time})
        convert(self, "at", fixed)
        if self.mtbf is None and not self.at:
            raise SpecError("no failure would ever happen: give mtbf, at, or both", path="mtbf")
        if self.checkpoint_every is None and self.checkpoint_seconds > 0:
            raise SpecError("checkpoint_seconds needs checkpoint_every (no checkpoint is "
                            "written without it)", path="checkpoint_seconds")


def parse_failures(raw: Any, path: str) -> dict[str, Any] | None:
    """The spec's `failures` section as stored in the run's configuration (plain data,
    seconds), or None without one."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise SpecError("expected a mapping with keys mtbf, restart, checkpoint_every, "
                        "checkpoint_seconds, seed, at", path=path)
    return options_to_dict(parse_options(FailureOptions, raw, path))


def node_count(config: dict[str, Any]) -> int:
    """The failure domains: the cluster's nodes, or one per worker without them."""
    cluster = config.get("cluster")
    return cluster["nodes"] if cluster else config["workers"]


def node_of(rank: int, workers: int, nodes: int) -> int:
    """The node rank `rank` runs on: workers are split over nodes in consecutive blocks."""
    return rank // (workers // nodes)


def check_failures(config: dict[str, Any], aggregator_cls: type, path: str) -> None:
    """Refuse a failure model the run cannot emulate: a fixed failure of a node that does not
    exist, an aggregator that cannot run under failures, a samples budget, failures that
    would come faster than steps."""
    failures = config.get("failures")
    if failures is None:
        return
    nodes = node_count(config)
    for index, fixed in enumerate(failures["at"]):
        if fixed["node"] >= nodes:
            domain = "cluster.nodes" if config.get("cluster") else "workers"
            raise SpecError(f"expected a node between 0 and {nodes - 1} (the run has {nodes} "
                            f"{domain}), got {fixed['node']}", path=f"{path}.at[{index}].node")
    budget = config.get("budget")
    if budget is not None and budget.get("samples") is not None:
        raise SpecError("a samples budget would count the samples of rolled-back steps; use "
                        "epochs or a seconds budget with failures", path=path)
    reason = unsupported_reason(aggregator_cls)
    if reason is not None:
        raise SpecError(f"aggregator {aggregator_cls.plugin_name!r} cannot run under failures: "
                        f"{reason}", path=path)
    check_failures_leave_time_for_steps(config, failure_mode(aggregator_cls), path)


def failure_mode(aggregator_cls: type) -> str | None:
    """The aggregator's declared `failure_mode` (FAILURE_MODES, None: refused): `restart`
    unless it says otherwise."""
    return getattr(aggregator_cls, "failure_mode", "restart")


def check_failures_leave_time_for_steps(config: dict[str, Any], mode: str, path: str) -> None:
    """Refuse an `mtbf` not longer than one step: failures would come faster than steps. Under
    `restart` any node's failure stops every worker, so the job fails every mtbf / nodes, and a
    failure at nearly every step boundary rolls the run back for ever. Under `continue` a node
    would be failing at nearly every step (and the schedule would draw many failures per step).
    A step lasts at least `compute.step_seconds`; without a compute model, UNMODELED_STEP_S."""
    mtbf = config["failures"]["mtbf"]
    if mtbf is None:  # only the fixed failures of `at`: a finite number
        return
    compute = config.get("compute")
    step = compute["step_seconds"] if compute else UNMODELED_STEP_S
    step_is = ("compute.step_seconds" if compute else
               "what a step without a compute model counts as")
    nodes = node_count(config)
    domain = "node" if config.get("cluster") else "worker"
    if mode == "restart":
        between = mtbf / nodes
        failing = (f"the job would fail every {readable_duration(between)} on average (mtbf "
                   f"{readable_duration(mtbf)} / {nodes} {domain}s: any {domain}'s failure "
                   f"restarts every worker)")
        outcome = "the run would be rolled back at nearly every step and never end"
    else:
        between = mtbf
        failing = f"each {domain} would fail every {readable_duration(mtbf)} on average (mtbf)"
        outcome = f"its {domain}s would be failing at nearly every step"
    if between <= step:
        raise SpecError(f"{failing}, not longer than one step ({readable_duration(step)}, "
                        f"{step_is}): {outcome}; raise mtbf", path=f"{path}.mtbf")


def unsupported_reason(aggregator_cls: type) -> str | None:
    """Why `aggregator_cls` cannot run under the failure emulation, or None if it can."""
    mode = failure_mode(aggregator_cls)
    if mode is None:
        return getattr(aggregator_cls, "failure_refusal", None) or "it declares failure_mode = None"
    if mode == "continue":
        return None  # it goes on without the down workers (ContinueEmulation)
    if mode != "restart":
        return f"unknown failure_mode {mode!r} (expected one of {', '.join(FAILURE_MODES)})"
    if aggregator_cls.asynchronous or aggregator_cls.steps_may_differ or aggregator_cls.decides_stop:
        return ("a restart rolls every worker back to the same step, and its workers do not "
                "run in step (asynchronous, or steps that may differ)")
    return None


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
        config = worker.config
        self.worker = worker
        self.timeline = RestartTimeline(config["failures"], node_count(config), start, step)
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
        config = worker.config
        aggregator = type(worker.aggregator)
        self.worker = worker
        self.workers = config["workers"]
        self.nodes = node_count(config)
        self.node = node_of(worker.rank, self.workers, self.nodes)
        self.in_step = not (aggregator.asynchronous or aggregator.steps_may_differ
                            or aggregator.decides_stop)
        self.schedule = OutageSchedule(config["failures"], self.nodes)
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
