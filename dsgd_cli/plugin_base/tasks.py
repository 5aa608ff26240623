"""Tasks: a dataset in memory and the model trained on it."""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from dsgd_cli.plugin_base.base import Plugin


@dataclass
class TaskData:
    """A whole dataset in memory; the runtime shards the training part across workers."""

    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor


class Task(Plugin):
    """Data and model. Models are built after `torch.manual_seed(run seed)` on every worker,
    so all workers start from the same parameters.

    `reports_perplexity`: `test_loss` is a mean cross-entropy per token (language models), and
    its exponential is recorded with it as `test_perplexity`.

    `one_label_per_example`: `train_y` holds one integer class per example, so the spec's
    `data_split: by_label` can sort by it; a task whose targets are sequences says False."""

    reports_perplexity: ClassVar[bool] = False
    one_label_per_example: ClassVar[bool] = True

    @abstractmethod
    def load_data(self, seed: int) -> TaskData:
        """The whole dataset, made or loaded locally (no downloads)."""

    @abstractmethod
    def build_model(self) -> nn.Module:
        """A freshly initialised model (the runtime seeds torch first)."""

    def train_examples(self) -> int | None:
        """How many training examples `load_data` returns, computed from the options without
        loading anything; None (the default) when unknown until loaded. The spec loader
        refuses, before launching, more workers than this (each worker needs one example)."""
        return None

    def augment(self, x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """A training batch as the model sees it (random crops, flips); the default leaves it
        as it is. `generator` (on the CPU) is the only source of randomness to use: the
        runtime seeds it from the run's seed, the worker's rank and the step, so the same run
        makes the same batches, workers make different ones, and a resumed run goes on
        with the batches of one never stopped. Test batches are not augmented."""
        return x

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(output, target)

    def count_correct(self, output: torch.Tensor, target: torch.Tensor) -> float:
        """How many of the batch's examples are right (`test_accuracy` is this over the
        number of examples); a language model counts each example's share of right tokens."""
        return int((output.argmax(dim=1) == target).sum())
