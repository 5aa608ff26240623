"""README.md stays true: every built-in plugin and each of its options is documented, and
built-in plugins import only the modules it lists for plugins."""

import ast
from pathlib import Path

import pytest

from dsgd_cli.spec import registry
from dsgd_cli.options import option_fields

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
BUILTINS = [(kind, name) for kind in registry.KINDS for name, entry in registry.discover(kind).items()
            if entry.distribution == "dsgd"]


@pytest.mark.parametrize("kind, name", BUILTINS, ids=[f"{k}:{n}" for k, n in BUILTINS])
def test_builtin_plugin_and_options_documented(kind, name):
    assert f"| `{name}` |" in README, f"README lacks a table row for {kind} {name!r}"
    for field in option_fields(registry.load(kind, name).Options):
        assert f"`{field.name}`" in README, f"README lacks option {field.name!r} of {kind} {name!r}"


def test_quick_start_and_commands_documented():
    for text in ("make run", "make test", "dsgd run", "dsgd compare", "dsgd advise", "dsgd runs",
                 "dsgd show", "dsgd plugins"):
        assert text in README


# What README's "Writing a plugin" says a plugin may import of dsgd.
PLUGIN_MODULES = {"dsgd_cli.api", "dsgd_cli.topology", "dsgd_cli.datacache", "numba_kernels"}


def _imported_modules(path: Path) -> set[str]:
    """Every module a file imports, function-level imports included; `from dsgd_cli import x`
    counts as `dsgd_cli.x`, since dsgd_cli holds modules only."""
    modules = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            modules.add(node.module)
            if node.module == "dsgd_cli":
                modules.update(f"dsgd_cli.{alias.name}" for alias in node.names)
                modules.discard("dsgd_cli")
    return modules


def test_builtin_plugins_import_only_the_plugin_modules():
    section = README[README.index("## Writing a plugin"):]
    for module in PLUGIN_MODULES:
        assert f"| `{module}` |" in section, f"README does not list {module} for plugins"
    used = set()
    for path in sorted((ROOT / "plugins").rglob("*.py")):
        ours = {module for module in _imported_modules(path)
                if module.split(".")[0] in ("dsgd_cli", "numba_kernels")}
        others = sorted(ours - PLUGIN_MODULES)
        assert not others, f"{path.relative_to(ROOT)} imports {others}"
        used |= ours
    assert used == PLUGIN_MODULES  # each listed module is one the built-ins need
