"""Optimizers: the worker's local torch optimizer."""

from __future__ import annotations

from abc import abstractmethod

import torch

from dsgd_cli.plugin_base.base import Plugin


class OptimizerPlugin(Plugin):
    """Builds the worker's local optimizer, applied to whatever the aggregator left in .grad."""

    @abstractmethod
    def build(self, params) -> torch.optim.Optimizer:
        """The torch optimizer over `params`."""
