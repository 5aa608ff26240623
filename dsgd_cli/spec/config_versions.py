"""Configurations stored by older versions of dsgd, brought up to date in one place.

A run's configuration (the resolved experiment as `Experiment.config`, the launch plan and
the database's `runs.config` hold it) carries `config_version`. Each step of `UPGRADES`
takes a configuration of one version to the next, as `results/migrations.py`'s `MIGRATIONS` do for
the database's schema: whoever reads a stored configuration calls `upgrade_config` once and
then finds every key the current version has, with its meaning of today.

A step changes only what its version changed; it never drops a key (`compare` and `show`
still list what a run recorded).
"""

from __future__ import annotations

import copy
import math
from typing import Any, Callable

from dsgd_cli.errors import DsgdError
from dsgd_cli.spec.compute_model import ComputeOptions
from dsgd_cli.spec.experiment_options import EXPERIMENT_DEFAULTS

# Version 1: every configuration stored before the number existed (it has no
# `config_version`), including those from before `lr_schedule`, `lr_scaling`, `data_split`,
# `timeout`, `stragglers`, `compute`, `budget`, `cluster` and `checkpoint_every` existed.
# Version 2: every experiment key is there, and an unlimited bandwidth is null.
# Version 3: a compute section has `ring_max` (how the real all-reduce moves).
CONFIG_VERSION = 3

# Keys added over version 1's life. A configuration without one gets the key's declared
# default (experiment_options.py), which is what the runtime did without it; were a default
# to change, the step would record the value of then (tests/test_config_versions.py checks
# what a version-1 configuration reads as).
ADDED_IN_VERSION_1 = ("steps_per_epoch", "log_interval", "timeout", "data_split",
                      "target_accuracy", "save_dir", "network", "stragglers", "compute",
                      "cluster", "budget", "checkpoint_every", "lr_scaling", "lr_schedule")
# The options of the default schedule then, filled in as a resolved section has them:
# reading them from its plugin would load it (and torch) in commands that only read.
_SCHEDULE_OPTIONS_THEN = {"warmup_steps": 0, "warmup_epochs": 0.0}


def declared_default(key: str) -> Any:
    """The default `ExperimentOptions` declares for `key`, as a configuration stores it (a
    section's default is null)."""
    return copy.deepcopy(EXPERIMENT_DEFAULTS[key])


def _to_version_2(config: dict[str, Any]) -> None:
    """Keys added over version 1's life get the value that meant what the run did then;
    a bandwidth stored as infinity (before null meant unlimited) becomes null."""
    for key in ADDED_IN_VERSION_1:
        if key not in config:
            config[key] = declared_default(key)
            if key == "lr_schedule":
                config[key].update(_SCHEDULE_OPTIONS_THEN)
    links = [config["network"]] if isinstance(config["network"], dict) else []
    if isinstance(config["cluster"], dict):
        links += list((config["cluster"].get("links") or {}).values())
    for link in links:
        bandwidth = link.get("bytes_per_second")
        if isinstance(bandwidth, float) and math.isinf(bandwidth):
            link["bytes_per_second"] = None


def _to_version_3(config: dict[str, Any]) -> None:
    """Runs before `compute.ring_max` all-reduced by gloo's ring up to 64 members."""
    if isinstance(config["compute"], dict):
        config["compute"].setdefault("ring_max", ComputeOptions.ring_max)  # declared: 64

# version -> the step from it to the next
UPGRADES: dict[int, Callable[[dict[str, Any]], None]] = {
    1: _to_version_2,
    2: _to_version_3,
}


def version_of(config: dict[str, Any]) -> int:
    return config.get("config_version", 1)


def upgrade_config(stored: dict[str, Any]) -> dict[str, Any]:
    """A copy of `stored` (a configuration as some version of dsgd stored it) in the current
    version's layout; DsgdError for one stored by a newer dsgd."""
    version = version_of(stored)
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise DsgdError(f"unreadable configuration: config_version {version!r}")
    if version > CONFIG_VERSION:
        raise DsgdError(f"this configuration was stored by a newer dsgd (config_version "
                        f"{version}; this one reads up to {CONFIG_VERSION}): upgrade dsgd")
    config = copy.deepcopy(stored)
    for step in range(version, CONFIG_VERSION):
        UPGRADES[step](config)
    config.pop("config_version", None)
    return {"config_version": CONFIG_VERSION, **config}  # first, as a resolved spec has it
