"""`cifar10_resnet` and `cifar100_resnet`: CIFAR-10/100 (Krizhevsky, 2009) with the CIFAR
ResNets of He et al. (2016, see resnet.py), read from the data set's own python-pickle
batches in a local directory: nothing is downloaded.

Images stay uint8 (N, 3, 32, 32) in memory (150 MB for CIFAR's 50,000 training images, a
quarter of float32); the model normalises them. Training batches get the standard
augmentation (He et al. 2016, section 4.2): a random 32×32 crop of the image padded by 4
black pixels on each side, and a horizontal flip with probability 1/2, done on tensors with
the generator the runtime seeds per worker and step.

The pickles are read with an unpickler that only rebuilds NumPy arrays, so a file that is
not a CIFAR batch cannot run code.
"""

from __future__ import annotations

import os
import pickle
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from torch import nn

from dsgd_cli.api import Task, TaskData, option
from plugins.tasks.resnet import CifarResNet

PIXELS = 3 * 32 * 32


@dataclass(frozen=True)
class Layout:
    """Where a CIFAR variant keeps its batches and labels."""

    title: str
    folder: str             # the directory the archive extracts to
    url: str
    train_files: tuple[str, ...]
    test_file: str
    label_key: str
    classes: int
    train_size: int         # examples in the full training set
    mean: tuple[float, float, float]  # per channel, of pixels in [0, 1], training set
    std: tuple[float, float, float]


CIFAR10 = Layout("CIFAR-10", "cifar-10-batches-py",
                 "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz",
                 tuple(f"data_batch_{i}" for i in range(1, 6)), "test_batch", "labels", 10,
                 50_000, (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))
CIFAR100 = Layout("CIFAR-100", "cifar-100-python",
                  "https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz",
                  ("train",), "test", "fine_labels", 100,
                  50_000, (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762))

# What a CIFAR pickle may rebuild: NumPy arrays (under NumPy 1's and 2's module names) and the
# byte strings Python 3 writes in protocol 2.
_ALLOWED = {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
            ("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode")}


class _ArraysOnly(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) not in _ALLOWED:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name}")
        return super().find_class(module, name)


def _how_to_get(layout: Layout) -> str:
    return (f"download {layout.url} and extract it (tar xzf), then set the task's data_dir "
            f"to the {layout.folder} directory or $DSGD_DATA to the directory holding it")


def data_directory(layout: Layout, data_dir: str | None) -> Path:
    """`data_dir`, else `$DSGD_DATA/<folder>`; ValueError naming the key if neither is set."""
    if data_dir:
        return Path(data_dir).expanduser().resolve()
    root = os.environ.get("DSGD_DATA")
    if not root:
        raise ValueError(f"data_dir: not set, nor $DSGD_DATA; {_how_to_get(layout)}")
    return (Path(root).expanduser() / layout.folder).resolve()


def read_batch(path: Path, layout: Layout) -> tuple[np.ndarray, np.ndarray]:
    """One pickle batch: images (N, 3, 32, 32) uint8 and labels (N,) int64; ValueError if
    the file is not a CIFAR batch."""
    try:
        with open(path, "rb") as file:
            batch = _ArraysOnly(file, encoding="bytes").load()
    except FileNotFoundError:
        raise ValueError(f"{path} is missing") from None
    except Exception as error:  # truncated, not a pickle, or a pickle of something else
        raise ValueError(f"{path} is not a {layout.title} batch "
                         f"({type(error).__name__}: {error})") from None
    if not isinstance(batch, dict):
        raise ValueError(f"{path} is not a {layout.title} batch (a {type(batch).__name__})")
    batch = {key.decode() if isinstance(key, bytes) else key: value for key, value in batch.items()}
    data, labels = batch.get("data"), batch.get(layout.label_key)
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 \
            or data.shape[1] != PIXELS:
        raise ValueError(f"{path} is not a {layout.title} batch (no uint8 'data' of "
                         f"{PIXELS} pixels per image)")
    labels = np.asarray(labels) if labels is not None else None
    if labels is None or labels.shape != (len(data),) or labels.dtype.kind not in "iu":
        raise ValueError(f"{path} is not a {layout.title} batch "
                         f"({layout.label_key!r}: expected one integer label per image)")
    if len(labels) and not (0 <= labels.min() and labels.max() < layout.classes):
        raise ValueError(f"{path}: labels outside 0..{layout.classes - 1}")
    return data.reshape(-1, 3, 32, 32), labels.astype(np.int64)


@lru_cache(maxsize=2)
def _read(directory: Path, layout: Layout, signature: tuple) -> TaskData:
    train = [read_batch(directory / name, layout) for name in layout.train_files]
    test_x, test_y = read_batch(directory / layout.test_file, layout)
    as_tensor = torch.from_numpy
    return TaskData(as_tensor(np.concatenate([x for x, _ in train])),
                    as_tensor(np.concatenate([y for _, y in train])),
                    as_tensor(test_x), as_tensor(test_y))


def read(directory: Path, layout: Layout) -> TaskData:
    """The whole data set, read once per process while its files are unchanged; ValueError
    naming the directory and how to get the data when it is missing or damaged."""
    if not directory.is_dir():
        raise ValueError(f"data_dir: no {layout.title} data at {directory} (not a directory); "
                         f"{_how_to_get(layout)}")
    files = [*layout.train_files, layout.test_file]
    missing = [name for name in files if not (directory / name).is_file()]
    if missing:
        raise ValueError(f"data_dir: {directory} is not {layout.title}'s {layout.folder}: "
                         f"{', '.join(missing)} missing; {_how_to_get(layout)}")
    signature = tuple((name, (directory / name).stat().st_size,
                       (directory / name).stat().st_mtime_ns) for name in files)
    try:
        return _read(directory, layout, signature)
    except ValueError as error:
        raise ValueError(f"data_dir: {error}; {_how_to_get(layout)}") from None


def augment(images: torch.Tensor, generator: torch.Generator, padding: int = 4) -> torch.Tensor:
    """Random crops of the images padded by `padding` black pixels, each flipped horizontally
    with probability 1/2. `images`: (N, C, H, W), any device; randomness from `generator`."""
    n, channels, height, width = images.shape
    padded = nn.functional.pad(images, (padding,) * 4)
    top = torch.randint(0, 2 * padding + 1, (n,), generator=generator)
    left = torch.randint(0, 2 * padding + 1, (n,), generator=generator)
    flip = torch.rand(n, generator=generator) < 0.5
    rows = top[:, None] + torch.arange(height)                # (n, H)
    cols = left[:, None] + torch.arange(width)                # (n, W)
    cols = torch.where(flip[:, None], cols.flip(1), cols)     # a flip reads columns backwards
    device = images.device
    index = (torch.arange(n)[:, None, None, None].to(device),
             torch.arange(channels)[None, :, None, None].to(device),
             rows[:, None, :, None].to(device), cols[:, None, None, :].to(device))
    return padded[index]


@dataclass
class CifarOptions:
    depth: Literal[20, 32, 44, 56, 110] = option(20, help="ResNet depth, 6n + 2")
    data_dir: str | None = option(None, help="the extracted python batches (else $DSGD_DATA/<folder>)")
    augment: bool = option(True, help="random crops and horizontal flips of training images")

    layout = CIFAR10  # a class attribute, not an option

    def __post_init__(self):
        # The directory is resolved and its files read when the spec is checked: a missing or
        # damaged data set stops `dsgd run` before anything launches, and the run's recorded
        # configuration says where its data came from.
        directory = data_directory(self.layout, self.data_dir)
        read(directory, self.layout)
        self.data_dir = str(directory)


@dataclass
class Cifar100Options(CifarOptions):
    layout = CIFAR100


class Cifar10ResNet(Task):
    """`cifar10_resnet`."""

    Options = CifarOptions

    def load_data(self, seed: int) -> TaskData:
        return read(Path(self.options.data_dir), self.options.layout)

    def train_examples(self) -> int:
        return len(self.load_data(0).train_y)

    def build_model(self) -> nn.Module:
        layout = self.options.layout
        return CifarResNet(self.options.depth, layout.classes, layout.mean, layout.std)

    def augment(self, x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        return augment(x, generator) if self.options.augment else x


class Cifar100ResNet(Cifar10ResNet):
    """`cifar100_resnet`: the same networks with 100 classes (fine labels)."""

    Options = Cifar100Options
