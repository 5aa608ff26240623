"""`dsgd compare`: one row per run (or per group of runs) with its final metrics, filtered,
grouped, set against a baseline, timed to a target and sorted."""

from __future__ import annotations

from typing import Annotated, Any, Optional

import typer

from dsgd_cli.commands.common import (ColumnsOption, DbOption, ExperimentOption, FormatOption,
                                     LastOption, WhereOption, split_columns)
from dsgd_cli.commands.output import check_format, fitted, readable, render

RUN_COLUMNS = ["id", "experiment", "aggregator", "optimizer", "task", "workers", "clock", "status"]


def compare(
    db: DbOption = None,
    experiment: ExperimentOption = None,
    where: WhereOption = None,
    by: Annotated[Optional[str], typer.Option(
        "--by", help="Group runs by these keys (KEY[,KEY]): one row per group, mean ± std")] = None,
    baseline: Annotated[Optional[str], typer.Option(
        "--baseline", help="An EXPERIMENT or RUN_ID: adds speedup, wall_ratio, bytes_ratio, "
        "accuracy_diff against it")] = None,
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
                                           baseline_values, group_rows, metric_columns,
                                           parse_target, run_rows, sort_rows)
    from dsgd_cli.results.query import (check_experiment_names, check_keys, clocks_note, parse_where,
                                        select_runs)
    from dsgd_cli.results.reader import Results

    check_format(fmt)
    conditions = [parse_where(text) for text in where or []]
    goal = parse_target(target) if target else None
    keys = [key.strip() for key in by.split(",") if key.strip()] if by else []
    store = Results(db)
    recorded = store.runs(experiments=experiment, details=False)
    check_experiment_names(experiment, recorded, lambda: [r.experiment for r in store.runs(details=False)])
    runs = select_runs(recorded, conditions)
    if last:
        runs = runs[-last:]
    check_keys(keys, recorded, "--by")

    metrics = metric_columns(metric)
    reached = None
    if goal:
        from dsgd_cli.results.history import reach_times  # SQLAlchemy, for this query only

        reached = reach_times(store, [run.id for run in runs], goal)
    rows = run_rows(runs, store.finals([run.id for run in runs]), metrics, reached)
    if keys:
        values = metrics + (list(TARGET_COLUMNS) if goal else [])
        rows = group_rows(runs, rows, keys, values)
    if baseline:
        # The baseline may be a run that --experiment left out.
        candidates = store.runs(details=False) if experiment else recorded
        add_baseline(rows, baseline_values(store, candidates, baseline))
    if sort:
        rows = sort_rows(rows, sort)

    columns = (keys + ["runs"] if keys else list(RUN_COLUMNS)) + metrics
    if goal:
        columns += list(TARGET_COLUMNS) + (["reached"] if keys else [])
    if baseline:
        columns += [column for column, _, _ in BASELINE_COLUMNS]
    compared = [column for column, _, _ in BASELINE_COLUMNS] if baseline else []
    if keys and fmt not in ("csv", "json"):
        rows = [_with_spread(row, metrics + (list(TARGET_COLUMNS) if goal else []), compared)
                for row in rows]
    elif keys:
        columns = _with_std_columns(columns, metrics + (list(TARGET_COLUMNS) if goal else []),
                                    compared)
    if fmt == "simple":
        typer.echo(fitted(rows, columns, picked=split_columns(shown)))
    else:
        typer.echo(render(rows, fmt, columns))
    note = clocks_note(runs)
    if note:
        typer.echo(note, err=True)


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
