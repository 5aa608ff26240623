"""`synthetic`: random data and an MLP of a chosen parameter count, for communication and
scaling studies where accuracy does not matter (how long does an all-reduce of a
ResNet-50-sized gradient take at 8 workers, which compressor pays off at which bandwidth).

Inputs are Gaussian; the labels are those of a random linear teacher (argmax of x·A), so
the loss does go down, but nothing about accuracy should be read from it. The model is
`features → h → … → h → classes` with `layers` hidden layers of ReLU units; the width h is the
one whose parameter count comes closest to `params`, which it must hit within 1%.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from dsgd_cli.api import Task, TaskData, option

_SUFFIXES = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "b": 10**9}
_COUNT = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([kKmMgGbB]?)\s*$")
MAX_PARAMS = 10**10
TOLERANCE = 0.01  # the model's parameter count is within 1% of `params`


def parse_count(value: int | str) -> int:
    """`25M` → 25,000,000 (suffixes k, M, G or B, any case; decimals allowed: `1.5M`)."""
    if isinstance(value, int):
        return value
    match = _COUNT.match(value)
    if not match:
        raise ValueError(f"params: expected a count such as 25M, 250k or 1000000, got {value!r}")
    count = float(match.group(1)) * _SUFFIXES[match.group(2).lower()]
    if not count.is_integer():
        raise ValueError(f"params: {value!r} is not a whole number of parameters")
    return int(count)


def mlp_params(features: int, width: int, layers: int, classes: int) -> int:
    """Weights and biases of `features → width (× layers) → classes`."""
    return (features * width + width + (layers - 1) * (width * width + width)
            + width * classes + classes)


def closest_width(target: int, features: int, layers: int, classes: int) -> int:
    """The width whose MLP has the parameter count closest to `target` (the count grows with
    the width, so a binary search finds the last width at or below it)."""
    low, high = 1, 1
    while mlp_params(features, high, layers, classes) < target:
        high *= 2
    while low < high:  # the smallest width with at least `target` parameters
        middle = (low + high) // 2
        if mlp_params(features, middle, layers, classes) < target:
            low = middle + 1
        else:
            high = middle
    candidates = [w for w in (low - 1, low) if w >= 1]
    return min(candidates, key=lambda w: abs(mlp_params(features, w, layers, classes) - target))


@dataclass
class SyntheticOptions:
    params: int | str = option("1M", help="the model's parameter count: 25000000, 25M, 1.5M, 250k")
    layers: int = option(2, min=1, max=64, help="hidden layers")
    features: int = option(64, min=1, max=1_000_000, help="input dimension")
    classes: int = option(10, min=2, max=1_000_000, help="classes")
    samples: int = option(8192, min=1, max=10_000_000, help="training examples (a quarter as many for test)")
    data_seed: int = option(0, min=0, max=2**32 - 1, help="seed of the generated data")

    def __post_init__(self):
        count = parse_count(self.params)
        if not 1 <= count <= MAX_PARAMS:
            raise ValueError(f"params: expected between 1 and {MAX_PARAMS:,}, got {self.params!r}")
        width = closest_width(count, self.features, self.layers, self.classes)
        reached = mlp_params(self.features, width, self.layers, self.classes)
        if abs(reached - count) > TOLERANCE * count:
            raise ValueError(f"params: {count:,} cannot be reached within 1% with layers "
                             f"{self.layers}, features {self.features} and classes "
                             f"{self.classes} (the closest is {reached:,}); ask for more "
                             f"parameters or fewer layers")


class Synthetic(Task):
    Options = SyntheticOptions

    def width(self) -> int:
        o = self.options
        return closest_width(parse_count(o.params), o.features, o.layers, o.classes)

    def load_data(self, seed: int) -> TaskData:
        o = self.options
        generator = torch.Generator().manual_seed(o.data_seed)
        total = o.samples + max(1, o.samples // 4)
        x = torch.randn(total, o.features, generator=generator)
        teacher = torch.randn(o.features, o.classes, generator=generator)
        y = (x @ teacher).argmax(dim=1)
        return TaskData(x[: o.samples], y[: o.samples], x[o.samples:], y[o.samples:])

    def train_examples(self) -> int:
        return self.options.samples

    def build_model(self) -> nn.Module:
        o, width = self.options, self.width()
        layers: list[nn.Module] = [nn.Linear(o.features, width), nn.ReLU()]
        for _ in range(o.layers - 1):
            layers += [nn.Linear(width, width), nn.ReLU()]
        layers.append(nn.Linear(width, o.classes))
        return nn.Sequential(*layers)
