"""How a run ended: its status, reason and failed rank, from what its workers said (their
`error`, `diverged` and `done` events), what torchrun reported of the workers that failed, and
torchrun's own exit. The launcher decides with these as a launch ends; `dsgd runs recover`
(unrecorded.py) decides with them for a run whose database could not be written.
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from dsgd_cli.spec import nodes

if TYPE_CHECKING:
    from dsgd_cli.launch.run_events import RunEvents
    from dsgd_cli.spec.experiments import Experiment

LAST_LINES = 3  # of the launch's output, in the reason of a run that failed without a word


@dataclass
class RunResult:
    run_id: int
    experiment: str
    status: str
    reason: str | None = None
    failed_rank: int | None = None


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


def listed_ranks(log: str) -> set[int]:
    """The ranks torchrun's error summary lists: those that did not exit with 0."""
    return {int(match.group(1)) for match in _FAILURE.finditer(log)}


def left_early(experiment: Experiment, said: RunEvents, listed: set[int],
               returncode: int) -> list[int]:
    """The ranks of this machine that exited with code 0 before the end of the run: they
    wrote no `done`, `error`, `diverged` or `stopped` event (`said`), and are not `listed`
    among the workers that did not exit 0 (those that failed and those stopped then).
    Known only when that list is known, or the launch exited with code 0."""
    if experiment.nodes is not None:  # other ranks' events are on other machines
        return []
    if not listed and returncode != 0:
        return []
    return left_without_a_word(said, set(range(experiment.workers)) - listed)


def left_without_a_word(said: RunEvents, exited_zero: set[int]) -> list[int]:
    """The ranks among `exited_zero` (seen to exit with code 0 while the launch runs) that
    wrote no `done`, `stopped`, `error` or `diverged` event: they left before the end."""
    spoke = said.done_ranks | said.stopped_ranks | {event["rank"] for event in said.problems}
    return sorted(exited_zero - spoke)


def rendezvous_failure(experiment: Experiment, log: str) -> str | None:
    """The reason of a run over several machines whose nodes did not all meet."""
    plan = experiment.nodes
    if plan is None or "RendezvousTimeoutError" not in log:
        return None
    return (f"rendezvous at {plan.endpoint} timed out: not all {plan.nnodes} nodes joined "
            f"within {plan.timeout:g} s")


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
        return _first_problem(run_id, experiment, problems)
    if launch_failure is not None:
        return RunResult(run_id, experiment.name, "failed", launch_failure)
    if returncode != 0 or len(done_ranks) < nodes.local_workers(experiment.nodes, experiment.workers):
        return RunResult(run_id, experiment.name, "failed",
                         f"torchrun {describe_exit(returncode)}: {log_tail}")
    return RunResult(run_id, experiment.name, "completed")


def _first_problem(run_id: int, experiment: Experiment, problems: list[dict]) -> RunResult:
    """The run's end as told by the first problem a worker reported."""
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


def launch_dir_full(launch_dir: Path) -> str:
    """The reason of a run whose launch directory (in $TMPDIR) ran out of space."""
    return (f"no space left on device in the launch directory {launch_dir} (in $TMPDIR, "
            f"{launch_dir.parent}), where the workers write their events and output: free "
            "space there, or set TMPDIR to a larger filesystem")


def last_lines(text: str, count: int = LAST_LINES) -> str:
    """The last `count` lines of the launch's output that say something, on one line."""
    lines = [line.strip()[:200] for line in text.splitlines() if line.strip()]
    return " | ".join(lines[-count:]) if lines else "(no output)"
