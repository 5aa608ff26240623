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

import re
import shlex
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from sqlalchemy.exc import DBAPIError

from dsgd_cli.spec import nodes, registry

from dsgd_cli.launch import unrecorded
from dsgd_cli.comm.events import EventReader, events_path, experiment_dir, stop_path
from dsgd_cli.results.database import one_line, sqlite_path
from dsgd_cli.errors import DsgdError
from dsgd_cli.spec.directories import make_experiment_directory
from dsgd_cli.spec.experiments import PLUGIN_SECTIONS, Experiment
from dsgd_cli.results.store import MetricRow, RunDeleted, Store, finite_number
from dsgd_cli.launch.torchrun import Shape, Torchrun
from dsgd_cli.launch.unrecorded import RecordingLost

POLL_SECONDS = 0.5
GRACE_AFTER_ERROR_S = 10.0  # torchrun normally stops the other workers well before this
CHECKPOINT_WAIT_S = 30.0  # for the workers of an interrupted run to save a last checkpoint


@dataclass
class RunResult:
    run_id: int
    experiment: str
    status: str
    reason: str | None = None
    failed_rank: int | None = None


@dataclass
class Progress:
    """What the progress display is told about a run as it goes."""

    total_steps: int | None = None
    step: float = 0  # done, of total_steps, in `unit`
    train_loss: float | None = None
    test_accuracy: float | None = None
    unit: str | None = None  # None: workers that write no `progress` events count steps
    updates: int | None = None  # the run's updates, when the bar counts samples or seconds


def launch_shape(experiment: Experiment) -> Shape:
    """What the torchrun of a launch beginning with `experiment` is started for."""
    return Shape.of(experiment.workers, experiment.nodes, experiment.spec_text, experiment.name)


def local_workers(experiment: Experiment) -> int:
    """How many of the experiment's workers run on this machine."""
    return nodes.local_workers(experiment.nodes, experiment.workers)


def plugin_versions(config: dict) -> list[tuple[str, str, str, str]]:
    rows = []
    for kind in PLUGIN_SECTIONS:
        if kind not in config:  # a resumed run recorded before the section existed
            continue
        name = config[kind]["name"]
        entry = registry.discover(kind)[name]
        rows.append((kind, name, entry.distribution, entry.version))
    return rows


@dataclass(frozen=True)
class DevicePlan:
    """Where a run's workers compute: "cuda" (one GPU each, NCCL) or "cpu" (gloo)."""

    kind: str
    notice: str | None = None  # why a machine with CUDA runs on the CPU


def choose_device(workers: int) -> DevicePlan:
    """NCCL needs a GPU of its own for every worker on a machine. With fewer GPUs than
    workers the run falls back to CPU tensors and gloo, and says so."""
    import torch  # already loaded by the spec; not needed by the reading commands

    if not torch.cuda.is_available():
        return DevicePlan("cpu")
    gpus = torch.cuda.device_count()
    if gpus >= workers:
        return DevicePlan("cuda")
    return DevicePlan("cpu", f"{workers} workers but {gpus} GPU{'s' if gpus != 1 else ''} "
                             "on this machine: running on the CPU with gloo")


# -- launches: consecutive experiments that share one torchrun --------------------------------

@dataclass
class Launch:
    """Experiments run one after another by the same torchrun workers: they share the worker
    count, the device and the timeout, so they can share the process group."""

    experiments: list[Experiment]
    device: DevicePlan

    def fits(self, experiment: Experiment, device: DevicePlan) -> bool:
        first = self.experiments[0]
        return (experiment.workers, experiment.config.get("timeout"), device.kind) == (
            first.workers, first.config.get("timeout"), self.device.kind)


def plan_launches(experiments: list[Experiment], shared: bool = True) -> list[Launch]:
    """One launch per run of consecutive experiments that fit together; one per experiment
    without `shared`."""
    launches: list[Launch] = []
    for experiment in experiments:
        device = choose_device(local_workers(experiment))
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
            done = _launch(pending, planned.device, store, spec_file, callbacks, early)
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
    device = device or choose_device(local_workers(experiment))
    return _launch([experiment], device, store, spec_file, callbacks)[0]


def make_output_directories(experiments: list[Experiment]) -> None:
    """Make (or check) each experiment's directory under its `save_dir` before anything
    trains: one planted by another user is refused now (UntrustedDirectory, exit 2), not
    after training, when the model could only be lost."""
    for experiment in experiments:
        if experiment.config.get("save_dir"):
            name = experiment.config.get("name", experiment.name)
            directory = Path(experiment.config["save_dir"]) / name.replace("/", "_")  # as the workers
            try:
                make_experiment_directory(directory)
            except OSError as error:
                raise DsgdError(f"save_dir: cannot make {directory}: "
                                f"{error.strerror or error}") from None


class _Running:
    """The experiment of a launch that is running now: its run id, its workers' events as
    read so far, and its progress.

    On one machine the workers are ranks 0 to n - 1. In a run over several machines this
    machine's workers have the ranks the rendezvous gave them, found as their event files
    appear; a node other than node rank 0 learns the run id from its workers (a `run` event)
    and keeps their metrics until then."""

    def __init__(self, index: int, experiment: Experiment, run_id: int | None, events_dir: Path):
        self.index, self.experiment, self.run_id = index, experiment, run_id
        self.events_dir = events_dir
        self.readers: dict[int, EventReader] = {}
        if experiment.nodes is None:
            self.readers = {rank: EventReader(events_path(events_dir, rank))
                            for rank in range(experiment.workers)}
        self.progress = Progress()
        self.problems: list[dict] = []  # `error` and `diverged` events
        self.done_ranks: set[int] = set()
        self.stopped_ranks: set[int] = set()  # saved a checkpoint and left, as asked
        self.first_problem_at: float | None = None
        self.unstored: list[MetricRow] = []  # until the run id is known

    @property
    def complete(self) -> bool:
        return len(self.done_ranks) == local_workers(self.experiment)

    @property
    def all_left(self) -> bool:
        """Every local worker finished or stopped as asked."""
        return len(self.done_ranks | self.stopped_ranks) == local_workers(self.experiment)

    def ingest(self, store: Store, callbacks: Callbacks) -> None:
        if self.experiment.nodes is not None:
            for path in self.events_dir.glob("rank*.jsonl"):
                rank = int(path.stem[len("rank"):])
                self.readers.setdefault(rank, EventReader(path))
        lead = min(self.readers, default=0)  # whose progress is shown
        rows = self.unstored
        moved = False  # a progress event arrived
        for reader in self.readers.values():
            for event in reader.read():
                kind, rank = event["type"], event["rank"]
                if kind == "metric":
                    if not finite_number(event["value"]):
                        continue  # no number to store or show (NaN parses from JSON)
                    rows.append(MetricRow(event["name"], event["value"], event["step"],
                                          event["epoch"], rank if event["per_rank"] else None,
                                          event["seconds"]))
                    if rank == lead:
                        _update_progress(self.progress, event)
                elif kind == "start" and rank == lead:
                    self.progress.total_steps = event["total_steps"]
                elif kind == "progress" and rank == lead:
                    _take_progress(self.progress, event)
                    moved = True
                elif kind == "run":
                    self.run_id = event["run_id"]
                elif kind in ("error", "diverged"):
                    self.problems.append(event)
                    self.first_problem_at = self.first_problem_at or time.monotonic()
                elif kind == "done":
                    self.done_ranks.add(rank)
                elif kind == "stopped":
                    self.stopped_ranks.add(rank)
        if self.run_id is None:
            self.unstored = rows
            return
        store.add_metrics(self.run_id, rows)
        self.unstored = []
        if rows or moved:
            callbacks.progress(self.experiment, self.progress)


def _launch(experiments: list[Experiment], device: DevicePlan, store: Store,
            spec_file: str | None, callbacks: Callbacks,
            early: Torchrun | None = None) -> list[RunResult]:
    """One torchrun for `experiments` (`early`, if started for this launch's shape); returns
    the results of those it got to (all of them, unless one ended the launch early). Every run
    it started is recorded before it returns or raises, never left `running`. A SIGINT or
    SIGTERM meanwhile stops the launch's processes and marks the running experiment
    interrupted; then the signal takes its usual course (the CLI's handler raises
    `Interrupted`)."""
    results: list[RunResult] = []
    running: _Running | None = None
    shape = launch_shape(experiments[0])
    if early is not None and early.shape != shape:
        early.close()
        early = None
    torchrun = early or Torchrun(shape)
    tmp = torchrun.dir

    def finish(result: RunResult) -> None:
        nonlocal running
        if _records(running.experiment):
            store.finish_run(result.run_id, result.status, result.reason, result.failed_rank)
        elif result.run_id is not None:  # node rank 0 ends the run; this node's metrics are in
            store.refresh_summaries(result.run_id)
        results.append(result)
        callbacks.ended(result)
        running = None

    def begin(index: int) -> None:
        nonlocal running
        experiment = experiments[index]
        callbacks.started(experiment, device)
        run_id = experiment.run_id  # a resumed run goes on under its own id
        if run_id is None and _records(experiment):
            run_id = store.create_run(experiment.name, experiment.config, spec_file,
                                      plugin_versions(experiment.config),
                                      experiment.checkpoint_dir)
        running = _Running(index, experiment, run_id, experiment_dir(tmp, index))

    def advance() -> None:
        """Read the running experiment's events; record each experiment that completed and
        begin the next (the workers have begun it already)."""
        while running is not None:
            running.ingest(store, callbacks)
            if not running.complete:
                return
            index = running.index
            finish(run_result(running.run_id, running.experiment, running.problems,
                              running.done_ranks, 0, ""))
            if index + 1 < len(experiments):
                begin(index + 1)

    with _Interrupts() as interrupts:
        try:
            begin(0)
            configs = [e.worker_config() for e in experiments]
            configs[0]["run_id"] = running.run_id  # other machines' workers learn it from these
            torchrun.write_plan({"device": device.kind, "experiments": configs})
            if torchrun.process is None:
                try:
                    torchrun.start()
                except OSError as error:
                    finish(RunResult(running.run_id, running.experiment.name, "failed",
                                     f"cannot start torchrun: {error}"))
                    return results
            process = torchrun.process
            stopped, interrupted_by, asked_at = False, None, None
            try:
                while process.poll() is None:
                    try:  # returns as soon as torchrun exits: no poll interval lost at the end
                        process.wait(timeout=POLL_SECONDS)
                    except subprocess.TimeoutExpired:
                        pass
                    advance()
                    interrupted_by = interrupts.caught[0] if interrupts.caught else None
                    if interrupted_by and running is not None and running.experiment.checkpoint_dir:
                        # The first interruption asks the workers to save a checkpoint where
                        # they are and leave; a second one, or their taking too long, does
                        # not wait for them.
                        if asked_at is None:
                            stop_path(tmp).touch()
                            asked_at = time.monotonic()
                        if not (running.all_left or len(interrupts.caught) > 1
                                or time.monotonic() - asked_at > CHECKPOINT_WAIT_S):
                            continue
                    if (running is not None and _must_stop(running)) or interrupted_by:
                        stopped = True
                        break
            finally:  # whatever happened, no process of the launch outlives it
                caught = len(interrupts.caught)  # another signal: no more waiting
                torchrun.stop(hurry=lambda: len(interrupts.caught) > caught)
            advance()
            if running is not None:  # the experiment that ended the launch
                if interrupted_by:
                    finish(RunResult(running.run_id, running.experiment.name, "interrupted",
                                     f"interrupted by {interrupted_by.name}"))
                else:
                    log_text = torchrun.log_text()
                    # Workers that dsgd itself stopped died of its signals: torchrun's
                    # record of them says nothing about the cause.
                    failures = [] if stopped else torchrun_failures(log_text)
                    left = [] if stopped else left_early(running, log_text, process.returncode)
                    result = run_result(running.run_id, running.experiment, running.problems,
                                        running.done_ranks, process.returncode,
                                        last_lines(log_text), failures,
                                        _rendezvous_failure(running.experiment, log_text), left)
                    if result.status == "failed" and torchrun.out_of_space():
                        # The workers could not write their events, nor torchrun its report:
                        # whatever the peers said, this is the cause.
                        result = RunResult(result.run_id, result.experiment, "failed",
                                           launch_dir_full(tmp))
                    finish(result)
        except RunDeleted as deleted:
            # `dsgd runs delete --force` took the running run away: the launch, which only
            # it was using now, has been stopped; the spec goes on with the next experiment.
            result = RunResult(deleted.run_id, running.experiment.name, "deleted",
                               f"{deleted}; its workers were stopped")
            results.append(result)
            callbacks.ended(result)
        except DBAPIError as error:  # the database cannot be written: nothing more is recorded
            raise recording_lost(error, running, store) from None
        except BaseException as error:
            if running is not None and _records(running.experiment) and running.run_id is not None:
                store.finish_run(running.run_id, "failed", f"dsgd failed: {error!r}")
            raise
        finally:
            torchrun.close()
    return results


def recording_lost(error: DBAPIError, running: _Running | None, store: Store) -> RecordingLost:
    """The one-line error of a database that stopped taking writes during a launch (whose
    processes are stopped by then), with the running experiment's records kept for
    `dsgd runs recover`."""
    reason = one_line(getattr(error, "orig", None) or error)
    message = f"cannot write to results database {store.shown_url}: {reason}"
    if running is not None and running.run_id is not None and _records(running.experiment):
        message += f"; run {running.run_id} ({running.experiment.name}) was stopped and is left 'running'"
        try:
            kept = unrecorded.keep(running, reason)
        except OSError as keep_error:
            message += f"; its workers' records could not be kept ({keep_error})"
        else:
            db = sqlite_path(store.url) or store.shown_url
            message += (f"; once the database can be written, `dsgd runs recover "
                        f"{shlex.quote(str(kept))} --db {shlex.quote(db)}` records what its "
                        "workers recorded (kept there) and ends it")
    return RecordingLost(message + "; later experiments were not run")


def launch_dir_full(launch_dir: Path) -> str:
    """The reason of a run whose launch directory (in $TMPDIR) ran out of space."""
    return (f"no space left on device in the launch directory {launch_dir} (in $TMPDIR, "
            f"{launch_dir.parent}), where the workers write their events and output: free "
            "space there, or set TMPDIR to a larger filesystem")


def _records(experiment: Experiment) -> bool:
    """Whether this machine records the run: always, unless it is another node's run."""
    return experiment.nodes is None or experiment.nodes.records


def _rendezvous_failure(experiment: Experiment, log: str) -> str | None:
    plan = experiment.nodes
    if plan is None or "RendezvousTimeoutError" not in log:
        return None
    return (f"rendezvous at {plan.endpoint} timed out: not all {plan.nnodes} nodes joined "
            f"within {plan.timeout:g} s")


def _must_stop(running: _Running) -> bool:
    """A worker that diverged has left, and its peers may wait for it forever; after any other
    error torchrun normally stops the workers itself, but not always within the grace time."""
    if any(event["type"] == "diverged" for event in running.problems):
        return True
    return (running.first_problem_at is not None
            and time.monotonic() - running.first_problem_at > GRACE_AFTER_ERROR_S)


@dataclass
class WorkerExit:
    """A worker that torchrun saw fail: its rank and exit code (negative: killed by a signal)."""

    rank: int
    exitcode: int

    def describe(self) -> str:
        return describe_exit(self.exitcode)


def describe_exit(code: int) -> str:
    """A process's exit code as words: "exited with code 1", "killed by SIGKILL"."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


_FAILURE = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank:\s*\d+\)\s*\n"
                      r"\s*exitcode\s*:\s*(-?\d+)(?:\s*\(pid:\s*(\d+)\))?")
_CLOSED = re.compile(r"Sending process (\d+) closing signal")


def torchrun_failures(log: str) -> list[WorkerExit]:
    """The workers that failed by themselves, from torchrun's error summary, root cause
    ("first observed failure") first. That summary also lists the workers torchrun stopped
    because of the failure, which it logs as "Sending process PID closing signal SIGTERM":
    those are left out."""
    closed = set(_CLOSED.findall(log))
    root_at = log.find("Root Cause")
    found = [(match.start() < root_at, WorkerExit(int(match.group(1)), int(match.group(2))))
             for match in _FAILURE.finditer(log) if match.group(3) not in closed]
    return [exit for _, exit in sorted(found, key=lambda pair: pair[0])]


def left_early(running: _Running, log: str, returncode: int) -> list[int]:
    """The ranks of this machine that exited with code 0 before the end of the run: they
    wrote no `done`, `error`, `diverged` or `stopped` event, and torchrun did not list them
    among the workers that did not exit 0 (those that failed and those it stopped then).
    Known only when torchrun wrote that list, or itself exited with code 0."""
    if running.experiment.nodes is not None:  # other ranks' events are on other machines
        return []
    listed = {int(match.group(1)) for match in _FAILURE.finditer(log)}
    if not listed and returncode != 0:
        return []
    spoke = running.done_ranks | running.stopped_ranks | {e["rank"] for e in running.problems}
    return sorted(set(range(running.experiment.workers)) - spoke - listed)


def run_result(run_id: int, experiment: Experiment, problems: list[dict], done_ranks: set[int],
               returncode: int, log_tail: str, failures: list[WorkerExit] = (),
               launch_failure: str | None = None, left: list[int] = ()) -> RunResult:
    """How a run ended, from its workers' `error` and `diverged` events, the workers that
    torchrun saw fail by themselves (`failures`, empty when dsgd stopped the workers), the
    ranks that exited with code 0 before the end (`left`) and torchrun's exit.

    A worker that died without a word (killed by a signal, at start-up, or leaving with
    code 0 mid-run) is the cause: its peers then fail with symptoms such as "Connection reset
    by peer". Otherwise the first problem a worker reported is the cause; the others are
    mostly peers losing their link."""
    reported = {event["rank"] for event in problems}
    silent = [exit for exit in failures if exit.rank not in reported]
    if silent:
        return RunResult(run_id, experiment.name, "failed",
                         f"rank {silent[0].rank}: {silent[0].describe()}", silent[0].rank)
    if left:
        return RunResult(run_id, experiment.name, "failed",
                         f"rank {left[0]}: exited with code 0 before the end of the run", left[0])
    if problems:
        first = min(problems, key=lambda e: (e.get("at", 0), e["rank"]))
        rank = first["rank"]
        if first["type"] == "diverged":
            return RunResult(run_id, experiment.name, "diverged",
                             f"{first.get('name', 'train_loss')} is {first['value']} "
                             f"at step {first['step']} on rank {rank}", rank)
        behind = first.get("behind") or []
        if behind:  # its collective timed out, waiting for ranks that never entered it
            return RunResult(run_id, experiment.name, "failed",
                             f"rank {behind[0]}: never entered the collective that rank {rank} "
                             f"waited in ({first['reason']})", behind[0])
        return RunResult(run_id, experiment.name, "failed", f"rank {rank}: {first['reason']}", rank)
    if launch_failure is not None:
        return RunResult(run_id, experiment.name, "failed", launch_failure)
    if returncode != 0 or len(done_ranks) < local_workers(experiment):
        return RunResult(run_id, experiment.name, "failed",
                         f"torchrun {describe_exit(returncode)}: {log_tail}")
    return RunResult(run_id, experiment.name, "completed")


def _update_progress(progress: Progress, event: dict) -> None:
    if event["name"] == "train_loss":
        progress.train_loss = event["value"]
        if progress.unit is None:
            progress.step = event["step"]
    elif event["name"] == "test_accuracy" or (
            event["name"] == "test_accuracy_workers" and event["per_rank"]):
        progress.test_accuracy = event["value"]  # asynchronous runs: a worker's own model


def _take_progress(progress: Progress, event: dict) -> None:
    """A `progress` event: the bar's count, total and unit as the worker knows them."""
    progress.step, progress.total_steps = event["done"], event["total"]
    progress.unit, progress.updates = event["unit"], event.get("updates")


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


LAST_LINES = 3  # of the launch's output, in the reason of a run that failed without a word


def last_lines(text: str, count: int = LAST_LINES) -> str:
    """The last `count` lines of the launch's output that say something, on one line."""
    lines = [line.strip()[:200] for line in text.splitlines() if line.strip()]
    return " | ".join(lines[-count:]) if lines else "(no output)"
