"""`dsgd plot`: a metric's curves over steps, epochs, time or bytes, into a file or the terminal."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from dsgd_cli.commands.common import DbOption
from dsgd_cli.commands.compare import WhereOption
from dsgd_cli.errors import DsgdError

if TYPE_CHECKING:
    from dsgd_cli.results import RunRecord


def plot(
    runs: Annotated[Optional[list[str]], typer.Argument(
        help="Run ids or experiment names (a grid's base name selects all its points); "
             "default: all runs")] = None,
    db: DbOption = None,
    where: WhereOption = None,
    by: Annotated[Optional[str], typer.Option(
        "--by", help="One line per group of runs with equal KEY[,KEY]: mean and ±std band")] = None,
    metric: Annotated[str, typer.Option("--metric", "-m", help="The metric to plot")] = "test_accuracy",
    x: Annotated[str, typer.Option("--x", help="The x axis: step, epoch, seconds or bytes")] = "step",
    last: Annotated[Optional[int], typer.Option("--last", min=1, help="Only the newest N runs")] = None,
    spec: Annotated[Optional[Path], typer.Option(
        "--spec", help="Only the newest run of each experiment of this spec")] = None,
    output: Annotated[Optional[Path], typer.Option(
        "--output", "-o", help="Write the chart to this file (.png, .pdf, .svg); "
                               "without it, draw it in the terminal")] = None,
) -> None:
    """Plot a metric of past runs: one line per run, or per group with --by."""
    # numpy, matplotlib and SQLAlchemy load here, not when the CLI starts.
    from dsgd_cli.plotting import X_AXES, figure, group_lines, run_lines, terminal_chart
    from dsgd_cli.query import check_keys, parse_where, pick, select_runs
    from dsgd_cli.results import Results

    if x not in X_AXES:
        raise DsgdError(f"--x: expected one of {', '.join(X_AXES)}, got {x!r}")
    conditions = [parse_where(text) for text in where or []]
    keys = [key.strip() for key in by.split(",") if key.strip()] if by else []
    store = Results(db)
    recorded = store.runs(details=False)
    chosen = select_runs(pick(recorded, runs or []), conditions)
    if spec is not None:
        from dsgd_cli.spec import load_spec  # imports torch and the plugins

        chosen = newest_of(chosen, [experiment.name for experiment in load_spec(spec)])
    if last:
        chosen = chosen[-last:]
    check_keys(keys, recorded, "--by")
    if not chosen:
        raise DsgdError("no recorded run matches: nothing to plot")
    lines = (group_lines(store, chosen, keys, metric, x) if keys
             else run_lines(store, chosen, metric, x))
    if output is None:
        size = shutil.get_terminal_size((100, 30))
        typer.echo(terminal_chart(lines, metric, x, size.columns, max(15, size.lines - 5),
                                  color=sys.stdout.isatty()))
        return
    try:
        figure(lines, metric, x).savefig(output, dpi=120)
    except (OSError, ValueError) as error:  # an unknown suffix, a directory that is not there
        raise DsgdError(f"--output {output}: {error}") from None
    typer.echo(f"wrote {output}")


def newest_of(runs: list[RunRecord], experiments: list[str]) -> list[RunRecord]:
    """The newest of `runs` of each experiment named (runs come oldest first)."""
    newest = {run.experiment: run for run in runs if run.experiment in set(experiments)}
    return sorted(newest.values(), key=lambda run: run.id)
