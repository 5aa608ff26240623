"""`dsgd runs` and `dsgd show`: list runs, or everything about one."""

from __future__ import annotations

from typing import Annotated

import typer
import yaml

from dsgd_cli.commands.common import DbOption, ExperimentOption, FormatOption
from dsgd_cli.errors import DsgdError
from dsgd_cli.output import check_format, render
from dsgd_cli.store import Store

MAX_RUN_ID = 2**63 - 1  # the largest id a database integer holds


def runs(db: DbOption = None, experiment: ExperimentOption = None,
         fmt: FormatOption = "simple") -> None:
    """List recorded runs."""
    check_format(fmt)
    rows = []
    for run in Store(db, readonly=True).runs(experiments=experiment):
        duration = (run.ended_at - run.started_at).total_seconds() if run.ended_at else None
        rows.append({"id": run.id, "experiment": run.experiment, "status": run.status,
                     "workers": run.workers, "started": run.started_at.strftime("%Y-%m-%d %H:%M:%S"),
                     "seconds": duration, "reason": run.reason})
    typer.echo(render(rows, fmt, ["id", "experiment", "status", "workers", "started", "seconds", "reason"]))


def show(run_id: Annotated[int, typer.Argument(help="A run id from `dsgd runs`")],
         db: DbOption = None) -> None:
    """Print one run: status, configuration, plugin versions and final metrics."""
    store = Store(db, readonly=True)
    run = store.get_run(run_id) if 0 < run_id <= MAX_RUN_ID else None
    if run is None:
        raise DsgdError(f"no run with id {run_id}")
    typer.echo(f"run {run.id}: {run.experiment}")
    typer.echo(f"status: {run.status}" + (f" ({run.reason})" if run.reason else ""))
    ended = run.ended_at.strftime("%Y-%m-%d %H:%M:%S") if run.ended_at else "-"
    typer.echo(f"started: {run.started_at:%Y-%m-%d %H:%M:%S}  ended: {ended}  host: {run.host}  "
               f"dsgd {run.dsgd_version}  spec: {run.spec_file or '-'}")
    typer.echo("\nconfiguration:")
    typer.echo(yaml.safe_dump(run.config, sort_keys=False).rstrip())
    typer.echo("\nplugins:")
    typer.echo(render([{"kind": p.kind, "name": p.name, "distribution": p.distribution,
                        "version": p.version} for p in run.plugins]))
    typer.echo("\nmetrics:")
    typer.echo(render([{"metric": s.name, "final": s.final, "best": s.best}
                       for s in sorted(run.summaries, key=lambda s: s.name)]))
