"""`dsgd run`: validate a spec, train each experiment under torchrun, record and summarize."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                           TimeElapsedColumn)

from dsgd_cli.commands.common import DbOption, ExperimentOption
from dsgd_cli.commands.compare import compare_rows
from dsgd_cli.errors import RunFailed
from dsgd_cli.output import render
from dsgd_cli.store import Store

if TYPE_CHECKING:
    from dsgd_cli.launcher import Progress as RunProgress, RunResult


def run(
    spec: Annotated[Path, typer.Argument(help="The experiment spec (YAML)")] = Path("experiments.yaml"),
    experiment: ExperimentOption = None,
    db: DbOption = None,
    workers: Annotated[Optional[int], typer.Option(
        "--workers", "-w", help="Override every experiment's worker count")] = None,
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="Print the resolved experiments and torchrun commands; run nothing")] = False,
) -> None:
    """Run every experiment in SPEC (default ./experiments.yaml) and record it in the database."""
    # torch and the plugins load here, not when the CLI starts: the other commands need neither.
    from dsgd_cli.launcher import choose_device, launch
    from dsgd_cli.spec import load_spec

    # Validate everything before anything is launched or written.
    experiments = load_spec(spec, only=experiment, workers=workers)
    console = Console()
    if dry_run:
        _print_plan(experiments)
        return
    store = Store(db)
    results = []
    # Experiment names and failure reasons are plain text, never rich markup: a gloo error
    # holds "[/127.0.0.1]:port", and a grid point's name "[key=value]".
    columns = (TextColumn("{task.description}", markup=False), BarColumn(), MofNCompleteColumn(),
               TextColumn("{task.fields[stats]}"), TimeElapsedColumn())
    with Progress(*columns, console=console, refresh_per_second=4) as bars:
        for exp in experiments:
            bar = bars.add_task(exp.name, total=None, stats="starting")


            def show(p: RunProgress, bar=bar) -> None:
                bars.update(bar, total=p.total_steps, completed=p.step, stats=_stats(p))

            device = choose_device(exp.workers)
            if device.notice:
                bars.console.print(f"{exp.name}: {device.notice}", markup=False, highlight=False)
            result = launch(exp, store, str(spec), show, device)
            bars.update(bar, stats=f"{bars.tasks[bar].fields['stats']}  {status_markup(result)}".strip())
            results.append(result)

    typer.echo(render(compare_rows(store, store.runs(ids=[r.run_id for r in results]))))
    failed = [r for r in results if r.status != "completed"]
    if failed:
        raise RunFailed(f"{len(failed)} of {len(results)} runs failed: " + "; ".join(
            f"{r.experiment} (run {r.run_id}): {_why(r)}" for r in failed))


def _why(result: RunResult) -> str:
    return result.reason if result.status == "failed" else f"{result.status}: {result.reason}"


def status_markup(result: RunResult) -> str:
    """How a run ended, as rich markup for its progress line; the reason is plain text."""
    if result.status == "completed":
        return "completed"
    return f"[red]{result.status}[/red] " + escape(f"({result.reason})")


def _stats(p: RunProgress) -> str:
    parts = []
    if p.train_loss is not None:
        parts.append(f"loss {p.train_loss:.4f}")
    if p.test_accuracy is not None:
        parts.append(f"acc {p.test_accuracy:.3f}")
    return "  ".join(parts)


def _print_plan(experiments) -> None:
    from dsgd_cli.launcher import torchrun_command

    for exp in experiments:
        c = exp.config
        typer.echo(f"{exp.name}: {c['workers']} workers, task {c['task']['name']}, "
                   f"aggregator {c['aggregator']['name']}, compressor {c['compressor']['name']}, "
                   f"optimizer {c['optimizer']['name']}, {c['epochs']} epochs of batch {c['batch_size']}")
        for key in ("task", "optimizer", "aggregator", "compressor"):
            options = {k: v for k, v in c[key].items() if k != "name"}
            if options:
                typer.echo(f"  {key} options: " + ", ".join(f"{k}={v}" for k, v in options.items()))
        typer.echo("  " + shlex.join(torchrun_command(exp, "<config.json>", "<events-dir>")))
