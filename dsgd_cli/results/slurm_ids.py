"""The SLURM job a run runs in, from the environment SLURM gives every process of a job, and how
it is shown: `12_3` for task 3 of array job 12 (as squeue and sacct write it), `12` for a job
that is not part of an array."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class SlurmJob:
    job_id: int  # SLURM_JOB_ID: every array task has its own
    array_job_id: int | None = None  # SLURM_ARRAY_JOB_ID: the array's, shared by its tasks
    array_task_id: int | None = None  # SLURM_ARRAY_TASK_ID: the task's index in the array

    def __str__(self) -> str:
        if self.array_job_id is None or self.array_task_id is None:
            return str(self.job_id)
        return f"{self.array_job_id}_{self.array_task_id}"


def slurm_job_of_this_process(environ: dict[str, str] | None = None) -> SlurmJob | None:
    """The SLURM job this process runs in; None outside SLURM (or where its variables are not
    numbers: nothing to record rather than a run that cannot start)."""
    environ = os.environ if environ is None else environ
    job_id = _number(environ.get("SLURM_JOB_ID"))
    if job_id is None:
        return None
    return SlurmJob(job_id, _number(environ.get("SLURM_ARRAY_JOB_ID")),
                    _number(environ.get("SLURM_ARRAY_TASK_ID")))


def _number(text: str | None) -> int | None:
    return int(text) if text is not None and text.strip().isdigit() else None
