"""`dsgd run --resume RUN_ID`: continue an interrupted or failed run from its last checkpoint.

The run goes on under its own id: the metrics recorded after the checkpoint's step are
dropped (its workers record those steps again), the resume is noted in the run, and the
workers start from every rank's saved state (model, optimizer, aggregator and compressor
state, random generators, position in the data). Synchronous algorithms on the CPU then end
with exactly the parameters of a run never interrupted; asynchronous ones resume correctly
but not bit for bit, as their workers' timing decides what they exchange.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from dsgd_cli.worker import checkpoint
from dsgd_cli.spec.config_versions import upgrade_config
from dsgd_cli.errors import DsgdError
from dsgd_cli.spec.experiments import Experiment
from dsgd_cli.results.store import Store

RESUMABLE = ("interrupted", "failed")


def resumable(store: Store, run_id: int, checkpoint_dir: str | Path | None = None) -> Experiment:
    """The experiment that continues run `run_id`, checked; nothing is changed yet.
    `checkpoint_dir` (`--checkpoint-dir`): where its checkpoints are now, if they moved."""
    run = store.get_run(run_id)
    if run is None:
        raise DsgdError(f"no run with id {run_id} in {store.shown_url}")
    if run.status not in RESUMABLE:
        raise DsgdError(f"run {run_id} is {run.status}: only interrupted or failed runs resume")
    machines = run.config.get("nnodes") or 1
    if machines > 1:  # it would need every machine again, each with its ranks: not built
        raise DsgdError(f"run {run_id} ran over {machines} machines, and --resume continues a "
                        "run on one machine only: run its experiment again (a new run)")
    directory = locate(store.checkpoint_dir(run_id), checkpoint_dir)
    if directory is not None and os.path.lexists(directory):
        try:
            checkpoint.check_directory(directory)
        except checkpoint.CheckpointRefused as refused:
            raise DsgdError(f"run {run_id} cannot resume: {refused}") from None
    for stray in checkpoint.strays(directory):
        print(f"dsgd: run {run_id}: skipped {stray}", file=sys.stderr)
    step, damaged = checkpoint.latest_sound(directory, run.workers)
    if step is None and damaged:
        earlier = ("as is its earlier checkpoint" if len(damaged) == 2 else
                   "as are its earlier checkpoints" if len(damaged) > 2 else
                   "and it has no earlier complete checkpoint")
        raise DsgdError(f"run {run_id} cannot resume: {damaged[0]}, {earlier}")
    if step is None:
        why = ("its spec set no checkpoint_every" if directory is None
               else f"none complete in {directory}")
        raise DsgdError(f"run {run_id} has no checkpoint to resume from ({why})")
    for problem in damaged:
        print(f"dsgd: run {run_id}: {problem}; resuming from the checkpoint of step {step}",
              file=sys.stderr)
    try:
        config = upgrade_config(run.config)  # as the workers of this version read it
    except DsgdError as error:
        raise DsgdError(f"run {run_id} cannot resume: {error}") from None
    experiment = Experiment(run.experiment, config, checkpoint_dir=directory, resume_step=step,
                            run_id=run_id)
    try:
        experiment.resolved  # each plugin still installed (else a clear error), with its options
    except (TypeError, ValueError) as error:  # options an installed plugin no longer takes
        raise DsgdError(f"run {run_id} cannot resume: {error}") from None
    return experiment


def locate(recorded: str | None, option: str | Path | None) -> str | None:
    """Where a run's checkpoints are: in the directory `--checkpoint-dir` names (`option`: the
    run's own directory, or one holding it under its recorded name), else where they were
    recorded, else in $DSGD_CHECKPOINTS under that name; the recorded place when none holds
    any."""
    if recorded is None:
        return None
    roots = [Path(option)] if option else [Path(recorded)] + (
        [Path(os.environ[checkpoint.ENV_ROOT])] if os.environ.get(checkpoint.ENV_ROOT) else [])
    # Made absolute, never resolved: a link there is refused (`check_directory`), not
    # followed to wherever it points, which would be recorded and later deleted.
    for root in roots:
        root = Path(os.path.abspath(root.expanduser()))
        for directory in (root, root / Path(recorded).name):
            if checkpoint.steps(directory):
                return str(directory)
    return os.path.abspath(Path(option).expanduser()) if option else recorded


def reopen(store: Store, experiment: Experiment) -> None:
    """Make way for the resumed workers: the later steps' checkpoints go (an earlier attempt
    may have written files for them: incomplete or damaged, or the run would resume from
    one), and so do the metrics recorded after the step. The earlier steps stay until the
    resumed run has written a newer complete one: a failed load can still fall back on them."""
    checkpoint.remove_later(experiment.checkpoint_dir, experiment.resume_step)
    store.resume_run(experiment.run_id, experiment.resume_step, experiment.checkpoint_dir)
