"""A third-party optimizer: SGD whose step is scaled, x ← x − lr · scale · g."""

from dataclasses import dataclass

import torch

from dsgd_cli.api import OptimizerPlugin, option


@dataclass
class ScaledSGDOptions:
    lr: float = option(0.1, min=0.0, help="learning rate")
    scale: float = option(1.0, min=0.0, help="factor on every step")


class ScaledSGD(OptimizerPlugin):
    Options = ScaledSGDOptions

    def build(self, params) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=self.options.lr * self.options.scale)
