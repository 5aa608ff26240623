"""Push-sum rounds on background threads, for OSGP.

Two threads per worker share its `PushSum` state with the training loop, under one lock:

* the sender runs rounds 0, 1, 2, ... in order. Round r splits off the shares of (x, w) for
  the out-peers of the topology at step r and sends them (blocking only this thread, which is
  where the emulated network time is spent). It starts round r when the training loop has
  taken a step since the last round it started itself, or when some in-peer has already sent
  round r ("follow"): a worker whose loop is busy, slow or parked at the runtime's end-of-epoch
  evaluation still takes part in its peers' rounds, so nobody waits for its computation.
* the receiver takes messages from any peer as they arrive and adds them to (x, w) at once.

Round r is complete at a worker once it has sent round r and received round r from every
in-peer. The delay bound (`wait_for_bound`): the state a worker has after step s must have
gone through a complete round by the end of step s + tau; the loop waits otherwise. Since
rounds are completed by the peers' threads, never by their training loops, this wait lasts at
most the network time of the rounds in flight.

Shutdown (`close`, every rank, from its training loop): stop starting rounds of one's own,
agree on the last round M = max over workers of the last round started (an all-reduce on the
world group), then every worker runs rounds up to M, so every message sent is received and
added, and sends one end-of-stream message to rank+1. A receiver stops after that end message
and exactly as many round messages as its in-peers send in rounds 0..M.
"""

from __future__ import annotations

import threading
import time
from collections import deque

import torch

from dsgd_cli.api import Comm, Group
from dsgd_cli.topology import Topology, push_weights

from plugins.aggregators.gossip.graph import in_degrees, messages_through
from plugins.aggregators.gossip.pushsum import (PushSum, end_message, is_end, message_buffer,
                                                 message_length)


class GossipStats:
    """What happened since the training loop last asked (read under the lock)."""

    def __init__(self):
        self.rounds = 0
        self.lag_sum = 0.0
        self.lag_count = 0

    def take(self) -> "GossipStats":
        taken = GossipStats()
        taken.rounds, taken.lag_sum, taken.lag_count = self.rounds, self.lag_sum, self.lag_count
        self.rounds, self.lag_sum, self.lag_count = 0, 0.0, 0
        return taken


class OverlapGossip:
    def __init__(self, comm: Comm, group: Group, topology: Topology, rank: int, state: PushSum):
        self.comm, self.group, self.topology, self.rank = comm, group, topology, rank
        self.state = state
        self.lock = threading.Condition()
        self.in_degrees = in_degrees(topology, rank)
        # All fields below are guarded by `lock`.
        self.steps = 0              # training steps taken so far (the loop's clock)
        self.next_round = 0         # the next round this worker's sender will run
        self.follow_to = -1         # highest round any in-peer has sent us
        self.pending = False        # the loop stepped since the sender last started a round of its own
        self.frozen = False         # closing: start no more rounds of one's own
        self.last_round: int | None = None  # agreed at shutdown
        self.sent_through = -1      # rounds 0..sent_through are sent
        self.completed = 0          # rounds 0..completed-1 are complete
        self.received: dict[int, int] = {}  # round -> messages received, for incomplete rounds
        self.started_at: deque[tuple[int, int]] = deque()  # (round, steps when it started)
        self.covered = 0            # the state after this many steps has been through a complete round
        self.stats = GossipStats()
        self.error: BaseException | None = None
        self._threads = [threading.Thread(target=self._guard, args=(loop,), daemon=True,
                                          name=f"osgp-{loop.__name__.strip('_')}-{rank}")
                         for loop in (self._send_loop, self._receive_loop)]
        for thread in self._threads:
            thread.start()

    # -- the training loop's side -----------------------------------------------------------

    def stepped(self) -> None:
        """The loop finished a step: let the sender start a round with the new state."""
        with self.lock:
            self.steps += 1
            self.pending = True
            self.lock.notify_all()

    def wait_for_bound(self, tau: int) -> float:
        """Block until the state of `tau` steps ago has been through a complete round (call it
        after `stepped`); returns the seconds waited."""
        started = time.perf_counter()
        with self.lock:
            self._check()
            if self.covered >= self.steps - tau:
                return 0.0
            with self.comm.blocked():
                while self.covered < self.steps - tau:
                    self.lock.wait()
                    self._check()
        return time.perf_counter() - started

    def close(self) -> None:
        """Finish every round any worker started, then stop both threads (all ranks call it)."""
        with self.lock:
            self.frozen = True
            last_started = torch.tensor([float(self.next_round - 1)], dtype=torch.float64,
                                        device=self.comm.device)
        self.comm.all_reduce(last_started, "max")  # the world group: the loops, not the threads
        with self.lock:
            self.last_round = int(last_started.item())
            self.lock.notify_all()
        for thread in self._threads:
            while thread.is_alive():
                thread.join(timeout=0.1)
                with self.lock:
                    self._check()
        with self.lock:
            self._check()

    # -- threads ------------------------------------------------------------------------------

    def _guard(self, loop) -> None:
        try:
            with self.comm.background():
                loop()
        except BaseException as error:  # handed to the training loop, which raises it
            with self.lock:
                self.error = error
                self.lock.notify_all()

    def _send_loop(self) -> None:
        comm, rank = self.comm, self.rank
        while True:
            with self.lock:
                while not self._finished_sending() and not self._may_start_round():
                    self.lock.wait()
                if self._finished_sending():
                    break
                round_ = self.next_round
                self.next_round += 1
                self.started_at.append((round_, self.steps))
                messages = self.state.emit(push_weights(self.topology, rank, round_), rank,
                                           round_, self.steps)
            handles = [comm.isend(message, peer, self.group) for peer, message in messages.items()]
            for handle in handles:
                handle.wait()
            with self.lock:
                self.sent_through = round_
                self._advance()
        # After every round message this worker sends to rank+1, so it arrives last from us.
        end = end_message(self.state.numerator.dtype, rank)
        comm.isend(end, (rank + 1) % comm.world_size, self.group).wait()

    def _receive_loop(self) -> None:
        comm, state = self.comm, self.state
        buffer = message_buffer(state.numerator.numel(), state.numerator.dtype)
        received, ended, expected = 0, False, None
        while True:
            with self.lock:
                if ended:
                    while self.last_round is None:
                        self.lock.wait()
                    expected = messages_through(self.in_degrees, self.last_round)
                if ended and received == expected:
                    return
            comm.irecv(buffer, None, self.group, length=message_length).wait()
            if is_end(buffer):
                ended = True
                continue
            with self.lock:
                info = state.absorb(buffer)
                received += 1
                self.received[info.round] = self.received.get(info.round, 0) + 1
                self.follow_to = max(self.follow_to, info.round)
                self.stats.lag_sum += self.steps - info.step
                self.stats.lag_count += 1
                self._advance()

    # -- helpers (called with the lock held) --------------------------------------------------

    def _finished_sending(self) -> bool:
        return self.last_round is not None and self.next_round > self.last_round

    def _may_start_round(self) -> bool:
        if self.last_round is not None:
            return self.next_round <= self.last_round
        if self.follow_to >= self.next_round:
            return True
        if self.pending and not self.frozen:
            self.pending = False
            return True
        return False

    def _advance(self) -> None:
        """Mark the rounds that are now complete and wake whoever waits for them."""
        while (self.completed <= self.sent_through
               and self.received.get(self.completed, 0)
               == self.in_degrees[self.completed % len(self.in_degrees)]):
            self.received.pop(self.completed, None)
            self.completed += 1
            self.stats.rounds += 1
        while self.started_at and self.started_at[0][0] < self.completed:
            self.covered = max(self.covered, self.started_at.popleft()[1])
        self.lock.notify_all()

    def _check(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"osgp gossip thread failed: {self.error!r}") from self.error
