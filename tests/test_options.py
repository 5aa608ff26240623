"""Typed plugin options: types, bounds, choices and unknown keys, with key paths."""

from dataclasses import dataclass
from typing import Literal

import pytest

from dsgd_cli.errors import SpecError
from dsgd_cli.options import option, parse_options


@dataclass
class Example:
    period: int = option(4, min=1)
    lr: float = option(0.1, min=0.0)
    topology: Literal["ring", "torus"] = option("ring")
    ranks: list[int] = option([])
    scale: float | None = option(None)
    flag: bool = option(False)


def test_defaults_and_conversions():
    parsed = parse_options(Example, {"lr": 1, "ranks": [0, 2], "scale": 2}, "x")
    assert parsed == Example(period=4, lr=1.0, topology="ring", ranks=[0, 2], scale=2.0)
    assert isinstance(parsed.lr, float)


@pytest.mark.parametrize("raw, path, message", [
    ({"period": 0}, "a.period", "expected a value >= 1, got 0"),
    ({"period": 2.5}, "a.period", "expected an integer, got 2.5"),
    ({"period": True}, "a.period", "expected an integer, got True"),
    ({"flag": 1}, "a.flag", "expected true or false, got 1"),
    ({"topology": "rign"}, "a.topology", "expected one of ring, torus, got 'rign'"),
    ({"ranks": [0, "x"]}, "a.ranks[1]", "expected an integer, got 'x'"),
    ({"perod": 2}, "a.perod", "unknown option 'perod' (known options: flag, lr, period, ranks, scale, topology)"),
])
def test_errors_name_the_key_path(raw, path, message):
    with pytest.raises(SpecError) as caught:
        parse_options(Example, raw, "a")
    assert caught.value.path == path
    assert caught.value.detail == message


def test_required_option():
    @dataclass
    class Needs:
        rank: int = option()

    with pytest.raises(SpecError, match="required option missing"):
        parse_options(Needs, {}, "b")


@dataclass
class Sizes:
    count: int = option(1, min=0)                  # no declared max: 64 bits at most
    seed: int = option(0, min=0, max=2**32 - 1)
    scale: float = option(1.0)
    counts: list[int] = option([])
    maybe: int | None = option(None)


@pytest.mark.parametrize("raw, path, message", [
    ({"count": 2**63}, "a.count",
     "expected a value <= 9223372036854775807 (64 bits), got 9223372036854775808"),
    ({"count": 1e19}, "a.count", "expected a value <= 9223372036854775807 (64 bits)"),
    ({"seed": 2**32}, "a.seed", "expected a value <= 4294967295, got 4294967296"),
    ({"counts": [1, 2**64]}, "a.counts[1]", "expected a value <= 9223372036854775807 (64 bits)"),
    ({"counts": [-2**63 - 1]}, "a.counts[0]", "expected a value >= -9223372036854775808 (64 bits)"),
    ({"maybe": 2**70}, "a.maybe", "expected a value <= 9223372036854775807 (64 bits)"),
    ({"scale": 10**400}, "a.scale", "expected a finite number, got 1000000000"),
])
def test_integers_fit_in_64_bits_and_floats_in_floats(raw, path, message):
    """Before: an integer option without a max passed whatever its size and overflowed in
    torch or NumPy in the workers; an integer beyond the floats for a float option raised
    OverflowError (a traceback)."""
    with pytest.raises(SpecError) as caught:
        parse_options(Sizes, raw, "a")
    assert caught.value.path == path
    assert caught.value.detail.startswith(message)
    assert len(caught.value.detail) < 120  # a huge value is cut short


def test_64_bit_bounds_are_inclusive():
    parsed = parse_options(Sizes, {"count": 2**63 - 1, "counts": [-2**63], "seed": 2**32 - 1}, "a")
    assert parsed.count == 2**63 - 1 and parsed.counts == [-2**63] and parsed.seed == 2**32 - 1


def test_long_values_are_cut_short_in_messages():
    with pytest.raises(SpecError) as caught:
        parse_options(Example, {"topology": "x" * 500}, "a")
    assert caught.value.detail.endswith("…") and len(caught.value.detail) < 120


# -- nested sections: a field whose type is a dataclass of its own (the experiment's keys) -----

@dataclass(frozen=True)
class Window:
    spec_section = True  # a section of the experiment: its errors say "unknown key", "required"

    start: int = option(min=0, max=9, expect="an integer between 0 and 9")
    length: float = option(1.0, more_than=0, expect="a number > 0")

    def __post_init__(self):
        if self.start + self.length > 10:
            raise SpecError("the window ends after 10", path="length")


@dataclass(frozen=True)
class WithWindow:
    spec_section = True

    window: Window | None = option(None, help="an optional nested section")
    size: int = option(2, min=1, max=8, expect="an integer between 1 and 8")


def test_a_nested_section_is_parsed_into_its_dataclass():
    assert parse_options(WithWindow, {}, "e") == WithWindow(None, 2)
    assert parse_options(WithWindow, {"window": None}, "e").window is None
    parsed = parse_options(WithWindow, {"window": {"start": 3, "length": 2}}, "e")
    assert parsed.window == Window(3, 2.0) and isinstance(parsed.window.length, float)


@pytest.mark.parametrize("raw, message", [
    ({"window": [1]}, "e.window: expected a mapping with keys start, length"),
    ({"window": {"length": 2}}, "e.window.start: required"),
    ({"window": {"start": 1, "end": 2}}, "e.window.end: unknown key (expected one of length, start)"),
    ({"window": {"start": 10}}, "e.window.start: expected an integer between 0 and 9, got 10"),
    ({"window": {"start": "x"}}, "e.window.start: expected an integer, got 'x'"),
    ({"window": {"start": 1, "length": 0}}, "e.window.length: expected a number > 0, got 0"),
    ({"window": {"start": 1, "length": "x"}}, "e.window.length: expected a number > 0, got 'x'"),
    ({"window": {"start": 9, "length": 2}}, "e.window.length: the window ends after 10"),
    ({"size": 9}, "e.size: expected an integer between 1 and 8, got 9"),
    ({"size": 3.0e10}, "e.size: expected an integer between 1 and 8, got 30000000000.0"),
])
def test_a_nested_section_reports_its_key_paths(raw, message):
    with pytest.raises(SpecError) as error:
        parse_options(WithWindow, raw, "e")
    assert str(error.value) == message


def test_the_experiments_keys_are_declared_once():
    """Every key an experiment may set is a declared option, with a help text; the
    choices of `data_split` and `lr_scaling` are those the runtime knows."""
    import typing

    from dsgd_cli.options import option_fields
    from dsgd_cli.spec.experiment_options import EXPERIMENT_DEFAULTS, ExperimentOptions
    from dsgd_cli.spec.learning_rate import SCALINGS
    from dsgd_cli.spec.sharding import DATA_SPLITS

    fields = {field.name: field for field in option_fields(ExperimentOptions)}
    assert set(EXPERIMENT_DEFAULTS) == {"name", "grid", *fields}
    assert all(field.metadata["help"] for field in fields.values())
    hints = typing.get_type_hints(ExperimentOptions)
    assert typing.get_args(hints["lr_scaling"]) == tuple(SCALINGS)
    assert typing.get_args(hints["data_split"]) == DATA_SPLITS
    assert EXPERIMENT_DEFAULTS["workers"] == 2 and EXPERIMENT_DEFAULTS["timeout"] == 600.0


def test_the_cluster_is_parsed_defaulted_and_checked_against_the_workers_by_its_declaration():
    """`cluster` is a declared section: parsing the experiment's options alone fills in its
    defaults and runs the checks that need the worker count and the other sections."""
    from dsgd_cli.spec.experiment_options import ExperimentOptions

    links = {"intra_node": {"bandwidth": "1GB/s"}, "inter_node": {"bandwidth": "1Gbit"}}
    keys = parse_options(ExperimentOptions, {"workers": 4, "cluster": {"nodes": 2, "links": links}},
                         "e")
    assert keys.cluster.nic == "shared" and keys.cluster.regions is None
    assert keys.cluster.resolved()["links"]["inter_node"] == {"bytes_per_second": 1e9 / 8,
                                                              "latency_s": 0.0}
    refusals = [
        ({"workers": 6, "cluster": {"nodes": 4, "links": links}},
         "e.cluster.nodes: 6 workers cannot be split evenly over 4 nodes: workers must be a "
         "multiple of nodes"),
        ({"workers": 4, "cluster": {"nodes": 4, "links": links}, "network": {"bandwidth": "1Gbit"}},
         "e.cluster: give either network (one link for every worker) or cluster, not both; "
         "set network: null where a default sets it"),
        ({"workers": 4, "cluster": {"nodes": 2, "links": links, "speed": [1, 2]}},
         "e.cluster.speed: node speeds scale the modeled compute: add a compute section "
         "(compute.step_seconds)"),
    ]
    for raw, message in refusals:
        with pytest.raises(SpecError) as error:
            parse_options(ExperimentOptions, raw, "e")
        assert str(error.value) == message


def test_an_option_typed_any_reaches_its_class_as_written():
    """A section converts an `Any` option itself (a bandwidth, a duration): 10**30 bits per
    second is not refused first as an integer beyond 64 bits."""
    from typing import Any

    @dataclass(frozen=True)
    class Link:
        spec_section = True
        bandwidth: Any = option(None)

    assert parse_options(Link, {"bandwidth": 10**30}, "l").bandwidth == 10**30
