"""`wagma`: WAGMA-SGD, wait-avoiding group model averaging (Li, Ben-Nun, Nadiradze,
Di Girolamo, Dryden, Alistarh, Hoefler, TPDS 2021).

After each local step a worker averages its model inside a group of `group_size` (S)
workers. The groups change every round: rank i's group in round r is every rank that differs
from i only in the log2 S bits starting at bit (r · log2 S) mod log2 n (a butterfly whose
mask shifts each round), so after ⌈log_S n⌉ consecutive rounds information from every worker
has reached every other.

Wait-avoiding: the group average of a round is started by the first member that arrives; a
member still computing contributes its latest published model instead of making the group
wait. Each worker runs a background thread that takes part in rounds on its behalf:

* when its training loop finishes a step, the worker publishes its model and the thread
  starts the next round with it: it sends the model to the round's group peers and waits for
  theirs (the training loop waits for that round only: `wait_seconds`);
* when a peer's model for a round arrives first, the thread joins that round at once with the
  worker's latest published model (stale by `staleness` rounds).

Every member of a group averages the same S models, so they leave the round with the same
average A; a member that contributed P applies A + (x - P) to its current model x, keeping
the local progress made since P was published. Every `tau` rounds the average is global and
synchronous (every worker contributes a fresh model), which bounds staleness by tau - 1.

`patience` (seconds, default 0: the paper's behaviour) lets a member drawn into a round by a
peer wait that long for its own fresh model before contributing a stale one; with a large
patience and S = n, wagma is local SGD with period 1.

Logs per step `wait_seconds`, `staleness` (the largest age, in rounds, of the models this
worker contributed since its previous step) and `rounds` (rounds it took part in).
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass

import torch

from dsgd_cli.api import Aggregator, AggregatorOptions, option

from plugins.aggregators.gossip.vector import ModelVector, to_wire

HEADER = 3  # round, sender, staleness; a negative round says goodbye


@dataclass
class WAGMAOptions(AggregatorOptions):
    group_size: int | None = option(
        None, min=2, help="workers averaged together per round, a power of two "
                          "(default: √n rounded to a power of two, at least 2)")
    tau: int = option(10, min=1, help="rounds between global synchronous averages")
    patience: float = option(0.0, min=0.0, help="seconds a member drawn in by a peer waits "
                                                "for its own fresh model (0: none)")


def default_group_size(world_size: int) -> int:
    return min(world_size, max(2, 2 ** round(math.log2(math.sqrt(world_size)))))


def group_of(rank: int, round_index: int, world_size: int, group_size: int) -> tuple[int, ...]:
    """The ranks averaged with `rank` in a round (butterfly mask shifted each round)."""
    bits, group_bits = world_size.bit_length() - 1, group_size.bit_length() - 1
    varying = [(round_index * group_bits + k) % bits for k in range(group_bits)]
    members = []
    for combination in range(group_size):
        member = rank
        for k, bit in enumerate(varying):
            member = (member & ~(1 << bit)) | (((combination >> k) & 1) << bit)
        members.append(member)
    return tuple(sorted(members))


def _is_power_of_two(value: int) -> bool:
    return value >= 1 and value & (value - 1) == 0


class WAGMA(Aggregator):
    Options = WAGMAOptions
    models_identical = False
    asynchronous = True
    steps_may_differ = True

    @classmethod
    def check_world(cls, options, world_size):
        if not _is_power_of_two(world_size):
            raise ValueError(f"wagma needs a power-of-two number of workers, got {world_size}")
        size = options.group_size or default_group_size(world_size)
        if not _is_power_of_two(size) or size > world_size:
            raise ValueError(f"group_size must be a power of two no larger than the "
                             f"{world_size} workers, got {size}")

    def setup(self, ctx):
        super().setup(ctx)
        n = ctx.world_size
        self.check_world(self.options, n)
        self.group_size = self.options.group_size or default_group_size(n)
        self.vector = ModelVector(ctx, self.options.sync_buffers)
        self.lock = threading.Condition()
        # Guarded by `lock`: what the other workers know of this worker's model, what the
        # training loop last synchronised with, and the round bookkeeping.
        self.published = self.vector.read()
        self.base = self.published
        self.fresh = False        # a newly published model no round has used yet
        self.arrivals = 0         # models published by the training loop
        self.arrivals_used = 0    # the latest arrival a completed round used
        self.max_staleness, self.rounds_done = 0, 0
        self.training_done = False  # then its final model stands in as fresh in every round
        self.error: BaseException | None = None
        self.thread = None
        if n == 1:
            return
        self.peers_group = ctx.comm.new_group(range(n), backend="gloo")
        self.global_group = ctx.comm.new_group(range(n), backend="gloo")
        self.thread = threading.Thread(target=self._serve, daemon=True,
                                       name=f"wagma-{ctx.rank}")
        self.thread.start()

    # -- the training loop ----------------------------------------------------------------------

    def before_forward(self, step):
        self._check()
        with self.lock:
            self._sync_locked()

    def after_step(self, step):
        if self.thread is None:
            return
        with self.lock:
            self._publish_locked()
            self.fresh = True
            self.arrivals += 1
            arrival = self.arrivals
            self.lock.notify_all()
        started = time.perf_counter()
        with self.ctx.comm.blocked(), self.lock:
            while self.arrivals_used < arrival and self.error is None:
                self.lock.wait(timeout=0.1)
            self._sync_locked()
            staleness, rounds = self.max_staleness, self.rounds_done
            self.max_staleness, self.rounds_done = 0, 0
        self._check()
        metrics = self.ctx.metrics
        # In modeled seconds, as every recorded time (the compute model's time scale).
        metrics.log("wait_seconds", (time.perf_counter() - started) / self.ctx.length.time_scale)
        metrics.log("staleness", staleness)
        metrics.log("rounds", rounds)

    def finish(self):
        if self.thread is None:
            return
        with self.lock:
            self._publish_locked()
            self.training_done = True
            self.lock.notify_all()
        while self.thread.is_alive():
            self.thread.join(timeout=0.1)
            self._check()
        self._check()
        with self.lock:
            self._sync_locked()

    def _sync_locked(self) -> None:
        """Bring the rounds completed since the last sync into the model: x <- P + (x - base)."""
        if self.published is not self.base:
            current = self.vector.read()
            self.vector.write(self.published + (current - self.base))
            self.base = self.published

    def _publish_locked(self) -> None:
        """Make the model, with every completed round brought in, what the peers will get."""
        self._sync_locked()
        self.published = self.base = self.vector.read()

    def _check(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"wagma round thread failed: {self.error!r}") from self.error

    # -- the round thread ---------------------------------------------------------------------

    def _serve(self) -> None:
        try:
            with self.ctx.comm.background():
                _Rounds(self).run()
        except BaseException as error:  # raised in the training loop by _check
            with self.lock:
                self.error = error
                self.lock.notify_all()


class _Rounds:
    """The rounds of one worker, in order, on its background thread; a second thread receives
    the peers' models (gloo can wait for a receive from any rank, not poll it)."""

    def __init__(self, wagma: WAGMA):
        self.wagma = wagma
        self.comm = wagma.ctx.comm
        self.rank, self.n = wagma.ctx.rank, wagma.ctx.world_size
        self.inbox: dict[int, dict[int, torch.Tensor]] = {}  # round -> sender -> model
        self.last_fresh_round = 0
        self.arrival: int | None = None
        self.receiver = threading.Thread(target=self._receive, daemon=True,
                                         name=f"wagma-receiver-{self.rank}")
        self.receiver.start()

    def run(self) -> None:
        """Rounds in order until a global round finds every worker's training finished.

        A worker whose training has finished keeps taking part with its final model, and
        starts every round itself, so peers still training are never left waiting for it."""
        round_index = 0
        while True:
            if (round_index + 1) % self.wagma.options.tau == 0:
                self._wait_for(round_index, peer_may_start=False)
                if self._global_round(round_index):
                    break
            else:
                self._wait_for(round_index, peer_may_start=True)
                self._group_round(round_index)
            round_index += 1
        self._goodbye()

    def _receive(self) -> None:
        """Stash every peer's model by round until the goodbye from rank - 1."""
        wagma = self.wagma
        try:
            with self.comm.background():
                while True:
                    buffer = wagma.vector.empty(HEADER, device="cpu")
                    self.comm.irecv(buffer, None, wagma.peers_group).wait()
                    round_index, sender = int(buffer[0]), int(buffer[1])
                    if round_index < 0:
                        return
                    with wagma.lock:
                        self.inbox.setdefault(round_index, {})[sender] = buffer[HEADER:]
                        wagma.lock.notify_all()
        except BaseException as error:
            with wagma.lock:
                wagma.error = error
                wagma.lock.notify_all()

    def _wait_for(self, round_index: int, peer_may_start: bool) -> None:
        """Until this worker has a fresh model (or has finished training) or, when
        `peer_may_start`, a peer has started the round (and `patience` has run out)."""
        wagma = self.wagma
        patience_until = None
        with wagma.lock:
            while wagma.error is None:
                if wagma.fresh or wagma.training_done:
                    return
                timeout = None
                if peer_may_start and self.inbox.get(round_index):
                    if patience_until is None:
                        # patience is modeled: real seconds are time_scale times longer
                        patience_until = (time.perf_counter() + wagma.options.patience
                                          * wagma.ctx.length.time_scale)
                    timeout = patience_until - time.perf_counter()
                    if timeout <= 0:
                        return
                wagma.lock.wait(timeout=timeout)
            raise RuntimeError("wagma receiver failed") from wagma.error

    def _contribute(self, round_index: int) -> tuple[torch.Tensor, int]:
        """The model this worker brings to a round, and its staleness in rounds."""
        wagma = self.wagma
        with wagma.lock:
            model = wagma.published
            self.arrival = None
            if wagma.fresh:
                self.last_fresh_round = round_index
                wagma.fresh = False
                self.arrival = wagma.arrivals
            if wagma.training_done:
                return model, 0
            staleness = round_index - self.last_fresh_round
            wagma.max_staleness = max(wagma.max_staleness, staleness)
        return model, staleness

    def _group_round(self, round_index: int) -> None:
        wagma = self.wagma
        mine, staleness = self._contribute(round_index)
        members = group_of(self.rank, round_index, self.n, wagma.group_size)
        peers = [r for r in members if r != self.rank]
        message = wagma.vector.empty(HEADER, device="cpu")
        message[:HEADER] = torch.tensor([round_index, self.rank, staleness])
        message[HEADER:] = to_wire(mine)
        sends = [self.comm.isend(message, peer, wagma.peers_group) for peer in peers]
        with wagma.lock:
            while len(self.inbox.get(round_index, {})) < len(peers) and wagma.error is None:
                wagma.lock.wait()
            if wagma.error is not None:
                raise RuntimeError("wagma receiver failed") from wagma.error
            theirs = self.inbox.pop(round_index)
        for handle in sends:
            handle.wait()
        # Every member sums the same models in rank order, so all get the same average.
        models = {self.rank: to_wire(mine), **theirs}
        average = sum(models[r] for r in members) / len(members)
        self._complete(mine, average.to(mine.device))

    def _global_round(self, round_index: int) -> bool:
        """The synchronous average of everyone; True when every worker's training is over."""
        wagma = self.wagma
        mine, _ = self._contribute(round_index)
        with wagma.lock:
            finished = wagma.training_done
        # The last entry is the share of workers whose training is over (exactly 1 if all).
        message = torch.cat([to_wire(mine), torch.tensor([float(finished)], dtype=mine.dtype)])
        self.comm.all_reduce(message, "avg", group=wagma.global_group)
        self._complete(mine, message[:-1].to(mine.device))
        return float(message[-1]) == 1.0

    def _complete(self, mine: torch.Tensor, average: torch.Tensor) -> None:
        wagma = self.wagma
        with wagma.lock:
            if wagma.published is mine:  # unchanged during the round: exactly the average
                wagma.published = average
            else:  # the training loop published meanwhile: move its model by the same amount
                wagma.published = wagma.published + (average - mine)
            if self.arrival is not None:
                wagma.arrivals_used = self.arrival
            wagma.rounds_done += 1
            wagma.lock.notify_all()

    def _goodbye(self) -> None:
        """Every worker sends one goodbye to rank + 1, which ends that rank's receiver. No
        round message is in flight: every worker has completed the same last round."""
        bye = self.wagma.vector.empty(HEADER, device="cpu").zero_()
        bye[0] = -1
        self.comm.isend(bye, (self.rank + 1) % self.n, self.wagma.peers_group).wait()
        self.receiver.join()
