"""A run whose database could not be written any more (the file made read-only, a full disk,
a server gone): its launch is stopped, and what its workers recorded is kept in a directory
of its own, `dsgd-unrecorded-run<ID>-<time>/` in the working directory (their event files,
and what the launcher had read of them but not stored). Once the database can be written
again, `dsgd runs recover DIR` stores those records and ends the run, which stayed `running`
meanwhile, as its workers' events say (`interrupted` if they were stopped part-way).
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict
from pathlib import Path

from dsgd_cli.results import strictjson
from dsgd_cli.errors import DsgdError
from dsgd_cli.launch.outcome import run_result
from dsgd_cli.launch.run_events import RunEvents
from dsgd_cli.spec.config_versions import upgrade_config
from dsgd_cli.results.store import MetricRow, Store
from dsgd_cli.spec.experiments import Experiment

STATE_FILE = "unrecorded.json"


class RecordingLost(DsgdError):
    """The results database could not be written during a run."""

    exit_code = 1


def keep(run_id: int, experiment: Experiment, events: RunEvents, reason: str,
         where: Path | None = None) -> Path:
    """Copy the run's event files and what the launcher read of them but did not store
    (`events`) into a new directory under `where` (default: the working directory); returns it."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    directory = Path(where or Path.cwd()) / f"dsgd-unrecorded-run{run_id}-{stamp}"
    directory.mkdir(parents=True)
    for path in events.events_dir.glob("rank*.jsonl"):
        shutil.copy2(path, directory / path.name)
    state = {
        "run_id": run_id, "experiment": experiment.name, "workers": experiment.workers,
        "reason": reason,
        # Where the launcher had read each rank's file to: what follows was never read.
        "offsets": {str(rank): offset for rank, offset in events.offsets.items()},
        "unstored": [asdict(row) for row in events.unstored],
        "problems": events.problems, "done_ranks": sorted(events.done_ranks),
        "stopped_ranks": sorted(events.stopped_ranks),
    }
    (directory / STATE_FILE).write_text(strictjson.dumps(state))
    return directory


def recover(directory: Path, db: str | None) -> str:
    """Store what `keep` kept in `directory` into the database, end the run, remove the
    directory; returns what was done, for the user."""
    state = _read_state(directory)
    store = Store(db, create=False)
    run_id = state["run_id"]
    run = store.get_run(run_id)
    if run is None:
        raise DsgdError(f"{directory}: no run with id {run_id} in {store.shown_url}")
    if run.status != "running":
        raise DsgdError(f"{directory}: run {run_id} is {run.status} already; nothing recovered")
    events = _events_as_kept(directory, state)
    events.read()
    rows = events.unstored
    store.add_metrics(run_id, rows)
    if events.problems or len(events.done_ranks) == state["workers"]:
        # it ended by itself: as the launcher would say
        result = run_result(run_id, Experiment(run.experiment, upgrade_config(run.config)), events.problems,
                            events.done_ranks, 0, "")
        status, reason, rank = result.status, result.reason, result.failed_rank
    else:  # stopped part-way by dsgd, as it could not record it: it may resume
        status, rank = "interrupted", None
        reason = f"stopped: the results database could not be written ({state['reason']})"
    store.finish_run(run_id, status, reason, rank)
    shutil.rmtree(directory)
    return f"run {run_id}: {len(rows)} records recovered; {status}"


def _events_as_kept(directory: Path, state: dict) -> RunEvents:
    """The kept event files, to be read on from where the launcher stopped, with what it had
    read of them before."""
    offsets = {int(rank): offset for rank, offset in state["offsets"].items()}
    events = RunEvents(directory, offsets=offsets)
    events.unstored = [MetricRow(**row) for row in state["unstored"]]
    events.problems = list(state["problems"])
    events.done_ranks = set(state["done_ranks"])
    events.stopped_ranks = set(state.get("stopped_ranks", ()))  # not kept by earlier versions
    return events


def _read_state(directory: Path) -> dict:
    try:
        return json.loads((directory / STATE_FILE).read_text())
    except FileNotFoundError:
        raise DsgdError(f"{directory}: not a directory of unrecorded records (no {STATE_FILE})") from None
    except (OSError, ValueError) as error:
        raise DsgdError(f"{directory / STATE_FILE}: cannot be read ({error})") from None
