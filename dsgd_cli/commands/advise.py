"""`dsgd advise`: for each algorithm among the selected runs and each worker count, the
predicted seconds per step, steps and time to a target, ranked; or what to run next where the
runs cannot support a number. The models are `dsgd_cli.results.advice`."""

from __future__ import annotations

import math
from typing import Annotated, Any, Optional

import typer

from dsgd_cli.commands.common import DbOption, ExperimentOption, FormatOption, WhereOption
from dsgd_cli.commands.output import check_format, fitted, render
from dsgd_cli.errors import DsgdError


def advise(
    target: Annotated[str, typer.Option(
        "--target", help="METRIC=VALUE to reach, e.g. test_accuracy=0.85")],
    db: DbOption = None,
    experiment: ExperimentOption = None,
    where: WhereOption = None,
    by: Annotated[Optional[str], typer.Option(
        "--by", help="Group runs by these keys (KEY[,KEY]) (default: aggregator, compressor, "
        "topology and the options that differ)")] = None,
    workers: Annotated[Optional[str], typer.Option(
        "--workers", help="Worker counts to predict at, e.g. 2,4,8,16 (default: the recorded "
        "counts and their doublings up to 64)")] = None,
    fmt: FormatOption = "simple",
) -> None:
    """Which algorithm and how many workers reach a target soonest, predicted from past runs."""
    from dsgd_cli.results.advice import ROW_COLUMNS, advise as advise_rows
    from dsgd_cli.results.advice import default_keys, parse_workers
    from dsgd_cli.results.analysis import parse_target
    from dsgd_cli.results.query import check_experiment_names, check_keys, parse_where, select_runs
    from dsgd_cli.results.reader import Results

    check_format(fmt)
    goal = parse_target(target)
    conditions = [parse_where(text) for text in where or []]
    counts = parse_workers(workers) if workers is not None else None
    store = Results(db)
    recorded = store.runs(experiments=experiment, details=False)
    check_experiment_names(experiment, recorded, lambda: [r.experiment for r in store.runs(details=False)])
    runs = select_runs(recorded, conditions)
    if not runs:
        raise DsgdError("no recorded run matches the selection (--experiment, --where)"
                        if experiment or where else f"no recorded runs in {store.shown_url}")
    keys = [key.strip() for key in by.split(",") if key.strip()] if by else default_keys(runs)
    check_keys(keys, recorded, "--by")

    rows = [_finite(row) for row in advise_rows(store, runs, goal, keys, counts)]
    if fmt not in ("csv", "json"):
        rows = [{**row, "extrapolated": "yes" if row["extrapolated"] else ""} for row in rows]
    if fmt == "simple":
        typer.echo(fitted(rows, keys + ROW_COLUMNS, every="every row"))
    else:
        typer.echo(render(rows, fmt, keys + ROW_COLUMNS))


def _finite(row: dict[str, Any]) -> dict[str, Any]:
    """No NaN or infinity leaves: json has no such numbers (a blank instead)."""
    return {key: None if isinstance(value, float) and not math.isfinite(value) else value
            for key, value in row.items()}
