"""`wagma`: WAGMA-SGD, wait-avoiding group model averaging (Li, Ben-Nun, Nadiradze,
Di Girolamo, Dryden, Alistarh, Hoefler, TPDS 2021).

Iteration t of every worker ends with round t: its model is averaged inside a group of
`group_size` (S) workers. The groups change every round: rank i's group in round t is every
rank that differs from i only in the log2 S bits starting at bit (t · log2 S) mod log2 n (a
butterfly whose mask shifts each round), so after ⌈log_S n⌉ consecutive rounds information
from every worker has reached every other. Every `tau`-th round ((t + 1) % tau == 0) is global
and synchronous: every worker contributes its model of iteration t, which bounds staleness by
tau - 1.

Rounds are one-to-one with iterations, as in the paper: the group collective of iteration t
is one collective, run once. It is wait-avoiding: the first member to reach t starts it, and a
member still computing an earlier iteration is drawn in at once and contributes its latest
published model (stale by `staleness` iterations); when that member reaches t it takes round
t's result instead of starting a round for its fresh model. A straggler may so take part in
several rounds during one of its steps and in none during a later one; over the run every
worker takes part in as many rounds as the run has iterations. Each worker runs a background
thread that takes part in its rounds, in order:

* when its training loop finishes step t and round t has not started, the worker publishes
  its model and the thread starts round t with it; the loop waits for round t only
  (`wait_seconds`), and not at all when round t is already over;
* when a peer's first message of round t arrives first, the thread joins round t at once
  with the worker's latest published model. Every member sends before it waits, so a member
  that started a round draws each partner in, and they draw in theirs.

A group averages its S models with an all-reduce inside the group, shaped as the paper's
group allreduce: a reduce-scatter by recursive halving, then an all-gather by recursive
doubling (log2 S exchanges each, with the member whose group index differs in one bit); a
global round is the same with S = n. Each member sends, and receives, 2(S - 1)/S of a model
per round, plus a 4-number header per message (2 log2 S messages). Each part of the average is
summed and divided once, by the member that owns it, so every member leaves the round with the
same average A; a member that contributed P applies A + (x - P) to its current model x,
keeping the local progress made since P was published (its step, when it published during
the round).

The run's rounds are its iterations: when workers stop after different numbers of steps (a
budget), one that has stopped takes part with its final model in the rounds of the others,
and in `finish()` the workers agree on the last round (the most steps any took).

`patience` (seconds, default 0: the paper's behaviour) lets a member drawn into a group round
by a peer wait that long for its own fresh model before contributing a stale one; with a large
patience and S = n, wagma is local SGD with period 1.

Logs per step `wait_seconds`, `staleness` (the largest age, in iterations, of the models this
worker contributed since its previous step) and `rounds` (rounds it completed since its
previous step).
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass

import torch

from dsgd_cli.api import Aggregator, AggregatorOptions, option

from plugins.aggregators.gossip.vector import ModelVector, to_wire

HEADER = 4  # round, sender, exchange, length of the part; a negative round says goodbye


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


def partners(rank: int, world_size: int) -> list[int]:
    """The ranks `rank` exchanges with in some round: those differing from it in one bit."""
    return [rank ^ (1 << bit) for bit in range(world_size.bit_length() - 1)]


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
        self.steps = 0              # steps the training loop has published: iterations done
        self.rounds_completed = 0   # rounds 0..rounds_completed-1 are over (round t: iteration t)
        self.last_contributed = -1  # the latest round this worker's model went into
        self.last_round: int | None = None  # the run's last round, agreed in finish()
        self.training_done = False  # then its final model stands in as fresh in every round
        self.max_staleness, self.rounds_reported = 0, 0
        self.error: BaseException | None = None
        self.thread = None
        if n == 1:
            return
        # The rounds' messages go on the world, beside the training loop's collectives (gloo
        # keeps messages and collectives apart), and the thread takes part in no collective:
        # no group of its own, since each gloo group runs a thread that wakes every 10 ms
        # (at 1,024 workers, a group of everyone costs two thirds of a core doing nothing).
        self.rounds = _Rounds(self)
        self.thread = threading.Thread(target=self._serve, daemon=True,
                                       name=f"wagma-{ctx.rank}")
        self.thread.start()

    def state_dict(self) -> dict:
        """The iterations done: a resumed run's rounds go on from there, on every worker."""
        return {"steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        # Before the first step: the round thread has taken part in no round yet, and moves on
        # to the round of the resumed iteration.
        with self.lock:
            self.steps = self.rounds_completed = self.rounds_reported = state["steps"]
            self.lock.notify_all()

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
            self.steps += 1
            self.lock.notify_all()
        started = time.perf_counter()
        with self.ctx.comm.blocked(), self.lock:
            # Round `steps - 1` is this iteration's: started with the model just published,
            # or already over (drawn in earlier), when its result is taken as it is.
            while self.rounds_completed < self.steps and self.error is None:
                self.lock.wait()  # notified by the round thread, also when it fails
            self._sync_locked()
            staleness, rounds = self.max_staleness, self.rounds_completed - self.rounds_reported
            self.max_staleness, self.rounds_reported = 0, self.rounds_completed
        self._check()
        metrics = self.ctx.metrics
        # In modeled seconds, as every recorded time.
        metrics.log("wait_seconds", self.ctx.clock.modeled_since(started))
        metrics.log("staleness", staleness)
        metrics.log("rounds", rounds)

    def finish(self):
        if self.thread is None:
            return
        with self.lock:
            self._publish_locked()
            self.training_done = True
            self.lock.notify_all()
        # The run's last round is the last iteration of the worker that took the most steps;
        # meanwhile the thread takes part in the rounds of workers still training.
        steps = torch.tensor([float(self.steps)], dtype=torch.float64)
        self.ctx.comm.all_reduce(steps, "max")
        with self.lock:
            self.last_round = int(steps.item()) - 1
            self.lock.notify_all()
        while self.thread.is_alive():
            self.thread.join(timeout=1.0)
            self._check()
        self._check()
        with self.ctx.comm.background():
            self.rounds.goodbye()
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
                self.rounds.run()
        except BaseException as error:  # raised in the training loop by _check
            with self.lock:
                self.error = error
                self.lock.notify_all()


class _Rounds:
    """The rounds of one worker, in order, on its background thread; one more thread per
    partner receives that partner's messages (gloo can wait for a receive, not poll it).

    Every message comes from a partner: a rank that differs from this one in one bit, in a
    butterfly group's recursive halving and doubling as in the group of all. A receive named
    by its source keeps gloo's connections to these log2 n partners: a receive from any member
    of the group would connect every pair of the n workers."""

    def __init__(self, wagma: WAGMA):
        self.wagma = wagma
        self.comm = wagma.ctx.comm
        self.rank, self.n = wagma.ctx.rank, wagma.ctx.world_size
        # round -> (sender, exchange) -> part of a model
        self.inbox: dict[int, dict[tuple[int, int], torch.Tensor]] = {}
        self.latest_round_seen = -1  # in a peer's message: rounds up to it are the run's
        self.partners = partners(self.rank, self.n)
        self.receivers = [threading.Thread(target=self._receive, args=(partner,), daemon=True,
                                           name=f"wagma-receiver-{self.rank}-from-{partner}")
                          for partner in self.partners]
        for receiver in self.receivers:
            receiver.start()

    def run(self) -> None:
        """Rounds in order, from the iteration the run starts at to its last one."""
        while (round_index := self._wait_for_next()) is not None:
            if self._is_global(round_index):
                members = tuple(range(self.n))
            else:
                members = group_of(self.rank, round_index, self.n, self.wagma.group_size)
            mine = self._contribute(round_index)
            average = self._group_average(round_index, members, to_wire(mine))
            self._complete(mine, average.to(mine.device))

    def _is_global(self, round_index: int) -> bool:
        return (round_index + 1) % self.wagma.options.tau == 0

    def _receive(self, partner: int) -> None:
        """Stash every part `partner` sends, by round, until its goodbye."""
        wagma = self.wagma
        try:
            with self.comm.background():
                while True:
                    buffer = wagma.vector.empty(HEADER, device="cpu")
                    self.comm.irecv(buffer, partner,
                                    length=lambda message: HEADER + int(message[3])).wait()
                    round_index, sender, exchange, length = (int(v) for v in buffer[:HEADER])
                    if round_index < 0:
                        return
                    with wagma.lock:
                        self.latest_round_seen = max(self.latest_round_seen, round_index)
                        parts = self.inbox.setdefault(round_index, {})
                        parts[sender, exchange] = buffer[HEADER: HEADER + length]
                        wagma.lock.notify_all()
        except BaseException as error:
            with wagma.lock:
                wagma.error = error
                wagma.lock.notify_all()

    def _wait_for_next(self) -> int | None:
        """The next round, once this worker takes part in it: its training loop has published
        the round's iteration, or a peer has started the round (in a group round, once
        `patience` has run out), or, training over, the round is one of the run's: a peer has
        reached it or a later one (whose group needs this worker, while this round's group
        may be workers that have stopped too). None once the run's last round is past."""
        wagma = self.wagma
        patience_until = None
        with wagma.lock:
            while wagma.error is None:
                round_index = wagma.rounds_completed  # moved on by a resume's loaded state
                if wagma.last_round is not None:
                    return round_index if round_index <= wagma.last_round else None
                if wagma.steps > round_index:  # fresh: the loop finished this iteration
                    return round_index
                if wagma.training_done:
                    if self.latest_round_seen >= round_index:  # with the final model
                        return round_index
                    wagma.lock.wait()
                    continue
                started_by_peer = bool(self.inbox.get(round_index))
                timeout = None
                if started_by_peer and not self._is_global(round_index):
                    if patience_until is None:
                        # patience is modeled; the lock waits in real seconds
                        patience_until = wagma.ctx.clock.real_deadline(wagma.options.patience)
                    timeout = patience_until - time.perf_counter()
                    if timeout <= 0:
                        return round_index
                wagma.lock.wait(timeout=timeout)
            raise RuntimeError("wagma receiver failed") from wagma.error

    def _contribute(self, round_index: int) -> torch.Tensor:
        """The model this worker brings to round `round_index`: its latest published one,
        the model of iteration `steps - 1`, stale by round_index + 1 - steps iterations."""
        wagma = self.wagma
        with wagma.lock:
            wagma.last_contributed = round_index
            if not wagma.training_done:
                staleness = max(0, round_index + 1 - wagma.steps)
                wagma.max_staleness = max(wagma.max_staleness, staleness)
            wagma.lock.notify_all()
            return wagma.published

    def _group_average(self, round_index: int, members: tuple[int, ...],
                       model: torch.Tensor) -> torch.Tensor:
        """The average of the members' models: reduce-scatter by recursive halving, then
        all-gather by recursive doubling. The model is cut into S parts; part c ends up summed
        (in a fixed tree order) and divided by S at member c, which sends it to the others."""
        size, me = len(members), members.index(self.rank)
        exchanges = size.bit_length() - 1
        bounds = [model.numel() * c // size for c in range(size + 1)]  # part c: [bounds[c], bounds[c+1])
        total = model.clone()
        lo, hi = 0, size  # the parts this member is responsible for
        sends = []
        for k in range(exchanges):  # after exchange k: the sum over 2^(k+1) members
            half = size >> (k + 1)
            partner = members[me ^ half]
            mid = lo + half
            (keep_lo, keep_hi), (give_lo, give_hi) = (
                ((mid, hi), (lo, mid)) if me & half else ((lo, mid), (mid, hi)))
            sends.append(self._send_part(round_index, k, partner,
                                         total[bounds[give_lo]: bounds[give_hi]]))
            theirs = self._receive_part(round_index, k, partner)
            total[bounds[keep_lo]: bounds[keep_hi]] += theirs
            lo, hi = keep_lo, keep_hi
        total[bounds[lo]: bounds[hi]] /= size  # lo == me: this member's part, complete
        for k in reversed(range(exchanges)):  # gather the parts back, in the opposite order
            half = size >> (k + 1)
            partner = members[me ^ half]
            exchange = 2 * exchanges - 1 - k
            sends.append(self._send_part(round_index, exchange, partner,
                                         total[bounds[lo]: bounds[hi]]))
            theirs = self._receive_part(round_index, exchange, partner)
            # The partner holds as many parts as this member, just before or after them.
            if me & half:
                their_lo, their_hi, lo = lo - half, lo, lo - half
            else:
                their_lo, their_hi, hi = hi, hi + half, hi + half
            total[bounds[their_lo]: bounds[their_hi]] = theirs
        for handle in sends:
            handle.wait()
        return total

    def _send_part(self, round_index: int, exchange: int, peer: int, part: torch.Tensor):
        message = torch.empty(HEADER + part.numel(), dtype=part.dtype)
        message[:HEADER] = torch.tensor([round_index, self.rank, exchange, part.numel()])
        message[HEADER:] = part
        return self.comm.isend(message, peer)

    def _receive_part(self, round_index: int, exchange: int, peer: int) -> torch.Tensor:
        wagma = self.wagma
        key = (peer, exchange)
        with wagma.lock:
            while key not in self.inbox.get(round_index, {}) and wagma.error is None:
                wagma.lock.wait()
            if wagma.error is not None:
                raise RuntimeError("wagma receiver failed") from wagma.error
            parts = self.inbox[round_index]
            part = parts.pop(key)
            if not parts:
                del self.inbox[round_index]
        return part

    def _complete(self, mine: torch.Tensor, average: torch.Tensor) -> None:
        wagma = self.wagma
        with wagma.lock:
            if wagma.published is mine:  # unchanged during the round: exactly the average
                wagma.published = average
            else:  # the training loop published meanwhile: A + (x - P) keeps its progress
                wagma.published = wagma.published + (average - mine)
            wagma.rounds_completed += 1
            wagma.lock.notify_all()

    def goodbye(self) -> None:
        """From the training loop, once this worker's rounds are over: when every worker is
        past the run's last round no round message is in flight, and each sends one goodbye
        to each partner, which ends that partner's receiver of it."""
        self.comm.barrier()
        bye = torch.tensor([-1, self.rank, 0, 0], dtype=self.wagma.vector.dtype)
        sends = [self.comm.isend(bye, partner) for partner in self.partners]
        for handle in sends:
            handle.wait()
        for receiver in self.receivers:
            receiver.join()
