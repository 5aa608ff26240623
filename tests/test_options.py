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
