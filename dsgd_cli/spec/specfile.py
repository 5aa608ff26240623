"""Reading a spec: the YAML file in, one raw experiment per grid point out, with `defaults`
merged in, `grid` expanded and the command line's worker count applied. Values are not
validated and no plugin is loaded here (spec.py does both), and nothing here imports torch:
`dsgd run` reads this far to start torchrun while it validates the rest. (One exception: a
`--set` key path into a nested plugin section the spec leaves to its default loads the plugin
that declares it, to merge into that default.)
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import yaml

from dsgd_cli.errors import SpecError
from dsgd_cli.spec.nodes import NodePlan, parse_launch
from dsgd_cli.options import check_finite
from dsgd_cli.spec.experiment_options import EXPERIMENT_DEFAULTS  # every key, with its default

TOP_LEVEL_KEYS = ("defaults", "experiments", "launch")
TOO_DEEP = "nested too deeply, or a YAML alias contains itself"

class SpecLoader(yaml.SafeLoader):
    """YAML 1.1 as PyYAML reads it, but `1e-3`, `1E6` or `-2.5e+4` are floats as in YAML 1.2,
    not strings (YAML 1.1 wants a dot and a signed exponent: `1.0e-3`)."""


SpecLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    # YAML 1.2's core-schema float, only the forms with an exponent: the others already load
    re.compile(r"^[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."))


def read_document(path: Path) -> tuple[str, Any]:
    """The spec's text and its YAML; a SpecError (naming no file) if either is unreadable."""
    text = _read_text(path)
    return text, load_yaml(text)


def load_yaml(text: str) -> Any:
    """`text` read as the spec reads YAML: `SpecLoader`'s numbers, a key given twice refused,
    nesting too deep refused; a SpecError (naming no file) saying what is wrong and where
    (line and column in `text`)."""
    try:
        loader = SpecLoader(text)
        try:
            node = loader.get_single_node()
            if node is None:  # an empty file
                return None
            check_unique_keys(node, "")
            return loader.construct_document(node)
        finally:
            loader.dispose()
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = getattr(error, "problem", None) or (str(error).splitlines() or ["?"])[0]
        raise SpecError(f"invalid YAML: {where}{problem}") from None
    except ValueError as error:  # an integer of more than 4300 digits
        raise SpecError(f"invalid YAML: {error}") from None
    except RecursionError:
        raise SpecError("invalid YAML: nested too deeply") from None

def check_unique_keys(node: yaml.Node, path: str, seen: set[int] | None = None) -> None:
    """A key given twice in one mapping is an error naming it and both lines: YAML would keep
    the second silently (a second `experiments:` would drop the first list). Merge keys (`<<`)
    are not duplicates: what they bring in is overridden by the mapping's own keys. A node an
    alias repeats is checked once (`seen`), so an alias inside itself ends."""
    seen = set() if seen is None else seen
    if id(node) in seen:
        return
    seen.add(id(node))
    if isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            check_unique_keys(item, f"{path}[{index}]", seen)
    elif isinstance(node, yaml.MappingNode):
        first_line: dict[tuple[str, str], int] = {}
        for key, value in node.value:
            name = key.value if isinstance(key, yaml.ScalarNode) else None
            if name is None or key.tag == "tag:yaml.org,2002:merge":
                continue
            key_path = f"{path}.{name}" if path else str(name)
            line = key.start_mark.line + 1
            if (key.tag, name) in first_line:
                raise SpecError(f"key {name!r} given twice, on lines {first_line[key.tag, name]} "
                                f"and {line}", path=key_path)
            first_line[key.tag, name] = line
            check_unique_keys(value, key_path, seen)


def _read_text(path: Path) -> str:
    try:
        data = path.read_bytes()
    except OSError as error:
        raise SpecError(f"cannot read spec: {error.strerror or error}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        raise SpecError(f"not UTF-8 text: byte 0x{data[error.start]:02x} at line {line} "
                        f"(offset {error.start}); save the spec as UTF-8") from None


MAX_NAME_BYTES = 255  # the longest file name most filesystems take: a name is a directory
_LINE_BREAKS = re.compile("[\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029]")


def one_line(text: str) -> str:
    """`text` with its line breaks escaped (those `str.splitlines` breaks at)."""
    return _LINE_BREAKS.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)


@dataclass(frozen=True)
class Point:
    """One experiment as written: where (`experiments[i]`), its name (a grid point's names
    its values) and its keys, defaults merged in, before validation."""

    path: str
    name: str
    raw: dict[str, Any]


def sections(document: Any, launch_override: dict[str, Any] | None = None
             ) -> tuple[dict, list, NodePlan | None]:
    """The spec's `defaults` and `experiments`, checked for shape, and its `launch:` section
    with the command line's values over it."""
    if not isinstance(document, dict):
        raise SpecError("expected a mapping with keys 'defaults' and 'experiments'")
    check_finite(document, "")  # where the value is written: `defaults` or an experiment
    for key in document:
        if key not in TOP_LEVEL_KEYS:
            raise SpecError(f"unknown key (expected one of {', '.join(TOP_LEVEL_KEYS)})", path=str(key))
    defaults = document.get("defaults")
    if defaults is None:
        defaults = {}
    if not isinstance(defaults, dict):
        raise SpecError("expected a mapping", path="defaults")
    check_keys(defaults, "defaults", allow=set(EXPERIMENT_DEFAULTS) - {"name", "grid"})
    nodes = parse_launch(document.get("launch"), launch_override)
    entries = document.get("experiments")
    if not isinstance(entries, list) or not entries:
        raise SpecError("expected a non-empty list of experiments", path="experiments")
    return defaults, entries, nodes


def parse_set(text: str) -> tuple[str, Any]:
    """`--set KEY=VALUE`: a dotted experiment key and a value read as the spec file reads
    YAML (`0.1`, `1e-3`, `true`, `[1, 2]`, `{name: sgd, lr: 0.1}`), under the same rules (no
    key twice, no NaN or infinity, bounded nesting). Its errors name `--set KEY`."""
    key, equals, raw = text.partition("=")
    key = key.strip()
    if not equals or not key:
        raise SpecError(f"expected KEY=VALUE, e.g. optimizer.lr=0.1, got {one_line(repr(text))}",
                        file="--set")
    try:
        value = load_yaml(raw) if raw.strip() else None
        check_finite(value, "")
    except SpecError as error:
        raise SpecError(one_line(error.detail), file=set_origin(key),
                        path=one_line(error.path) if error.path else None) from None
    except RecursionError:  # `&a [*a]`: a value that contains itself
        raise SpecError(TOO_DEEP, file=set_origin(key)) from None
    return key, value


def set_origin(key: str) -> str:
    """How an error names the `--set KEY` its value came from."""
    return one_line(f"--set {key}")


_IN_AN_EXPERIMENT = re.compile(r"experiments\[\d+\]\.(.+)", re.DOTALL)


def set_key_holding(path: str | None, keys: list[str]) -> str | None:
    """The `--set` key (of `keys`) whose value holds the key path `path` of an error met in
    an experiment (`experiments[0].optimizer.lr`), or None. A `--set` value replaces its key
    whole in every experiment, so whatever lies under that key came from the command line."""
    match = _IN_AN_EXPERIMENT.fullmatch(path or "")
    if match is None:
        return None
    inside = match.group(1)
    for key in reversed(keys):  # of two --set of one key, the last one is set
        if inside == key or inside.startswith((key + ".", key + "[")):
            return key
    return None


_KEY_PARTS = re.compile(r"([^.\[\]]+)|\[(\d+)\]")


def defaults_path(path: str | None, defaults: dict, entries: list) -> str | None:
    """`defaults.KEY...` where the value at the key path `path` of an error met in an
    experiment (`experiments[0].network.bandwidth`) was written in the spec's `defaults`, not
    in that experiment (nor its grid): the place to fix it. None where the experiment wrote
    it, `defaults` does not hold it (dsgd's own default), or the path is not an experiment's."""
    match = re.fullmatch(r"experiments\[(\d+)\]\.(.+)", path or "", re.DOTALL)
    if match is None or not isinstance(entries, list) or int(match.group(1)) >= len(entries):
        return None
    entry, inside = entries[int(match.group(1))], match.group(2)
    if not isinstance(entry, dict) or not isinstance(defaults, dict):
        return None
    grid = entry.get("grid")
    if isinstance(grid, dict) and any(inside == str(key) or inside.startswith(f"{key}.")
                                      or inside.startswith(f"{key}[") for key in grid):
        return None  # a grid key sets it in every point
    parts = [name if name else int(index)
             for name, index in _KEY_PARTS.findall(inside)]
    mine: Any = entry  # None once the experiment has nothing along the path
    theirs: Any = defaults
    for part in parts:
        if isinstance(part, int):
            if mine is not None or not isinstance(theirs, list) or part >= len(theirs):
                return None  # a list the experiment wrote replaces the default's whole
        elif not isinstance(theirs, dict) or part not in theirs:
            return None  # not in defaults: dsgd's own default, or the experiment's
        elif isinstance(mine, dict) and part in mine:
            if not (isinstance(mine[part], dict) and isinstance(theirs[part], dict)):
                return None  # the experiment's own value replaced the default's
            if "name" in mine[part] and mine[part]["name"] != theirs[part].get("name"):
                return None  # another plugin: its section replaced the default's whole
        mine = mine.get(part) if isinstance(mine, dict) else None
        theirs = theirs[part]
    return "defaults." + inside


def points(defaults: dict, entries: list, workers_override: int | None = None,
           overrides: list[tuple[str, Any]] = (), only: list[str] | None = None) -> Iterator[Point]:
    """Every experiment of the spec, grid points expanded, in order; lazily, so that the
    first error is met as early as when validating as they come. `overrides` (the command
    line's `--set KEY=VALUE`) are set over the spec and its grid in every point that `only`
    (`--experiment`) selects: a mapping merges into the section it names as `defaults` do."""
    for index, entry in enumerate(entries):
        path = f"experiments[{index}]"
        if not isinstance(entry, dict):
            raise SpecError("expected a mapping", path=path)
        check_keys(entry, path, allow=set(EXPERIMENT_DEFAULTS))
        merged = copy.deepcopy(EXPERIMENT_DEFAULTS)
        for layer in (defaults, entry):
            merged.update({key: merge(merged.get(key), value) for key, value in layer.items()})
        for name, point in expand_grid(merged, path):
            if workers_override is not None:  # the command line wins over spec and grid
                point["workers"] = workers_override
            for key, value in overrides if selected(name, only) else ():
                try:
                    _set_dotted(point, key, value, "", "--set key", merging=True)
                except SpecError as error:
                    raise SpecError(error.detail, file=set_origin(key)) from None
            yield Point(path, name, point)


def selected(name: str, only: list[str] | None) -> bool:
    """Whether `--experiment` (`only`) selects the experiment `name`: by its exact name, or
    by its grid's base name."""
    return not only or name in only or name.split("[", 1)[0] in only

def check_keys(mapping: dict, path: str, allow: set[str]) -> None:
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
    if name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
        # It names the run's directory under `save_dir`: it must stay one directory there.
        raise SpecError(f"expected a name without '/', '\\' or a NUL character, other than "
                        f"'.' and '..', got {name!r}", path=f"{path}.name")
    _check_name_length(name, f"{path}.name")
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
        # Shallow: points share what they do not set (`_set_dotted` copies what it changes)
        # and validation only reads them.
        point = dict(experiment)
        labels = []
        for key, value in zip(grid, combination):
            _set_dotted(point, str(key), value, f"{path}.grid.{key}")
            labels.append(f"{key}={value}")
        point_name = f"{name}[{','.join(labels)}]"
        if point.get("save_dir"):  # the point's name is then a directory's
            _check_name_length(point_name.replace("/", "_"), f"{path}.grid")
        points.append((point_name, point))
    return points


def _check_name_length(name: str, path: str) -> None:
    """Refuse a name longer than a file name may be: it names a directory under `save_dir`."""
    size = len(name.encode("utf-8", "surrogatepass"))
    if size > MAX_NAME_BYTES:
        raise SpecError(f"expected a name of at most {MAX_NAME_BYTES} bytes (UTF-8), the "
                        f"longest file name, got {name[:40]!r}... of {size} bytes", path=path)


def _set_dotted(mapping: dict, dotted: str, value: Any, path: str, what: str = "grid key",
                merging: bool = False) -> None:
    """Set one grid key (or `--set` key). `section.name` picks a plugin: like a section naming
    another plugin in `defaults`, it replaces the section's options (they belong to the old
    plugin). `merging` (`--set`): a mapping merges into the section it names (`merge`), and a
    key path may lead into a nested plugin section the spec leaves to its plugin's default
    (`aggregator.outer_optimizer.lr`), which it then changes."""
    *parents, leaf = dotted.split(".")
    if not leaf or (not parents and (leaf not in EXPERIMENT_DEFAULTS or leaf in ("name", "grid"))):
        raise SpecError(f"{what} must name an experiment key, a plugin option or a plugin "
                        "section's name", path=path)
    node, kind = mapping, None  # kind: the plugin kind of the section `node` (None: the experiment)
    for part in parents:
        child = node.get(part)
        if child is None and merging:
            child = _default_section(node, kind, part)
        if child is None and leaf == "name":  # e.g. a compressor section not yet there
            child = {}
        if isinstance(child, str) and _section_kind(node, kind, part):  # `optimizer: sgd`
            child = {"name": child}
        if not isinstance(child, dict):
            raise SpecError(f"{part!r} is not a section of the experiment", path=path)
        node[part] = child = dict(child)  # this point's own copy: the others share the original
        node, kind = child, _section_kind(node, kind, part)
    if leaf == "name" and node.get("name") != value:
        kept = {key: section for key, section in node.items() if isinstance(section, dict)}
        node.clear()
        node.update(kept)  # nested plugin sections stay: an aggregator keeps its compressor
    if merging and isinstance(value, dict):
        current = node.get(leaf)
        if current is None:
            current = _default_section(node, kind, leaf)
        if isinstance(current, str) and _section_kind(node, kind, leaf):
            current = {"name": current}
        value = merge(current, value)
    node[leaf] = value


def _section_kind(section: dict, kind: str | None, key: str) -> str | None:
    """The plugin kind of the section under `key` of `section` (itself of plugin kind `kind`,
    None for the experiment): `aggregator` for the experiment's `aggregator`, `optimizer` for
    DiLoCo's `outer_optimizer`; None where it is no plugin section."""
    from dsgd_cli.spec.registry import KINDS

    if kind is None:
        return key if key in KINDS else None
    field = _plugin_option(section, kind, key)
    return field.metadata.get("plugin") if field is not None else None


def _default_section(section: dict, kind: str | None, key: str) -> dict | None:
    """The default of the nested plugin section `key` of the plugin `section` names (loading
    that plugin: the only place here that may), for a `--set` key path into it; None where
    there is none (validation then says what is wrong)."""
    field = _plugin_option(section, kind, key) if kind is not None else None
    if field is None or not field.metadata.get("plugin"):
        return None
    default = (field.default_factory() if field.default_factory is not dataclasses.MISSING
               else field.default)
    return copy.deepcopy(default) if isinstance(default, dict) else None


def _plugin_option(section: dict, kind: str, key: str) -> dataclasses.Field | None:
    """The declared option `key` of the plugin of kind `kind` that `section` names."""
    from dsgd_cli.errors import PluginError
    from dsgd_cli.spec import registry

    name = section.get("name")
    if not isinstance(name, str):
        return None
    try:
        options = registry.load(kind, name).Options
    except (PluginError, SpecError):
        return None  # an unknown plugin: validation names it
    if not dataclasses.is_dataclass(options):
        return None
    return next((field for field in dataclasses.fields(options) if field.name == key), None)
