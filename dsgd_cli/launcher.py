"""Runs experiments: one torchrun per experiment, events tailed into the results store.

The launcher is the only writer of the database. For each run it records the configuration,
starts `torchrun ... -m dsgd_cli.runtime`, stores metrics as workers flush them and draws a
progress bar from rank 0's. When a worker fails, torchrun stops the others; the run is marked
failed with the rank and reason of the first error, keeping every metric already stored. When a
worker reports that training diverged (its loss is NaN or infinite), the launcher stops the run
at once, as the other workers may wait for it forever, and marks it diverged.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from dsgd_cli import registry
from dsgd_cli.errors import Interrupted
from dsgd_cli.events import EventReader, events_path
from dsgd_cli.spec import Experiment
from dsgd_cli.store import MetricRow, Store, finite_number

POLL_SECONDS = 0.5
GRACE_AFTER_ERROR_S = 10.0  # torchrun normally stops the other workers well before this
PLUGIN_SECTIONS = ("task", "optimizer", "aggregator", "compressor")


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
    step: int = 0
    train_loss: float | None = None
    test_accuracy: float | None = None


def torchrun_command(experiment: Experiment, config_path: str | Path, events_dir: str | Path) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={experiment.workers}", "--max-restarts=0",
            "-m", "dsgd_cli.runtime", str(config_path), str(events_dir)]


def plugin_versions(config: dict) -> list[tuple[str, str, str, str]]:
    rows = []
    for kind in PLUGIN_SECTIONS:
        name = config[kind]["name"]
        entry = registry.discover(kind)[name]
        rows.append((kind, name, entry.distribution, entry.version))
    return rows


def launch(experiment: Experiment, store: Store, spec_file: str | None,
           on_progress: Callable[[Progress], None] = lambda p: None) -> RunResult:
    config = experiment.config
    run_id = store.create_run(experiment.name, config, spec_file, plugin_versions(config))
    progress = Progress()
    problems: list[dict] = []  # `error` and `diverged` events
    with tempfile.TemporaryDirectory(prefix=f"dsgd-run{run_id}-") as tmp:
        config_path = Path(tmp) / "config.json"
        config_path.write_text(json.dumps(config))
        readers = [EventReader(events_path(tmp, rank)) for rank in range(experiment.workers)]
        done_ranks: set[int] = set()

        def ingest() -> None:
            rows = []
            for reader in readers:
                for event in reader.read():
                    kind, rank = event["type"], event["rank"]
                    if kind == "metric":
                        if not finite_number(event["value"]):
                            continue  # no number to store or show (NaN parses from JSON)
                        rows.append(MetricRow(event["name"], event["value"], event["step"],
                                              event["epoch"], rank if event["per_rank"] else None,
                                              event["seconds"]))
                        if rank == 0:
                            _update_progress(progress, event)
                    elif kind == "start" and rank == 0:
                        progress.total_steps = event["total_steps"]
                    elif kind in ("error", "diverged"):
                        problems.append(event)
                    elif kind == "done":
                        done_ranks.add(rank)
            store.add_metrics(run_id, rows)
            if rows:
                on_progress(progress)

        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")  # workers share the machine's cores
        env.setdefault("NUMBA_NUM_THREADS", env["OMP_NUM_THREADS"])
        env["PYTHONUNBUFFERED"] = "1"
        log_path = Path(tmp) / "torchrun.log"
        with open(log_path, "w") as log:
            try:
                process = subprocess.Popen(torchrun_command(experiment, config_path, tmp),
                                           stdout=log, stderr=subprocess.STDOUT, env=env,
                                           start_new_session=True)
            except OSError as error:  # never leave the run `running`
                result = RunResult(run_id, experiment.name, "failed",
                                   f"cannot start torchrun: {error}")
                store.finish_run(run_id, result.status, result.reason)
                return result
            try:
                first_error_at, stopped = None, False
                while process.poll() is None:
                    time.sleep(POLL_SECONDS)
                    ingest()
                    if problems and first_error_at is None:
                        first_error_at = time.monotonic()
                    # A worker that diverged has left, and its peers may wait for it forever.
                    diverged = any(e["type"] == "diverged" for e in problems)
                    late = first_error_at and time.monotonic() - first_error_at > GRACE_AFTER_ERROR_S
                    if diverged or late:
                        _stop(process)
                        stopped = True
                ingest()
            except BaseException as error:  # a signal or anything else: leave no worker behind
                _stop(process)
                ingest()
                if isinstance(error, (Interrupted, KeyboardInterrupt)):
                    name = getattr(error, "signal_name", "SIGINT")
                    store.finish_run(run_id, "interrupted", f"interrupted by {name}")
                else:
                    store.finish_run(run_id, "failed", f"dsgd failed: {error!r}")
                raise
        returncode = process.returncode
        log_tail = _last_line(log_path)
        # Workers that dsgd itself stopped died of its signals: torchrun's record of them
        # says nothing about the cause.
        failures = [] if stopped else torchrun_failures(log_path.read_text(errors="replace"))

    result = run_result(run_id, experiment, problems, done_ranks, returncode, log_tail, failures)
    store.finish_run(run_id, result.status, result.reason, result.failed_rank)
    return result


@dataclass
class WorkerExit:
    """A worker that torchrun saw fail: its rank and exit code (negative: killed by a signal)."""

    rank: int
    exitcode: int

    def describe(self) -> str:
        if self.exitcode < 0:
            try:
                return f"killed by {signal.Signals(-self.exitcode).name}"
            except ValueError:
                return f"killed by signal {-self.exitcode}"
        return f"exited with code {self.exitcode}"


_FAILURE = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank:\s*\d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)")


def torchrun_failures(log: str) -> list[WorkerExit]:
    """The failed workers of torchrun's error summary ("Root Cause (first observed failure)"
    and the other "Failures"), root cause first."""
    root_at = log.find("Root Cause")
    found = [(match.start() < root_at, WorkerExit(int(match.group(1)), int(match.group(2))))
             for match in _FAILURE.finditer(log)]
    return [exit for _, exit in sorted(found, key=lambda pair: pair[0])]


def run_result(run_id: int, experiment: Experiment, problems: list[dict], done_ranks: set[int],
               returncode: int, log_tail: str, failures: list[WorkerExit] = ()) -> RunResult:
    """How a run ended, from its workers' `error` and `diverged` events, the failures torchrun
    recorded (`failures`, empty when dsgd stopped the workers itself) and torchrun's exit.

    A worker killed by a signal wrote nothing; its peers then fail with symptoms such as
    "Connection closed by peer", so a signal death is the cause. Otherwise the first problem
    a worker reported is the cause; the others are mostly peers losing their link."""
    reported = {event["rank"] for event in problems}
    killed = [exit for exit in failures if exit.exitcode < 0 and exit.rank not in reported]
    if killed:
        return RunResult(run_id, experiment.name, "failed",
                         f"rank {killed[0].rank}: {killed[0].describe()}", killed[0].rank)
    if problems:
        first = min(problems, key=lambda e: (e.get("at", 0), e["rank"]))
        rank = first["rank"]
        if first["type"] == "diverged":
            return RunResult(run_id, experiment.name, "diverged",
                             f"{first.get('name', 'train_loss')} is {first['value']} "
                             f"at step {first['step']} on rank {rank}", rank)
        return RunResult(run_id, experiment.name, "failed", f"rank {rank}: {first['reason']}", rank)
    if failures:  # died without a word, e.g. at start-up
        return RunResult(run_id, experiment.name, "failed",
                         f"rank {failures[0].rank}: {failures[0].describe()}", failures[0].rank)
    if returncode != 0 or len(done_ranks) < experiment.workers:
        return RunResult(run_id, experiment.name, "failed",
                         f"torchrun exited with code {returncode}: {log_tail}")
    return RunResult(run_id, experiment.name, "completed")


def _update_progress(progress: Progress, event: dict) -> None:
    if event["name"] == "train_loss":
        progress.step, progress.train_loss = event["step"], event["value"]
    elif event["name"] == "test_accuracy" or (
            event["name"] == "test_accuracy_workers" and event["per_rank"]):
        progress.test_accuracy = event["value"]  # asynchronous runs: a worker's own model


def _stop(process: subprocess.Popen) -> None:
    """Terminate torchrun and its workers (their own process group), then make sure. A second
    interrupt while they shut down kills them at once."""
    for sig, wait_s in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        if process.poll() is not None:
            return
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            continue
        except (Interrupted, KeyboardInterrupt):
            continue  # on to SIGKILL


def _last_line(path: Path) -> str:
    try:
        lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    return lines[-1][:500] if lines else "(no output)"
