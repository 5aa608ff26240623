"""No import cycle among dsgd's modules (dsgd_cli and the built-in plugins): each module's
imports are read from its source (every `import` that runs, at module level or in a function;
those under `if TYPE_CHECKING:` only name types), and the strongly connected components of
that graph are the cycles."""

from __future__ import annotations

import ast
from pathlib import Path

import dsgd_cli
import plugins

PACKAGE = Path(dsgd_cli.__file__).parent
PACKAGES = (PACKAGE, Path(plugins.__file__).parent)  # the import packages read
# Packages that no cycle may pass through.
NO_CYCLES_THROUGH = ("dsgd_cli", "plugins")
COMMANDS = "dsgd_cli.commands"


def module_name(path: Path, root: Path = PACKAGE) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path, name: str, modules: set[str]) -> set[str]:
    """The package's modules that the module at `path` imports, anywhere in it."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in _runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, `level - 1` packages up
                parents = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parents + ([base] if base else []))
            for alias in node.names:  # `from package import submodule` imports the submodule
                submodule = f"{base}.{alias.name}"
                found.add(submodule if submodule in modules else base)
    return {module for module in found if module in modules and module != name}


def _runtime_nodes(tree: ast.AST):
    """Every node of `tree` but those under `if TYPE_CHECKING:`."""
    for child in ast.iter_child_nodes(tree):
        if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
            yield from (node for orelse in child.orelse for node in ast.walk(orelse))
            continue
        yield child
        yield from _runtime_nodes(child)


def import_graph() -> dict[str, set[str]]:
    paths = {module_name(path, root): path for root in PACKAGES for path in root.rglob("*.py")}
    return {name: imported(path, name, set(paths)) for name, path in paths.items()}


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[set[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for other in graph[module]:
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            component = set()
            while not component or member != module:
                member = stack.pop()
                component.add(member)
            if len(component) > 1:
                found.append(component)

    for module in graph:
        if module not in index:
            visit(module)
    return found


def in_package(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [{"a", "b", "c"}]


def test_imports_in_functions_count_and_those_for_type_checking_do_not(tmp_path):
    source = tmp_path / "late.py"
    source.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import a.typed\n"
                      "else:\n    import a.other\ndef f():\n    from a import lazy\n")
    modules = {"a.typed", "a.other", "a.lazy", "a.late"}
    assert imported(source, "a.late", modules) == {"a.other", "a.lazy"}


def test_a_submodule_imported_from_its_package_is_an_import_of_the_submodule(tmp_path):
    """`from a import sub` is an edge to a.sub (as `from a.sub import x` is); `from a import
    name`, where the name is not a module, is an edge to the package a."""
    source = tmp_path / "user.py"
    source.write_text("from a import sub\nfrom a.other import thing\n")
    modules = {"a", "a.sub", "a.other", "a.user"}
    assert imported(source, "a.user", modules) == {"a.sub", "a.other"}
    source.write_text("from a import sub, Name\n")
    assert imported(source, "a.user", modules) == {"a.sub", "a"}


def test_no_import_cycle_passes_through_the_covered_packages():
    graph = import_graph()
    assert "dsgd_cli.launch.torchrun" in graph["dsgd_cli.launch.launcher"]  # imports are read
    assert "dsgd_cli.api" in graph["plugins.aggregators.allreduce"]  # the plugins are read
    through = [sorted(component) for component in cycles(graph)
               if any(in_package(module, package) for module in component
                      for package in NO_CYCLES_THROUGH)]
    assert through == []


def command_modules() -> set[str]:
    """The modules that define a `dsgd` command: those cli.py imports from dsgd_cli.commands."""
    cli = PACKAGE / "cli.py"
    return {module for module in imported(cli, "dsgd_cli.cli", set(import_graph()))
            if module.startswith(COMMANDS + ".")}


def test_no_command_imports_another_command():
    """Commands share options and output through helper modules (common, output, reference,
    ...), never by importing one another."""
    graph = import_graph()
    commands = command_modules()
    assert {"dsgd_cli.commands.run", "dsgd_cli.commands.compare"} <= commands  # cli.py is read
    crossing = sorted((module, other) for module in graph if in_package(module, COMMANDS)
                      for other in graph[module] if other in commands)
    assert crossing == []
