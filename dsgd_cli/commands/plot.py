"""`dsgd plot`: a metric's curves over steps, epochs, time or bytes, into a file or the terminal."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from dsgd_cli.commands.common import DbOption, LastOption, WhereOption
from dsgd_cli.errors import DsgdError

if TYPE_CHECKING:
    from dsgd_cli.results.reader import RunRecord

CHART_FORMATS = ("png", "pdf", "svg")


def plot(
    runs: Annotated[Optional[list[str]], typer.Argument(
        help="Run ids or experiment names (a grid's base name selects all its points); "
             "default: all runs")] = None,
    db: DbOption = None,
    where: WhereOption = None,
    by: Annotated[Optional[str], typer.Option(
        "--by", help="One line per group of runs with equal KEY[,KEY]: the mean with a band")] = None,
    band: Annotated[str, typer.Option(
        "--band", help="What a group's band shows: ci (the 95% interval of the mean) or std")] = "ci",
    metric: Annotated[str, typer.Option("--metric", "-m", help="The metric to plot")] = "test_accuracy",
    x: Annotated[str, typer.Option("--x", help="The x axis: step, epoch, seconds or bytes")] = "step",
    last: LastOption = None,
    spec: Annotated[Optional[Path], typer.Option(
        "--spec", help="Only the newest run of each experiment of this spec")] = None,
    output: Annotated[Optional[Path], typer.Option(
        "--output", "-o", help="Write the chart to this file (.png, .pdf, .svg); "
                               "without it, draw it in the terminal")] = None,
) -> None:
    """Plot a metric of past runs: one line per run, or per group with --by."""
    # numpy, matplotlib and SQLAlchemy load here, not when the CLI starts.
    from dsgd_cli.results.plotting import (BANDS, X_AXES, coincidence_notes, figure,
                                            group_lines, run_lines, terminal_chart)
    from dsgd_cli.results.query import (check_keys, clocks_note, overran_note, parse_where, pick,
                                        select_runs)
    from dsgd_cli.results.reader import Results

    if x not in X_AXES:
        raise DsgdError(f"--x: expected one of {', '.join(X_AXES)}, got {x!r}")
    if band not in BANDS:
        raise DsgdError(f"--band: expected one of {', '.join(BANDS)}, got {band!r}")
    file_format = None if output is None else chart_format(output)
    conditions = [parse_where(text) for text in where or []]
    keys = [key.strip() for key in by.split(",") if key.strip()] if by else []
    store = Results(db)
    recorded = store.runs(details=False)
    chosen = select_runs(pick(recorded, runs or []), conditions)
    if spec is not None:
        from dsgd_cli.spec.experiments import load_spec  # imports torch and the plugins

        chosen = newest_of(chosen, [experiment.name for experiment in load_spec(spec)])
    if last:
        chosen = chosen[-last:]
    check_keys(keys, recorded, "--by")
    if not chosen:
        raise DsgdError("no recorded run matches: nothing to plot")
    lines = (group_lines(store, chosen, keys, metric, x, band) if keys
             else run_lines(store, chosen, metric, x))
    clocks = {run.clock for run in chosen}
    clock = clocks.pop() if len(clocks) == 1 else "mixed"
    for note in (clocks_note(chosen), overran_note(chosen),
                 *coincidence_notes(lines, terminal=output is None)):
        if note:
            typer.echo(note, err=True)
    if output is None:
        size = shutil.get_terminal_size((100, 30))
        typer.echo(terminal_chart(lines, metric, x, size.columns, max(15, size.lines - 5),
                                  color=sys.stdout.isatty(), clock=clock))
        return
    write_chart(figure(lines, metric, x, clock, keys), output, file_format)
    typer.echo(f"wrote {output}")


def chart_format(output: Path) -> str:
    """The file format `output` names by its suffix; a DsgdError for a name without a known
    one, or a directory (matplotlib would write another file than the one named)."""
    if output.is_dir():
        raise DsgdError(f"--output {output}: is a directory; name the file to write "
                        f"({', '.join('.' + f for f in CHART_FORMATS)})")
    file_format = output.suffix.lower().lstrip(".")
    if file_format not in CHART_FORMATS:
        raise DsgdError(f"--output {output}: expected a file name ending in "
                        f"{', '.join('.' + f for f in CHART_FORMATS)}")
    return file_format


def write_chart(chart, output: Path, file_format: str) -> None:
    """Write the chart to exactly `output`: whole, or (on an error) not at all."""
    partial = output.with_name(f".{output.name}.partial")
    try:
        chart.savefig(partial, format=file_format, dpi=120)
        os.replace(partial, output)
    except OSError as error:  # a directory that is not there, a full disk
        partial.unlink(missing_ok=True)
        raise DsgdError(f"--output {output}: {error.strerror or error}") from None


def newest_of(runs: list[RunRecord], experiments: list[str]) -> list[RunRecord]:
    """The newest of `runs` of each experiment named (runs come oldest first)."""
    newest = {run.experiment: run for run in runs if run.experiment in set(experiments)}
    return sorted(newest.values(), key=lambda run: run.id)
