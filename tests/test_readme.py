"""README.md stays true: every built-in plugin and each of its options is documented."""

from pathlib import Path

import pytest

from dsgd_cli import registry
from dsgd_cli.options import option_fields

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()
BUILTINS = [(kind, name) for kind in registry.KINDS for name, entry in registry.discover(kind).items()
            if entry.distribution == "dsgd"]


@pytest.mark.parametrize("kind, name", BUILTINS, ids=[f"{k}:{n}" for k, n in BUILTINS])
def test_builtin_plugin_and_options_documented(kind, name):
    assert f"| `{name}` |" in README, f"README lacks a table row for {kind} {name!r}"
    for field in option_fields(registry.load(kind, name).Options):
        assert f"`{field.name}`" in README, f"README lacks option {field.name!r} of {kind} {name!r}"


def test_quick_start_and_commands_documented():
    for text in ("make run", "make test", "dsgd run", "dsgd compare", "dsgd runs", "dsgd show",
                 "dsgd plugins"):
        assert text in README
