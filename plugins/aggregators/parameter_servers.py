"""Asynchronous parameter servers on the modeled clock, shared by `async_local_sgd` and `halos`
(issue 51; HALoS: Kim et al., ICML 2025, whose simulator, utnslab/halos, orders the same events).

Reproducibility comes first: the order in which servers apply updates is decided on the
modeled clock, never by real timing. Every worker's timeline is a pure function of the spec:

    round 0 arrives at  a(w, 0) = C(w, 0) + up(w)
    round k + 1 at      a(w, k + 1) = a(w, k) + down(w) + C(w, k + 1) + up(w)

with C(w, k) the modeled compute of round k's H steps (the compute model's `step_seconds ×
straggler factor × variation ÷ speed`: `ctx.modeled_step_seconds`, what the runtime pads each step to; without a
`compute` section every step counts 1 s), and up/down the modeled transfer of the model
between the worker and its server (the cluster's or network's link; 0 when the server lives
on the worker's own rank). A server applies a pseudo-gradient at its arrival and answers at
once, so no worker's timeline depends on another's. `Timeline` merges them (and, for
`halos`, the local servers' sends to the global server and its answers) into one ordered
list of events, ties broken by insertion order; every rank computes the same list.

Server roles live on ranks: a server's state and a background thread that applies, in that
order, the events it takes part in, receiving each message from the rank the event names
(messages between two ranks arrive in order, so no tags are needed). A message to or from a
server on the sender's own rank is handed over in-process (a server co-located with a worker
on its machine: no bytes, no transfer time, in the timeline as in the run).
"""

from __future__ import annotations

import heapq
import queue
import threading
from dataclasses import dataclass

import torch

# Event kinds.
PUSH = "push"              # a worker's pseudo-gradient reaches its server
UP = "up"                  # a local server's accumulated change reaches the global server
MERGE = "merge"            # the global model reaches a local server


@dataclass(frozen=True)
class Event:
    time: float
    kind: str
    who: int       # PUSH: the worker; UP, MERGE: the region
    round: int     # PUSH: the worker's round; UP, MERGE: the region's exchange count
    sends_up: bool = False  # PUSH (halos): after it the local server sends to the global one


def modeled_step_seconds(ctx, rank: int, step: int) -> float:
    """The modeled compute of `rank`'s `step`, as the runtime pads it
    (`WorkerContext.modeled_step_seconds`); tests replace it with a fake clock."""
    return ctx.modeled_step_seconds(rank, step)


def transfer_seconds(ctx, source: int, destination: int, nbytes: int) -> float:
    """The modeled time of one message of `nbytes` from `source` to `destination`; 0 within
    one rank."""
    if source == destination:
        return 0.0
    comm = ctx.comm
    if comm.cluster is not None:
        return ctx.clock.to_modeled(comm.cluster.p2p_seconds(source, destination, nbytes))
    return ctx.clock.to_modeled(comm.network.duration(nbytes, 1))


class Timeline:
    """The ordered events of a run: `pushes[w]` lists worker w's arrival times (one per
    round, from `worker_arrivals`); with `regions` (halos), each region's local server sends
    its accumulated change after `accumulation` updates since its last merge (none while one
    is in flight), arriving `up[r]` later at the global server, whose answer arrives `down[r]`
    after that."""

    def __init__(self, pushes: list[list[float]], region_of: list[int] | None = None,
                 accumulation: int = 0, up: list[float] | None = None,
                 down: list[float] | None = None):
        heap: list[tuple[float, int, Event]] = []
        seq = 0

        def add(event: Event) -> None:
            nonlocal seq
            heapq.heappush(heap, (event.time, seq, event))
            seq += 1

        for k in range(max((len(p) for p in pushes), default=0)):
            for worker, times in enumerate(pushes):
                if k < len(times):
                    add(Event(times[k], PUSH, worker, k))
        regions = 0 if region_of is None else max(region_of) + 1
        version = [0] * regions
        merged_version = [0] * regions
        exchanges = [0] * regions
        self.events: list[Event] = []
        while heap:
            _, _, event = heapq.heappop(heap)
            if region_of is None:
                self.events.append(event)
                continue
            if event.kind == PUSH:
                region = region_of[event.who]
                version[region] += 1
                sends = version[region] == merged_version[region] + accumulation
                event = Event(event.time, PUSH, event.who, event.round, sends)
                if sends:
                    add(Event(event.time + up[region], UP, region, exchanges[region]))
                    exchanges[region] += 1
            elif event.kind == UP:
                add(Event(event.time + down[event.who], MERGE, event.who, event.round))
            else:  # MERGE
                merged_version[event.who] = version[event.who]
            self.events.append(event)


def worker_arrivals(durations: list[float], up: float, down: float) -> list[float]:
    """The arrival times of one worker's rounds, from their compute durations."""
    times, now = [], 0.0
    for k, compute in enumerate(durations):
        now += (down if k else 0.0) + compute + up
        times.append(now)
    return times


def round_durations(ctx, rank: int, period: int, rounds: int) -> list[float]:
    return [sum(modeled_step_seconds(ctx, rank, k * period + s) for s in range(period))
            for k in range(rounds)]


def run_rounds(ctx, period: int) -> int:
    """The run's full rounds per worker; the event order needs them known: a length in steps."""
    steps = ctx.length.steps
    if steps is None:
        raise ValueError("asynchronous servers order their events on the modeled clock and need "
                         "the run's length in steps or epochs, not a budget")
    return steps // period


class Mailbox:
    """Messages to a server thread from its own rank (in-process)."""

    def __init__(self):
        self.queue: queue.Queue = queue.Queue()


class ServerThread(threading.Thread):
    """Runs `process(event)` for each of `events` in order, in the background; an error is
    kept and re-raised by `check()` in the training loop."""

    def __init__(self, comm, events: list[Event], process, name: str):
        super().__init__(daemon=True, name=name)
        self.comm, self.events, self.process = comm, events, process
        self.error: BaseException | None = None
        self.sends: list = []  # handles of sends in flight: a server never waits on them

    def run(self) -> None:
        try:
            with self.comm.background():
                for event in self.events:
                    self.process(event)
                    self.sends = [h for h in self.sends if not h.is_completed()]
                for handle in self.sends:
                    handle.wait()
        except BaseException as error:  # re-raised by check()
            self.error = error

    def check(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"{self.name} failed: {self.error!r}") from self.error


def flat_params(params: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in params]) if params else torch.zeros(0)


@torch.no_grad()
def write_flat(flat: torch.Tensor, params: list[torch.Tensor]) -> None:
    offset = 0
    for p in params:
        p.copy_(flat[offset: offset + p.numel()].view_as(p).to(p.device, p.dtype))
        offset += p.numel()


class Server:
    """A parameter server's model and optimizer (HALoS's ParameterServer: `update_model`
    with the pseudo-gradient as the gradient, `merge_model`)."""

    def __init__(self, initial: torch.Tensor, section: dict, build_optimizer):
        self.model = initial.clone()
        self.optimizer = build_optimizer(section, [self.model])

    def update(self, pseudo_gradient: torch.Tensor) -> None:
        self.model.grad = pseudo_gradient.to(self.model.dtype)
        self.optimizer.step()
        self.model.grad = None

    @torch.no_grad()
    def merge(self, other: torch.Tensor, weight: float) -> None:
        """θ ← (1 − weight) θ + weight · other (HALoS's ps.py: weight on the other model)."""
        self.model.mul_(1.0 - weight).add_(other * weight)
