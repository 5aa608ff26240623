"""The training data a worker sees: the task's data set, loaded once for the experiments of a
launch that share it, and the generator of a batch's augmentation. Which examples a rank
trains on is `dsgd_cli.spec.sharding`."""

from __future__ import annotations

import json
import random
from typing import TYPE_CHECKING

import torch

from dsgd_cli.api import TaskData

if TYPE_CHECKING:
    from dsgd_cli.spec.resolved import PluginSection

_loaded: dict[str, TaskData] = {}  # the last data set loaded in this process


def load_data(task, section: PluginSection, seed: int) -> TaskData:
    """The task's data; consecutive experiments of a launch with the same task section
    (`experiment.task`) and seed reuse the tensors (they are never modified: workers index
    and copy them)."""
    key = json.dumps([section.to_dict(), seed], sort_keys=True)
    if key not in _loaded:
        _loaded.clear()
        _loaded[key] = task.load_data(seed)
    return _loaded[key]


def augmentation_generator(seed: int, rank: int, step: int) -> torch.Generator:
    """The generator of a training batch's augmentation (`Task.augment`): a function of the
    run's seed, the worker's rank and the step (from 0), so nothing needs checkpointing."""
    mixed = random.Random(f"augment:{seed}:{rank}:{step}").getrandbits(63)
    return torch.Generator().manual_seed(mixed)
