"""`dsgd compare`: one row per run (or per group of runs) with its final metrics, filtered,
grouped, set against a baseline, timed to a target and sorted."""

from __future__ import annotations

import shutil
import textwrap
from typing import Annotated, Any, Optional

import typer

from dsgd_cli.commands.common import (ColumnsOption, DbOption, ExperimentOption, FormatOption,
                                     LastOption, WhereOption, split_columns)
from dsgd_cli.commands.output import LABEL_COLUMNS, check_format, fitted, readable, render

RUN_COLUMNS = ["id", "experiment", "aggregator", "optimizer", "task", "workers", "clock", "timing",
               "status"]


def compare(
    db: DbOption = None,
    experiment: ExperimentOption = None,
    where: WhereOption = None,
    by: Annotated[Optional[str], typer.Option(
        "--by", help="Group runs by these keys (KEY[,KEY]): one row per group of seeds, mean ± "
        "the half-width of its 95% interval; runs that differ in other keys are split")] = None,
    baseline: Annotated[Optional[str], typer.Option(
        "--baseline", help="An EXPERIMENT or RUN_ID: adds speedup, wall_ratio, bytes_ratio, "
        "accuracy_diff against its runs set up alike (task, workers, clock, ...)")] = None,
    target: Annotated[Optional[str], typer.Option(
        "--target", help="METRIC=VALUE: adds time, steps and bytes to first reach it")] = None,
    sort: Annotated[Optional[str], typer.Option(
        "--sort", help="Sort by this column (a leading - sorts descending)")] = None,
    last: LastOption = None,
    metric: Annotated[Optional[list[str]], typer.Option(
        "--metric", "-m", help="Another metric column (repeatable)")] = None,
    fmt: FormatOption = "simple",
    shown: ColumnsOption = None,
) -> None:
    """Tabulate past runs: configuration and final metrics, one row per run or per group."""
    from dsgd_cli.results.analysis import (BASELINE_COLUMNS, TARGET_COLUMNS, add_baseline,
                                           baseline_runs, group_rows, metric_columns,
                                           parse_target, run_rows, sort_rows, split_keys)
    from dsgd_cli.results.query import (check_experiment_names, check_keys, clocks_note,
                                        overran_note, parse_where, select_runs)
    from dsgd_cli.results.reader import Results

    check_format(fmt)
    conditions = [parse_where(text) for text in where or []]
    goal = parse_target(target) if target else None
    keys = [key.strip() for key in by.split(",") if key.strip()] if by else []
    store = Results(db)
    recorded = store.runs(experiments=experiment, details=False)
    check_experiment_names(experiment, recorded, lambda: [r.experiment for r in store.runs(details=False)])
    runs = select_runs(recorded, conditions)
    hidden = [] if _asks_for_status(conditions) else [r for r in runs if r.status == "interrupted"]
    runs = [run for run in runs if run not in hidden]
    if last:
        runs = runs[-last:]
    check_keys(keys, recorded, "--by")

    picked = split_columns(shown)
    finals = store.finals([run.id for run in runs])
    metrics = metric_columns([*(metric or []), *_recorded_picks(picked, finals)])
    reached = None
    if goal:
        from dsgd_cli.results.history import reach_times  # SQLAlchemy, for this query only

        reached = reach_times(store, [run.id for run in runs], goal)
    rows = run_rows(runs, finals, metrics, reached)
    row_runs = runs  # the run each row stands for (a group: its first, the others its seeds)
    split = split_keys(runs, keys) if keys else []
    if keys:
        values = metrics + (list(TARGET_COLUMNS) if goal else [])
        rows, groups = group_rows(runs, rows, keys + split, values)
        row_runs = [members[0] for members in groups]
    if baseline:
        # The baseline may be a run that --experiment or --where left out.
        base = baseline_runs(store.runs(details=False) if experiment else recorded, baseline)
        add_baseline(rows, row_runs, base, store.finals([run.id for run in base]))
    if sort:
        rows = sort_rows(rows, sort)

    columns = (keys + split + ["runs"] if keys else list(RUN_COLUMNS)) + metrics
    if goal:
        columns += list(TARGET_COLUMNS) + (["reached"] if keys else [])
    if baseline:
        columns += ["baseline"] + [column for column, _, _ in BASELINE_COLUMNS]
    compared = [column for column, _, _ in BASELINE_COLUMNS] if baseline else []
    if keys and fmt not in ("csv", "json"):
        rows = [_with_spread(row, metrics + (list(TARGET_COLUMNS) if goal else []), compared)
                for row in rows]
    elif keys:
        columns = _with_std_columns(columns, metrics + (list(TARGET_COLUMNS) if goal else []),
                                    compared)
    notes = [note for note in (_split_note(split), _hidden_note(hidden)) if note]
    if fmt not in ("csv", "json"):  # said above the table; csv and json stay data
        for note in notes:
            typer.echo(textwrap.fill(note, shutil.get_terminal_size((100, 24)).columns,
                                     subsequent_indent="  "))
        notes = []
    if fmt == "simple":
        give_up = _give_up_first(keys + split, metric or [], asked=bool(goal or baseline or metric))
        typer.echo(fitted(rows, columns, picked=picked, labels=give_up,
                          every="every group" if keys else "all runs"))
    else:
        typer.echo(render(rows, fmt, columns))
    for note in [*notes, clocks_note(runs), overran_note(runs)]:
        if note:
            typer.echo(note, err=True)


# The default metrics a narrow table gives up for the columns its options asked for.
SPARED_METRICS = ["total_bytes_sent", "samples_per_second", "train_loss", "test_loss"]


def _give_up_first(keys: list[str], named_metrics: list[str], asked: bool) -> list[str]:
    """The columns a table too wide for the terminal leaves out first: the run's labels but a
    group's keys (they say what it is), then, where --target, --baseline or --metric asked
    for columns, the default metrics but accuracy and time, and the baseline's run ids."""
    labels = [column for column in LABEL_COLUMNS if column not in keys]
    if not asked:
        return labels
    return labels + [m for m in SPARED_METRICS if m not in named_metrics] + ["baseline"]


def _recorded_picks(picked: list[str] | None, finals: dict[int, dict[str, float]]) -> list[str]:
    """The names in `--columns` that are metrics some selected run recorded (`comm_overrun`,
    `total_bytes_sent_inter_region`): each becomes a metric column, as `--metric` makes it."""
    recorded = {name for values in finals.values() for name in values}
    return [name for name in picked or [] if name in recorded]


def _asks_for_status(conditions) -> bool:
    return any(condition.key == "status" for condition in conditions)


def _split_note(split: list[str]) -> str | None:
    """What the header says when `--by`'s groups were split: a group holds runs that differ
    only in their seed, so runs that differ in other keys are set apart by them."""
    if not split:
        return None
    return (f"groups split by {', '.join(split)} too: only seeds are pooled, and their runs "
            f"differ in these")


def _hidden_note(hidden) -> str | None:
    if not hidden:
        return None
    return (f"({len(hidden)} interrupted run{'s' if len(hidden) > 1 else ''} not shown: "
            f"--where status=interrupted shows them)")


def _with_spread(row: dict[str, Any], names: list[str], compared: list[str]) -> dict[str, Any]:
    """For a table: each group mean shown as `mean ± h (n=k)`, h the half-width of the 95%
    confidence interval over the group's k runs; a single run shows its value alone. Each
    comparison with the baseline (`compared`) as `value [low, high]` where it has an interval
    (a ratio's interval is not symmetric)."""
    shown = dict(row)
    for name in names:
        mean, low, high = row.get(name), row.get(f"{name}_ci_low"), row.get(f"{name}_ci_high")
        if mean is not None and low is not None:
            half = (high - low) / 2
            shown[name] = f"{readable(mean, name)} ± {readable(half, name)} (n={row[f'{name}_n']})"
    for name in compared:
        value, low, high = row.get(name), row.get(f"{name}_ci_low"), row.get(f"{name}_ci_high")
        if value is not None and low is not None:
            shown[name] = f"{readable(value, name)} [{readable(low, name)}, {readable(high, name)}]"
    return shown


def _with_std_columns(columns: list[str], names: list[str], compared: list[str]) -> list[str]:
    """For csv and json: each mean column followed by its spread: `_std`, `_ci_low`, `_ci_high`
    (the 95% interval of the mean) and `_n` (the runs behind them); each comparison with the
    baseline by its interval."""
    result = []
    for column in columns:
        result.append(column)
        if column in names:
            result += [f"{column}_{part}" for part in ("std", "ci_low", "ci_high", "n")]
        if column in compared:
            result += [f"{column}_ci_low", f"{column}_ci_high"]
    return result
