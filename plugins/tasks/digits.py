"""scikit-learn's bundled 8x8 handwritten digits (1797 images), with a small CNN."""

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from dsgd_cli.api import Task, TaskData, option

IMAGES = 1797  # scikit-learn's bundled digits: 1797 images of 8x8 pixels
SEED_MAX = 2**32 - 1  # the range of NumPy's seeds, what people expect of a seed


def held_out(images: int, test_fraction: float) -> int:
    """Images held out for the test set; the rest train."""
    return int(images * test_fraction)


@dataclass
class DigitsOptions:
    test_fraction: float = option(0.2, min=0.05, max=0.5, help="share of images held out")
    data_seed: int = option(0, min=0, max=SEED_MAX, help="seed of the train/test split")


class DigitsCNN(Task):
    """`digits_cnn`: two 3x3 convolutions, max-pooling, a linear read-out."""

    Options = DigitsOptions

    def load_data(self, seed: int) -> TaskData:
        from sklearn.datasets import load_digits  # ships with scikit-learn, no download

        digits = load_digits()
        x = torch.from_numpy((digits.images / 16.0).astype(np.float32))
        y = torch.from_numpy(digits.target.astype(np.int64))
        order = torch.randperm(len(y), generator=torch.Generator().manual_seed(self.options.data_seed))
        n_test = held_out(len(y), self.options.test_fraction)
        test, train = order[:n_test], order[n_test:]
        return TaskData(x[train], y[train], x[test], y[test])

    def train_examples(self) -> int:
        return IMAGES - held_out(IMAGES, self.options.test_fraction)

    def build_model(self) -> nn.Module:
        return nn.Sequential(
            nn.Unflatten(1, (1, 8)),
            nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(32 * 4 * 4, 10),
        )
