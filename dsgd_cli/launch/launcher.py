"""Runs experiments: one torchrun per launch (consecutive experiments that can share its
workers), events tailed into the results store.

The launcher is the only writer of the database. For each run it records the configuration,
tells the launch's workers what to run (the plan; torchrun.py starts and stops torchrun),
stores metrics as workers flush them and draws a progress bar from rank 0's. When a worker
fails, torchrun stops the others; the run is marked failed with the rank and reason of the
first error, keeping every metric already stored. When a worker reports that training
diverged (its loss is NaN or infinite), the launcher stops the run at once, as the other
workers may wait for it forever, and marks it diverged.
"""

from __future__ import annotations

import shlex
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from sqlalchemy.exc import DBAPIError

from dsgd_cli.spec import nodes, registry

from dsgd_cli.launch import unrecorded
from dsgd_cli.comm.events import experiment_dir, stop_path
from dsgd_cli.results.database import one_line, sqlite_path
from dsgd_cli.errors import DsgdError
from dsgd_cli.spec.directories import make_experiment_directory
from dsgd_cli.spec.experiments import PLUGIN_SECTIONS, Experiment
from dsgd_cli.spec.resolved import ResolvedExperiment
from dsgd_cli.spec.run_plan import plan_entry
from dsgd_cli.results.store import MetricRow, RunDeleted, Store
from dsgd_cli.launch.outcome import (RunResult, launch_dir_full, last_lines, left_early,
                                     left_without_a_word, rendezvous_failure, run_result)
from dsgd_cli.launch.run_events import Progress, RunEvents
from dsgd_cli.launch.devices import (DevicePlan, choose_device, cuda_kernels_problem,  # noqa: F401
                                     plan_for)
from dsgd_cli.launch.torchrun import Shape, Torchrun
from dsgd_cli.launch.unrecorded import RecordingLost

POLL_SECONDS = 0.5
GRACE_AFTER_ERROR_S = 10.0  # torchrun normally stops the other workers well before this
CHECKPOINT_WAIT_S = 30.0  # for the workers of an interrupted run to save a last checkpoint


def launch_shape(experiment: Experiment) -> Shape:
    """What the torchrun of a launch beginning with `experiment` is started for."""
    return Shape.of(experiment.workers, experiment.nodes, experiment.spec_text, experiment.name)


def local_workers(experiment: Experiment) -> int:
    """How many of the experiment's workers run on this machine."""
    return nodes.local_workers(experiment.nodes, experiment.workers)


def plugin_versions(experiment: ResolvedExperiment) -> list[tuple[str, str, str, str]]:
    """Each plugin the experiment names, with the distribution and version that provide it."""
    rows = []
    for kind in PLUGIN_SECTIONS:  # a resumed run's config is upgraded: it has every section
        name = getattr(experiment, kind).name
        entry = registry.discover(kind)[name]
        rows.append((kind, name, entry.distribution, entry.version))
    return rows


# -- launches: consecutive experiments that share one torchrun --------------------------------

@dataclass
class Launch:
    """Experiments run one after another by the same torchrun workers: they share the worker
    count, the device and the timeout, so they can share the process group."""

    experiments: list[Experiment]
    device: DevicePlan

    def fits(self, experiment: Experiment, device: DevicePlan) -> bool:
        first = self.experiments[0]
        return (experiment.workers, experiment.resolved.timeout, device.kind) == (
            first.workers, first.resolved.timeout, self.device.kind)


def plan_launches(experiments: list[Experiment], shared: bool = True) -> list[Launch]:
    """One launch per run of consecutive experiments that fit together; one per experiment
    without `shared`."""
    launches: list[Launch] = []
    for experiment in experiments:
        device = plan_for(experiment, local_workers(experiment))
        # A run over several machines has a rendezvous of its own.
        if shared and experiment.nodes is None and launches and launches[-1].fits(experiment, device):
            launches[-1].experiments.append(experiment)
        else:
            launches.append(Launch([experiment], device))
    return launches


@dataclass
class Callbacks:
    """What the caller hears while experiments run: each start (with its device plan), its
    progress, and how it ended."""

    started: Callable[[Experiment, DevicePlan], None] = lambda experiment, device: None
    progress: Callable[[Experiment, Progress], None] = lambda experiment, progress: None
    ended: Callable[[RunResult], None] = lambda result: None


def run_all(experiments: list[Experiment], store: Store, spec_file: str | None,
            callbacks: Callbacks = Callbacks(), shared: bool = True,
            early: Torchrun | None = None) -> list[RunResult]:
    """Run and record every experiment, in order. A launch that ends early (an experiment
    failed, diverged or was killed: its process group is not to be trusted) records that
    experiment and the rest go on in a fresh launch. `early`: a torchrun started before the
    spec was validated (`torchrun.early_start`), for the first launch if it fits."""
    make_output_directories(experiments)
    results = []
    for planned in plan_launches(experiments, shared):
        pending = planned.experiments
        while pending:
            done = _Launcher(pending, planned.device, store, spec_file, callbacks).run(early)
            early = None
            results += done
            pending = pending[len(done):]
    return results


def launch(experiment: Experiment, store: Store, spec_file: str | None,
           on_progress: Callable[[Progress], None] = lambda p: None,
           device: DevicePlan | None = None) -> RunResult:
    """Run and record one experiment in a launch of its own. `device`: by default
    `choose_device`'s."""
    callbacks = Callbacks(progress=lambda experiment, progress: on_progress(progress))
    make_output_directories([experiment])
    device = device or plan_for(experiment, local_workers(experiment))
    return _Launcher([experiment], device, store, spec_file, callbacks).run()[0]


def make_output_directories(experiments: list[Experiment]) -> None:
    """Make (or check) each experiment's directory under its `save_dir` before anything
    trains: one planted by another user is refused now (UntrustedDirectory, exit 2), not
    after training, when the model could only be lost."""
    for experiment in experiments:
        resolved = experiment.resolved
        if resolved.save_dir:
            directory = Path(resolved.save_dir) / resolved.name.replace("/", "_")  # as the workers
            try:
                make_experiment_directory(directory)
            except OSError as error:
                raise DsgdError(f"save_dir: cannot make {directory}: "
                                f"{error.strerror or error}") from None


class _Running:
    """The experiment of a launch that is running now: its run id, what its workers said so
    far (`events`), and when the first of them reported a problem.

    On one machine the workers are ranks 0 to n - 1. In a run over several machines this
    machine's workers have the ranks the rendezvous gave them, found as their event files
    appear; a node other than node rank 0 learns the run id from its workers (a `run` event)
    and keeps their metrics until then."""

    def __init__(self, index: int, experiment: Experiment, run_id: int | None, events_dir: Path):
        self.index, self.experiment, self.run_id = index, experiment, run_id
        ranks = range(experiment.workers) if experiment.nodes is None else None
        self.events = RunEvents(events_dir, ranks)
        self.first_problem_at: float | None = None

    @property
    def complete(self) -> bool:
        return len(self.events.done_ranks) == local_workers(self.experiment)

    @property
    def all_left(self) -> bool:
        """Every local worker finished or stopped as asked."""
        left = self.events.done_ranks | self.events.stopped_ranks
        return len(left) == local_workers(self.experiment)

    def ingest(self, store: Store, callbacks: Callbacks) -> None:
        """Read the workers' new events and store their metrics (once the run id is known)."""
        moved = self.events.read()
        if self.events.problems and self.first_problem_at is None:
            self.first_problem_at = time.monotonic()
        if self.events.run_id is not None:
            self.run_id = self.events.run_id
        if self.run_id is None:
            return
        rows = self.events.unstored
        store.add_metrics(self.run_id, rows)  # if it raises, the rows stay unstored
        self.events.unstored = []
        if rows or moved:
            callbacks.progress(self.experiment, self.events.progress)

    def result(self, returncode: int = 0, log_tail: str = "", **how) -> RunResult:
        """How the run ended, as `outcome.run_result` tells from its workers' events."""
        return run_result(self.run_id, self.experiment, self.events.problems,
                          self.events.done_ranks, returncode, log_tail, **how)


class _Launcher:
    """One torchrun for `experiments`; `run` returns the results of those it got to (all of
    them, unless one ended the launch early). Every run it started is recorded before `run`
    returns or raises, never left `running`. A SIGINT or SIGTERM meanwhile stops the launch's
    processes and marks the running experiment interrupted; then the signal takes its usual
    course (the CLI's handler raises `Interrupted`).

    The launch's experiments run one after another: `begin` records one as started, `advance`
    stores what the workers wrote and moves on from each experiment they completed, `finish`
    records how one ended."""

    def __init__(self, experiments: list[Experiment], device: DevicePlan, store: Store,
                 spec_file: str | None, callbacks: Callbacks):
        self.experiments, self.device = experiments, device
        self.store, self.spec_file, self.callbacks = store, spec_file, callbacks
        self.results: list[RunResult] = []
        self.running: _Running | None = None
        self.torchrun: Torchrun | None = None
        self.stop_asked_at: float | None = None  # when the workers were asked to checkpoint and leave
        self.left_early: list[int] = []  # ranks seen to exit with code 0 before the run's end

    def run(self, early: Torchrun | None = None) -> list[RunResult]:
        """`early`: a torchrun started before the spec was validated, used if it has this
        launch's shape."""
        self.torchrun = _torchrun_for(launch_shape(self.experiments[0]), early)
        with _Interrupts() as interrupts:
            # A write waiting for a busy database gives up once a signal is noted.
            self.store.interrupted = lambda: bool(interrupts.caught)
            try:
                self.begin(0)
                self._write_plan()
                if self.torchrun.process is None and not self._start_torchrun():
                    return self.results
                stopped, interrupted_by = self._watch(interrupts)
                if self.running is not None:  # the experiment that ended the launch
                    self.finish(self._ended_early(stopped, interrupted_by))
            except RunDeleted as deleted:
                self._deleted(deleted)
            except DBAPIError as error:  # the database cannot be written: nothing more is recorded
                raise recording_lost(error, self.running, self.store) from None
            except BaseException as error:
                self._record_own_failure(error)
                raise
            finally:
                self.torchrun.close()
                self.store.interrupted = lambda: False
        return self.results

    def begin(self, index: int) -> None:
        """Record the launch's experiment `index` as started (its workers begin it by
        themselves, from the plan)."""
        experiment = self.experiments[index]
        self.callbacks.started(experiment, self.device)
        run_id = experiment.run_id  # a resumed run goes on under its own id
        if run_id is None and _records(experiment):
            run_id = self.store.create_run(experiment.name, experiment.config, self.spec_file,
                                           plugin_versions(experiment.resolved),
                                           experiment.checkpoint_dir)
            if self.device.workers_per_gpu is not None:  # its workers took turns on the GPUs
                self.store.add_metrics(run_id, [MetricRow("workers_per_gpu",
                                                          self.device.workers_per_gpu)])
        self.running = _Running(index, experiment, run_id, experiment_dir(self.torchrun.dir, index))

    def advance(self) -> None:
        """Read the running experiment's events; record each experiment that completed and
        begin the next (the workers have begun it already)."""
        while self.running is not None:
            self.running.ingest(self.store, self.callbacks)
            if not self.running.complete:
                return
            index = self.running.index
            self.finish(self.running.result())
            if index + 1 < len(self.experiments):
                self.begin(index + 1)

    def finish(self, result: RunResult) -> None:
        """Record how the running experiment ended; no experiment is running after it."""
        if _records(self.running.experiment):
            self.store.finish_run(result.run_id, result.status, result.reason, result.failed_rank)
        elif result.run_id is not None:  # node rank 0 ends the run; this node's metrics are in
            self.store.refresh_summaries(result.run_id)
        self.results.append(result)
        self.callbacks.ended(result)
        self.running = None

    def _write_plan(self) -> None:
        entries = [experiment.worker_config() for experiment in self.experiments]
        # The workers of the first experiment learn its run id from the plan; those on node rank
        # 0 pass it to the other machines' workers through the rendezvous store.
        first = self.experiments[0]
        entries[0] = plan_entry(first.config, replace(first.run_plan, run_id=self.running.run_id))
        self.torchrun.write_plan({"device": self.device.kind, "experiments": entries})

    def _start_torchrun(self) -> bool:
        """Start torchrun; False (and the running experiment recorded as failed) if it cannot."""
        try:
            self.torchrun.start()
        except OSError as error:
            self.finish(RunResult(self.running.run_id, self.running.experiment.name, "failed",
                                  f"cannot start {self.torchrun.starter}: {error}"))
            return False
        return True

    def _watch(self, interrupts: _Interrupts) -> tuple[bool, signal.Signals | None]:
        """Advance while torchrun runs, until it exits or the launch must end; then stop every
        process of the launch and read what the workers wrote last. Returns whether dsgd
        stopped the workers, and the signal that interrupted the launch (None if none)."""
        process = self.torchrun.process
        stopped, interrupted_by = False, None
        try:
            while process.poll() is None:
                try:  # returns as soon as torchrun exits: no poll interval lost at the end
                    process.wait(timeout=POLL_SECONDS)
                except subprocess.TimeoutExpired:
                    pass
                # Taken before the events are read: a rank that ended well wrote `done` (line
                # buffered) before it exited, so its `done` is read below.
                exited = self.torchrun.exited_zero()
                self.advance()
                if self.running is not None and not self.left_early:
                    self.left_early = left_without_a_word(self.running.events, exited)
                    if self.left_early:  # its peers may wait for it until the timeout
                        stopped = True
                        break
                interrupted_by = interrupts.caught[0] if interrupts.caught else None
                if interrupted_by and self._saving_checkpoints(interrupts):
                    continue
                if (self.running is not None and _must_stop(self.running)) or interrupted_by:
                    stopped = True
                    break
        finally:  # whatever happened, no process of the launch outlives it
            caught = len(interrupts.caught)  # another signal: no more waiting
            self.torchrun.stop(hurry=lambda: len(interrupts.caught) > caught)
        self.advance()
        return stopped, interrupted_by

    def _saving_checkpoints(self, interrupts: _Interrupts) -> bool:
        """Whether to wait, after an interruption, for the running experiment's workers to
        save a checkpoint where they are and leave: the first interruption asks them to; a
        second one, or their taking longer than CHECKPOINT_WAIT_S, does not wait for them."""
        if self.running is None or not self.running.experiment.checkpoint_dir:
            return False
        if self.stop_asked_at is None:
            stop_path(self.torchrun.dir).touch()
            self.stop_asked_at = time.monotonic()
        return not (self.running.all_left or len(interrupts.caught) > 1
                    or time.monotonic() - self.stop_asked_at > CHECKPOINT_WAIT_S)

    def _ended_early(self, stopped: bool, interrupted_by: signal.Signals | None) -> RunResult:
        """How the experiment that ended the launch ended."""
        running = self.running
        if interrupted_by:
            return RunResult(running.run_id, running.experiment.name, "interrupted",
                             f"interrupted by {interrupted_by.name}")
        log_text = self.torchrun.log_text()
        returncode = self.torchrun.process.returncode
        # Workers that dsgd itself stopped died of its signals: torchrun's record of them
        # says nothing about the cause.
        failures = [] if stopped else self.torchrun.failures(log_text)
        left = self.left_early or ([] if stopped else left_early(
            running.experiment, running.events, self.torchrun.not_zero(log_text), returncode))
        result = running.result(returncode, last_lines(log_text), failures=failures,
                                launch_failure=rendezvous_failure(running.experiment, log_text),
                                left=left)
        if result.status == "failed" and self.torchrun.out_of_space():
            # The workers could not write their events, nor torchrun its report: whatever the
            # peers said, this is the cause.
            result = RunResult(result.run_id, result.experiment, "failed",
                               launch_dir_full(self.torchrun.dir))
        return result

    def _deleted(self, deleted: RunDeleted) -> None:
        """`dsgd runs delete --force` took the running run away: the launch, which only it was
        using now, has been stopped; the spec goes on with the next experiment."""
        result = RunResult(deleted.run_id, self.running.experiment.name, "deleted",
                           f"{deleted}; its workers were stopped")
        self.results.append(result)
        self.callbacks.ended(result)

    def _record_own_failure(self, error: BaseException) -> None:
        running = self.running
        if running is not None and _records(running.experiment) and running.run_id is not None:
            self.store.finish_run(running.run_id, "failed", f"dsgd failed: {error!r}")


def _torchrun_for(shape: Shape, early: Torchrun | None) -> Torchrun:
    """`early` if it was started for `shape` (else it is closed), or a new torchrun."""
    if early is not None and early.shape != shape:
        early.close()
        early = None
    return early or Torchrun(shape)


def recording_lost(error: DBAPIError, running: _Running | None, store: Store) -> RecordingLost:
    """The one-line error of a database that stopped taking writes during a launch (whose
    processes are stopped by then), with the running experiment's records kept for
    `dsgd runs recover`."""
    reason = one_line(getattr(error, "orig", None) or error)
    message = f"cannot write to results database {store.shown_url}: {reason}"
    if running is not None and running.run_id is not None and _records(running.experiment):
        # The database may fail after the workers finished (a write waiting for a busy
        # database, interrupted): the run was not stopped then, only not recorded as ended.
        ended = ("had finished training and is left 'running'" if running.complete
                 else "was stopped and is left 'running'")
        message += f"; run {running.run_id} ({running.experiment.name}) {ended}"
        try:
            kept = unrecorded.keep(running.run_id, running.experiment, running.events, reason)
        except OSError as keep_error:
            message += f"; its workers' records could not be kept ({keep_error})"
        else:
            db = sqlite_path(store.url) or store.shown_url
            message += (f"; once the database can be written, `dsgd runs recover "
                        f"{shlex.quote(str(kept))} --db {shlex.quote(db)}` records what its "
                        "workers recorded (kept there) and ends it")
    return RecordingLost(message + "; later experiments were not run")


def _records(experiment: Experiment) -> bool:
    """Whether this machine records the run: always, unless it is another node's run."""
    return experiment.nodes is None or experiment.nodes.records


def _must_stop(running: _Running) -> bool:
    """A worker that diverged has left, and its peers may wait for it forever; after any other
    error torchrun normally stops the workers itself, but not always within the grace time."""
    if any(event["type"] == "diverged" for event in running.events.problems):
        return True
    return (running.first_problem_at is not None
            and time.monotonic() - running.first_problem_at > GRACE_AFTER_ERROR_S)


class _Interrupts:
    """While a run is on, SIGINT, SIGTERM and SIGHUP are noted in `caught` instead of going
    to their handlers (the CLI's raises, and an exception at an arbitrary point could cut a
    database write or the cleanup short); the launcher polls `caught`. On leaving, the first
    signal caught is raised again, for its own handler."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self):
        self.caught: list[signal.Signals] = []
        self._previous: dict = {}

    def __enter__(self) -> _Interrupts:
        if threading.current_thread() is threading.main_thread():  # else they are not ours
            self._previous = {sig: signal.signal(sig, self._note) for sig in self.SIGNALS}
        return self

    def _note(self, signum, _frame) -> None:
        self.caught.append(signal.Signals(signum))

    def __exit__(self, *exc_info) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
        if self.caught:
            signal.raise_signal(self.caught[0])
