"""The resolved experiment, typed: what a run's configuration (`Experiment.config`, the
launch plan, the database's `runs.config`) holds, as frozen dataclasses, with each plugin
section's options as the plugin's own `Options` instance.

`ResolvedExperiment.from_config` reads a configuration of the current version (a stored one
goes through `config_versions.upgrade_config` first); `to_dict` writes it back in the same
JSON layout, key for key. The worker gives it to plugins as `ctx.experiment`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from dsgd_cli.options import options_to_dict
from dsgd_cli.spec import registry
from dsgd_cli.spec.experiment_options import Budget, RandomStragglers, Stragglers


@dataclass(frozen=True)
class Link:
    """A network link in modeled time: `network`, or one level of a `cluster`."""

    bytes_per_second: float | None  # None: unlimited
    latency_s: float


@dataclass(frozen=True)
class Compute:
    step_seconds: float
    variation: dict[str, Any] | None  # {distribution: name, <its option>: value}
    time_scale: float
    ring_max: int  # groups above it all-reduce by messages in real (comm/by_messages.py)


@dataclass(frozen=True)
class Cluster:
    nodes: int
    regions: list[int] | None
    # By level, only those given; inter_region may be a matrix, one link per ordered pair of
    # regions (row: from, column: to), None on its diagonal.
    links: dict[str, Link | list[list[Link | None]]]
    nic: str
    speed: list[float | list[float]] | None  # per node; a node's list: one per worker


@dataclass(frozen=True)
class PluginSection:
    """A plugin section: the plugin's registered name and its options, every one filled in."""

    name: str
    options: Any

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, **options_to_dict(self.options)}

    def build(self, kind: str) -> Any:
        """A new instance of the plugin, with options of its own (a plugin may change them)."""
        return registry.build(kind, self.to_dict())

    @classmethod
    def read(cls, kind: str, section: Mapping[str, Any]) -> PluginSection:
        return cls(section["name"], registry.build_options(kind, section))


@dataclass(frozen=True)
class ResolvedExperiment:
    """Every key of a run's configuration, in its order."""

    config_version: int
    name: str
    workers: int
    epochs: int
    batch_size: int
    seed: int
    log_interval: int
    timeout: float
    steps_per_epoch: int | None
    data_split: str
    target_accuracy: float | None
    save_dir: str | None
    network: Link | None
    stragglers: Stragglers | None
    compute: Compute | None
    cluster: Cluster | None
    budget: Budget | None
    checkpoint_every: int | None
    task: PluginSection
    optimizer: PluginSection
    aggregator: PluginSection
    compressor: PluginSection
    lr_scaling: str
    lr_schedule: PluginSection
    nnodes: int | None = None  # a run over several machines: how many
    failures: dict[str, Any] | None = None  # spec/failures_spec.py's section, in seconds
    device: str = "auto"  # launch/devices.py

    def to_dict(self) -> dict[str, Any]:
        """The configuration's JSON layout (what `from_config` reads)."""
        config = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name in ("nnodes", "failures") and value is None:
                continue  # only a run over several machines (with failures) has the key
            if field.name == "device" and value == "auto":
                continue  # only a run that names its device has the key
            if isinstance(value, PluginSection):
                value = value.to_dict()
            elif dataclasses.is_dataclass(value):
                value = dataclasses.asdict(value)
            config[field.name] = value
        return config

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ResolvedExperiment:
        """The typed experiment of a configuration of the current version."""
        values = dict(config)
        for kind in ("task", "optimizer", "aggregator", "compressor", "lr_schedule"):
            values[kind] = PluginSection.read(kind, config[kind])
        values["network"] = _link(config["network"])
        values["stragglers"] = _stragglers(config["stragglers"])
        if config["compute"] is not None:
            values["compute"] = Compute(**config["compute"])
        if config["cluster"] is not None:
            cluster = dict(config["cluster"])
            cluster["links"] = {level: _links(link) for level, link in cluster["links"].items()}
            values["cluster"] = Cluster(**cluster)
        if config["budget"] is not None:
            values["budget"] = Budget(**config["budget"])
        return cls(**values)


def _link(section: Mapping[str, Any] | None) -> Link | None:
    return None if section is None else Link(**section)


def _links(section: Any) -> Link | list[list[Link | None]]:
    """A cluster level's link, or its matrix of links per pair of regions."""
    if isinstance(section, list):
        return [[_link(entry) for entry in row] for row in section]
    return _link(section)


def _stragglers(section: Mapping[str, Any] | None) -> Stragglers | None:
    if section is None:
        return None
    randomly = section["random"]
    return Stragglers(list(section["ranks"]), section["slowdown"],
                      None if randomly is None else RandomStragglers(**randomly))
