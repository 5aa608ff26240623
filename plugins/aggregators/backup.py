"""`backup`: synchronous SGD with backup workers (Chen, Pan, Monga, Bengio, Jozefowicz,
"Revisiting Distributed Synchronous SGD", 2016).

n = N + b workers compute gradients on the same model version; each step's update is the
average of the first N gradients to arrive, and the b late ones are dropped. As in the paper a
parameter server collects the gradients: here a coordinator thread on rank 0, beside its
training loop, so that a slow rank 0 does not slow the coordination.

Step s, as worker i sees it (its model has had s updates applied):

1. it computes its gradient on x_s, then asks how many updates the coordinator has published;
   if update s is already out, its gradient is stale and it is dropped without being sent;
   otherwise it sends (s, g_i) to the coordinator;
2. it receives every update up to the newest published one (at least update s) and applies
   them in order with its optimizer, so a late worker skips straight to the newest model
   instead of holding anyone up. Every worker applies the same updates in the same order from
   the same start, so models stay identical.

The coordinator closes step s when N gradients for s have arrived: it sends their average
(and who contributed) to every worker, and ignores gradients for closed steps. The run's length
is counted in updates: the coordinator marks the update that ends the run (the epochs' step
count, or the budget spent), and each worker stops once it has applied that one.

Rank 0's own gradient reaches the coordinator at the same emulated network cost as any
other rank's (its bytes counted, the send taking the emulated time), so sitting beside the
coordinator does not put it among the first N.

Per step each worker logs `dropped_own` (1 when its own gradient was dropped or skipped as
stale) and `updates_applied` (more than 1 when it caught up). The run's summary has, per rank
r, `dropped_rank{r}`: how many of the run's updates were made without r's gradient (together
b per update). With `backups: 0` it is synchronous SGD: every update averages all n
gradients, as `allreduce` does.

Under `failures` (failure_mode "continue", docs/failures.md) a worker whose node is down
computes nothing: instead of its gradient it tells the coordinator it is absent (an untracked
control message of the emulation), so its gradient is one more dropped. The coordinator closes
a step with the first N gradients, or with every live worker's when fewer than N are up, and
averages those it closed with. A down worker still receives every update and applies it
itself (the runtime makes no optimizer step for it): when it rejoins it holds the newest
model and optimizer state, as if taken from a live peer. The coordinator thread on rank 0 is
assumed to survive rank 0's failures (a parameter server on its own machine).
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass

import torch

from dsgd_cli.api import Aggregator, AggregatorOptions, flatten, option

GRADIENT, DONE, ABSENT = 1.0, 0.0, 2.0
REQUEST_HEADER = 3  # kind, sender, step
UPDATE_HEADER = 2   # step, final (then one 0/1 per rank: who contributed)


@dataclass
class BackupOptions(AggregatorOptions):
    backups: int = option(1, min=0, help="gradients dropped per step: the b slowest (b < workers)")


@dataclass
class _Update:
    step: int
    final: bool
    contributors: list[int]
    average: torch.Tensor


class Backup(Aggregator):
    Options = BackupOptions
    asynchronous = True      # no worker waits for the slowest
    steps_may_differ = True  # late workers skip steps
    decides_stop = True      # the coordinator counts the run's updates
    failure_mode = "continue"  # a failed worker's gradient is one more dropped
    instances = 0            # per process: names this instance's shared counter

    @classmethod
    def check_world(cls, options, world_size):
        if options.backups >= world_size:
            raise ValueError(f"backups must be smaller than the number of workers "
                             f"({world_size}), got {options.backups}")

    def setup(self, ctx):
        super().setup(ctx)
        n = ctx.world_size
        self.params = ctx.parameters()
        self.numel = sum(p.numel() for p in self.params)
        self.dtype = self.params[0].dtype if self.params else torch.float32
        self.group = ctx.comm.new_group(range(n), backend="gloo") if n > 1 else None
        Backup.instances += 1  # every rank builds its aggregators in the same order
        self.published = ctx.comm.counter(
            f"{ctx.experiment_name}/backup{Backup.instances}/published")
        self.applied = 0  # updates applied: this worker's model version
        self.dropped = [0] * n  # per rank: the applied updates made without its gradient
        self._finished = False
        self.coordinator = None
        if ctx.rank == 0:
            self.coordinator = _Coordinator(self, needed=n - self.options.backups)
            self.coordinator.start()
        else:
            self.update_buffer = torch.empty(UPDATE_HEADER + n + self.numel, dtype=self.dtype)

    def finished(self) -> bool:
        return self._finished

    def updates_done(self) -> int:
        """The run's updates as this worker knows them: its model version, which after each
        step includes every update published by then."""
        return self.applied

    def after_backward(self, step):
        version = self.applied
        grad = flatten([p.grad if p.grad is not None else torch.zeros_like(p)
                        for p in self.params]).to("cpu", self.dtype)
        published = self._published_count()
        up = getattr(self.ctx, "up", True)
        sent = up and published <= version  # else update `version` is out: the gradient is stale
        if sent:
            self._send(GRADIENT, version, grad)
        elif not up and published <= version:
            self._send_absent(version)
        updates = [self._receive() for _ in range(max(version + 1, published) - version)]
        # Catching up: all but the last applied here; a down worker applies the last one too
        # (the runtime makes no optimizer step for it).
        for update in updates if not up else updates[:-1]:
            self._set_grads(update)
            self.ctx.optimizer.step()
        if up:
            self._set_grads(updates[-1])  # the runtime's optimizer step applies it
        else:
            self.ctx.optimizer.zero_grad(set_to_none=True)
        self.applied += len(updates)
        self._finished = any(update.final for update in updates)
        for update in updates:
            for rank in set(range(self.ctx.world_size)) - set(update.contributors):
                self.dropped[rank] += 1
        own = updates[0]  # the update this worker's gradient was meant for
        self.ctx.metrics.log("dropped_own", 0.0 if sent and self.ctx.rank in own.contributors
                             else 1.0)
        self.ctx.metrics.log("updates_applied", len(updates))

    def run_totals(self) -> dict[str, float]:
        return {f"dropped_rank{rank}": float(count) for rank, count in enumerate(self.dropped)}

    def state_dict(self) -> dict:
        return {"applied": self.applied, "dropped": list(self.dropped)}

    def load_state_dict(self, state: dict) -> None:
        """Go on from update `applied`. Every worker must have applied the same updates: the
        updates between two versions are not in any checkpoint, so a worker behind could not
        catch up (with no gradient dropped before the checkpoint, versions agree)."""
        self.applied = state["applied"]
        self.dropped = list(state.get("dropped", [0] * self.ctx.world_size))
        versions = torch.tensor([self.applied, -self.applied], dtype=torch.float64)
        with self.ctx.comm.untracked():
            self.ctx.comm.all_reduce(versions, "max", group=self.group)
        newest, oldest = int(versions[0]), -int(versions[1])
        if newest != oldest:
            raise ValueError(f"backup cannot resume from this checkpoint: its workers had "
                             f"applied between {oldest} and {newest} updates (a late worker's "
                             f"gradients were dropped before it)")
        if self.coordinator is not None:
            self.coordinator.published = self.coordinator.first_step = self.applied
            self.published.add(self.applied)

    def finish(self):
        self._send(DONE, self.applied, None)
        if self.coordinator is not None:
            self.coordinator.join()

    # -- talking to the coordinator -----------------------------------------------------------

    def _published_count(self) -> int:
        if self.coordinator is not None:
            return self.coordinator.published
        return self.published.value()

    def _send(self, kind: float, step: int, grad: torch.Tensor | None) -> None:
        message = torch.zeros(REQUEST_HEADER + self.numel, dtype=self.dtype)
        message[:REQUEST_HEADER] = torch.tensor([kind, self.ctx.rank, step])
        if grad is not None:
            message[REQUEST_HEADER:] = grad
        if self.coordinator is None:
            self.ctx.comm.send(message, 0, self.group)
            return
        # The same message and emulated cost as a remote rank's, handed over in-process.
        self.ctx.comm.send_within_process(message)
        self.coordinator.inbox.put((kind, 0, step, message[REQUEST_HEADER:]))

    def _send_absent(self, step: int) -> None:
        """Tell the coordinator this worker is down for `step`: no gradient will come. A
        message of the emulation, not of the algorithm: untracked, no bytes, no time."""
        if self.coordinator is not None:
            self.coordinator.inbox.put((ABSENT, 0, step, None))
            return
        message = torch.zeros(REQUEST_HEADER + self.numel, dtype=self.dtype)
        message[:REQUEST_HEADER] = torch.tensor([ABSENT, self.ctx.rank, step])
        with self.ctx.comm.untracked():
            self.ctx.comm.send(message, 0, self.group)

    def _receive(self) -> _Update:
        if self.coordinator is not None:
            with self.ctx.comm.blocked():
                update = self.coordinator.outbox.get()
            self.coordinator.check()
            return update
        buffer = self.ctx.comm.recv(self.update_buffer, 0, self.group)
        return _parse_update(buffer, self.ctx.world_size)

    def _set_grads(self, update: _Update) -> None:
        """The update's average as the gradients; none when nobody contributed (every
        worker down: the optimizer step then leaves the model alone)."""
        if not update.contributors:
            self.ctx.optimizer.zero_grad(set_to_none=True)
            return
        average = update.average
        average = average.to(self.params[0].device) if self.params else average
        offset = 0
        for p in self.params:
            p.grad = average[offset: offset + p.numel()].view_as(p).to(p.dtype)
            offset += p.numel()


def _parse_update(buffer: torch.Tensor, n: int) -> _Update:
    step, final = (int(v) for v in buffer[:UPDATE_HEADER].tolist())
    mask = buffer[UPDATE_HEADER: UPDATE_HEADER + n].tolist()
    return _Update(step, bool(final), [r for r, bit in enumerate(mask) if bit],
                   buffer[UPDATE_HEADER + n:].clone())


class _Coordinator(threading.Thread):
    """Rank 0's coordinator: closes each step with the first `needed` gradients for it."""

    def __init__(self, backup: Backup, needed: int):
        super().__init__(daemon=True, name="backup-coordinator")
        self.backup, self.needed = backup, needed
        self.comm, self.n = backup.ctx.comm, backup.ctx.world_size
        self.inbox: queue.Queue = queue.Queue()   # messages from every rank
        self.outbox: queue.Queue = queue.Queue()  # rank 0's updates
        self.published = 0  # updates sent; read by rank 0's training loop
        self.first_step = 0  # the first update to close (a resumed run's version)
        self.error: BaseException | None = None

    def check(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"backup coordinator failed: {self.error!r}") from self.error

    def join(self, timeout=None):
        super().join(timeout)
        self.check()

    def run(self) -> None:
        try:
            with self.comm.background():
                self._coordinate()
        except BaseException as error:  # re-raised in the training loop by check()
            self.error = error
            self.outbox.put(None)

    def _receive_remote(self) -> None:
        """Feeds the other ranks' messages into the inbox until each has sent DONE (gloo can
        only wait for a receive from any rank, not poll it: hence a thread of its own)."""
        backup = self.backup
        try:
            with self.comm.background():
                running = self.n - 1
                while running:
                    buffer = torch.empty(REQUEST_HEADER + backup.numel, dtype=backup.dtype)
                    self.comm.irecv(buffer, None, backup.group).wait()
                    kind, sender, step = (int(v) for v in buffer[:REQUEST_HEADER].tolist())
                    self.inbox.put((kind, sender, step, buffer[REQUEST_HEADER:]))
                    running -= kind == DONE
        except BaseException as error:
            self.inbox.put(error)

    def _messages(self):
        """(kind, sender, step, gradient) from every rank until all have sent DONE."""
        receiver = threading.Thread(target=self._receive_remote, daemon=True,
                                    name="backup-receiver")
        receiver.start()
        running = self.n
        while running:
            message = self.inbox.get()
            if isinstance(message, BaseException):
                raise message
            running -= message[0] == DONE
            yield message
        receiver.join()

    def _coordinate(self) -> None:
        step, total, contributors, absent, closed = None, None, [], 0, False
        sends = []  # updates in flight to remote workers: a slow one receives them late
        for kind, sender, gradient_step, gradient in self._messages():
            if step is None:  # set by now: messages come once training has begun
                step = self.first_step
            if kind == DONE or closed or gradient_step != step:
                continue  # a stale gradient: its step was closed without it
            if kind == ABSENT:  # a down worker (failures): no gradient will come from it
                absent += 1
            else:
                total = gradient.clone() if total is None else total.add_(gradient)
                contributors.append(sender)
            # The first N gradients; with more than b workers down, every live one's.
            if len(contributors) < min(self.needed, self.n - absent):
                continue
            final = self._run_ends_after(step + 1)
            average = total / len(contributors) if contributors else torch.zeros(
                self.backup.numel, dtype=self.backup.dtype)
            self._publish(_Update(step, final, sorted(contributors), average), sends)
            sends = [handle for handle in sends if not handle.is_completed()]
            step, total, contributors, absent, closed = step + 1, None, [], 0, final
        for handle in sends:
            handle.wait()

    def _run_ends_after(self, updates: int) -> bool:
        length = self.backup.ctx.length
        if length.steps is not None:
            return updates >= length.steps
        return length.spent()

    def _publish(self, update: _Update, sends: list) -> None:
        backup = self.backup
        message = torch.zeros(UPDATE_HEADER + self.n + backup.numel, dtype=backup.dtype)
        message[:UPDATE_HEADER] = torch.tensor([update.step, float(update.final)])
        if update.contributors:
            message[UPDATE_HEADER + torch.tensor(update.contributors)] = 1.0
        message[UPDATE_HEADER + self.n:] = update.average
        for rank in range(1, self.n):
            sends.append(self.comm.isend(message, rank, backup.group))
        self.outbox.put(update)
        self.published += 1
        backup.published.add(1)  # after the sends are issued: a reader may then receive
