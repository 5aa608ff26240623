"""Plugin discovery through entry points: find without importing, load only what is named.

Built-in plugins are registered in dsgd's own pyproject.toml under the same groups a third
party uses, so there is one discovery path. A plugin that fails to import, or whose class does
not derive from the right base, is reported with its distribution, entry name and the original
error, and never breaks the others.

`plugin_section` checks a spec's plugin section (`{name: ..., option: value}`) against the
options its plugin declares; a plugin's options may hold plugin sections of their own
(`option(plugin=kind)`), which come back here.
"""

from __future__ import annotations

import difflib

import importlib.metadata as metadata
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, Any, Mapping

from dsgd_cli.errors import PluginError, SpecError
from dsgd_cli.options import check_defaults, options_to_dict, parse_options, show

if TYPE_CHECKING:
    from dsgd_cli.plugin_base import Plugin

# kind -> (entry-point group, the base class in dsgd_cli.api its plugins derive from)
KINDS: dict[str, tuple[str, str]] = {
    "aggregator": ("dsgd.aggregators", "Aggregator"),
    "compressor": ("dsgd.compressors", "Compressor"),
    "optimizer": ("dsgd.optimizers", "OptimizerPlugin"),
    "task": ("dsgd.tasks", "Task"),
    "lr_schedule": ("dsgd.schedules", "LRSchedule"),
}


@dataclass(frozen=True)
class PluginEntry:
    """One registered plugin, known from its distribution's metadata alone."""

    kind: str
    name: str
    target: str          # "module:attribute"
    distribution: str
    version: str
    entry_point: metadata.EntryPoint
    shadowed_by: str | None = None  # another distribution registered the same name first

    def describe(self) -> str:
        return f"{self.kind} plugin {self.name!r} ({self.target}, from {self.distribution} {self.version})"

    def load(self) -> type[Plugin]:
        from dsgd_cli import plugin_base  # torch: discovering plugins needs none, loading one does

        if self.shadowed_by:
            raise PluginError(f"{self.describe()}: name already registered by {self.shadowed_by}")
        try:
            loaded = self.entry_point.load()
        except Exception as error:  # any import-time failure of third-party code
            raise PluginError(
                f"{self.describe()} failed to import: {type(error).__name__}: {error}") from error
        base = getattr(plugin_base, KINDS[self.kind][1])
        if not (isinstance(loaded, type) and issubclass(loaded, base)):
            raise PluginError(f"{self.describe()} is not a subclass of dsgd_cli.api.{base.__name__}")
        self._check_defaults(loaded)
        loaded.plugin_name = self.name
        return loaded

    def _check_defaults(self, loaded: type) -> None:
        """The defaults of its options obey the rules a value in a spec does."""
        try:
            check_defaults(loaded.Options, plugin_section)
        except SpecError as error:
            raise PluginError(f"{self.describe()}: the default of option {error.path!r} is "
                              f"invalid: {error.detail}") from None
        except (TypeError, NameError) as error:  # not a dataclass, or an unresolvable type
            raise PluginError(f"{self.describe()}: its Options cannot be read: "
                              f"{type(error).__name__}: {error}") from None


@cache
def _entry_points() -> metadata.EntryPoints:
    """All installed entry points, read once: each scan reads every distribution's metadata."""
    return metadata.entry_points()


@cache
def discover(kind: str) -> dict[str, PluginEntry]:
    """Every plugin registered for `kind`, by name, without importing any of them."""
    group, _ = KINDS[kind]
    found: dict[str, PluginEntry] = {}
    shadowed: list[PluginEntry] = []
    for ep in sorted(_entry_points().select(group=group), key=lambda e: e.name):
        dist = ep.dist
        entry = PluginEntry(kind, ep.name, ep.value, dist.name if dist else "?",
                            dist.version if dist else "?", ep)
        if ep.name in found:
            if found[ep.name].distribution == entry.distribution:
                continue  # the same distribution seen twice on sys.path
            first = found[ep.name]
            shadowed.append(PluginEntry(**{**entry.__dict__,
                                           "shadowed_by": f"{first.distribution} {first.version}"}))
        else:
            found[ep.name] = entry
    for entry in shadowed:
        found[f"{entry.name} ({entry.distribution})"] = entry
    return found


@cache
def load(kind: str, name: str) -> type[Plugin]:
    """The plugin class registered as `name`; PluginError if unknown or broken."""
    entries = discover(kind)
    if name not in entries:
        installed = [n for n, e in entries.items() if not e.shadowed_by]
        near = difflib.get_close_matches(name, installed, n=1)
        hint = f"did you mean {near[0]!r}? " if near else ""
        raise PluginError(f"unknown {kind} {name!r} ({hint}installed: "
                          f"{', '.join(installed) or 'none installed'})")
    return entries[name].load()


def plugin_section(kind: str, raw: Any, path: str) -> dict[str, Any]:
    """Validate `{name: ..., option: value, ...}` (or the plugin's name alone) at key path
    `path`; return it with every option filled in."""
    if raw is None:
        raise SpecError(f"required: a {kind} section such as {{name: ...}}", path=path)
    if isinstance(raw, str):
        raw = {"name": raw}
    if not isinstance(raw, dict):
        raise SpecError(f"expected a mapping with a 'name' key, got {show(raw)}", path=path)
    name = raw.get("name")
    if not isinstance(name, str):
        raise SpecError(f"expected the name of a {kind} plugin, got {show(name)}", path=f"{path}.name")
    try:
        cls = load(kind, name)
    except PluginError as error:
        raise SpecError(str(error), path=f"{path}.name") from None
    options = parse_options(cls.Options, {k: v for k, v in raw.items() if k != "name"}, path,
                            plugin_section)
    return {"name": name, **options_to_dict(options)}


def build_options(kind: str, section: Mapping[str, Any]) -> Any:
    """The options instance of an already validated section (`{name: ..., option: value}`,
    every option filled in, as the resolved experiment holds it)."""
    cls = load(kind, section["name"])
    return cls.Options(**{key: value for key, value in section.items() if key != "name"})


def build(kind: str, section: Mapping[str, Any]) -> Plugin:
    """An instance of the plugin an already validated section names, with its options."""
    return load(kind, section["name"])(build_options(kind, section))


def status(entry: PluginEntry) -> str:
    """'ok', or 'broken: <reason>' — this imports the plugin."""
    try:
        entry.load()
    except PluginError as error:
        cause = error.__cause__
        return f"broken: {type(cause).__name__}: {cause}" if cause else f"broken: {error}"
    return "ok"
