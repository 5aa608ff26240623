"""The experiment's keys, declared once: type, bounds, default and help text of each, with the
same `option()` the plugins declare their options with (`dsgd_cli.options`).

`ExperimentOptions` is what an experiment of the spec may set besides `name` and `grid`;
`options.parse_options` checks a merged experiment against it (the key paths of its errors
are the spec's), and `EXPERIMENT_DEFAULTS` (what `defaults:` and each experiment are merged
over) is read from it. The checks that involve several keys are in `__post_init__`.

The plugin sections (`task`, `optimizer`, `aggregator` with its `compressor`,
`lr_schedule`) are checked by the plugin each names. Nothing here imports torch: `dsgd run`
reads the spec this far before torch loads.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Mapping

from dsgd_cli.comm.cluster import INTER_NODE, INTER_REGION, INTRA_NODE, LEVELS
from dsgd_cli.errors import SpecError
from dsgd_cli.options import as_float, option, option_fields, parse_options, show
from dsgd_cli.spec.failures_spec import FailureOptions
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

# The keys that name a plugin, each a registry kind: checked by the plugin each names
# (spec/experiments.py), held by the resolved experiment as the plugin's name and `Options`.
# `compressor` is written inside the aggregator's section and stored beside it.
PLUGIN_KEYS = ("task", "optimizer", "aggregator", "compressor", "lr_schedule")
# Keys a run's configuration holds only when they are not their default: the configurations
# of the runs that leave them are as they were before the key existed. Stored just before the
# plugin sections (spec/resolved.py).
STORED_WHEN_SET = ("device", "failures")


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

    @classmethod
    def read(cls, section: Mapping[str, Any]) -> Stragglers:
        """The section as a run's configuration stores it."""
        randomly = section["random"]
        return cls(list(section["ranks"]), section["slowdown"],
                   None if randomly is None else RandomStragglers(**randomly))


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


MAX_NODE_SPEED = 1000.0
_LINK_EXAMPLE = "{bandwidth: 10Gbit, latency: 50us}"


@dataclass(frozen=True)
class ClusterLinks:
    """One link per level of the cluster, each what a `network` section takes. Between
    regions, one link for every pair or a matrix of them: `inter_region[a][b]` from region a
    to region b (a list of rows, one row and one column per region; null on the diagonal,
    whose pairs take the intra_node or inter_node link)."""

    spec_section: ClassVar[bool] = True

    intra_node: NetworkOptions | None = option(None, help="between workers of one node")
    inter_node: NetworkOptions | None = option(None, help="between nodes of one region")
    # Typed Any and read in __post_init__: a link, or a matrix of links, one per pair.
    inter_region: Any = option(
        None, help="between regions (needs regions): one link for every pair of regions, or "
                   "a matrix of links, [a][b] from region a to region b, null on the diagonal")

    def __post_init__(self):
        object.__setattr__(self, "inter_region", _checked_region_links(self.inter_region))

    def given(self) -> dict[str, NetworkOptions | list[list[NetworkOptions | None]]]:
        """The levels written, in level order (inter_region: a link or a matrix of links)."""
        return {level: getattr(self, level) for level in LEVELS
                if getattr(self, level) is not None}


def _checked_region_links(written: Any) -> NetworkOptions | list[list[NetworkOptions | None]] | None:
    """`inter_region` as written: null, one link, or a square matrix of links whose diagonal
    is null (checked against the regions by `ClusterOptions`)."""
    path = INTER_REGION
    if written is None or isinstance(written, NetworkOptions):
        return written
    if isinstance(written, dict):
        return parse_options(NetworkOptions, written, path)
    if not isinstance(written, list) or not written:
        raise SpecError(f"expected a link such as {_LINK_EXAMPLE}, or a matrix of links (a list "
                        f"of rows, one row and one column per region), got {show(written)}",
                        path=path)
    regions = len(written)
    matrix = []
    for a, row in enumerate(written):
        if not isinstance(row, list) or len(row) != regions:
            got = f"a row of {len(row)}" if isinstance(row, list) else show(row)
            raise SpecError(f"expected a row of {regions} links, one per region (a square "
                            f"matrix: as many columns as rows), got {got}", path=f"{path}[{a}]")
        checked = []
        for b, entry in enumerate(row):
            where = f"{path}[{a}][{b}]"
            if a == b:
                if entry is not None:
                    raise SpecError(f"expected null: two workers of region {a} take the "
                                    f"intra_node or inter_node link, not an inter-region one",
                                    path=where)
                checked.append(None)
            elif entry is None:
                raise SpecError(f"required: the link from region {a} to region {b}, such as "
                                f"{_LINK_EXAMPLE}", path=where)
            elif not isinstance(entry, dict):
                raise SpecError(f"expected a link such as {_LINK_EXAMPLE}, got {show(entry)}",
                                path=where)
            else:
                checked.append(parse_options(NetworkOptions, entry, where))
        matrix.append(checked)
    return matrix


def _resolved_link(link: NetworkOptions | list[list[NetworkOptions | None]]) -> Any:
    """A link as the configuration holds it; a matrix of links entry by entry."""
    if isinstance(link, list):
        return [[None if entry is None else entry.resolved() for entry in row] for row in link]
    return link.resolved()


@dataclass(frozen=True)
class ClusterOptions:
    """`{nodes: 4, regions: [2, 2], links: {intra_node: ..., inter_node: ...}, nic: shared,
    speed: [1, 1, 0.5, 1]}`: the workers split evenly over nodes (rank r on node
    r // (workers / nodes)), nodes grouped into regions in node order. A node's speed may
    be a list, one per worker of the node (`speed: [1, [1, 0.5], 1, 1]`).

    `nodes`, `regions` and `speed` are typed `Any` and checked in `__post_init__`, because
    the option types would take or word them otherwise: `int` takes 2.0 as 2 and says only
    "expected an integer"; `list[...]` takes an empty list, names no bad item (`speed[2]`)
    and cannot say how many speeds it expects (one per node). What needs the worker count
    is checked by `check_workers`, called by the experiment."""

    spec_section: ClassVar[bool] = True

    nodes: Any = option(missing="the number of nodes the workers are split over",
                        help="an integer >= 1 that divides workers: the workers split evenly "
                             "over nodes, in rank order")
    regions: Any = option(None, help="a list of node counts, one per region, in node order, "
                                     "summing to nodes; null: one region")
    links: ClusterLinks | None = option(
        None, help="one link per level the cluster has, each as `network` takes it")
    nic: Literal["shared", "dedicated"] = option(
        "shared", help="whether the workers of a node share its network card's bandwidth")
    speed: Any = option(None, help=f"a list of relative compute speeds, one per node, each "
                                   f"> 0 and <= {MAX_NODE_SPEED:g}, or for a node a list of "
                                   f"one per worker of the node; null: all 1")

    def __post_init__(self):
        _check_nodes(self.nodes)
        object.__setattr__(self, "regions", _checked_regions(self.regions, self.nodes))
        if self.links is not None and self.links.inter_region is not None and self.regions is None:
            raise SpecError("an inter_region link needs regions (cluster.regions)",
                            path=f"links.{INTER_REGION}")
        matrix = self.links.inter_region if self.links is not None else None
        if isinstance(matrix, list) and len(matrix) != len(self.regions):
            raise SpecError(f"expected a {len(self.regions)} × {len(self.regions)} matrix, one "
                            f"row and one column per region (cluster.regions), got "
                            f"{len(matrix)} × {len(matrix)}", path=f"links.{INTER_REGION}")
        object.__setattr__(self, "speed", _checked_speeds(self.speed, self.nodes))

    def check_workers(self, workers: int) -> None:
        """Raise SpecError (path inside the section) unless `workers` split evenly over the
        nodes and a link is given for every level some pair of workers crosses."""
        if workers % self.nodes:
            raise SpecError(f"{workers} workers cannot be split evenly over {self.nodes} "
                            f"nodes: workers must be a multiple of nodes", path="nodes")
        per_node = workers // self.nodes
        for node, speed in enumerate(self.speed or []):
            if isinstance(speed, list) and len(speed) != per_node:
                raise SpecError(f"expected {per_node} speeds (one per worker of node {node}: "
                                f"{workers} workers on {self.nodes} nodes), got {len(speed)}",
                                path=f"speed[{node}]")
        given = self.links.given() if self.links is not None else {}
        for level in self.levels_crossed(workers // self.nodes):
            if level not in given:
                raise SpecError(f"required: this cluster has {level.replace('_', '-')} links, "
                                f"such as {_LINK_EXAMPLE}", path=f"links.{level}")

    def levels_crossed(self, workers_per_node: int) -> list[str]:
        """The levels some pair of workers crosses."""
        levels = [INTRA_NODE] if workers_per_node > 1 else []
        if any(count > 1 for count in (self.regions or [self.nodes])):
            levels.append(INTER_NODE)
        if self.regions is not None and len(self.regions) > 1:
            levels.append(INTER_REGION)
        return levels

    def resolved(self) -> dict[str, Any]:
        """The section as the configuration holds it: the links given (a level the cluster
        lacks may still be, for a grid over nodes) in bytes per second and seconds."""
        given = self.links.given() if self.links is not None else {}
        return {"nodes": self.nodes, "regions": self.regions,
                "links": {level: _resolved_link(link) for level, link in given.items()},
                "nic": self.nic, "speed": self.speed}


def _is_count(value: Any) -> bool:
    """An integer >= 1 as written (not 2.0, not true)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _check_nodes(nodes: Any) -> None:
    if not _is_count(nodes):
        raise SpecError(f"expected an integer >= 1, got {show(nodes)}", path="nodes")


def _checked_regions(regions: Any, nodes: int) -> list[int] | None:
    if regions is None:
        return None
    if not isinstance(regions, list) or not regions or not all(map(_is_count, regions)):
        raise SpecError(f"expected a list of node counts >= 1, one per region, "
                        f"got {show(regions)}", path="regions")
    if sum(regions) != nodes:
        raise SpecError(f"the regions hold {sum(regions)} nodes, expected {nodes} "
                        f"(cluster.nodes)", path="regions")
    return list(regions)


def _checked_speeds(speeds: Any, nodes: int) -> list[float | list[float]] | None:
    """One speed per node; a node's may be a list, one per worker (its length is checked
    against the workers per node by `check_workers`)."""
    if speeds is None:
        return None
    if not isinstance(speeds, list):
        raise SpecError(f"expected a list of {nodes} speeds, one per node, got {show(speeds)}",
                        path="speed")
    if len(speeds) != nodes:
        raise SpecError(f"expected {nodes} speeds (one per node), got {len(speeds)}",
                        path="speed")
    checked = []
    for index, written in enumerate(speeds):
        if isinstance(written, list):
            if not written:
                raise SpecError("expected a number, or a list of one speed per worker of the "
                                "node, got []", path=f"speed[{index}]")
            checked.append([_checked_speed(item, f"speed[{index}][{worker}]")
                            for worker, item in enumerate(written)])
        else:
            checked.append(_checked_speed(written, f"speed[{index}]"))
    return checked


def _checked_speed(written: Any, path: str) -> float:
    speed = as_float(written)
    if speed is None or not 0 < speed <= MAX_NODE_SPEED:
        raise SpecError(f"expected a number > 0 and <= {MAX_NODE_SPEED:g}, got {show(written)}",
                        path=path)
    return speed


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
    device: Literal["auto", "cpu", "cuda"] = option(
        "auto", help="where workers compute: auto (a GPU each with NCCL when there are as many "
                     "as workers, else the CPU), cpu, or cuda (GPUs, shared in turn when fewer "
                     "than workers, communicating over gloo)")
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
    cluster: ClusterOptions | None = option(
        None, help="nodes, regions and a link per level: a hierarchical network")
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
        if self.cluster is not None:
            self._check_cluster_fits()

    def _check_cluster_fits(self) -> None:
        """What the cluster needs from the rest of the experiment: workers it splits evenly,
        no second network model, and a compute model to scale when nodes have speeds."""
        try:
            self.cluster.check_workers(self.workers)
        except SpecError as error:
            raise SpecError(error.detail, path=f"cluster.{error.path}") from None
        if self.network is not None:
            raise SpecError("give either network (one link for every worker) or cluster, not "
                            "both; set network: null where a default sets it", path="cluster")
        if self.cluster.speed is not None and self.compute is None:
            raise SpecError("node speeds scale the modeled compute: add a compute section "
                            "(compute.step_seconds)", path="cluster.speed")


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
