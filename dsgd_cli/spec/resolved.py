"""The resolved experiment, typed: what a run's configuration (`Experiment.config`, the
launch plan, the database's `runs.config`) holds, as a frozen dataclass derived from the
declaration (`experiment_options.ExperimentOptions`), with each plugin section's options as
the plugin's own `Options` instance.

How a key travels, from the YAML to the worker:

1. `ExperimentOptions` declares it with `option()`: type, bounds, default, help;
   `parse_options` checks the merged experiment against it (spec/experiments.py).
2. `stored(value)` writes the checked value into the run's configuration, plain JSON: a
   section by its `resolved()` when it has one (a link in bytes per second), else its fields.
3. The configuration goes to the database and to the workers (the launch plan).
4. `ResolvedExperiment.from_config` reads it back in the worker, each key as `KEYS` says,
   and the worker hands it to the plugins as `ctx.experiment`; `to_dict` writes it back in the
   same JSON layout, key for key.

`KEYS` is made from the declaration: one entry per declared key, plus `config_version` and
`name` first, `compressor` (written inside the aggregator's section) after `aggregator`, and
`nnodes` (a run over several machines) last. A key added to `ExperimentOptions` needs nothing
here, unless it is a section whose stored form is not its declared class
(`RESOLVED_SECTIONS`).
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from dsgd_cli.emulation.compute import Compute
from dsgd_cli.options import option_fields, options_to_dict
from dsgd_cli.spec import registry
from dsgd_cli.spec.compute_model import ComputeOptions
from dsgd_cli.spec.experiment_options import (
    PLUGIN_KEYS, STORED_WHEN_SET, Budget, ClusterOptions, ExperimentOptions, NetworkOptions,
    Stragglers)
from dsgd_cli.spec.failures_spec import FailureOptions

__all__ = ["Budget", "Cluster", "Compute", "KEYS", "Link", "PluginSection",
           "ResolvedExperiment", "Stragglers", "read_key", "stored"]


@dataclass(frozen=True)
class Link:
    """A network link in modeled time: `network`, or one level of a `cluster`."""

    bytes_per_second: float | None  # None: unlimited
    latency_s: float

    @classmethod
    def read(cls, section: Mapping[str, Any]) -> Link:
        return cls(**section)


@dataclass(frozen=True)
class Cluster:
    nodes: int
    regions: list[int] | None
    # By level, only those given; inter_region may be a matrix, one link per ordered pair of
    # regions (row: from, column: to), None on its diagonal.
    links: dict[str, Link | list[list[Link | None]]]
    nic: str
    speed: list[float | list[float]] | None  # per node; a node's list: one per worker

    @classmethod
    def read(cls, section: Mapping[str, Any]) -> Cluster:
        links = {level: _links(link) for level, link in section["links"].items()}
        return cls(**{**section, "links": links})


def _links(section: Any) -> Link | list[list[Link | None]]:
    """A cluster level's link, or its matrix of links per pair of regions."""
    if isinstance(section, list):
        return [[None if entry is None else Link.read(entry) for entry in row] for row in section]
    return Link.read(section)


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


# The sections whose stored form is not their declared class: the class the resolved
# experiment holds instead, and how it reads the stored section. Any other section is held
# as its declared class, read as `cls(**stored)` (`Budget`).
RESOLVED_SECTIONS: dict[type, tuple[Any, Callable[[Mapping[str, Any]], Any]]] = {
    NetworkOptions: (Link, Link.read),           # bytes per second and seconds
    Stragglers: (Stragglers, Stragglers.read),   # its `random` a section of its own
    ComputeOptions: (Compute, Compute.read),
    ClusterOptions: (Cluster, Cluster.read),     # links as `network`'s
    # In seconds, as spec/failures_spec.py stores it; a mapping, as plugins have read it.
    FailureOptions: (dict[str, Any], dict),
}


@dataclass(frozen=True)
class Key:
    """One key of a run's configuration: its name, what the resolved experiment holds for it,
    how that is read from the stored JSON, and whether every configuration has it (else it is
    stored only when not `default`)."""

    name: str
    type: Any
    read: Callable[[Any], Any]
    always: bool = True
    default: Any = None


def _as_is(value: Any) -> Any:
    return value


def _plugin_key(kind: str) -> Key:
    return Key(kind, PluginSection, lambda section: PluginSection.read(kind, section))


def _declared_key(field: dataclasses.Field, annotation: Any) -> Key:
    """The resolved form of one key `ExperimentOptions` declares."""
    if field.name in PLUGIN_KEYS:
        return _plugin_key(field.name)
    always = field.name not in STORED_WHEN_SET
    section = _section_class(annotation)
    if section is None:  # a value: held as checked
        return Key(field.name, annotation, _as_is, always, field.default)
    held, read = RESOLVED_SECTIONS.get(section, (section, lambda stored: section(**stored)))
    return Key(field.name, held | None,
               lambda stored: None if stored is None else read(stored), always, field.default)


def _section_class(annotation: Any) -> type | None:
    """The class of a section key (`Budget | None`: Budget), else None."""
    classes = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
    if len(classes) == 1 and dataclasses.is_dataclass(classes[0]):
        return classes[0]
    return None


def _keys() -> tuple[Key, ...]:
    """Every key of a run's configuration, in the order the configuration stores them: the
    declared keys in their order, but those stored only when set just before the plugin
    sections, and the compressor after the aggregator."""
    hints = typing.get_type_hints(ExperimentOptions)
    declared = [_declared_key(field, hints[field.name])
                for field in option_fields(ExperimentOptions)]
    when_set = [key for key in declared if key.name in STORED_WHEN_SET]
    keys = [Key("config_version", int, _as_is), Key("name", str, _as_is)]
    for key in declared:
        if key.name == PLUGIN_KEYS[0]:
            keys += when_set
        if key.name not in STORED_WHEN_SET:
            keys.append(key)
        if key.name == "aggregator":
            keys.append(_plugin_key("compressor"))
    keys.append(Key("nnodes", int | None, _as_is, always=False))  # a run over several machines: how many
    return tuple(keys)


KEYS: tuple[Key, ...] = _keys()
_KEY_NAMED = {key.name: key for key in KEYS}


def read_key(config: Mapping[str, Any], name: str) -> Any:
    """One key of a stored configuration (of the current version), as the typed experiment
    holds it: `read_key(config, "cluster")` is a `Cluster` or None; the key's default where
    the configuration lacks it. For a reader that needs a few keys and no plugin loaded (the
    checks at validation, `dsgd show`); `ResolvedExperiment.from_config` reads them all."""
    key = _KEY_NAMED[name]
    return key.read(config[name]) if name in config else key.default


def stored(value: Any) -> Any:
    """A checked value of the declaration as the configuration stores it: a section by its
    `resolved()` when it has one, else its fields; anything else as it is."""
    if hasattr(value, "resolved"):
        return value.resolved()
    if dataclasses.is_dataclass(value):
        return options_to_dict(value)
    return value


class _ResolvedMethods:
    """`ResolvedExperiment`'s methods (its fields come from `KEYS`)."""

    def to_dict(self) -> dict[str, Any]:
        """The configuration's JSON layout (what `from_config` reads)."""
        config = {}
        for key in KEYS:
            value = getattr(self, key.name)
            if not key.always and value == key.default:
                continue  # only a run that sets the key has it
            if isinstance(value, PluginSection):
                value = value.to_dict()
            elif dataclasses.is_dataclass(value):
                value = dataclasses.asdict(value)
            config[key.name] = value
        return config

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ResolvedExperiment:
        """The typed experiment of a configuration of the current version."""
        return cls(**{key.name: read_key(config, key.name) for key in KEYS
                      if key.name in config})


ResolvedExperiment = dataclasses.make_dataclass(
    "ResolvedExperiment",
    [(key.name, key.type) if key.always
     else (key.name, key.type, dataclasses.field(default=key.default)) for key in KEYS],
    bases=(_ResolvedMethods,), frozen=True, kw_only=True)
ResolvedExperiment.__module__ = __name__
ResolvedExperiment.__doc__ = ("Every key of a run's configuration, in its order (`KEYS`, "
                              "made from `ExperimentOptions`).")
