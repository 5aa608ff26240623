"""One worker's training loop: its steps in the order the plugin API documents (see api.py),
the log intervals' metrics, the evaluations due, checkpoints, and stopping when the run's
length is reached or the launcher asks."""

from __future__ import annotations

import errno
import math
import os
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from dsgd_cli.worker import checkpoint
from dsgd_cli.api import Task
from dsgd_cli.comm.communicator import Traffic
from dsgd_cli.comm.events import EventWriter, launcher_gone
from dsgd_cli.emulation.failures import emulate_failures
from dsgd_cli.emulation.stragglers import Straggling
from dsgd_cli.worker.data import augmentation_generator
from dsgd_cli.worker.parts import Worker


class NoSpaceLeft(OSError):
    """A file could not be written for lack of space on its filesystem."""

    def __str__(self) -> str:
        return self.args[0]


def out_of_space(error: BaseException, directory: str | Path) -> bool:
    """Whether `error` came from a full filesystem: an ENOSPC (or EDQUOT) anywhere in its
    chain (torch.save reports one as "unexpected pos N vs M"), or no free block left in
    `directory`'s filesystem."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        seen = seen.__cause__ or seen.__context__
    try:
        usage = os.statvfs(directory)
    except OSError:
        return False
    # root may write into the blocks a filesystem keeps for it; other users may not
    return (usage.f_bfree if os.geteuid() == 0 else usage.f_bavail) == 0


class Diverged(Exception):
    """The training loss became NaN or infinite."""

    def __init__(self, step: int, value: float):
        super().__init__(f"train_loss is {value} at step {step}")
        self.step, self.value = step, value


class LauncherGone(Exception):
    """The `dsgd run` that started this worker died without stopping it."""

    def __init__(self):
        super().__init__("the launcher (dsgd run) is gone")


class Stopped(Exception):
    """The launcher asked the workers to stop (the run was interrupted); this one saved a
    checkpoint after `step` and leaves."""

    def __init__(self, step: int):
        super().__init__(f"stopped after step {step}")
        self.step = step


class StopRequest:
    """The launcher's request to stop: a file it creates (`events.stop_path`)."""

    def __init__(self, stop_file: Path | None, namespace: str):
        self.stop_file, self.namespace = stop_file, namespace
        self.stop_at: int | None = None  # the step all workers stop after, once asked

    def stops_after(self, step: int) -> bool:
        """Whether this worker stops after `step`, `step` steps done. Once the launcher asks,
        the first worker to notice proposes to stop two steps later and the others take its
        proposal from the rendezvous store: workers in step are at most one step apart, so
        all of them can still stop after that same step, none waiting for a peer that left."""
        if self.stop_at is None:
            if self.stop_file is None or not self.stop_file.exists():
                return False
            store = dist.distributed_c10d._get_default_store()
            key = f"dsgd/stop_at/{self.namespace}"
            self.stop_at = int(store.compare_set(key, "", str(step + 2)))
        return step >= self.stop_at


@dataclass
class Totals:
    """What this worker did, for the end-of-run report."""

    train_seconds: float  # the steps' time, evaluation and checkpoints excluded
    samples: int
    bytes_sent: int
    reached_at: float | None  # see WorkerEvaluation.reached_at
    failures: dict | None = None  # the failure emulation's totals() under `failures`
    # On a cluster: bytes_sent split by the link level they crossed (cluster.LEVELS).
    sent_by_level: dict[str, int] | None = None


class TrainingLoop:
    """Trains one worker through one experiment: `run()` once."""

    def __init__(self, worker: Worker, events: EventWriter, stop: StopRequest,
                 check_each_step: bool | None = None):
        self.worker, self.events, self.stop = worker, events, stop
        self.recent_compute: deque[float] = deque(maxlen=16)  # forward+backward seconds
        # Reading a loss on the host waits for the device to finish the step's work. On the
        # CPU that costs nothing, and each step's loss is checked before its backward, so a
        # diverged worker stops at once, the steps before it kept. On a GPU the step's losses
        # stay on the device and are read once per log interval (`_check_interval`): the
        # host queues the next steps' work meanwhile. A divergence is then noticed at the
        # interval's end, its step still exact.
        self.check_each_step = (worker.device.type == "cpu" if check_each_step is None
                                else check_each_step)

    def run(self) -> Totals:
        """Train until this worker's last step, then let the aggregator finish and evaluate
        what the end of the run calls for."""
        worker, events = self.worker, self.events
        experiment, interval, evaluation = worker.experiment, worker.interval, worker.evaluation
        batch = experiment.batch_size
        steps_per_epoch = worker.steps_per_epoch
        events.write("start", total_steps=worker.stop_rule.expected_steps())
        step, samples, total_sent = 0, 0, 0
        sent_by_level: dict[str, int] = {}
        train_seconds, seconds_before = 0.0, 0.0
        resumed = worker.resumed
        if resumed is not None:  # go on where the checkpoint left off
            step, samples, total_sent = (resumed[k] for k in ("step", "samples", "total_sent"))
            sent_by_level = dict(resumed.get("total_sent_by_level") or {})
            train_seconds, seconds_before = resumed["train_seconds"], resumed["seconds"]
            evaluation.reached_at = resumed["reached_at"]
            interval.restore(resumed["interval"])
            if worker.padding is not None and resumed.get("padding") is not None:
                worker.padding.steps, worker.padding.overran_steps = resumed["padding"]
        with worker.comm.untracked():
            worker.comm.barrier()  # a common start: budgets in seconds count from here
        # The worker's clock (the events' too) counts from this common start, a resumed run
        # from its checkpoint's time: recorded `seconds`, `wall_seconds` and budgets in
        # seconds. What came before it (joining the process group, building the worker and
        # its warm-up step) is not the run's training time.
        clock = worker.ctx.clock
        clock.start(seconds_before)
        worker.ctx.length.started_at = clock.started_at
        done = worker.stop_rule.after_resume(step) if resumed is not None else False
        failures = None
        if experiment.failures is not None:
            # From the run's start as the clock was set, not `clock.elapsed()`, which is
            # already past it: a failure at time 0 (or at a resumed run's start) would be lost.
            failures = emulate_failures(worker, seconds_before, step, samples)
        order_epoch = None
        augments = type(worker.task).augment is not Task.augment  # else no generator per step
        while not done:
            epoch, b = divmod(step, steps_per_epoch)
            if epoch != order_epoch:  # on the model's device once an epoch, not every step
                order, order_epoch = worker.shard.indices(epoch).to(worker.device), epoch
            index = order[b * batch: (b + 1) * batch]
            x, y = worker.train_x[index], worker.train_y[index]
            if augments:
                x = worker.task.augment(x, augmentation_generator(experiment.seed, worker.rank,
                                                                  step))
            up = failures is None or failures.before_step(step)
            try:
                loss, step_seconds = self._step(step, x, y) if up else self._down_step(step)
            except Diverged:
                self._flush(step, epoch)  # the steps before it are sound: keep them
                raise
            if not self.check_each_step:  # the loss is read on the host once an interval
                interval.add_loss(loss)
            traffic = worker.comm.take_traffic()
            # Recorded times are modeled.
            step_seconds = clock.to_modeled(step_seconds)
            traffic.seconds = clock.to_modeled(traffic.seconds)
            total_sent += traffic.bytes_sent
            _add_levels(sent_by_level, traffic)
            samples += len(y) if up else 0
            train_seconds += step_seconds
            interval.add(float(loss) if self.check_each_step else None, step_seconds, traffic)
            step += 1
            if failures is not None:
                back_to = failures.after_step(step, samples)
                if back_to is not None:  # a failure: this step's metrics, then redo from there
                    self._flush(step, epoch)
                    step, samples = back_to
                    continue
            done = worker.stop_rule.after_step(step, len(y) if up else 0)
            end_of_epoch = b == steps_per_epoch - 1
            every = worker.checkpoint_every
            stopping = bool(every) and not done and self.stop.stops_after(step)
            checkpointing = bool(every) and not done and (step % every == 0 or stopping)
            # The last step's metrics wait for the aggregator's finish() (below).
            if not done and (step % experiment.log_interval == 0 or end_of_epoch):
                train_seconds += self._check_interval(step)
                self._flush(step, epoch)
                if launcher_gone():  # nobody reads the metrics, nobody would stop the run
                    raise LauncherGone()
            evaluation.after_step(step, epoch, end_of_epoch, done)
            if checkpointing:  # after the step's metrics and evaluation: resumes repeat neither
                self._save_checkpoint(step, {
                    "step": step, "samples": samples, "total_sent": total_sent,
                    "total_sent_by_level": dict(sent_by_level),
                    "train_seconds": train_seconds, "seconds": clock.elapsed(),
                    # real seconds, which versions before the clock resumed from
                    "elapsed": clock.to_real(clock.elapsed()),
                    "reached_at": evaluation.reached_at,
                    "interval": interval.state(),
                    "padding": (worker.padding.steps, worker.padding.overran_steps)
                    if worker.padding is not None else None})
            if stopping:
                raise Stopped(step)
        worker.aggregator.finish()
        # What was sent after the last step's counters were taken (finish() draining, a
        # background thread serving peers still training) counts in the last step, so that
        # the steps' bytes add up to the run's.
        drained = worker.comm.take_traffic()
        total_sent += drained.bytes_sent
        _add_levels(sent_by_level, drained)
        interval.add_bytes(drained)
        train_seconds += self._check_interval(step)
        self._flush(step, epoch)
        if launcher_gone():
            raise LauncherGone()
        evaluation.after_training(step, epoch)
        return Totals(train_seconds, samples, total_sent, evaluation.reached_at,
                      failures.totals() if failures is not None else None,
                      sent_by_level if worker.comm.cluster is not None else None)

    def _step(self, step: int, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, float]:
        """One training step in the loop's order; returns (loss, detached, and seconds)."""
        worker = self.worker
        started = time.perf_counter()
        padding, factor = worker.padding, 1.0
        if worker.straggling.active:
            # An emulated slower machine, counted in the step's (compute) time.
            factor = worker.straggling.factor(step)
            worker.interval.log("slowdown", factor)
            if padding is None:  # with a compute model, the padding applies the factor
                time.sleep(Straggling.delay(factor, self.recent_compute))
        worker.learning_rate.apply(step + 1)  # the schedule counts steps from 1
        worker.optimizer.zero_grad(set_to_none=True)
        worker.aggregator.before_forward(step)
        if padding is not None:
            padding.start(step, factor)
        compute_started = time.perf_counter()
        loss = worker.task.loss(worker.model(x), y)
        if self.check_each_step:
            value = float(loss.detach())
            if not math.isfinite(value):
                raise Diverged(step, value)
        loss.backward()
        self.recent_compute.append(time.perf_counter() - compute_started)
        if padding is not None:  # the forward/backward lasts its modeled time
            worker.interval.log("emulation_overrun", padding.finish())
        worker.ctx.loss = loss.detach()
        worker.aggregator.after_backward(step)
        worker.optimizer.step()
        worker.aggregator.after_step(step)
        return loss.detach(), time.perf_counter() - started

    def _down_step(self, step: int) -> tuple[torch.Tensor, float]:
        """A step of a worker whose node is down (`failures` under `continue`): no forward,
        backward or optimizer step, so nothing it computes counts. The aggregator's hooks
        still run, with `ctx.up` False and no gradients, so that the worker reaches every
        collective the algorithm requires while contributing nothing to it. The step's
        recorded loss repeats the worker's last one (its model has not trained since)."""
        worker = self.worker
        started = time.perf_counter()
        worker.learning_rate.apply(step + 1)
        worker.optimizer.zero_grad(set_to_none=True)
        worker.aggregator.before_forward(step)
        worker.aggregator.after_backward(step)
        worker.aggregator.after_step(step)
        last = worker.ctx.loss
        if last is None:
            last = torch.tensor(math.nan, device=worker.device)
        return last, time.perf_counter() - started

    def _check_interval(self, step: int) -> float:
        """Where losses stay on the device: read the interval's (one synchronisation) and
        raise Diverged at the first that is not finite; `step` steps are done. Returns the
        seconds the read waited, counted in the interval's step time (added to it here).

        Each step's time is the host's, which queues a GPU's work and goes on: the read
        waits for the device to finish what was queued, so under a measured clock that wait
        is the steps' time too (else samples/s would count queuing, not computing). Under a
        compute model the steps last their modeled time, and the wait is not theirs."""
        if self.check_each_step:
            return 0.0
        worker = self.worker
        counted = worker.interval.steps
        started = time.perf_counter()
        bad = worker.interval.read_losses()
        waited = 0.0
        if worker.padding is None:
            waited = worker.ctx.clock.to_modeled(time.perf_counter() - started)
            worker.interval.step_seconds += waited
        if bad is not None:
            index, value = bad
            diverged = step - counted + index
            if worker.interval.steps == index:  # it holds the steps before it: keep them
                self._flush(diverged, diverged // worker.steps_per_epoch)
            raise Diverged(diverged, value)
        return waited

    def _flush(self, step: int, epoch: int) -> None:
        self.worker.interval.flush(self.events, step, epoch,
                                   lr=self.worker.optimizer.param_groups[0]["lr"])
        self.events.write("progress", **vars(self.worker.stop_rule.progress_bar(step)))

    def _save_checkpoint(self, step: int, progress: dict) -> None:
        worker = self.worker
        state = {"progress": progress, "model": worker.model.state_dict(),
                 "optimizer": worker.optimizer.state_dict(),
                 "aggregator": worker.aggregator.state_dict(),
                 "compressor": worker.ctx.compressor.state_dict(),
                 "rng": checkpoint.rng_state(worker.device)}
        try:
            checkpoint.save(worker.checkpoint_dir, step, worker.rank, state, worker.world_size)
        except (OSError, RuntimeError) as error:
            if out_of_space(error, worker.checkpoint_dir):
                raise NoSpaceLeft(f"no space left on device for the checkpoint of step {step} "
                                  f"in {worker.checkpoint_dir}") from error
            raise


def _add_levels(sent_by_level: dict[str, int], traffic: Traffic) -> None:
    """Add `traffic`'s bytes per link level (on a cluster) to the run's."""
    for level, sent in (traffic.sent_by_level or {}).items():
        sent_by_level[level] = sent_by_level.get(level, 0) + sent
