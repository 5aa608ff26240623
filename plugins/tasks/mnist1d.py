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
    # mnist1d seeds NumPy's global generator with it: NumPy takes 0 .. 2**32 - 1
    data_seed: int = option(42, min=0, max=2**32 - 1,
                            help="seed of the generated data set (fixed across runs)")


# The generation parameters passed to the mnist1d package besides num_samples and seed: the
# package's defaults (mnist1d 0.0.2), pinned here so that a change of its defaults cannot
# change the data silently. Part of the data cache's key, like everything the data depends on.
GENERATION = {
    "train_split": 0.8, "template_len": 12, "padding": [36, 60], "scale_coeff": 0.4,
    "max_translation": 48, "corr_noise_scale": 0.25, "iid_noise_scale": 0.02,
    "shear_scale": 0.75, "shuffle_seq": False, "final_seq_length": 40,
}
_GENERATOR_VERSION = 1  # bump when `make` below changes what it returns


def cache_options(num_samples: int, data_seed: int) -> dict:
    """Everything the generated data depends on: the data cache's key (dsgd_cli/datacache.py).
    Cheap: package versions come from their metadata, mnist1d itself is not imported."""
    from importlib.metadata import PackageNotFoundError, version

    def installed(package: str) -> str | None:
        try:
            return version(package)
        except PackageNotFoundError:
            return None

    return {"num_samples": num_samples, "data_seed": data_seed, "generation": GENERATION,
            "generator": _GENERATOR_VERSION,
            "packages": {p: installed(p) for p in ("mnist1d", "numpy", "scipy")}}


def make(num_samples: int, data_seed: int) -> TaskData:
    """Generate MNIST-1D (about 1.7 s for 5000 examples, 1.1 s of it importing mnist1d)."""
    import random

    # Imported here: generating is the only thing that needs the package.
    from mnist1d.data import get_dataset_args, make_dataset

    args = get_dataset_args()
    for name, value in GENERATION.items():
        setattr(args, name, list(value) if isinstance(value, list) else value)
    args.num_samples = num_samples
    args.seed = data_seed
    # make_dataset seeds the global NumPy and `random` generators; restore them so that a
    # generation and a cache hit leave the process in the same state.
    np_state, py_state = np.random.get_state(), random.getstate()
    try:
        data = make_dataset(args)  # pure NumPy generation, no download
    finally:
        np.random.set_state(np_state)
        random.setstate(py_state)
    as_x = lambda a: torch.from_numpy(np.asarray(a, dtype=np.float32))
    as_y = lambda a: torch.from_numpy(np.asarray(a, dtype=np.int64))
    return TaskData(as_x(data["x"]), as_y(data["y"]), as_x(data["x_test"]), as_y(data["y_test"]))


def train_count(num_samples: int) -> int:
    """The training examples `make` returns, as mnist1d splits them: `num_samples // 10`
    examples of each of its ten digit templates, the first `train_split` of them train."""
    generated = num_samples // 10 * 10
    return int(generated * GENERATION["train_split"])


def generate(num_samples: int, data_seed: int) -> TaskData:
    """MNIST-1D from the local data cache, generated (and stored) on a miss."""
    from dsgd_cli import datacache

    return datacache.cached("mnist1d", cache_options(num_samples, data_seed),
                            lambda: make(num_samples, data_seed),
                            label=f"n{num_samples}-seed{data_seed}")


class MNIST1DTask(Task):
    Options = MNIST1DOptions

    def load_data(self, seed: int) -> TaskData:
        return generate(self.options.num_samples, self.options.data_seed)

    def train_examples(self) -> int:
        return train_count(self.options.num_samples)


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
