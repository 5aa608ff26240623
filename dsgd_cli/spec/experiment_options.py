"""The experiment's keys, declared once: type, bounds, default and help text of each, with the
same `option()` the plugins declare their options with (`dsgd_cli.options`).

`ExperimentOptions` is what an experiment of the spec may set besides `name` and `grid`;
`options.parse_options` checks a merged experiment against it (the key paths of its errors
are the spec's), and `EXPERIMENT_DEFAULTS` (what `defaults:` and each experiment are merged
over) is read from it. The checks that involve several keys are in `__post_init__`.

`cluster` takes a shape of its own (one link per level, which a `network` section
describes): it is checked by `cluster_spec.parse_cluster`; the plugin sections
(`task`, `optimizer`, `aggregator` with its `compressor`, `lr_schedule`) by the plugin each
names. Nothing here imports torch: `dsgd run` reads the spec this far before torch loads.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from dsgd_cli.errors import SpecError
from dsgd_cli.options import as_float, option, option_fields, parse_options, show
from dsgd_cli.emulation.failures import FailureOptions
from dsgd_cli.spec.compute_model import ComputeOptions

MAX_WORKERS = 1024
MAX_TIMEOUT_S = 7 * 24 * 3600  # a week: beyond, a wait is a hang
# Bounds that keep the worker's arithmetic in 64 bits: it seeds torch with
# `seed * 1_000_003 + epoch` and `seed * 7919 + rank`, counts epochs × steps per epoch and
# adds up samples in an int64 counter. Seeds span NumPy's range, what researchers expect.
MAX_SEED = 2**32 - 1
MAX_COUNT = 2**31 - 1   # epochs, batch_size, steps_per_epoch, log_interval
MAX_SAMPLES = 2**62     # budget.samples
MAX_EVALUATIONS = 10_000


def _count(default: Any, low: int, high: int, help: str) -> Any:
    """An integer option whose error names both bounds, as the experiment's counts do."""
    return option(default, min=low, max=high, expect=f"an integer between {low} and {high}",
                  help=help)


@dataclass(frozen=True)
class RandomStragglers:
    spec_section: ClassVar[bool] = True

    probability: float = option(min=0, max=1, expect="a number >= 0 and <= 1",
                                help="chance that a worker's step is slow, each step")
    slowdown: float = option(min=1, expect="a number >= 1",
                             help="how many times slower such a step computes")


@dataclass(frozen=True)
class Stragglers:
    """`{ranks: [0], slowdown: 3.0}`: those ranks compute `slowdown` times slower;
    `random: {probability: p, slowdown: s}`: each worker, each step, computes `s` times
    slower with probability `p` (drawn from the run's seed; combines with `ranks`)."""

    spec_section: ClassVar[bool] = True

    ranks: list[int] = option([], expect="a list of worker ranks",
                              help="the workers that are always slow")
    slowdown: float = option(1.0, min=1, expect="a number >= 1",
                             help="how many times slower those ranks compute")
    random: RandomStragglers | None = option(
        None, expect="a mapping with keys probability, slowdown",
        help="slow steps drawn at random on every worker")


@dataclass(frozen=True)
class Budget:
    """`{samples: N}` (training samples over all workers) or `{seconds: T}` (training time):
    train until it is spent, not for `epochs`."""

    spec_section: ClassVar[bool] = True

    samples: int | None = _count(None, 1, MAX_SAMPLES, "training samples over all workers")
    seconds: float | None = option(None, more_than=0, expect="a number > 0",
                                   help="modeled seconds of training")
    evaluations: int = _count(10, 1, MAX_EVALUATIONS,
                              "evenly spaced evaluations of the average model")

    def __post_init__(self):
        if (self.samples is None) == (self.seconds is None):
            raise ValueError("expected exactly one of samples, seconds")


_BANDWIDTH = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(bit|bps|b|byte)(/s)?\s*$", re.I)
_LATENCY = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(s|ms|us|µs|ns)\s*$")
_SCALE = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_SECONDS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
_UNLIMITED = object()  # no bandwidth given (a written null is an error)
_BANDWIDTH_EXAMPLES = "a bandwidth such as 1Gbit, 100Mbit or 10GB/s"
_LATENCY_EXAMPLES = "a duration such as 100us, 2ms or 0.01 (seconds)"


@dataclass(frozen=True)
class NetworkOptions:
    """`{bandwidth: 1Gbit, latency: 100us}`: a link, resolved to bytes per second (None: no
    limit, which JSON can hold, unlike infinity) and seconds."""

    spec_section: ClassVar[bool] = True

    bandwidth: Any = option(_UNLIMITED, expect=_BANDWIDTH_EXAMPLES,
                            help="1Gbit, 100Mbit, 10GB/s, or a number of bits per second; "
                                 "absent: unlimited")
    latency: Any = option(0.0, expect=_LATENCY_EXAMPLES,
                          help="100us, 2ms, or a number of seconds")
    bytes_per_second: float | None = dataclasses.field(init=False)
    latency_s: float = dataclasses.field(init=False)

    def __post_init__(self):
        unlimited = self.bandwidth is _UNLIMITED
        object.__setattr__(self, "bytes_per_second", None if unlimited else _bytes_per_second(self.bandwidth))
        object.__setattr__(self, "latency_s", _seconds(self.latency))

    def resolved(self) -> dict[str, float | None]:
        """The link as the configuration holds it."""
        return {"bytes_per_second": self.bytes_per_second, "latency_s": self.latency_s}


def _bytes_per_second(value: Any) -> float:
    bits = as_float(value)
    if bits is not None and bits > 0:
        return bits / 8  # a bare number is bits per second
    match = _BANDWIDTH.match(value) if isinstance(value, str) else None
    if match and 0 < float(match.group(1)) < math.inf:
        amount = float(match.group(1)) * _SCALE[match.group(2).lower()]
        return amount if match.group(3) in ("B", "byte", "Byte") else amount / 8
    raise SpecError(f"expected {_BANDWIDTH_EXAMPLES}, got {show(value)}", path="bandwidth")


def _seconds(value: Any) -> float:
    seconds = as_float(value)
    match = _LATENCY.match(value) if isinstance(value, str) else None
    if seconds is None and match:
        seconds = float(match.group(1)) * _SECONDS[match.group(2)]
    if seconds is None or not 0 <= seconds < math.inf:
        raise SpecError(f"expected {_LATENCY_EXAMPLES}, got {show(value)}", path="latency")
    return seconds


def parse_network(raw: Any, path: str) -> dict[str, float | None] | None:
    """A `network` section, or a cluster's link, as the configuration holds it (None: none)."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise SpecError("expected a mapping with keys bandwidth, latency", path=path)
    return parse_options(NetworkOptions, raw, path).resolved()


@dataclass(frozen=True)
class ExperimentOptions:
    """Every key of an experiment but `name` and `grid`, in the order they are checked."""

    spec_section: ClassVar[bool] = True

    workers: int = _count(2, 1, MAX_WORKERS, "worker processes (ranks)")
    epochs: int = _count(1, 1, MAX_COUNT, "passes over the training set")
    batch_size: int = _count(32, 1, MAX_COUNT, "examples per step, per worker")
    seed: int = _count(0, 0, MAX_SEED, "seeds the model, the data order and every random draw")
    log_interval: int = _count(10, 1, MAX_COUNT, "steps between logged training metrics")
    timeout: float = option(600.0, more_than=0, max=MAX_TIMEOUT_S,
                            expect=f"a number > 0 and <= {MAX_TIMEOUT_S}",
                            help="seconds a communication may make no progress before it fails")
    steps_per_epoch: int | None = _count(None, 1, MAX_COUNT,
                                         "cap on steps per epoch, for quick runs")
    data_split: Literal["random", "by_label"] = option(
        "random", help="each epoch a random part of the set (random) or one by label")
    target_accuracy: float | None = option(
        None, more_than=0, max=1, expect="a number in (0, 1]",
        help="records time_to_accuracy when the test accuracy reaches it")
    save_dir: Any = option(None, help="saves each worker's final model to "
                                      "<save_dir>/<name>/rank<r>.pt (a directory path)")
    network: NetworkOptions | None = option(
        None, help="{bandwidth: 1Gbit, latency: 100us}: one link between every pair of workers")
    stragglers: Stragglers | None = option(None, help="workers that compute slower")
    compute: ComputeOptions | None = option(
        None, help="{step_seconds, variation, time_scale}: modeled step time, an emulated cluster")
    cluster: Any = option(None, help="nodes, regions and a link per level: a hierarchical "
                                     "network")
    budget: Budget | None = option(
        None, expect="a mapping with one of the keys samples, seconds",
        help="{samples: N} or {seconds: T}: train until spent, not for epochs")
    checkpoint_every: int | None = _count(None, 1, MAX_COUNT,
                                          "steps between checkpoints, for `dsgd run --resume`")
    failures: FailureOptions | None = option(
        None, expect="a mapping with keys restart, mtbf, checkpoint_every, checkpoint_seconds, "
                     "seed, at",
        help="failures on the modeled clock: {mtbf: 2h, restart: 120s, checkpoint_every: 50}")
    task: Any = option(None, help="the task plugin: data, model and loss (required)")
    optimizer: Any = option({"name": "sgd", "lr": 0.05}, help="the optimizer plugin")
    aggregator: Any = option({"name": "allreduce"},
                             help="the aggregator plugin (the algorithm), with its compressor")
    lr_scaling: Literal["none", "linear", "sqrt"] = option(
        "none", help="the optimizer's lr times 1 (none), workers (linear) or √workers (sqrt)")
    lr_schedule: Any = option({"name": "constant"},
                              help="the lr of each step, from the optimizer's lr")

    def __post_init__(self):
        if self.stragglers is not None:
            for index, rank in enumerate(self.stragglers.ranks):  # as written
                if not 0 <= rank < self.workers:
                    raise SpecError(f"expected a rank between 0 and {self.workers - 1}, "
                                    f"got {rank}", path=f"stragglers.ranks[{index}]")
            ranks = sorted(set(self.stragglers.ranks))
            object.__setattr__(self, "stragglers", dataclasses.replace(self.stragglers, ranks=ranks))
        if self.checkpoint_every is not None and self.budget is not None:
            raise SpecError("checkpoints are not supported with a budget (a run with a budget "
                            "cannot resume yet)", path="checkpoint_every")


def _default(field: dataclasses.Field) -> Any:
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


# Every experiment key with its default (None: required, or optional and absent): what
# `defaults:` and each experiment are merged over.
EXPERIMENT_DEFAULTS: dict[str, Any] = {
    "name": None,
    **{field.name: _default(field) for field in option_fields(ExperimentOptions)},
    "grid": None,
}
