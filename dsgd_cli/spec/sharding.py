"""How the training set is shared out: each rank's shard per epoch, and how many steps an epoch
has. The spec checks a run's length with it (a schedule's last step); each worker draws its
batches from its own shard.

Two splits (the spec's `data_split`): `random`, a fresh seeded permutation of the whole set each
epoch, cut into equal parts; and `by_label`, the set sorted by label and cut into contiguous
parts once, so each worker holds one or a few classes for the whole run (the "sorted" setting of
Koloskova, Stich and Jaggi, 2019, where decentralized workers' local optima disagree most)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

DATA_SPLITS = ("random", "by_label")


@dataclass
class Shard:
    """This rank's share of the training set, split evenly (the remainder is dropped so every
    worker runs the same number of steps). `labels` (one class per example) is needed for
    the `by_label` split."""

    num_examples: int
    rank: int
    world_size: int
    seed: int
    split: str = "random"
    labels: torch.Tensor | None = None
    size: int = field(init=False)
    _fixed: torch.Tensor | None = field(init=False, default=None, repr=False)

    def __post_init__(self):
        self.size = self.num_examples // self.world_size
        if self.size == 0:
            raise ValueError(f"{self.num_examples} training examples cannot be shared by "
                             f"{self.world_size} workers: each needs at least one")
        if self.split not in DATA_SPLITS:
            raise ValueError(f"unknown data split {self.split!r}: expected one of "
                             f"{', '.join(DATA_SPLITS)}")
        if self.split == "by_label":
            self._fixed = self._label_part()

    def _label_part(self) -> torch.Tensor:
        labels = self.labels
        if labels is None or labels.dim() != 1 or len(labels) != self.num_examples:
            shape = None if labels is None else tuple(labels.shape)
            raise ValueError(f"data_split by_label needs one label per training example; "
                             f"the task's targets have shape {shape}")
        # Ties (examples of one class) in a seeded order, so which examples of a class that
        # straddles two parts go to which worker depends on the seed only.
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 - 1)
        shuffled = torch.randperm(self.num_examples, generator=generator)
        by_label = shuffled[torch.argsort(labels.cpu()[shuffled], stable=True)]
        return by_label[self.rank * self.size: (self.rank + 1) * self.size].clone()

    def indices(self, epoch: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        if self._fixed is not None:  # the same examples every epoch, in a new order
            order = torch.randperm(self.size, generator=generator)
            return self._fixed[order]
        order = torch.randperm(self.num_examples, generator=generator)
        return order[self.rank * self.size: (self.rank + 1) * self.size]


def steps_per_epoch(shard: Shard, batch_size: int, cap: int | None) -> int:
    """Batches per epoch: the whole shard (the last batch may be short), or `cap` if fewer."""
    steps = math.ceil(shard.size / batch_size)
    return min(steps, cap) if cap else steps


def samples_budget_steps(samples: int, workers: int, shard_size: int, batch_size: int,
                         per_epoch: int) -> int:
    """The step after which the workers of a run in step have trained on `samples` examples
    or more (and fewer than `workers × batch_size` more): each worker's batches are taken in
    order from its shard, `per_epoch` of them per epoch, and an epoch's last batch is short
    when `batch_size` does not divide the shard. So ⌈samples / (workers × batch_size)⌉ when
    every batch is full, and later by the samples the short batches missed otherwise."""
    per_worker = -(-samples // workers)  # workers × this ≥ samples, and no fewer suffice
    per_epoch_samples = min(shard_size, per_epoch * batch_size)
    epochs, rest = divmod(per_worker, per_epoch_samples)
    # Within an epoch every batch but the last is full, and `rest` < the epoch's samples.
    return epochs * per_epoch + -(-rest // batch_size)


def samples_in_steps(steps: int, shard_size: int, batch_size: int, per_epoch: int) -> int:
    """The examples one worker trains on in its first `steps` steps (an epoch's last batch may
    be short)."""
    epochs, rest = divmod(steps, per_epoch)
    return epochs * min(shard_size, per_epoch * batch_size) + rest * batch_size
