"""The experiment spec: YAML in, a list of fully resolved and validated experiments out.

Resolution order: read YAML → merge `defaults` into each experiment → expand `grid` →
apply command-line overrides → validate every key and resolve every plugin. Nothing launches
unless every experiment passes; every error is a `SpecError` naming the file and key path.
Numbers may use scientific notation (`1e-3`), and NaN or infinity (`.nan`, `.inf`) is an error.
"""

from __future__ import annotations

import copy
import itertools
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from dsgd_cli import registry
from dsgd_cli.comm import NetworkModel
from dsgd_cli.errors import PluginError, SpecError
from dsgd_cli.options import check_finite, options_to_dict, parse_options

TOP_LEVEL_KEYS = ("defaults", "experiments")
PLUGIN_SECTIONS = ("task", "optimizer", "aggregator")
MAX_WORKERS = 1024

# Every experiment key, with its default (None: required or optional-and-absent).
EXPERIMENT_DEFAULTS: dict[str, Any] = {
    "name": None,
    "task": None,
    "optimizer": {"name": "sgd", "lr": 0.05},
    "aggregator": {"name": "allreduce"},
    "workers": 2,
    "epochs": 1,
    "batch_size": 32,
    "seed": 0,
    "steps_per_epoch": None,   # cap on steps per epoch, for quick runs
    "log_interval": 10,        # steps between logged training metrics
    "target_accuracy": None,   # records time_to_accuracy when reached
    "network": None,
    "stragglers": None,
    "budget": None,            # {samples: N} or {seconds: T}: train until spent, not for epochs
    "save_dir": None,          # saves each worker's final model to <save_dir>/<name>/rank<r>.pt
    "grid": None,
}


class SpecLoader(yaml.SafeLoader):
    """YAML 1.1 as PyYAML reads it, but `1e-3`, `1E6` or `-2.5e+4` are floats as in YAML 1.2,
    not strings (YAML 1.1 wants a dot and a signed exponent: `1.0e-3`)."""


SpecLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    # YAML 1.2's core-schema float, only the forms with an exponent: the others already load
    re.compile(r"^[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."))


@dataclass
class Experiment:
    """One run to launch: its name and its complete, JSON-serializable configuration."""

    name: str
    config: dict[str, Any]

    @property
    def workers(self) -> int:
        return self.config["workers"]

    def plugin_label(self, section: str) -> str:
        return self.config[section]["name"]


def load_spec(path: str | Path, *, only: list[str] | None = None,
              workers: int | None = None) -> list[Experiment]:
    """Read, expand and validate the spec at `path`; `only` selects experiments by name."""
    file = str(path)
    try:
        text = Path(path).read_text()
    except OSError as error:
        raise SpecError(f"cannot read spec: {error.strerror}", file=file) from None
    try:
        document = yaml.load(text, Loader=SpecLoader)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise SpecError(f"invalid YAML: {where}{problem}", file=file) from None
    try:
        experiments = resolve_document(document, workers_override=workers)
        return select(experiments, only)
    except SpecError as error:
        raise SpecError(error.detail, file=file, path=error.path) from None


def resolve_document(document: Any, workers_override: int | None = None) -> list[Experiment]:
    if not isinstance(document, dict):
        raise SpecError("expected a mapping with keys 'defaults' and 'experiments'")
    check_finite(document, "")  # where the value is written: `defaults` or an experiment
    for key in document:
        if key not in TOP_LEVEL_KEYS:
            raise SpecError(f"unknown key (expected one of {', '.join(TOP_LEVEL_KEYS)})", path=str(key))
    defaults = document.get("defaults") or {}
    if not isinstance(defaults, dict):
        raise SpecError("expected a mapping", path="defaults")
    _check_keys(defaults, "defaults", allow=set(EXPERIMENT_DEFAULTS) - {"name", "grid"})
    entries = document.get("experiments")
    if not isinstance(entries, list) or not entries:
        raise SpecError("expected a non-empty list of experiments", path="experiments")

    experiments: list[Experiment] = []
    for index, entry in enumerate(entries):
        path = f"experiments[{index}]"
        if not isinstance(entry, dict):
            raise SpecError("expected a mapping", path=path)
        _check_keys(entry, path, allow=set(EXPERIMENT_DEFAULTS))
        merged = copy.deepcopy(EXPERIMENT_DEFAULTS)
        for layer in (defaults, entry):
            merged.update({key: merge(merged.get(key), value) for key, value in layer.items()})
        for name, point in expand_grid(merged, path):
            if workers_override is not None:  # the command line wins over spec and grid
                point["workers"] = workers_override
            experiments.append(Experiment(name, validate_experiment(point, path, name)))

    seen: dict[str, int] = {}
    for experiment in experiments:
        if experiment.name in seen:
            raise SpecError(f"duplicate experiment name {experiment.name!r}", path="experiments")
        seen[experiment.name] = 1
    return experiments


def _check_keys(mapping: dict, path: str, allow: set[str]) -> None:
    for key in mapping:
        if key not in allow:
            raise SpecError(f"unknown key (expected one of {', '.join(sorted(allow))})",
                            path=f"{path}.{key}")


def merge(base: Any, override: Any) -> Any:
    """Deep-merge an experiment section `override` into `base`. A plugin section naming a
    different plugin replaces the base whole: the base's options belong to another plugin."""
    if not (isinstance(base, dict) and isinstance(override, dict)):
        return copy.deepcopy(override)
    if "name" in base and "name" in override and base["name"] != override["name"]:
        return copy.deepcopy(override)
    result = dict(base)
    for key, value in override.items():
        result[key] = merge(base.get(key), value) if key in base else copy.deepcopy(value)
    return result


def expand_grid(experiment: dict, path: str) -> list[tuple[str, dict]]:
    """One (name, experiment) per point of the cartesian product of `grid`."""
    name = experiment.get("name")
    if not isinstance(name, str) or not name:
        raise SpecError("expected a non-empty string", path=f"{path}.name")
    grid = experiment.pop("grid", None)
    if grid is None:
        return [(name, experiment)]
    if not isinstance(grid, dict) or not grid:
        raise SpecError("expected a mapping of dotted keys to lists of values", path=f"{path}.grid")
    for key, values in grid.items():
        if not isinstance(values, list) or not values:
            raise SpecError("expected a non-empty list of values", path=f"{path}.grid.{key}")
    points = []
    for combination in itertools.product(*grid.values()):
        point = copy.deepcopy(experiment)
        labels = []
        for key, value in zip(grid, combination):
            _set_dotted(point, str(key), value, f"{path}.grid.{key}")
            labels.append(f"{key}={value}")
        points.append((f"{name}[{','.join(labels)}]", point))
    return points


def _set_dotted(mapping: dict, dotted: str, value: Any, path: str) -> None:
    """Set one grid key. `section.name` picks a plugin: like a section naming another plugin
    in `defaults`, it replaces the section's options (they belong to the old plugin)."""
    *parents, leaf = dotted.split(".")
    if not leaf or (not parents and (leaf not in EXPERIMENT_DEFAULTS or leaf in ("name", "grid"))):
        raise SpecError("grid key must name an experiment key, a plugin option or a plugin "
                        "section's name", path=path)
    node = mapping
    for part in parents:
        if node.get(part) is None and leaf == "name":  # e.g. a compressor section not yet there
            node[part] = {}
        if not isinstance(node.get(part), dict):
            raise SpecError(f"{part!r} is not a section of the experiment", path=path)
        node = node[part]
    if leaf == "name" and node.get("name") != value:
        kept = {key: section for key, section in node.items() if isinstance(section, dict)}
        node.clear()
        node.update(kept)  # nested plugin sections stay: an aggregator keeps its compressor
    node[leaf] = value


def validate_experiment(raw: dict, path: str, name: str) -> dict[str, Any]:
    """Check every key and resolve every plugin; return the complete configuration."""
    config: dict[str, Any] = {"name": name}
    config["workers"] = _int(raw, "workers", path, low=1, high=MAX_WORKERS)
    config["epochs"] = _int(raw, "epochs", path, low=1)
    config["batch_size"] = _int(raw, "batch_size", path, low=1)
    config["seed"] = _int(raw, "seed", path, low=0)
    config["log_interval"] = _int(raw, "log_interval", path, low=1)
    config["steps_per_epoch"] = (None if raw["steps_per_epoch"] is None
                                 else _int(raw, "steps_per_epoch", path, low=1))
    target = raw["target_accuracy"]
    if target is not None and (isinstance(target, bool) or not isinstance(target, (int, float))
                               or not 0 < target <= 1):
        raise SpecError(f"expected a number in (0, 1], got {target!r}", path=f"{path}.target_accuracy")
    config["target_accuracy"] = target
    save_dir = raw["save_dir"]
    if save_dir is not None and (not isinstance(save_dir, str) or not save_dir):
        raise SpecError(f"expected a directory path, got {save_dir!r}", path=f"{path}.save_dir")
    config["save_dir"] = str(Path(save_dir).resolve()) if save_dir else None
    config["network"] = parse_network(raw["network"], f"{path}.network")
    config["stragglers"] = parse_stragglers(raw["stragglers"], f"{path}.stragglers", config["workers"])
    config["budget"] = parse_budget(raw["budget"], f"{path}.budget")

    config["task"] = _plugin_section("task", raw["task"], f"{path}.task")
    config["optimizer"] = _plugin_section("optimizer", raw["optimizer"], f"{path}.optimizer")
    aggregator = raw["aggregator"]
    compressor_raw = {"name": "none"}
    if isinstance(aggregator, dict) and "compressor" in aggregator:
        aggregator = dict(aggregator)
        compressor_raw = aggregator.pop("compressor")
    config["aggregator"] = _plugin_section("aggregator", aggregator, f"{path}.aggregator")
    config["compressor"] = _plugin_section("compressor", compressor_raw,
                                           f"{path}.aggregator.compressor")
    aggregator_cls = registry.load("aggregator", config["aggregator"]["name"])
    if config["compressor"]["name"] != "none" and not aggregator_cls.supports_compression:
        raise SpecError(f"aggregator {aggregator_cls.plugin_name!r} does not support compression",
                        path=f"{path}.aggregator.compressor")
    try:
        options = build_options("aggregator", config["aggregator"])
        aggregator_cls.check_world(options, config["workers"])
    except ValueError as error:
        raise SpecError(str(error), path=f"{path}.aggregator") from None
    return config


def _int(raw: dict, key: str, path: str, low: int | None = None, high: int | None = None) -> int:
    value = raw[key]
    if isinstance(value, float) and value.is_integer():  # 2e4, as people write counts
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(f"expected an integer, got {value!r}", path=f"{path}.{key}")
    if low is not None and value < low or high is not None and value > high:
        bounds = f">= {low}" if high is None else f"between {low} and {high}"
        raise SpecError(f"expected an integer {bounds}, got {value!r}", path=f"{path}.{key}")
    return value


def _plugin_section(kind: str, raw: Any, path: str) -> dict[str, Any]:
    """Validate `{name: ..., option: value, ...}`; return it with every option filled in."""
    if raw is None:
        raise SpecError(f"required: a {kind} section such as {{name: ...}}", path=path)
    if isinstance(raw, str):
        raw = {"name": raw}
    if not isinstance(raw, dict):
        raise SpecError(f"expected a mapping with a 'name' key, got {raw!r}", path=path)
    name = raw.get("name")
    if not isinstance(name, str):
        raise SpecError(f"expected the name of a {kind} plugin, got {name!r}", path=f"{path}.name")
    try:
        cls = registry.load(kind, name)
    except PluginError as error:
        raise SpecError(str(error), path=f"{path}.name") from None
    options = parse_options(cls.Options, {k: v for k, v in raw.items() if k != "name"}, path)
    return {"name": name, **options_to_dict(options)}


def build_options(kind: str, section: dict[str, Any]) -> Any:
    """The options instance for an already validated section."""
    cls = registry.load(kind, section["name"])
    return cls.Options(**{k: v for k, v in section.items() if k != "name"})


def build_plugin(kind: str, section: dict[str, Any]):
    """An instance of the plugin an already validated section names."""
    return registry.load(kind, section["name"])(build_options(kind, section))


_BANDWIDTH = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(bit|bps|b|byte)(/s)?\s*$", re.I)
_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(s|ms|us|µs|ns)\s*$")
_SCALE = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_SECONDS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}


def parse_network(raw: Any, path: str) -> dict[str, float] | None:
    """`{bandwidth: 1Gbit, latency: 100us}` → bytes per second and seconds."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise SpecError("expected a mapping with keys bandwidth, latency", path=path)
    _check_keys(raw, path, {"bandwidth", "latency"})
    result = {"bytes_per_second": float("inf"), "latency_s": 0.0}
    if "bandwidth" in raw:
        value = raw["bandwidth"]
        match = _BANDWIDTH.match(str(value)) if isinstance(value, str) else None
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            result["bytes_per_second"] = float(value) / 8  # a bare number is bits per second
        elif match and float(match.group(1)) > 0:
            amount = float(match.group(1)) * _SCALE[match.group(2).lower()]
            is_bytes = match.group(3) in ("B", "byte", "Byte")
            result["bytes_per_second"] = amount if is_bytes else amount / 8
        else:
            raise SpecError(f"expected a bandwidth such as 1Gbit, 100Mbit or 10GB/s, got {value!r}",
                            path=f"{path}.bandwidth")
    if "latency" in raw:
        value = raw["latency"]
        match = _DURATION.match(value) if isinstance(value, str) else None
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0:
            result["latency_s"] = float(value)
        elif match:
            result["latency_s"] = float(match.group(1)) * _SECONDS[match.group(2)]
        else:
            raise SpecError(f"expected a duration such as 100us, 2ms or 0.01 (seconds), got {value!r}",
                            path=f"{path}.latency")
    return result


def network_model(config: dict[str, Any]) -> NetworkModel | None:
    network = config.get("network")
    return None if network is None else NetworkModel(network["latency_s"], network["bytes_per_second"])


def _number(raw: dict, key: str, path: str, *, low: float, high: float | None = None,
            low_open: bool = False) -> float:
    """A finite number in [low, high] (or (low, high] with `low_open`)."""
    value = raw[key]
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if (not is_number or not math.isfinite(value) or (value <= low if low_open else value < low)
            or (high is not None and value > high)):
        bound = f"> {low}" if low_open else f">= {low}"
        if high is not None:
            bound += f" and <= {high}"
        raise SpecError(f"expected a number {bound}, got {value!r}", path=f"{path}.{key}")
    return float(value)


def parse_stragglers(raw: Any, path: str, workers: int) -> dict[str, Any] | None:
    """`{ranks: [0], slowdown: 3.0}`: those ranks compute `slowdown` times slower.
    `random: {probability: p, slowdown: s}`: each worker, each step, computes `s` times slower
    with probability `p` (drawn from the run's seed; combines with `ranks`)."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise SpecError("expected a mapping with keys ranks, slowdown, random", path=path)
    _check_keys(raw, path, {"ranks", "slowdown", "random"})
    ranks = raw.get("ranks", [])
    if not isinstance(ranks, list) or not all(isinstance(r, int) and not isinstance(r, bool)
                                              for r in ranks):
        raise SpecError(f"expected a list of worker ranks, got {ranks!r}", path=f"{path}.ranks")
    for i, rank in enumerate(ranks):
        if not 0 <= rank < workers:
            raise SpecError(f"expected a rank between 0 and {workers - 1}, got {rank}",
                            path=f"{path}.ranks[{i}]")
    slowdown = _number({"slowdown": raw.get("slowdown", 1.0)}, "slowdown", path, low=1)
    result: dict[str, Any] = {"ranks": sorted(set(ranks)), "slowdown": slowdown, "random": None}
    randomly = raw.get("random")
    if randomly is not None:
        where = f"{path}.random"
        if not isinstance(randomly, dict):
            raise SpecError("expected a mapping with keys probability, slowdown", path=where)
        _check_keys(randomly, where, {"probability", "slowdown"})
        for key in ("probability", "slowdown"):
            if key not in randomly:
                raise SpecError("required", path=f"{where}.{key}")
        result["random"] = {
            "probability": _number(randomly, "probability", where, low=0, high=1),
            "slowdown": _number(randomly, "slowdown", where, low=1)}
    return result


def parse_budget(raw: Any, path: str) -> dict[str, Any] | None:
    """`{samples: N}` (training samples over all workers) or `{seconds: T}` (training time),
    with `evaluations` (default 10) evenly spaced evaluations of the average model."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise SpecError("expected a mapping with one of the keys samples, seconds", path=path)
    _check_keys(raw, path, {"samples", "seconds", "evaluations"})
    if ("samples" in raw) == ("seconds" in raw):
        raise SpecError("expected exactly one of samples, seconds", path=path)
    budget: dict[str, Any] = {"samples": None, "seconds": None,
                              "evaluations": _int({"evaluations": raw.get("evaluations", 10)},
                                                  "evaluations", path, low=1, high=10_000)}
    if "samples" in raw:
        budget["samples"] = _int(raw, "samples", path, low=1)
    else:
        budget["seconds"] = _number(raw, "seconds", path, low=0, low_open=True)
    return budget


def select(experiments: list[Experiment], only: list[str] | None) -> list[Experiment]:
    """Keep experiments named in `only`: an exact name, or a grid's base name."""
    if not only:
        return experiments
    chosen = [e for e in experiments if e.name in only or e.name.split("[", 1)[0] in only]
    missing = [n for n in only if not any(e.name == n or e.name.split("[", 1)[0] == n
                                          for e in experiments)]
    if missing:
        known = ", ".join(e.name for e in experiments)
        raise SpecError(f"no experiment named {missing[0]!r} (the spec has: {known})", path="experiments")
    return chosen
