"""`dsgd advise`: for each algorithm among the selected runs and each worker count, the
predicted seconds per step, steps and time to a target, ranked; or what to run next where the
runs cannot support a number. The models are `dsgd_cli.results.advice`."""

from __future__ import annotations

import math
from typing import Annotated, Any, Optional

import typer

from dsgd_cli.commands.common import DbOption, ExperimentOption, FormatOption, WhereOption
from dsgd_cli.commands.output import check_format, fitted, readable, render
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
    from dsgd_cli.results.advice import MAX_FIT_ERROR, ROW_COLUMNS, advise as advise_rows
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
    overran = []
    if not any(condition.key == "timing" for condition in conditions):
        overran = [run for run in runs if run.timing == "overran"]
        runs = [run for run in runs if run.timing != "overran"]
    if not runs:
        raise DsgdError("no recorded run matches the selection (--experiment, --where)"
                        + (f" but {len(overran)} whose timing overran" if overran else "")
                        if experiment or where or overran
                        else f"no recorded runs in {store.shown_url}")
    keys = [key.strip() for key in by.split(",") if key.strip()] if by else default_keys(runs)
    check_keys(keys, recorded, "--by")

    rows = [_finite(row) for row in advise_rows(store, runs, goal, keys, counts)]
    notes = [_left_out_note(overran)] if overran else []
    if fmt not in ("csv", "json"):
        rows = [_extrapolated_warned(row) for row in rows]
        rows = _one_row_per_refusal(rows, keys)
        unsure = [row for row in rows if (row["fit_error"] or 0) > MAX_FIT_ERROR]
        for row in unsure:  # not a plain number: the models miss the group's own runs
            row.update({column: f"{readable(row[column], column)}?" for column in UNSURE_COLUMNS
                        if row[column] is not None})
        if unsure:
            notes.append(f"?: a fit_error above {MAX_FIT_ERROR:g}: the models miss this group's "
                         f"own runs by that much; not a number to go by")
    if fmt == "simple":
        typer.echo(fitted(rows, keys + ROW_COLUMNS, every="every row", labels=GIVEN_UP_FIRST))
    else:
        typer.echo(render(rows, fmt, keys + ROW_COLUMNS))
    for note in notes:
        typer.echo(note, err=fmt in ("csv", "json"))


# The columns a table too wide gives up first; `warning` and `advice` it never gives up
# (output.KEPT_COLUMNS), and the warning says what `fit_error` and `extrapolated` would.
GIVEN_UP_FIRST = ["clock", "time_low", "time_high", "seconds_per_step", "rank", "best",
                  "fit_error", "extrapolated", "steps_to_target"]


def _extrapolated_warned(row: dict[str, Any]) -> dict[str, Any]:
    """For a table: `extrapolated` as `yes`, and said first in the warning too, which a
    narrow table keeps."""
    if not row["extrapolated"]:
        return {**row, "extrapolated": ""}
    return {**row, "extrapolated": "yes",
            "warning": "; ".join(filter(None, ["extrapolated", row["warning"]]))}
# A prediction's numbers, marked `?` in a table where the group's fit error is too large.
UNSURE_COLUMNS = ["seconds_per_step", "steps_to_target", "time_to_target", "time_low",
                  "time_high"]


def _left_out_note(overran) -> str:
    return (f"(left out {len(overran)} run{'s' if len(overran) > 1 else ''} whose timing overran "
            f"their compute model: their seconds are partly this machine's; any --where on "
            f"timing, such as --where timing!=none, takes them in)")


def _one_row_per_refusal(rows: list[dict[str, Any]], keys: list[str]) -> list[dict[str, Any]]:
    """For a table: a group that gets advice instead of numbers in one row, not one per `n`,
    its `workers` the counts it was asked about."""
    shown, refused = [], {}
    for row in rows:
        if row["advice"] is None:
            shown.append(row)
            continue
        label = tuple(row[key] for key in keys)
        if label not in refused:
            refused[label] = {**row, "workers": []}
            shown.append(refused[label])
        refused[label]["workers"].append(row["workers"])
    for row in refused.values():
        counts = row["workers"]
        row["workers"] = (",".join(map(str, counts)) if len(counts) <= 3
                          else f"{counts[0]}-{counts[-1]}")
    return shown


def _finite(row: dict[str, Any]) -> dict[str, Any]:
    """No NaN or infinity leaves: json has no such numbers (a blank instead)."""
    return {key: None if isinstance(value, float) and not math.isfinite(value) else value
            for key, value in row.items()}
