"""MNIST-1D (Greydanus, 2020): 40-sample 1-D signals of the ten digits, generated locally.

Published test accuracies: about 68% for an MLP and 94% for the paper's small CNN.
"""

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from dsgd_cli.api import Task, TaskData, option


@dataclass
class MNIST1DOptions:
    num_samples: int = option(5000, min=100, help="examples generated (80% train, 20% test)")
    data_seed: int = option(42, min=0, help="seed of the generated data set (fixed across runs)")


def generate(num_samples: int, data_seed: int) -> TaskData:
    # Imported here: generating is the only thing that needs the package.
    from mnist1d.data import get_dataset_args, make_dataset

    args = get_dataset_args()
    args.num_samples = num_samples
    args.seed = data_seed
    data = make_dataset(args)  # pure NumPy generation, no download
    as_x = lambda a: torch.from_numpy(np.asarray(a, dtype=np.float32))
    as_y = lambda a: torch.from_numpy(np.asarray(a, dtype=np.int64))
    return TaskData(as_x(data["x"]), as_y(data["y"]), as_x(data["x_test"]), as_y(data["y_test"]))


class MNIST1DTask(Task):
    Options = MNIST1DOptions

    def load_data(self, seed: int) -> TaskData:
        return generate(self.options.num_samples, self.options.data_seed)


@dataclass
class MLPOptions(MNIST1DOptions):
    hidden: int = option(100, min=1, help="width of the two hidden layers")


class MNIST1DMLP(MNIST1DTask):
    """`mnist1d_mlp`: 40 → hidden → hidden → 10 with ReLU."""

    Options = MLPOptions

    def build_model(self) -> nn.Module:
        h = self.options.hidden
        return nn.Sequential(nn.Linear(40, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, 10))


@dataclass
class CNNOptions(MNIST1DOptions):
    channels: int = option(25, min=1, help="channels of each convolution")


class _ConvNet1D(nn.Module):
    """The MNIST-1D paper's CNN: three strided 1-D convolutions and a linear read-out."""

    def __init__(self, channels: int):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv1d(1, channels, 5, stride=2, padding=1), nn.ReLU(),    # 40 -> 19
            nn.Conv1d(channels, channels, 3, stride=2, padding=1), nn.ReLU(),  # 19 -> 10
            nn.Conv1d(channels, channels, 3, stride=2, padding=1), nn.ReLU(),  # 10 -> 5
        )
        self.readout = nn.Linear(channels * 5, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.readout(self.features(x.unsqueeze(1)).flatten(1))


class MNIST1DCNN(MNIST1DTask):
    """`mnist1d_cnn`: the reference paper's small CNN."""

    Options = CNNOptions

    def build_model(self) -> nn.Module:
        return _ConvNet1D(self.options.channels)
