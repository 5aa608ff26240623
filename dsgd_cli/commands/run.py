"""`dsgd run`: validate a spec, train each experiment under torchrun, record and summarize."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from dsgd_cli.commands.common import DbOption, ExperimentOption
from dsgd_cli.errors import DsgdError, RunFailed
from dsgd_cli.commands.output import fitted, wrap_lines

if TYPE_CHECKING:
    from dsgd_cli.launch.outcome import RunResult
    from dsgd_cli.launch.run_events import Progress as RunProgress

ANNOUNCE_OVER = 100  # a spec with more experiments says how many before anything runs


def run(
    spec: Annotated[Path, typer.Argument(help="The experiment spec (YAML)")] = Path("experiments.yaml"),
    experiment: ExperimentOption = None,
    db: DbOption = None,
    workers: Annotated[Optional[int], typer.Option(
        "--workers", "-n", help="Override every experiment's worker count")] = None,
    sets: Annotated[Optional[list[str]], typer.Option(
        "--set", metavar="KEY=VALUE",
        help="Set a dotted key in every experiment, the value read as YAML (repeatable): "
             "--set epochs=2 --set optimizer.lr=0.1")] = None,
    isolate: Annotated[bool, typer.Option(
        "--isolate", help="One torchrun per experiment, instead of one per run of consecutive "
                          "experiments with the same workers, device and timeout")] = False,
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="Print the resolved experiments and the launch plan; run nothing")] = False,
    resume: Annotated[Optional[int], typer.Option(
        "--resume", metavar="RUN_ID", help="Continue an interrupted or failed run from its last "
                                           "checkpoint (the spec is not read)")] = None,
    nnodes: Annotated[Optional[int], typer.Option(
        "--nnodes", help="Machines the run spans (each runs this command) [spec: launch.nnodes]")] = None,
    node_rank: Annotated[Optional[int], typer.Option(
        "--node-rank", help="This machine's rank among them; 0 records the runs [spec: launch.node_rank]")] = None,
    rdzv_endpoint: Annotated[Optional[str], typer.Option(
        "--rdzv-endpoint", metavar="HOST:PORT",
        help="Where the machines meet (torchrun's c10d rendezvous) [spec: launch.rdzv_endpoint]")] = None,
    rdzv_timeout: Annotated[Optional[float], typer.Option(
        "--rdzv-timeout", help="Seconds to wait for every machine to join [spec: launch.rdzv_timeout, 600]")] = None,
    checkpoint_dir: Annotated[Optional[Path], typer.Option(
        "--checkpoint-dir", help="Where runs that set checkpoint_every keep their checkpoints "
                                 "[default: $DSGD_CHECKPOINTS or dsgd-checkpoints/ beside the database]; "
                                 "with --resume, where the run's checkpoints are now")] = None,
    point: Annotated[Optional[int], typer.Option(
        "--point", metavar="K", min=0,
        help="Only the K-th experiment of the spec (0 is the first; after --experiment, "
             "--workers and --set): one task of `dsgd submit`'s array")] = None,
) -> None:
    """Run every experiment in SPEC (default ./experiments.yaml) and record it in the database."""
    from dsgd_cli.launch.launch_dirs import launch_root, remove_stale
    from dsgd_cli.launch.torchrun import early_start

    launch = {"nnodes": nnodes, "node_rank": node_rank, "rdzv_endpoint": rdzv_endpoint,
              "rdzv_timeout": rdzv_timeout}
    # The first launch's torchrun starts while this process imports torch and the plugins to
    # validate the spec; it is stopped if the spec is not valid.
    from dsgd_cli.spec.specfile import parse_set

    overrides = [parse_set(text) for text in sets or []]
    if not dry_run:
        launch_root()  # a TMPDIR another user could swap launches in is refused (exit 2)
        remove_stale()  # the launch directories of this user's `dsgd run`s that were killed
    if point is not None and resume is not None:
        raise DsgdError("--point selects an experiment of the spec; --resume continues a run: "
                        "give one of them")
    first = experiment if point is None else point_selection(spec, experiment, workers, launch,
                                                              overrides, point)
    early = (None if dry_run or resume is not None
             else early_start(spec, first, workers, launch, overrides))
    try:
        _run(spec, experiment, db, workers, isolate, dry_run, resume, launch, checkpoint_dir, early,
             overrides, point)
    finally:
        if early is not None:
            early.close()


def point_selection(spec, experiment, workers, launch, overrides, point: int) -> list[str] | None:
    """The name of the spec's `point`-th experiment as a selection, read from the spec's YAML
    alone (for the early start of its launch); the whole selection where the spec cannot be
    read that far (validation then says why)."""
    from dsgd_cli.errors import SpecError
    from dsgd_cli.spec import specfile

    try:
        _, document = specfile.read_document(Path(spec))
        defaults, entries, _ = specfile.sections(document, launch)
        names = [p.name for p in specfile.points(defaults, entries, workers, overrides)
                 if specfile.selected(p.name, experiment)]
    except (SpecError, RecursionError):
        return experiment
    return [names[point]] if point < len(names) else experiment


def one_point(experiments: list, point: int, spec) -> list:
    """`--point K`: the K-th of the spec's experiments, alone."""
    if point >= len(experiments):
        count = len(experiments)
        raise DsgdError(f"--point {point}: {spec} has {count} experiment{'s' if count != 1 else ''}"
                        f" (points 0 to {count - 1})")
    return [experiments[point]]


def _run(spec, experiment, db, workers, isolate, dry_run, resume, launch, checkpoint_dir,
         early, overrides, point=None) -> None:
    # torch, the plugins and rich load here, not when the CLI starts: the other commands need
    # none of them.
    from rich.console import Console
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                               TimeElapsedColumn)

    from dsgd_cli.worker import checkpoint
    from dsgd_cli.launch.launcher import Callbacks, cuda_kernels_problem, plan_launches, run_all
    from dsgd_cli.results.analysis import compare_rows
    from dsgd_cli.results.database import resolve_url
    from dsgd_cli.launch.resume import reopen, resumable
    from dsgd_cli.spec.experiments import load_spec
    from dsgd_cli.results.store import Store

    if resume is not None:
        if experiment or workers is not None or overrides:
            raise DsgdError("--resume continues a run with its own configuration: "
                            "without --experiment, --workers or --set")
        if any(value is not None for value in launch.values()):
            raise DsgdError("--resume continues a run on this machine alone: without --nnodes, "
                            "--node-rank, --rdzv-endpoint or --rdzv-timeout")
        store = Store(db, create=False)  # a run is looked up: no database is made for it
        experiments = [resumable(store, resume, checkpoint_dir)]
    else:
        # Validate everything before anything is written or any worker is told what to run.
        experiments = load_spec(spec, only=experiment, workers=workers, launch=launch,
                                overrides=overrides)
        if point is not None:
            experiments = one_point(experiments, point, spec)
        if len(experiments) > ANNOUNCE_OVER:  # a grid can be larger than its author thinks
            typer.echo(f"dsgd: {len(experiments)} experiments in {spec}", err=True)
    console = Console()
    if dry_run:
        _print_plan(plan_launches(experiments, shared=not isolate))
        return
    kernels_problem = cuda_kernels_problem(plan_launches(experiments, shared=not isolate))
    if kernels_problem is not None:  # refused before anything is written
        raise DsgdError(kernels_problem)
    if resume is not None:
        reopen(store, experiments[0])
    else:
        if any(exp.resolved.checkpoint_every for exp in experiments):
            # Checked before the database is opened: a bad one writes nothing.
            root = checkpoint.usable_root(checkpoint_dir, resolve_url(db))
            for exp in experiments:
                if exp.resolved.checkpoint_every:
                    exp.checkpoint_dir = checkpoint.run_directory(root, exp.name)
        store = Store(db)
    # Experiment names and failure reasons are plain text, never rich markup: a gloo error
    # holds "[/127.0.0.1]:port", and a grid point's name "[key=value]".
    columns = (TextColumn("{task.description}", markup=False), BarColumn(), MofNCompleteColumn(),
               TextColumn("{task.fields[stats]}"), TimeElapsedColumn())
    with Progress(*columns, console=console, refresh_per_second=4) as bars:
        bar_of: dict[str, int] = {}

        def started(exp, device) -> None:
            if device.notice:
                bars.console.print(f"{exp.name}: {device.notice}", markup=False, highlight=False)
            bar_of[exp.name] = bars.add_task(exp.name, total=None, stats="starting")

        def progress(exp, p: RunProgress) -> None:
            bars.update(bar_of[exp.name], total=p.total_steps, completed=p.step, stats=_stats(p))

        def ended(result: RunResult) -> None:
            bar = bar_of[result.experiment]
            shown = f"{bars.tasks[bar].fields['stats']}  {status_markup(result)}"
            bars.update(bar, stats=shown.strip())

        results = run_all(experiments, store, str(spec), Callbacks(started, progress, ended),
                          shared=not isolate, early=early)

    recorded = [r.run_id for r in results if r.run_id is not None]
    runs = store.runs(ids=recorded)
    summary = compare_rows(store, runs)
    typer.echo(fitted(summary, list(summary[0])) if summary else "")
    _advise_time_scale(runs)
    failed = [r for r in results if r.status != "completed"]
    if failed:
        raise RunFailed(f"{len(failed)} of {len(results)} runs failed: " + "; ".join(
            f"{r.experiment} (run {r.run_id}): {_why(r)}" for r in failed))


def _advise_time_scale(runs) -> None:
    """One line when the real work of some runs did not fit their compute model."""
    from dsgd_cli.spec.compute_model import overrun_advice, overrun_steps

    overran = [run for run in runs if overrun_advice(run)]
    if overran:
        worst = max(overran, key=overrun_steps)
        others = f" (and {len(overran) - 1} more)" if len(overran) > 1 else ""
        typer.echo(f"dsgd: run {worst.id} ({worst.experiment}){others}: "
                   f"{overrun_advice(worst)}", err=True)


def _why(result: RunResult) -> str:
    return result.reason if result.status == "failed" else f"{result.status}: {result.reason}"


def status_markup(result: RunResult) -> str:
    """How a run ended, as rich markup for its progress line; the reason is plain text."""
    from rich.markup import escape

    if result.status == "completed":
        return "completed"
    return f"[red]{result.status}[/red] " + escape(f"({result.reason})")


def _stats(p: RunProgress) -> str:
    parts = []
    if p.unit not in (None, "steps"):  # the bar counts the run's updates, samples or seconds
        parts.append(p.unit if p.updates is None else f"{p.unit}, {p.updates} updates")
    if p.train_loss is not None:
        parts.append(f"loss {p.train_loss:.4f}")
    if p.test_accuracy is not None:
        parts.append(f"acc {p.test_accuracy:.3f}")
    return "  ".join(parts)


def _starter(shape) -> str:
    """What will start the launch's workers: dsgd's agent on one machine, else torchrun."""
    from dsgd_cli.launch import agent
    from dsgd_cli.launch.torchrun import command

    if shape.nodes is None and agent.wanted():
        return (f"{shape.workers} worker{'s' if shape.workers != 1 else ''} forked by dsgd's "
                f"agent (DSGD_LAUNCHER=torchrun: one torchrun instead)")
    return shlex.join(command(shape, "<experiments.json>", "<launch-dir>"))


def _print_plan(launches) -> None:
    from dsgd_cli.launch.launcher import launch_shape
    from dsgd_cli.spec.describe import Describer

    describer = Describer()
    lines: list[str] = []
    for number, planned in enumerate(launches, 1):
        count = len(planned.experiments)
        first = planned.experiments[0]
        where = ""
        if first.nodes is not None:
            where = (f", {first.nodes.local_workers(first.workers)} on this machine (node "
                     f"{first.nodes.node_rank} of {first.nodes.nnodes})")
        lines.append(f"launch {number}: {count} experiment{'s' if count > 1 else ''} on "
                     f"{first.workers} workers{where} ({planned.device.kind})")
        if planned.device.notice:
            lines.append(f"  {planned.device.notice}")
        lines.append("  " + _starter(launch_shape(first)))
        for exp in planned.experiments:
            c = exp.config
            lines.append(f"  {exp.name}: {c['workers']} workers, task {c['task']['name']}, "
                         f"aggregator {c['aggregator']['name']}, compressor {c['compressor']['name']}, "
                         f"optimizer {c['optimizer']['name']}")
            lines.extend(f"    {line}" for line in describer.lines(exp.resolved))
            for key in ("task", "optimizer", "aggregator", "compressor"):
                options = [f"{k}={v}" for k, v in c[key].items() if k != "name"]
                if options:
                    lines.append(f"    {key} options: " + ", ".join(options))
            if len(lines) >= 10_000:  # a plan of 100,000 experiments: a few writes, not 400,000
                typer.echo("\n".join(wrap_lines(lines)))
                lines.clear()
    if lines:  # wrapped to a terminal or $COLUMNS, whole for scripts (output.terminal_width)
        typer.echo("\n".join(wrap_lines(lines)))
