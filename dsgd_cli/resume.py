"""`dsgd run --resume RUN_ID`: continue an interrupted or failed run from its last checkpoint.

The run goes on under its own id: the metrics recorded after the checkpoint's step are
dropped (its workers record those steps again), the resume is noted in the run, and the
workers start from every rank's saved state (model, optimizer, aggregator and compressor
state, random generators, position in the data). Synchronous algorithms on the CPU then end
with exactly the parameters of a run never interrupted; asynchronous ones resume correctly
but not bit for bit, as their workers' timing decides what they exchange.
"""

from __future__ import annotations

from dsgd_cli import checkpoint, registry
from dsgd_cli.errors import DsgdError
from dsgd_cli.spec import PLUGIN_SECTIONS, Experiment
from dsgd_cli.store import Store

RESUMABLE = ("interrupted", "failed")


def resumable(store: Store, run_id: int) -> Experiment:
    """The experiment that continues run `run_id`, checked; nothing is changed yet."""
    run = store.get_run(run_id)
    if run is None:
        raise DsgdError(f"no run with id {run_id} in {store.shown_url}")
    if run.status not in RESUMABLE:
        raise DsgdError(f"run {run_id} is {run.status}: only interrupted or failed runs resume")
    directory = store.checkpoint_dir(run_id)
    step = checkpoint.latest_complete(directory, run.workers)
    if step is None:
        why = ("its spec set no checkpoint_every" if directory is None
               else f"none complete in {directory}")
        raise DsgdError(f"run {run_id} has no checkpoint to resume from ({why})")
    for kind in PLUGIN_SECTIONS:
        if kind in run.config:  # runs recorded before lr_schedule existed have none
            registry.load(kind, run.config[kind]["name"])  # still installed: else a clear error
    return Experiment(run.experiment, run.config, checkpoint_dir=directory, resume_step=step,
                      run_id=run_id)


def reopen(store: Store, experiment: Experiment) -> None:
    """Make way for the resumed workers: the other steps' checkpoints go (an earlier attempt
    may have written files for later ones), and so do the metrics recorded after the step."""
    checkpoint.keep_only(experiment.checkpoint_dir, experiment.resume_step)
    store.resume_run(experiment.run_id, experiment.resume_step)
