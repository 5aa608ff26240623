"""benchmarks/results_row.py formats one row of RESULTS.md's current-figures table, and that
table opens RESULTS.md: the right columns, every command naming a benchmark script or a make
target, every link in the file leading to a heading of the file. No benchmark runs."""

from __future__ import annotations

import datetime
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"
RESULTS = BENCHMARKS / "RESULTS.md"
COLUMNS = ["figure", "value", "machine", "date", "command"]


@pytest.fixture(scope="module")
def results_row():
    spec = importlib.util.spec_from_file_location("results_row", BENCHMARKS / "results_row.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cells(line: str) -> list[str]:
    """The cells of a markdown table row; `\\|` is a pipe inside a cell."""
    assert line.startswith("|") and line.endswith("|"), line
    return [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line[1:-1])]


def slug(text: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    fenced = False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        match = None if fenced else re.match(r"#{1,6} (.*)", line)
        if match:
            base = slug(match.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def test_row_has_the_five_columns_filled(results_row):
    line = results_row.row("dsgd / DDP", "0.98 | at par", command="python benchmarks/x.py --a 1")
    assert line.startswith("| ") and line.endswith(" |")
    figure, value, machine, date, command = cells(line)
    assert (figure, value) == ("dsgd / DDP", "0.98 | at par")
    assert "\\|" in line  # the pipe in the value is escaped, so the row keeps five cells
    assert machine and "core" in machine
    assert date == datetime.date.today().isoformat()
    assert command == "`python benchmarks/x.py --a 1`"


def test_row_defaults_to_the_command_as_run(results_row, monkeypatch):
    monkeypatch.setattr("sys.argv", [str(BENCHMARKS / "sweep.py"), "--points", "4"])
    assert cells(results_row.row("f", "v", machine_name="m", date="2026-01-02"))[2:] == [
        "m", "2026-01-02", "`python benchmarks/sweep.py --points 4`"]
    assert results_row.cell("two\nlines  and | pipe") == "two lines and \\| pipe"


def test_print_rows_puts_each_row_on_a_line_under_the_header(results_row, capsys):
    results_row.print_rows(("a", 1), ("b", "x|y"))
    lines = capsys.readouterr().out.splitlines()
    start = lines.index(results_row.HEADER)
    assert lines[start] == "Row for RESULTS.md:"
    assert [len(cells(line)) for line in lines[start + 1:]] == [5, 5]


def current_table(text: str) -> list[list[str]]:
    lines = text.splitlines()
    assert lines[0] == "# Benchmark results"
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    assert not any(line.startswith("## History") for line in lines[:start]), \
        "the current figures come before the history"
    table = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        table.append(cells(line))
    assert table[0] == COLUMNS
    assert set("".join(table[1])) <= set("-:")
    return table[2:]


def test_results_md_opens_with_the_current_figures():
    text = RESULTS.read_text()
    rows = current_table(text)
    assert 15 <= len(rows) <= 40
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
    scripts = {p.name for p in BENCHMARKS.glob("*.py")}
    for row in rows:
        assert len(row) == 5 and all(row), row
        figure, value, machine, date, command = row
        assert re.search(r"\b20\d\d-\d\d-\d\d\b", date), row
        named = re.findall(r"benchmarks/([\w.]+\.py)", command)
        made = re.findall(r"\bmake ([\w-]+)", command)
        assert named or made, f"{figure}: the command names no benchmark script or make target"
        assert all(name in scripts for name in named), (figure, named)
        assert all(target in targets for target in made), (figure, made)
    assert any("GPU" in row[0] and "no GPU" in row[1] for row in rows), \
        "a row says that no GPU figure exists yet"
    assert "## History" in text


def test_every_link_within_results_md_leads_to_a_heading():
    text = RESULTS.read_text()
    known = anchors(text)
    links = re.findall(r"\]\(#([^)]+)\)", text)
    assert links
    assert sorted(set(links) - known) == []
    assert text.count("> Superseded") >= 5
