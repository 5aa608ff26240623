"""What every worker of a launch builds first, built once in the fork server before it forks
them (forkserver.py), so that the workers share it instead of each making a copy.

A forked worker shares the server's memory until it writes to it. What it builds itself is
its own: at a thousand workers, each megabyte a worker makes is a gigabyte. So once the
launch's plan exists, the server (on a CPU launch) imports the plan's plugins, loads the first
experiment's data set (which `worker.data.load_data` then finds in memory: the workers index
and copy it, never modify it), and takes one throwaway step of its model and optimizer, and of
a gloo process group of one rank, which create what torch makes lazily on first use.

Nothing here changes what a worker computes: the data set is the one the worker would load,
and the server's random state is restored after the throwaway steps. `DSGD_PRELOAD=0` turns
it off. A plan this cannot prepare is left to the workers, which report what is wrong.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

from dsgd_cli.spec.resolved import ResolvedExperiment
from dsgd_cli.spec.run_plan import read_plan_entry
from dsgd_cli.worker.data import load_data
from dsgd_cli.worker.warmup import warm_up

SWITCH = "DSGD_PRELOAD"


def enabled() -> bool:
    return os.environ.get(SWITCH, "1").strip() != "0"


def prepare(plan_path: Path) -> bool:
    """Prepare the workers of the plan at `plan_path`; False when there is nothing to do (no
    plan yet, a CUDA launch: CUDA must not be initialised before a fork) or it failed."""
    if not enabled() or not plan_path.exists():
        return False
    try:
        plan = json.loads(plan_path.read_text())
        if plan.get("device", "cpu") != "cpu":
            return False
        # Reading each experiment imports every plugin it names.
        experiments = [ResolvedExperiment.from_config(read_plan_entry(entry)[0])
                       for entry in plan["experiments"]]
        with torch.random.fork_rng(devices=[]):
            _prepare_experiment(experiments[0])
            _process_group_of_one()
    except Exception:  # the workers meet the same problem and report it
        return False
    return True


def _prepare_experiment(experiment: ResolvedExperiment) -> None:
    """The data set in memory, and one training step of the task's model and optimizer."""
    task = experiment.task.build("task")
    data = load_data(task, experiment.task, experiment.seed)
    model = task.build_model()
    batch = experiment.batch_size
    warm_up(task, model, experiment.optimizer, data.train_x[:batch], data.train_y[:batch])


def _process_group_of_one() -> None:
    """gloo's process-group code run once, on a world of this process alone, then torn down
    (its threads end with it: nothing but memory is left when the server forks)."""
    if dist.is_initialized():
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        tensor = torch.ones(4)
        dist.all_reduce(tensor)
        dist.barrier()
    finally:
        dist.destroy_process_group()
