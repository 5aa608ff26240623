"""Built-in local optimizers: thin, validated wrappers over torch.optim."""

from dataclasses import dataclass

import torch

from dsgd_cli.api import OptimizerPlugin, option


@dataclass
class SGDOptions:
    lr: float = option(0.05, min=0.0, help="learning rate")
    momentum: float = option(0.0, min=0.0, max=1.0, help="heavy-ball momentum")
    nesterov: bool = option(False, help="Nesterov momentum (needs momentum > 0)")
    weight_decay: float = option(0.0, min=0.0, help="L2 penalty")

    def __post_init__(self):
        if self.nesterov and self.momentum == 0:
            raise ValueError("nesterov: true needs momentum > 0")


class SGD(OptimizerPlugin):
    Options = SGDOptions

    def build(self, params) -> torch.optim.Optimizer:
        o = self.options
        return torch.optim.SGD(params, lr=o.lr, momentum=o.momentum, nesterov=o.nesterov,
                               weight_decay=o.weight_decay)


@dataclass
class AdamOptions:
    lr: float = option(0.001, min=0.0, help="learning rate")
    beta1: float = option(0.9, min=0.0, max=1.0, help="first-moment decay")
    beta2: float = option(0.999, min=0.0, max=1.0, help="second-moment decay")
    eps: float = option(1e-8, min=0.0, help="denominator term")
    weight_decay: float = option(0.0, min=0.0, help="L2 penalty")


class Adam(OptimizerPlugin):
    Options = AdamOptions

    def build(self, params) -> torch.optim.Optimizer:
        o = self.options
        return torch.optim.Adam(params, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                                weight_decay=o.weight_decay)
