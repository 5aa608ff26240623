"""README.md and docs/ stay true: every spec shown validates, every `dsgd` command shown
exists with the flags it is shown with, every link lands, every built-in plugin and option is
in the generated reference (which equals what the generator prints now), and built-in plugins
import only the modules "Writing a plugin" lists. In-process only: nothing is launched."""

from __future__ import annotations

import ast
import re
import shlex
from pathlib import Path

import pytest
import typer
import typer.main
import yaml

from dsgd_cli.options import option_fields
from dsgd_cli.spec import registry
from dsgd_cli.spec.specfile import EXPERIMENT_DEFAULTS, SpecLoader

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = ROOT / "README.md"
PAGES = [README] + sorted(DOCS.glob("*.md"))
REFERENCE = DOCS / "reference.md"
BUILTINS = [(kind, name) for kind in registry.KINDS for name, entry in registry.discover(kind).items()
            if entry.distribution == "dsgd"]


def _text(path: Path) -> str:
    return path.read_text()


def _blocks(text: str) -> list[tuple[str, str]]:
    """Each fenced block of a Markdown text: (its language, its text)."""
    return re.findall(r"^```(\w*)\n(.*?)^```", text, flags=re.M | re.S)


def _prose(text: str) -> str:
    """The text outside fenced blocks."""
    return re.sub(r"^```\w*\n.*?^```", "", text, flags=re.M | re.S)


def _ids(items):
    return [f"{path.relative_to(ROOT)}#{index}" for path, index, _ in items]


# ---------------------------------------------------------------------------
# Every spec shown validates
# ---------------------------------------------------------------------------

# A block without `experiments` is a part of an experiment (`compute:`, `optimizer:` …): it is
# checked as the keys of one experiment over this base, which holds what any part may need.
FRAGMENT_BASE = {"name": "doc", "task": {"name": "mnist1d_mlp"}, "workers": 8, "epochs": 10,
                 "compute": {"step_seconds": 0.01}}

YAML_BLOCKS = [(path, index, block) for path in PAGES
               for index, (language, block) in enumerate(_blocks(_text(path)))
               if language == "yaml"]


def validate_yaml_block(block: str) -> list:
    """The experiments a spec block resolves to, through the spec loader itself."""
    from dsgd_cli.spec.experiments import resolve_document

    document = yaml.load(block, Loader=SpecLoader)
    if "experiments" not in document:
        document = {"experiments": [{**FRAGMENT_BASE, **document}]}
    return resolve_document(document)


def test_docs_have_specs():
    assert len(YAML_BLOCKS) >= 5 and any(path == README for path, _, _ in YAML_BLOCKS)


@pytest.mark.parametrize("path, index, block", YAML_BLOCKS, ids=_ids(YAML_BLOCKS))
def test_every_spec_block_validates(path, index, block):
    assert validate_yaml_block(block)


def test_a_wrong_spec_block_is_caught():
    from dsgd_cli.errors import SpecError

    with pytest.raises(SpecError):
        validate_yaml_block("compute: {step_seconds: -1}")
    with pytest.raises(SpecError):
        validate_yaml_block("experiments:\n  - {name: a, task: mnist1d_mlp, aggregator: {name: nope}}")


def test_readme_spec_is_twelve_lines_and_its_table_is_shown():
    text = _text(README)
    specs = [block for language, block in _blocks(text) if language == "yaml"]
    assert len(specs[0].splitlines()) <= 12
    names = {experiment.name.split("[")[0] for experiment in validate_yaml_block(specs[0])}
    table = next(block for _, block in _blocks(text) if "test_accuracy" in block)
    for name in names:  # the table shown is the one of that spec's runs (a row, or a group)
        assert re.search(rf"^\s*(\d+\s+)?{re.escape(name)}[\s\[]", table, flags=re.M), name


# ---------------------------------------------------------------------------
# Every command shown exists, with its flags
# ---------------------------------------------------------------------------

def _cli():
    from dsgd_cli.cli import app

    return typer.main.get_command(app)


def _command(words: list[str]):
    """The click command `dsgd WORDS…` names (typer's own click), the words after it, and
    its name."""
    root = command = _cli()
    name = "dsgd"
    while hasattr(command, "commands") and words and words[0] in command.commands:
        name += " " + words[0]
        command, words = command.commands[words[0]], words[1:]
    if command is root:
        raise AssertionError(f"no command `dsgd {words[0] if words else ''}`")
    return command, words, name


def _flags(command) -> set[str]:
    names = {"--help"}
    for param in command.params:
        names.update(param.opts)
        names.update(param.secondary_opts)
    return names


def _shown_commands() -> list[tuple[Path, str, bool]]:
    """Each `dsgd …` a page shows: (page, text, whether it is a concrete example to parse).
    Examples are the lines of shell blocks; inline code is a synopsis (`RUN_ID`, `[--db URL]`)
    whose command and flags are checked."""
    shown = []
    for path in PAGES:
        text = _text(path)
        for language, block in _blocks(text):
            if language not in ("sh", ""):
                continue
            for line in block.splitlines():
                line = line.removeprefix("$ ")
                if line.startswith("dsgd "):
                    shown.append((path, line.split(" #")[0].strip(), language == "sh"))
        for span in re.findall(r"`(dsgd [a-z][^`]*)`", _prose(text)):
            shown.append((path, span.replace("\\|", "|"), False))
    return shown


SHOWN = _shown_commands()


def check_command(text: str, example: bool) -> None:
    words = shlex.split(text)[1:] if example else text.split()[1:]
    command, rest, name = _command(words)
    known = _flags(command)
    flags = (re.findall(r"(?<![\w-])(--?[a-zA-Z][\w-]*)", " ".join(rest)) if not example
             else [word.split("=")[0] for word in rest if word.startswith("-")])
    unknown = sorted(set(flags) - known)
    assert not unknown, f"`{name}` has no option {', '.join(unknown)}"
    if example and not hasattr(command, "commands"):
        command.make_context(name, list(rest))  # arguments and values parse as typed


def test_docs_show_commands():
    assert len([1 for _, _, example in SHOWN if example]) >= 5 and len(SHOWN) >= 30


@pytest.mark.parametrize("path, text, example", SHOWN,
                         ids=[f"{p.relative_to(ROOT)}:{t[:40]}" for p, t, _ in SHOWN])
def test_every_command_shown_exists(path, text, example):
    check_command(text, example)


@pytest.mark.parametrize("text, example", [
    ("dsgd compare --no-such-flag", True),
    ("dsgd nosuchcommand --db x", False),
    ("dsgd runs tag RUN_ID TAG [--remove] [--bogus]", False),
    ("dsgd run --nnodes two", True),
])
def test_a_wrong_command_is_caught(text, example):
    usage_error = typer.BadParameter.__mro__[1]  # click's UsageError, as typer bundles it
    with pytest.raises((AssertionError, usage_error)):
        check_command(text, example)


def test_every_command_is_documented():
    commands = _text(DOCS / "commands.md")
    for name, command in _cli().commands.items():
        assert f"`dsgd {name}" in commands, f"docs/commands.md lacks `dsgd {name}`"
        for sub in getattr(command, "commands", {}):
            assert f"`dsgd {name} {sub}" in commands, f"docs/commands.md lacks `dsgd {name} {sub}`"


def test_readme_quick_start_and_commands():
    text = _text(README)
    assert len(text.splitlines()) < 250
    for shown in ("make run", "make test", "make docs"):
        assert shown in text
    for name in _cli().commands:
        assert f"dsgd {name}" in text, f"README does not name `dsgd {name}`"


# ---------------------------------------------------------------------------
# Every link lands; every page is linked
# ---------------------------------------------------------------------------

def _anchors(text: str) -> set[str]:
    """GitHub's anchors for a page's headings (a repeated one gets -1, -2, …)."""
    anchors, counts = set(), {}
    for heading in re.findall(r"^#{1,6} (.+)$", _prose(text), flags=re.M):
        base = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        count = counts.get(base, 0)
        counts[base] = count + 1
        anchors.add(base if count == 0 else f"{base}-{count}")
    return anchors


def _links(path: Path) -> list[str]:
    return [link for link in re.findall(r"\]\(([^)\s]+)\)", _prose(_text(path)))
            if not re.match(r"[a-z]+:", link)]  # not https:, mailto:


LINKS = [(path, link) for path in PAGES for link in _links(path)]

# Pages another piece of work is writing: their links are ready before the page is. Once the
# page exists its links are checked as any other.
COMING = {DOCS / "failures.md"}


@pytest.mark.parametrize("path, link", LINKS, ids=[f"{p.relative_to(ROOT)}:{l}" for p, l in LINKS])
def test_every_link_lands(path, link):
    target, _, anchor = link.partition("#")
    page = (path.parent / target).resolve() if target else path
    if page in COMING and not page.exists():
        pytest.skip(f"{page.name} is not written yet")
    assert page.exists(), f"{path.name}: {link} names no file"
    if anchor:
        assert anchor in _anchors(_text(page)), f"{path.name}: {link}: no such heading"


def test_every_docs_page_is_linked_from_readme_or_index():
    linked = {(path.parent / link.partition("#")[0]).resolve()
              for path in (README, DOCS / "index.md") for link in _links(path)}
    for page in DOCS.glob("*.md"):
        assert page.resolve() in linked, f"{page.name} is linked from neither README.md nor docs/index.md"


# ---------------------------------------------------------------------------
# Plugins and experiment keys: described, and in the generated reference
# ---------------------------------------------------------------------------

def test_reference_is_what_the_generator_prints():
    from dsgd_cli.commands.reference import reference_markdown

    assert _text(REFERENCE) == reference_markdown(), (
        "docs/reference.md is stale: regenerate it with `make docs` "
        "(`.venv/bin/dsgd plugins --markdown > docs/reference.md`)")


def _reference_section(kind: str, name: str) -> str:
    """A plugin's section of the reference: from its heading to the next."""
    text = _text(REFERENCE)
    group = registry.KINDS[kind][0]
    of_kind = text[text.index(f"(`{group}`)\n"):]
    start = of_kind.index(f"### `{name}`\n")
    end = of_kind.find("\n## ", start)
    section = of_kind[start:end if end >= 0 else None]
    return section[:section.find("\n### ", 1) if "\n### " in section else None]


@pytest.mark.parametrize("kind, name", BUILTINS, ids=[f"{k}:{n}" for k, n in BUILTINS])
def test_builtin_plugin_and_its_options_are_in_the_reference(kind, name):
    section = _reference_section(kind, name)
    for field in option_fields(registry.load(kind, name).Options):
        assert f"| `{field.name}` |" in section, f"reference lacks option {field.name!r} of {kind} {name!r}"


@pytest.mark.parametrize("kind, name", BUILTINS, ids=[f"{k}:{n}" for k, n in BUILTINS])
def test_builtin_plugin_is_described(kind, name):
    assert f"| `{name}` |" in _text(DOCS / "plugins.md"), f"docs/plugins.md lacks a row for {kind} {name!r}"


def test_every_experiment_key_is_in_the_spec_page_and_the_reference():
    spec, reference = _text(DOCS / "spec.md"), _text(REFERENCE)
    for key in EXPERIMENT_DEFAULTS:
        assert f"| `{key}` |" in spec, f"docs/spec.md lacks a row for experiment key {key!r}"
        assert f"| `{key}` |" in reference, f"docs/reference.md lacks experiment key {key!r}"


def test_plugins_markdown_prints_the_reference(capsys):
    from conftest import dsgd_in_process

    result = dsgd_in_process("plugins", "--markdown")
    assert result.returncode == 0 and result.stdout == _text(REFERENCE)
    one = dsgd_in_process("plugins", "local_sgd", "--markdown")
    assert one.returncode == 0 and one.stdout.startswith("### `local_sgd`")
    assert "| `period` | an integer | `4` | >= 1 |" in one.stdout
    assert dsgd_in_process("plugins", "--markdown", "--json").returncode == 2


def test_layout_names_every_package():
    layout = _text(DOCS / "architecture.md")
    for package in sorted((ROOT / "dsgd_cli").glob("*/__init__.py")):
        assert f"  {package.parent.name}/ " in layout, f"docs/architecture.md's layout lacks dsgd_cli/{package.parent.name}/"


def test_option_rows_show_sections_and_open_bounds():
    from dataclasses import dataclass

    from dsgd_cli.commands.reference import option_rows
    from dsgd_cli.options import option

    @dataclass
    class Declared:
        base: dict = option({"name": "local_sgd"}, plugin="aggregator", help="the base")
        rate: float = option(1.0, more_than=0, max=2, help="a rate")
        share: float = option(0.5, min=0, max=1)
        count: int = option(1, min=1)

    rows = {row["option"]: row for row in option_rows(Declared)}
    assert rows["base"]["type"] == "an aggregator section"
    assert [rows[name]["bounds"] for name in ("rate", "share", "count")] == [
        "> 0 and <= 2", "0 to 1", ">= 1"]


def test_option_rows_show_a_sentinel_default_as_absent_and_leave_derived_fields_out():
    """The reference is the same text on every run: a sentinel default would print its address."""
    from dataclasses import dataclass, field

    from dsgd_cli.commands.reference import option_rows
    from dsgd_cli.options import option

    left_out = object()

    @dataclass(frozen=True)
    class Link:
        bandwidth: object = option(left_out, help="absent: unlimited")
        latency: float = option(0.0)
        latency_s: float = field(init=False, default=0.0)  # derived from `latency`

    rows = option_rows(Link)
    assert [row["option"] for row in rows] == ["bandwidth", "latency"]
    assert [row["default"] for row in rows] == ["absent", 0.0]


# ---------------------------------------------------------------------------
# Writing a plugin: the modules a plugin may import, and the worked example
# ---------------------------------------------------------------------------

# What "Writing a plugin" says a plugin may import of dsgd.
PLUGIN_MODULES = {"dsgd_cli.api", "dsgd_cli.topology", "dsgd_cli.datacache", "numba_kernels"}
WRITING = DOCS / "writing-plugins.md"


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
    section = _text(WRITING)
    for module in PLUGIN_MODULES:
        assert f"| `{module}` |" in section, f"docs/writing-plugins.md does not list {module} for plugins"
    used = set()
    for path in sorted((ROOT / "plugins").rglob("*.py")):
        ours = {module for module in _imported_modules(path)
                if module.split(".")[0] in ("dsgd_cli", "numba_kernels")}
        others = sorted(ours - PLUGIN_MODULES)
        assert not others, f"{path.relative_to(ROOT)} imports {others}"
        used |= ours
    assert used == PLUGIN_MODULES  # each listed module is one the built-ins need


def test_worked_example_is_the_tested_plugin_package():
    package = ROOT / "tests" / "plugin_pkgs" / "dsgd_testplugins"
    blocks = {block.splitlines()[0]: block for _, block in _blocks(_text(WRITING))
              if block.startswith("# ")}
    module = blocks["# dsgd_testplugins/averaging.py"].split("\n", 1)[1]
    assert module.strip() in (package / "dsgd_testplugins" / "averaging.py").read_text()
    entry_points = blocks["# pyproject.toml of the plugin's distribution"]
    assert 'model_average = "dsgd_testplugins.averaging:ModelAverage"' in entry_points
    assert 'model_average = "dsgd_testplugins.averaging:ModelAverage"' in (package / "pyproject.toml").read_text()
