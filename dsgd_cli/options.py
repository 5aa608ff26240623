"""Typed plugin options: declare a dataclass, get validation with key paths for free.

A plugin declares its options as a dataclass whose fields use `option(...)`::

    @dataclass
    class Options:
        period: int = option(1, min=1, help="local steps between averages")

`parse_options(Options, raw, path)` checks a spec mapping against it: unknown keys, types
(int, float, bool, str, Literal[...], X | None, list[X], a nested plugin section with
`option(plugin=kind)`, and a nested section declared as a dataclass of its own, or that
dataclass | None; an option typed `Any` is passed on as written, for its class to convert)
and bounds, and raises a `SpecError` naming the key path of the first problem. NaN and
infinities are never accepted, and an integer must fit in 64 bits (what torch and NumPy take)
even where no `max` is declared.

A nested plugin section is checked by the registry (`spec.registry.plugin_section`), which
passes itself as `plugin_section`: the registry imports this module, never the reverse.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from typing import Any, Callable, Literal, Mapping

from dsgd_cli.errors import SpecError

INT64_MIN, INT64_MAX = -2**63, 2**63 - 1  # an integer option beyond these overflows torch
FLOAT32_MAX = 3.4028234663852886e38  # the largest float32; a float option beyond it overflows torch
_SHOWN = 60  # characters of a value an error message shows

# How a nested plugin section is checked: (kind, section as written, key path) -> the section
# with every option filled in. The registry's `plugin_section`.
PluginSectionReader = Callable[[str, Any, str], dict[str, Any]]


def show(value: Any) -> str:
    """`repr(value)` for an error message: one line, and cut short when long."""
    try:
        text = repr(value)
    except ValueError:  # an int beyond Python's 4300-digit limit for str()
        digits = int(value.bit_length() * 0.30103) if isinstance(value, int) else "many"
        text = f"an integer of about {digits} digits"
    if len(text) > _SHOWN:
        text = text[:_SHOWN - 1] + "…"
    return text


def as_float(value: Any) -> float | None:
    """A number of the spec as a float; None for anything else, or for an integer beyond
    the floats (more than 1.8e308)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        return float(value)
    except OverflowError:
        return None


def option(default: Any = dataclasses.MISSING, *, min: float | None = None,
           max: float | None = None, help: str = "", plugin: str | None = None,
           more_than: float | None = None, expect: str | None = None,
           missing: str | None = None) -> Any:
    """A dataclass field with bounds and a help text for docs and `dsgd plugins`.

    `plugin`: the option is a nested plugin section of that registry kind, such as
    `outer_optimizer: {name: sgd, lr: 0.7}` with `plugin="optimizer"`; it is validated as the
    experiment's own section of that kind is, and arrives with every option filled in.
    `more_than`: an open lower bound (the value must be greater). `expect`: what an error
    says was expected ("expected <expect>, got ..."), for a value out of bounds and for one
    of the wrong type (an integer's wrong type still says "expected an integer"). `missing`:
    what the error for a required option left out says after "required: "."""
    metadata = {"min": min, "max": max, "help": help, "plugin": plugin,
                "more_than": more_than, "expect": expect, "missing": missing}
    if isinstance(default, (list, dict, set)):
        value = default
        return dataclasses.field(default_factory=lambda: type(value)(value), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def describe_type(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return "one of " + ", ".join(str(choice) for choice in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(annotation)
        parts = [describe_type(a) for a in args if a is not type(None)]
        return " or ".join(parts) + (" or null" if type(None) in args else "")
    if origin is list:
        (item,) = typing.get_args(annotation)
        return f"a list of {describe_type(item)}"
    names = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
    return names.get(annotation, getattr(annotation, "__name__", str(annotation)))


def _convert(value: Any, annotation: Any, path: str) -> Any:
    """Return `value` as `annotation`, or raise SpecError(path)."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(annotation)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(value, arg, path)
            except SpecError:
                continue
        raise _type_error(value, annotation, path)
    if origin is Literal:
        # type check too, so that `true` does not pass for the choice 1
        if any(value == c and type(value) is type(c) for c in typing.get_args(annotation)):
            return value
        raise _type_error(value, annotation, path)
    if origin is list:
        (item,) = typing.get_args(annotation)
        if not isinstance(value, list):
            raise _type_error(value, annotation, path)
        return [_convert(v, item, f"{path}[{i}]") for i, v in enumerate(value)]
    if annotation is bool:
        if isinstance(value, bool):
            return value
    elif annotation is int:
        if isinstance(value, float) and value.is_integer():  # 1e4, as people write counts
            value = int(value)
        if isinstance(value, int) and not isinstance(value, bool):
            return value  # parse_options checks the declared bounds, then 64 bits
    elif annotation is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                return float(value)
            except OverflowError:  # an integer beyond the largest float, 1.8e308
                raise SpecError(f"expected a finite number, got {show(value)}", path=path) from None
    elif annotation is str:
        if isinstance(value, str):
            return value
    elif annotation is Any:
        return value
    raise _type_error(value, annotation, path)


def _type_error(value: Any, annotation: Any, path: str) -> SpecError:
    return SpecError(f"expected {describe_type(annotation)}, got {show(value)}", path=path)


def check_finite(value: Any, path: str) -> None:
    """Raise SpecError for the first NaN or infinity in `value` (nested lists and mappings too)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise SpecError(f"expected a finite number, got {show(value)}", path=path)
    if isinstance(value, dict):
        for key, item in value.items():
            check_finite(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            check_finite(item, f"{path}[{index}]")


def option_fields(options_cls: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(options_cls) if f.init]


@functools.cache
def _declaration(options_cls: type) -> tuple[dict[str, Any], dict[str, dataclasses.Field]]:
    """The type hints and fields of `options_cls`: resolved once per class, not per section."""
    return typing.get_type_hints(options_cls), {f.name: f for f in option_fields(options_cls)}


def parse_options(options_cls: type, raw: Mapping[str, Any], path: str,
                  plugin_section: PluginSectionReader | None = None) -> Any:
    """Build `options_cls` from a spec mapping, checking every key against its declaration.
    A class with `spec_section = True` is a section of the experiment rather than a plugin's
    options: its errors say "unknown key" and "required" as the experiment's keys' do. Its
    `__post_init__` may raise SpecError with a key path inside it (`ranks[0]`).
    `plugin_section` checks the options declared with `option(plugin=kind)`; a class that
    declares one cannot be parsed without it."""
    hints, fields = _declaration(options_cls)
    section = getattr(options_cls, "spec_section", False)
    for key in raw:
        if key not in fields:
            known = ", ".join(sorted(fields)) or "none"
            message = (f"unknown key (expected one of {known})" if section
                       else f"unknown option {show(key)} (known options: {known})")
            raise SpecError(message, path=f"{path}.{key}")
    values = {}
    for name, field in fields.items():
        key_path = f"{path}.{name}"
        if field.metadata.get("plugin") and name not in raw:  # a nested section's default
            values[name] = _checked(_default(field), hints[name], field, key_path,
                                    plugin_section)  # filled in
            continue
        if name not in raw:
            if field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
                raise SpecError(_missing(field, hints[name], section), path=key_path)
            continue
        values[name] = _checked(raw[name], hints[name], field, key_path, plugin_section)
    try:
        return options_cls(**values)
    except SpecError as error:  # a cross-field check, naming the key inside the section
        raise SpecError(error.detail, path=f"{path}.{error.path}" if error.path else path) from None
    except (ValueError, TypeError) as error:
        raise SpecError(str(error), path=path) from None


def _missing(field: dataclasses.Field, annotation: Any, section: bool) -> str:
    """The error for a required option left out."""
    if field.metadata.get("missing"):
        return f"required: {field.metadata['missing']}"
    return "required" if section else f"required option missing ({describe_type(annotation)})"


def _section_class(annotation: Any) -> type | None:
    """The dataclass of a nested section (`Budget` or `Budget | None`), else None."""
    args = typing.get_args(annotation) if typing.get_origin(annotation) in (
        typing.Union, types.UnionType) else (annotation,)
    classes = [a for a in args if a is not type(None)]
    if len(classes) == 1 and dataclasses.is_dataclass(classes[0]):
        return classes[0]
    return None


def _nested_section(cls: type, written: Any, annotation: Any, field: dataclasses.Field,
                    key_path: str, plugin_section: PluginSectionReader | None) -> Any:
    if written is None and type(None) in typing.get_args(annotation):
        return None
    if not isinstance(written, Mapping):
        names = ", ".join(f.name for f in option_fields(cls))
        expect = field.metadata.get("expect") or f"a mapping with keys {names}"
        raise SpecError(f"expected {expect}", path=key_path)
    return parse_options(cls, written, key_path, plugin_section)


def _checked(written: Any, annotation: Any, field: dataclasses.Field, key_path: str,
             plugin_section: PluginSectionReader | None) -> Any:
    """`written` as the option's type, within its bounds; SpecError(key_path) if not."""
    plugin_kind = field.metadata.get("plugin")
    if plugin_kind is not None:  # a nested section, checked as a top-level one is
        if plugin_section is None:
            raise TypeError(f"option {field.name!r} is a {plugin_kind} section: parse its class "
                            f"through dsgd_cli.spec.registry, which checks plugin sections")
        return plugin_section(plugin_kind, written, key_path)
    section_cls = _section_class(annotation)
    if section_cls is not None:
        return _nested_section(section_cls, written, annotation, field, key_path, plugin_section)
    check_finite(written, key_path)
    if annotation is Any:  # taken as written: its class's __post_init__ converts and checks it
        return written
    expect = field.metadata.get("expect")
    try:
        value = _convert(written, annotation, key_path)
    except SpecError:
        if expect is None:
            raise
        expected = "an integer" if _is_integer(annotation) else expect  # `null` goes unsaid
        raise SpecError(f"expected {expected}, got {show(written)}", path=key_path) from None
    low, high = field.metadata.get("min"), field.metadata.get("max")
    more_than = field.metadata.get("more_than")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        out_of_bounds = None
        if more_than is not None and value <= more_than:
            out_of_bounds = f"a value > {more_than}"
        elif low is not None and value < low:
            out_of_bounds = f"a value >= {low}"
        elif high is not None and value > high:
            out_of_bounds = f"a value <= {high}"
        if out_of_bounds is not None:
            shown = show(written) if expect else show(value)  # as the user wrote it, or as taken
            raise SpecError(f"expected {expect or out_of_bounds}, got {shown}", path=key_path)
    try:
        _check_64_bits(value, key_path)
        _check_float32(value, key_path)
    except SpecError:
        if expect is None:
            raise
        raise SpecError(f"expected {expect}, got {show(written)}", path=key_path) from None
    return value


def _is_integer(annotation: Any) -> bool:
    """`int` or `int | None`."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [a for a in typing.get_args(annotation) if a is not type(None)] == [int]
    return annotation is int


def check_defaults(options_cls: type, plugin_section: PluginSectionReader | None = None) -> None:
    """Raise SpecError(path=option name) for the first default that the same option written
    in a spec would fail: a plugin's defaults obey its own declaration. `plugin_section` as
    for `parse_options`."""
    hints, fields = _declaration(options_cls)
    for name, field in fields.items():
        if field.default is not dataclasses.MISSING:
            default = field.default
        elif field.default_factory is not dataclasses.MISSING:
            default = field.default_factory()
        else:
            continue  # required: the spec must give it
        _checked(default, hints[name], field, name, plugin_section)


def _default(field: dataclasses.Field) -> Any:
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return None if field.default is dataclasses.MISSING else field.default


def _check_64_bits(value: Any, path: str) -> None:
    """An integer (or one in a list) that torch or NumPy would take must fit in 64 bits."""
    if isinstance(value, list):
        for index, item in enumerate(value):
            _check_64_bits(item, f"{path}[{index}]")
    elif isinstance(value, int) and not isinstance(value, bool):
        if value > INT64_MAX:
            raise SpecError(f"expected a value <= {INT64_MAX} (64 bits), got {show(value)}", path=path)
        if value < INT64_MIN:
            raise SpecError(f"expected a value >= {INT64_MIN} (64 bits), got {show(value)}", path=path)


def _check_float32(value: Any, path: str) -> None:
    """A float option (or one in a list) must fit in a float32: torch applies a learning
    rate or a weight to float32 tensors, and 1e300 would overflow there, in every worker,
    after the launch."""
    if isinstance(value, list):
        for index, item in enumerate(value):
            _check_float32(item, f"{path}[{index}]")
    elif isinstance(value, float) and abs(value) > FLOAT32_MAX:
        raise SpecError(f"expected a number between -{FLOAT32_MAX:.4g} and {FLOAT32_MAX:.4g} "
                        f"(float32, which training computes in), got {show(value)}", path=path)


def options_to_dict(options: Any) -> dict[str, Any]:
    return dataclasses.asdict(options) if dataclasses.is_dataclass(options) else {}
