"""Where each point of a spec stands in a results database, for `dsgd submit --only failed`.

A point's runs are the runs of its experiment name whose configuration is the point's own
(a run of an earlier version of the spec, or with other `--set` values, is another
experiment). The newest of them says where the point stands: `completed` (or `diverged`: it
ran to its end, and would diverge again) is done and never run again; `running` is being run;
`failed` and `interrupted` go again, resuming the run from its checkpoint where it has one
(a run over several machines does not resume: it goes again as a new run); a point without a
run is `missing`, and goes too.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsgd_cli.errors import DsgdError
from dsgd_cli.spec.experiments import Experiment

DONE = ("completed", "diverged")
AGAIN = ("failed", "interrupted")


@dataclass
class Point:
    index: int  # its place in the spec: the array index of its task
    name: str
    status: str  # `missing`, or its newest run's status
    run_id: int | None = None  # its newest run
    resumes: bool = False  # the run can go on from a checkpoint (`dsgd run --resume`)
    machines: int = 1  # how many its run spanned

    @property
    def to_run(self) -> bool:
        return self.status == "missing" or self.status in AGAIN


def points_in(experiments: list[Experiment], reader) -> list[Point]:
    """Each experiment's point with where it stands in the database `reader` reads."""
    names = {experiment.name for experiment in experiments}
    newest: dict[str, list] = {}  # by name: its runs, oldest first
    for run in reader.runs(details=False):
        if run.experiment in names:
            newest.setdefault(run.experiment, []).append(run)
    points = []
    for index, experiment in enumerate(experiments):
        same = [run for run in newest.get(experiment.name, []) if run.config == experiment.config]
        if not same:
            points.append(Point(index, experiment.name, "missing"))
            continue
        run = same[-1]
        machines = run.config.get("nnodes") or 1
        resumes = run.status in AGAIN and machines == 1 and _can_resume(reader, run.id)
        points.append(Point(index, experiment.name, run.status, run.id, resumes, machines))
    return points


def _can_resume(reader, run_id: int) -> bool:
    """Whether `dsgd run --resume` would take the run: it has a sound checkpoint."""
    from dsgd_cli.launch.resume import resumable

    try:
        resumable(reader, run_id)
    except DsgdError:
        return False
    return True
