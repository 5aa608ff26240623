"""`dsgd runs` (list runs; `runs delete`, `runs tag` change them) and `dsgd show`."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated

import typer

from dsgd_cli.commands.common import DbOption, ExperimentOption, FormatOption
from dsgd_cli.errors import DsgdError
from dsgd_cli.commands.output import check_format, fitted, readable, render, wrap_text

# real_seconds: how long the run took on this machine's clock, whatever clock its metrics are on;
# slurm: the SLURM jobs it ran in (`12_3`: task 3 of array job 12)
# timing: `overran` where the run's modeled times are partly this machine's (results.md)
LIST_COLUMNS = ["id", "experiment", "status", "workers", "clock", "timing", "started",
                "real_seconds", "tags", "slurm", "reason"]

runs_app = typer.Typer(invoke_without_command=True, no_args_is_help=False,
                       add_completion=False, pretty_exceptions_enable=False)


@runs_app.callback(invoke_without_command=True)
def runs(ctx: typer.Context, db: DbOption = None, experiment: ExperimentOption = None,
         fmt: FormatOption = "simple") -> None:
    """List recorded runs; `runs delete` deletes runs, `runs tag` tags them, `runs recover`
    stores a run's records kept while its database could not be written."""
    if ctx.invoked_subcommand is not None:
        if experiment or fmt != "simple":
            raise DsgdError(f"--experiment and --format belong to the listing, not to "
                            f"`dsgd runs {ctx.invoked_subcommand}`")
        return
    from dsgd_cli.results.query import check_experiment_names
    from dsgd_cli.results.reader import Results

    check_format(fmt)
    rows = []
    store = Results(db)
    listed = store.runs(experiments=experiment, details=False)
    check_experiment_names(experiment, listed, lambda: [r.experiment for r in store.runs(details=False)])
    for run in listed:
        duration = (run.ended_at - run.started_at).total_seconds() if run.ended_at else None
        tags = run.tag_names
        jobs = [str(job) for job in run.slurm_jobs]
        rows.append({"id": run.id, "experiment": run.experiment, "status": run.status,
                     "workers": run.workers, "clock": run.clock, "timing": run.timing,
                     "started": run.started_at.strftime("%Y-%m-%d %H:%M:%S"),
                     "real_seconds": duration, "tags": tags if fmt == "json" else ",".join(tags),
                     "slurm": jobs if fmt == "json" else ",".join(jobs),
                     "reason": run.reason})
    typer.echo(fitted(rows, LIST_COLUMNS) if fmt == "simple" else render(rows, fmt, LIST_COLUMNS))


RunIds = Annotated[list[int], typer.Argument(help="Run ids from `dsgd runs`", show_default=False)]


@runs_app.command("delete")
def delete(ctx: typer.Context, run_ids: RunIds, db: DbOption = None,
           force: Annotated[bool, typer.Option(
               "--force", help="Also delete runs still marked running")] = False) -> None:
    """Delete runs with their metrics, configuration, tags and checkpoints (an unknown id:
    none at all)."""
    from dsgd_cli.results.store import MAX_ID, Store
    from dsgd_cli.worker.checkpoint import remove_run

    store = Store(_db(ctx, db), create=False)
    checkpoints = [store.checkpoint_dir(run_id) for run_id in run_ids if 0 < run_id <= MAX_ID]
    deleted = store.delete_runs(run_ids, force=force)
    # Only the checkpoint files dsgd writes, never through a link: the recorded path is
    # whatever the database says, which is no reason to delete what is there.
    for left in filter(None, map(remove_run, filter(None, checkpoints))):
        typer.echo(f"dsgd: {left}", err=True)
    typer.echo(f"deleted run{'s' if len(deleted) > 1 else ''} {', '.join(map(str, deleted))}")


@runs_app.command("tag")
def tag(ctx: typer.Context,
        run_id: Annotated[int, typer.Argument(help="A run id from `dsgd runs`", show_default=False)],
        tags: Annotated[list[str], typer.Argument(help="Tags to add (or remove)", show_default=False)],
        db: DbOption = None,
        remove: Annotated[bool, typer.Option("--remove", help="Remove the tags instead")] = False,
        ) -> None:
    """Tag a run (`dsgd compare --where tag=TAG` selects by tag); --remove untags it."""
    from dsgd_cli.results.store import Store

    now = Store(_db(ctx, db), create=False).tag_run(run_id, tags, remove=remove)
    typer.echo(f"run {run_id}: " + (f"tags {', '.join(now)}" if now else "no tags"))


@runs_app.command("recover")
def recover(ctx: typer.Context,
            directory: Annotated[Path, typer.Argument(
                help="A dsgd-unrecorded-run* directory that `dsgd run` named", show_default=False)],
            db: DbOption = None) -> None:
    """Store the records of a run kept while its database could not be written; end the run."""
    from dsgd_cli.launch.unrecorded import recover as recover_run

    typer.echo(recover_run(directory, _db(ctx, db)))


def _db(ctx: typer.Context, db: str | None) -> str | None:
    """`dsgd runs --db X delete 3` and `dsgd runs delete 3 --db X` mean the same."""
    return db or (ctx.parent.params.get("db") if ctx.parent else None)


def show(run_id: Annotated[int, typer.Argument(help="A run id from `dsgd runs`")],
         db: DbOption = None) -> None:
    """Print one run: status, configuration, plugin versions and final metrics."""
    import yaml

    from dsgd_cli.spec.compute_model import overrun_advice
    from dsgd_cli.results.reader import Results, has_direction

    store = Results(db)
    run = store.get_run(run_id)
    if run is None:
        raise DsgdError(f"no run with id {run_id}")

    def echo(text: str) -> None:  # wrapped to a terminal or $COLUMNS (output.terminal_width)
        typer.echo(wrap_text(text))

    typer.echo(f"run {run.id}: {run.experiment}")
    echo(f"status: {_status_line(run.status, run.reason)}")
    echo("clock: " + ("modeled (an emulated cluster: every time below is modeled seconds, "
                      "real time ÷ compute.time_scale)" if run.clock == "modeled" else
                      "measured (seconds of this machine's clock)"))
    ended = run.ended_at.strftime("%Y-%m-%d %H:%M:%S") if run.ended_at else "-"
    echo(f"started: {run.started_at:%Y-%m-%d %H:%M:%S}  ended: {ended}  host: {run.host}  "
         f"dsgd {run.dsgd_version}  spec: {run.spec_file or '-'}")
    if run.tag_names:
        echo(f"tags: {', '.join(run.tag_names)}")
    if run.slurm_jobs:
        echo(f"slurm jobs: {', '.join(map(str, run.slurm_jobs))}")
    advice = overrun_advice(run)
    if advice:
        echo(f"emulation: {advice}")
    checkpoints = store.checkpoint_dir(run.id)
    if checkpoints:
        resumes = "; ".join(f"{r['at']} from step {r['step']}" for r in store.resumes(run.id))
        echo(f"checkpoints: {checkpoints}" + (f"  resumed: {resumes}" if resumes else ""))
    typer.echo("\nconfiguration:")
    typer.echo(yaml.safe_dump(_shown_numbers(run.config), sort_keys=False).rstrip())
    typer.echo("\nplugins:")
    typer.echo(render([{"kind": p.kind, "name": p.name, "distribution": p.distribution,
                        "version": p.version} for p in run.plugins]))
    picture = _cluster_picture(store, run)
    if picture:
        typer.echo("")
        typer.echo("\n".join(picture))
    typer.echo("\nmetrics:")
    # Each value in its metric's units (bytes in MB, seconds to three digits); a best value
    # only where the metric has a direction.
    typer.echo(render([{"metric": s.name, "final": readable(s.final, s.name),
                        "best": readable(s.best, s.name) if has_direction(s.name) else ""}
                       for s in sorted(run.summaries, key=lambda s: s.name)]))


def _cluster_picture(store, run) -> list[str]:
    """The run's cluster drawn with what it sent per link level (none without a cluster)."""
    from dsgd_cli.spec.resolved import read_key

    if read_key(run.config, "cluster") is None:
        return []  # and nothing imported: the picture's imports load torch
    from dsgd_cli.commands.cluster_picture import cluster_picture

    def peak_rate(level: str) -> float | None:
        records = store.metric_history(run.id, f"peak_rate_{level}")
        return max((record.value for record in records), default=None)
    finals = {summary.name: summary.final for summary in run.summaries}
    return cluster_picture(run.config, finals, peak_rate)


def _status_line(status: str, reason: str | None) -> str:
    """`failed (rank 1: ...)`; a reason that already starts with the status word is not
    repeated (`interrupted by SIGINT`, not `interrupted (interrupted by SIGINT)`)."""
    if not reason:
        return status
    return reason if reason.startswith(status) else f"{status} ({reason})"


def _shown_numbers(value):
    """The configuration with floats as people write them: 1e-4, not 9.999999999999999e-05
    (the stored values are unchanged; 12 significant digits keep every number a spec holds)."""
    if isinstance(value, dict):
        return {key: _shown_numbers(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_shown_numbers(item) for item in value]
    if isinstance(value, float) and math.isfinite(value):
        return float(f"{value:.12g}")
    return value
