"""The training data a worker sees: the task's data set, loaded once for the experiments of a
launch that share it, and this rank's shard of the training part."""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field

import torch

from dsgd_cli.api import TaskData

_loaded: dict[str, TaskData] = {}  # the last data set loaded in this process


def load_data(task, options: dict, seed: int) -> TaskData:
    """The task's data; consecutive experiments of a launch with the same task options and
    seed reuse the tensors (they are never modified: workers index and copy them)."""
    key = json.dumps([options, seed], sort_keys=True)
    if key not in _loaded:
        _loaded.clear()
        _loaded[key] = task.load_data(seed)
    return _loaded[key]


@dataclass
class Shard:
    """This rank's share of the training set: a seeded permutation per epoch, split evenly
    (the remainder is dropped so every worker runs the same number of steps)."""

    num_examples: int
    rank: int
    world_size: int
    seed: int
    size: int = field(init=False)

    def __post_init__(self):
        self.size = self.num_examples // self.world_size
        if self.size == 0:
            raise ValueError(f"{self.num_examples} training examples cannot be shared by "
                             f"{self.world_size} workers: each needs at least one")

    def indices(self, epoch: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        order = torch.randperm(self.num_examples, generator=generator)
        return order[self.rank * self.size: (self.rank + 1) * self.size]


def steps_per_epoch(shard: Shard, batch_size: int, cap: int | None) -> int:
    """Batches per epoch: the whole shard (the last batch may be short), or `cap` if fewer."""
    steps = math.ceil(shard.size / batch_size)
    return min(steps, cap) if cap else steps


def augmentation_generator(seed: int, rank: int, step: int) -> torch.Generator:
    """The generator of a training batch's augmentation (`Task.augment`): a function of the
    run's seed, the worker's rank and the step (from 0), so nothing needs checkpointing."""
    mixed = random.Random(f"augment:{seed}:{rank}:{step}").getrandbits(63)
    return torch.Generator().manual_seed(mixed)
