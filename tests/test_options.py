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
