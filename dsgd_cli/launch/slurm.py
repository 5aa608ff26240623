"""A spec's experiments as a SLURM job array (`dsgd submit --slurm`): the sbatch script, its
submission, and which of its tasks SLURM still holds.

Array task K runs the spec's K-th experiment (`dsgd run SPEC --point K`), so the array's
indices are the spec's points: a resubmission of some points is an array of just those
indices. Every task records its run in the one database the script names. A task whose point
resumes an earlier run instead runs `dsgd run --resume RUN_ID` (a run of one machine: `--resume`
continues no other). An experiment over several machines runs under `srun`, one `dsgd run` per
node, meeting in torchrun's rendezvous on the task's first node.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from dsgd_cli.errors import DsgdError

RDZV_PORT_BASE = 20000  # a task's rendezvous port: this + its job id modulo RDZV_PORT_SPREAD
RDZV_PORT_SPREAD = 20000


@dataclass(frozen=True)
class Resources:
    """What each array task asks SLURM for; None leaves it to the cluster's defaults."""

    cpus_per_task: int | None = None
    gpus_per_task: int | None = None
    time: str | None = None  # SLURM's format: minutes, MM:SS, HH:MM:SS, D-HH...
    partition: str | None = None
    mem: str | None = None  # per node: 4G, 500M
    nodes: int = 1
    extra: tuple[str, ...] = ()  # further sbatch options, as written: --account=lab

    def sbatch_lines(self) -> list[str]:
        options = [f"--nodes={self.nodes}", "--ntasks-per-node=1"]  # one dsgd run per node
        for name, value in (("cpus-per-task", self.cpus_per_task),
                            ("gpus-per-task", self.gpus_per_task), ("time", self.time),
                            ("partition", self.partition), ("mem", self.mem)):
            if value is not None:
                options.append(f"--{name}={value}")
        return [f"#SBATCH {option}" for option in (*options, *self.extra)]


@dataclass
class ArrayJob:
    """An array of `dsgd run`s over the points `indices` of `spec`."""

    spec: Path  # absolute
    point_count: int  # how many experiments the spec has (after the selection in `run_args`)
    indices: list[int]  # the points to run, each an array index
    db_url: str
    run_args: list[str]  # what every `dsgd run` of a point gets beside the spec and the point
    resources: Resources
    concurrency: int | None  # at most this many tasks at once (--array=...%K)
    job_name: str
    log_dir: Path  # absolute: sbatch's --output
    workdir: Path  # absolute: where each task runs (relative paths of the spec resolve there)
    resumes: dict[int, int] = field(default_factory=dict)  # point -> the run it resumes
    resume_args: list[str] = field(default_factory=list)  # what a resume gets (--checkpoint-dir)

    @property
    def script_path(self) -> Path:
        return self.log_dir / f"{self.job_name}.sbatch"

    def array_option(self) -> str:
        limit = f"%{self.concurrency}" if self.concurrency else ""
        return index_ranges(self.indices) + limit


def index_ranges(indices: list[int]) -> str:
    """`0-5`, `1,3,7-9`: SLURM's notation for a set of array indices."""
    ranges: list[str] = []
    values = sorted(set(indices))
    start = previous = values[0]
    for value in values[1:] + [None]:
        if value is not None and value == previous + 1:
            previous = value
            continue
        ranges.append(str(start) if start == previous else f"{start}-{previous}")
        if value is not None:
            start = previous = value
    return ",".join(ranges)


def spec_digest(spec: Path) -> str:
    return hashlib.sha256(spec.read_bytes()).hexdigest()


def array_script(job: ArrayJob, shown_db: str | None = None) -> str:
    """The sbatch script of `job`. `shown_db`: the database as the script shows it (a URL
    without its password, for --dry-run); by default the URL itself."""
    dsgd = shlex.join([sys.executable, "-m", "dsgd_cli"])
    db = shlex.quote(shown_db or job.db_url)
    count = len(job.indices)
    lines = [
        "#!/bin/bash",
        "# A dsgd sweep as a SLURM job array, written by `dsgd submit`: array task K runs the",
        "# spec's K-th experiment (`dsgd run SPEC --point K --dry-run` shows which) and records",
        "# it in one database.",
        f"# {count} task{'s' if count != 1 else ''} of the {job.point_count} points of "
        f"{job.spec}",
        f"#SBATCH --job-name={job.job_name}",
        f"#SBATCH --array={job.array_option()}",
        *job.resources.sbatch_lines(),
        f"#SBATCH --output={job.log_dir}/%x-%A_%a.out",
        f"#SBATCH --chdir={job.workdir}",
        "",
        "set -euo pipefail",
        f"DSGD=({dsgd})",
        f"SPEC={shlex.quote(str(job.spec))}",
        f"DB={db}",
        "POINT=$SLURM_ARRAY_TASK_ID",
        "",
        "# The spec as it was submitted: an edited spec may number its points otherwise.",
        f'if ! echo "{spec_digest(job.spec)}  $SPEC" | sha256sum --check --status; then',
        '    echo "dsgd: $SPEC changed since it was submitted; resubmit it" >&2',
        "    exit 2",
        "fi",
        *_node_lines(job.resources.nodes),
        *_resume_lines(job),
        _task_line(job, '"${DSGD[@]}" run "$SPEC" --point "$POINT" --db "$DB"', job.run_args),
    ]
    return "\n".join(lines) + "\n"


def _node_lines(nodes: int) -> list[str]:
    """Where a run over several machines meets: torchrun's rendezvous on the task's first
    node, on a port of its own (tasks of several arrays may share a node)."""
    if nodes == 1:
        return []
    return [
        "",
        "# One `dsgd run` per node (srun), meeting on the task's first node.",
        'HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        f"PORT=$(({RDZV_PORT_BASE} + SLURM_JOB_ID % {RDZV_PORT_SPREAD}))",
        'NODES=(--nnodes "$SLURM_JOB_NUM_NODES" --rdzv-endpoint "$HEAD:$PORT")',
    ]


def _resume_lines(job: ArrayJob) -> list[str]:
    """A `case` sending each resumed point to `dsgd run --resume` of its run."""
    if not job.resumes:
        return [""]
    if job.resources.nodes > 1:  # `dsgd run --resume` refuses a run over several machines
        raise ValueError("only a point on one machine resumes; its run starts again instead")
    lines = ["", 'case "$POINT" in']
    for point, run_id in sorted(job.resumes.items()):
        command = f'"${{DSGD[@]}}" run --resume {run_id} --db "$DB"'
        lines.append(f"    {point}) {_task_line(job, command, job.resume_args)} ;;"
                     f"  # goes on from run {run_id}'s checkpoint")
    lines += ["esac", ""]
    return lines


def _task_line(job: ArrayJob, command: str, args: list[str]) -> str:
    """`exec` the command (so SLURM's signals reach dsgd itself), under srun on several nodes,
    each node adding its rank."""
    full = " ".join([command, *map(shlex.quote, args)])
    if job.resources.nodes == 1:
        return f"exec {full}"
    return (f'exec srun --kill-on-bad-exit=1 bash -c \'exec "$@" --node-rank "$SLURM_NODEID"\' '
            f'dsgd {full} "${{NODES[@]}}"')


# -- talking to SLURM -------------------------------------------------------------------------

def write_script(job: ArrayJob, script: str) -> Path:
    """The script into the log directory, readable by its owner only (it names the database)."""
    job.log_dir.mkdir(parents=True, exist_ok=True)
    path = job.script_path
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as file:
        file.write(script)
    return path


def submit(script: Path) -> str:
    """sbatch the script; the array's job id."""
    result = _slurm_command("sbatch", "--parsable", str(script))
    return result.stdout.strip().split(";")[0]  # `12` or `12;cluster`


def queued_points(job_name: str) -> dict[int, str]:
    """The array tasks of this user's jobs named `job_name` that SLURM still holds (pending
    or running), by array index, each with its job (`12_3`)."""
    user = os.environ.get("USER") or _user_name()
    result = _slurm_command("squeue", "--noheader", "--array", f"--user={user}",
                            f"--name={job_name}", "--format=%K %i")
    queued = {}
    for line in result.stdout.splitlines():
        index, _, job = line.strip().partition(" ")
        if index.isdigit():
            queued[int(index)] = job
    return queued


def _user_name() -> str:
    import pwd

    return pwd.getpwuid(os.geteuid()).pw_name


def _slurm_command(program: str, *args: str) -> subprocess.CompletedProcess:
    """A SLURM client; a missing client or its refusal is a one-line DsgdError."""
    path = shutil.which(program)
    if path is None:
        raise DsgdError(f"{program} not found: dsgd submit --slurm runs where SLURM's commands "
                        "are (a login node of the cluster)")
    result = subprocess.run([path, *args], capture_output=True, text=True, timeout=120)
    if result.returncode != 0:
        why = " ".join(result.stderr.split()) or f"exit code {result.returncode}"
        raise DsgdError(f"{program} failed: {why}")
    return result
