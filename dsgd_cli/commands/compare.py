"""`dsgd compare`: one row per run with its final metrics."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from dsgd_cli.commands.common import DbOption, ExperimentOption, FormatOption
from dsgd_cli.output import check_format, render
from dsgd_cli.store import Run, Store

DEFAULT_METRICS = ["test_accuracy", "test_loss", "train_loss", "wall_seconds",
                   "samples_per_second", "total_bytes_sent"]


def run_row(run: Run, metrics: list[str]) -> dict:
    aggregator = run.aggregator if run.compressor == "none" else f"{run.aggregator}+{run.compressor}"
    row = {"id": run.id, "experiment": run.experiment, "aggregator": aggregator,
           "optimizer": run.optimizer, "task": run.task, "workers": run.workers,
           "status": run.status}
    finals = {s.name: s.final for s in run.summaries}
    row.update({name: finals.get(name) for name in metrics})
    return row


def compare_rows(runs: list[Run], extra_metrics: list[str] | None = None) -> list[dict]:
    metrics = DEFAULT_METRICS + [m for m in extra_metrics or [] if m not in DEFAULT_METRICS]
    return [run_row(run, metrics) for run in runs]


def compare(
    db: DbOption = None,
    experiment: ExperimentOption = None,
    last: Annotated[Optional[int], typer.Option("--last", min=1, help="Only the newest N runs")] = None,
    metric: Annotated[Optional[list[str]], typer.Option(
        "--metric", "-m", help="Another metric column (repeatable)")] = None,
    fmt: FormatOption = "simple",
) -> None:
    """Tabulate past runs: configuration and final metrics, one row per run."""
    check_format(fmt)
    runs = Store(db, readonly=True).runs(experiments=experiment, last=last)
    typer.echo(render(compare_rows(runs, metric), fmt, _columns(metric)))


def _columns(extra: list[str] | None) -> list[str]:
    base = ["id", "experiment", "aggregator", "optimizer", "task", "workers", "status"]
    return base + DEFAULT_METRICS + [m for m in extra or [] if m not in DEFAULT_METRICS]
