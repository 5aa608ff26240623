"""How the training set is shared out: each rank's shard per epoch, and how many steps an epoch
has. The spec checks a run's length with it (a schedule's last step); each worker draws its
batches from its own shard."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


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
