"""`logreg`: synthetic logistic regression, a convex problem whose optimum is computed exactly.

Features x ~ N(0, I_d), labels y ~ Bernoulli(sigmoid(x·w_true)). With many more samples than
features the classes overlap, so the maximum-likelihood weights are finite and unique;
`optimum()` finds them with Newton's method in float64 (to gradient norm ~1e-12).
"""

from dataclasses import dataclass

import torch
from torch import nn

from dsgd_cli.api import Task, TaskData, option


@dataclass
class LogRegOptions:
    samples: int = option(2048, min=16, help="training examples (plus a quarter as many for test)")
    features: int = option(10, min=1, help="dimension d")
    data_seed: int = option(0, min=0, max=2**32 - 1, help="seed of the generated problem")


class LogisticRegression(Task):
    Options = LogRegOptions

    def load_data(self, seed: int) -> TaskData:
        o = self.options
        generator = torch.Generator().manual_seed(o.data_seed)
        w_true = torch.randn(o.features, generator=generator)
        n_total = o.samples + o.samples // 4
        x = torch.randn(n_total, o.features, generator=generator)
        y = torch.bernoulli(torch.sigmoid(x @ w_true), generator=generator)
        return TaskData(x[: o.samples], y[: o.samples], x[o.samples:], y[o.samples:])

    def train_examples(self) -> int:
        return self.options.samples

    def build_model(self) -> nn.Module:
        return nn.Linear(self.options.features, 1, bias=False)

    def loss(self, output, target):
        return nn.functional.binary_cross_entropy_with_logits(output.squeeze(1), target)

    def count_correct(self, output, target) -> int:
        return int(((output.squeeze(1) > 0).float() == target).sum())

    def optimum(self) -> torch.Tensor:
        """The minimiser of the mean training loss, float64."""
        data = self.load_data(0)
        x, y = data.train_x.double(), data.train_y.double()
        w = torch.zeros(x.shape[1], dtype=torch.float64)
        for _ in range(100):
            p = torch.sigmoid(x @ w)
            gradient = x.T @ (p - y) / len(y)
            if gradient.norm() < 1e-12:
                break
            hessian = (x.T * (p * (1 - p))) @ x / len(y)
            w = w - torch.linalg.solve(hessian, gradient)
        return w
