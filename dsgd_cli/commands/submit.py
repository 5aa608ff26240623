"""`dsgd submit SPEC --slurm`: a spec's experiments as a SLURM job array, one task per point,
every task recording its run in one PostgreSQL database; `--only failed` submits again the
points whose runs are missing, failed or interrupted (see `dsgd_cli.launch.slurm` and
`dsgd_cli.launch.sweep`)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Optional

import typer

from dsgd_cli.commands.common import DbOption, ExperimentOption
from dsgd_cli.errors import DsgdError

# An endpoint that only passes validation at submission: each task names its own first node.
PLACEHOLDER_ENDPOINT = "first-node-of-the-task:1"


def submit(
    spec: Annotated[Path, typer.Argument(help="The experiment spec (YAML)")] = Path("experiments.yaml"),
    slurm: Annotated[bool, typer.Option(
        "--slurm", help="Submit to SLURM as a job array (the only scheduler so far)")] = False,
    experiment: ExperimentOption = None,
    db: DbOption = None,
    workers: Annotated[Optional[int], typer.Option(
        "--workers", "-n", help="Override every experiment's worker count")] = None,
    sets: Annotated[Optional[list[str]], typer.Option(
        "--set", metavar="KEY=VALUE", help="Set a dotted key in every experiment (repeatable)")] = None,
    only: Annotated[Optional[str], typer.Option(
        "--only", metavar="failed",
        help="Only the points whose runs are missing, failed or interrupted (resumed from "
             "their checkpoints where they have one); completed points are never run again")] = None,
    concurrency: Annotated[Optional[int], typer.Option(
        "--concurrency", "-j", min=1, help="At most this many tasks at once (--array=...%K)")] = None,
    partition: Annotated[Optional[str], typer.Option("--partition", help="SLURM partition")] = None,
    time: Annotated[Optional[str], typer.Option(
        "--time", help="Each task's time limit, as SLURM writes it (30, 2:00:00, 1-12)")] = None,
    cpus_per_task: Annotated[Optional[int], typer.Option(
        "--cpus-per-task", min=1,
        help="CPUs of each task on each node [default: the most workers a point has there]")] = None,
    gpus_per_task: Annotated[Optional[int], typer.Option(
        "--gpus-per-task", min=0, help="GPUs of each task on each node")] = None,
    mem: Annotated[Optional[str], typer.Option("--mem", help="Memory per node (4G)")] = None,
    nodes: Annotated[Optional[int], typer.Option(
        "--nodes", min=1, help="Machines each point spans [spec: launch.nnodes, else 1]")] = None,
    sbatch_options: Annotated[Optional[list[str]], typer.Option(
        "--sbatch-option", metavar="OPTION",
        help="Another sbatch option for the script, as written (--sbatch-option=--account=lab; "
             "repeatable)")] = None,
    job_name: Annotated[Optional[str], typer.Option(
        "--job-name", help="The array's name [default: dsgd-SPEC'S-NAME]")] = None,
    log_dir: Annotated[Path, typer.Option(
        "--log-dir", help="Where the script and each task's output go")] = Path("dsgd-slurm"),
    checkpoint_dir: Annotated[Optional[Path], typer.Option(
        "--checkpoint-dir", help="Where runs that set checkpoint_every keep their checkpoints "
                                 "(a filesystem every node sees)")] = None,
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="Print the sbatch script; submit nothing")] = False,
) -> None:
    """Submit SPEC's experiments as a SLURM job array: task K runs point K into one database."""
    from dsgd_cli.launch import slurm as slurm_jobs
    from dsgd_cli.spec.specfile import parse_set

    if not slurm:
        raise DsgdError("dsgd submit needs a scheduler: --slurm (the only one so far)")
    if only not in (None, "failed"):
        raise DsgdError(f"--only {only}: expected --only failed")
    url = array_database(db)
    overrides = [parse_set(text) for text in sets or []]
    experiments = _validated(spec, experiment, workers, overrides, nodes)
    node_count = experiments[0].nodes.nnodes if experiments[0].nodes else 1
    name = job_name or default_job_name(spec)
    job = slurm_jobs.ArrayJob(
        spec=spec.resolve(), point_count=len(experiments), indices=list(range(len(experiments))),
        db_url=url, run_args=_run_args(experiment, workers, sets, checkpoint_dir),
        resources=slurm_jobs.Resources(
            cpus_per_task=cpus_per_task or max(_local_workers(e) for e in experiments),
            gpus_per_task=gpus_per_task, time=time, partition=partition, mem=mem,
            nodes=node_count, extra=tuple(sbatch_options or ())),
        concurrency=concurrency, job_name=name, log_dir=log_dir.resolve(),
        workdir=Path.cwd().resolve(),
        resume_args=["--checkpoint-dir", str(checkpoint_dir.resolve())] if checkpoint_dir else [])
    if not dry_run:
        _check_database(db)
    if only == "failed":
        _keep_points_to_run(job, experiments, db, dry_run)
        if not job.indices:
            return
    if dry_run:
        from dsgd_cli.results.database import shown_db

        typer.echo(slurm_jobs.array_script(job, shown_db=shown_db(url)), nl=False)
        return
    script = slurm_jobs.write_script(job, slurm_jobs.array_script(job))
    job_id = slurm_jobs.submit(script)
    count = len(job.indices)
    at_once = f", {concurrency} at a time" if concurrency else ""
    typer.echo(f"submitted array job {job_id}: {count} task{'s' if count != 1 else ''} "
               f"(points {slurm_jobs.index_ranges(job.indices)} of {spec}){at_once}; "
               f"script and output in {job.log_dir}")


def array_database(db: str | None) -> str:
    """The database URL every task writes to: not SQLite, whose file would be written by tasks
    on several machines at once."""
    from dsgd_cli.results.database import resolve_url, shown_db

    url = resolve_url(db)
    if url.startswith("sqlite"):
        raise DsgdError(f"{shown_db(db)}: an array's tasks write to one database at once, from "
                        "several machines, and SQLite on a shared filesystem (NFS) loses or "
                        "corrupts concurrent writes; use PostgreSQL: --db "
                        "postgresql+psycopg://USER@HOST/DATABASE (or DSGD_DB)")
    return url


def default_job_name(spec: Path) -> str:
    """`dsgd-` and the spec's file name without its suffix, in characters any shell and
    SLURM take as they are."""
    return "dsgd-" + (re.sub(r"[^A-Za-z0-9_.-]", "_", spec.stem) or "spec")


def _validated(spec, experiment, workers, overrides, nodes):
    """The spec's experiments, validated as each task will read them. A run over several
    machines gets a placeholder endpoint: each task names its own first node."""
    from dsgd_cli.spec.experiments import load_spec

    launch = {"nnodes": nodes, "node_rank": 0, "rdzv_endpoint": PLACEHOLDER_ENDPOINT}
    return load_spec(spec, only=experiment, workers=workers, launch=launch, overrides=overrides)


def _local_workers(experiment) -> int:
    """How many workers of the experiment one node runs."""
    nodes = experiment.nodes
    return experiment.workers if nodes is None else nodes.local_workers(experiment.workers)


def _run_args(experiment, workers, sets, checkpoint_dir) -> list[str]:
    """What selects the same experiments in every task, in the order `dsgd run` reads them."""
    args: list[str] = []
    for name in experiment or []:
        args += ["-e", name]
    if workers is not None:
        args += ["-n", str(workers)]
    for text in sets or []:
        args += ["--set", text]
    if checkpoint_dir is not None:
        args += ["--checkpoint-dir", str(checkpoint_dir.resolve())]
    return args


def _keep_points_to_run(job, experiments, db, dry_run: bool) -> None:
    """`--only failed`: only the points to run again, each said on stderr; the resumed ones
    go on from their runs. A point SLURM still holds a task of is left to it."""
    from dsgd_cli.launch import slurm as slurm_jobs
    from dsgd_cli.launch.sweep import points_in
    from dsgd_cli.results.reader import Results

    points = points_in(experiments, Results(db))
    queued = slurm_jobs.queued_points(job.job_name)
    chosen = []
    for point in points:
        if point.index in queued:
            _say(f"point {point.index} ({point.name}): still in SLURM as {queued[point.index]}")
        elif point.status == "running":
            _say(f"point {point.index} ({point.name}): run {point.run_id} is still running "
                 f"(if its task is gone: dsgd runs delete --force {point.run_id})")
        elif point.to_run:
            chosen.append(point)
    job.indices = [point.index for point in chosen]
    job.resumes = {point.index: point.run_id for point in chosen if point.resumes}
    done = sum(point.status in ("completed", "diverged") for point in points)
    if not chosen:
        _say(f"nothing to submit: {done} of {len(points)} points done, none missing, failed or "
             "interrupted")
        return
    for point in chosen:
        _say(f"point {point.index} ({point.name}): {_how_it_runs(point)}")
    verb = "would submit" if dry_run else "submitting"
    _say(f"{done} of {len(points)} points done; {verb} {len(chosen)}")


def _how_it_runs(point) -> str:
    if point.resumes:
        return f"resumes run {point.run_id}"
    if point.status == "missing":
        return "no run yet"
    if point.machines > 1:
        return (f"run {point.run_id} {point.status} over {point.machines} machines, which "
                f"--resume does not continue: from the start as a new run (run {point.run_id} "
                "stays as it is)")
    return f"run {point.run_id} {point.status}, without a checkpoint: from the start"


def _check_database(db) -> None:
    """Open the database for writing now (creating or upgrading its tables), so that a
    database the tasks cannot use is refused before anything is queued."""
    from dsgd_cli.results.store import Store

    Store(db).engine.dispose()


def _say(line: str) -> None:
    typer.echo(f"dsgd: {line}", err=True)
