"""Tables for the terminal or for scripts: any tabulate format, plus csv and json.

Tables are for people: bytes in kB, MB, GB (powers of 1000), seconds to three significant
digits, samples per second without decimals. csv and json keep the raw values."""

from __future__ import annotations

import csv
import io
import math
import os
import re
import shutil
import sys
import textwrap
from itertools import chain
from typing import Any

from dsgd_cli.results import strictjson
from dsgd_cli.errors import DsgdError

EXTRA_FORMATS = ("csv", "json")


def check_format(fmt: str) -> str:
    if fmt in EXTRA_FORMATS or fmt == "simple":  # tabulate loads only for the other formats
        return fmt
    from tabulate import tabulate_formats

    if fmt not in tabulate_formats:
        known = ", ".join(sorted(set(tabulate_formats) | set(EXTRA_FORMATS)))
        raise DsgdError(f"--format: unknown format {fmt!r} (known: {known})")
    return fmt


def render(rows: list[dict[str, Any]], fmt: str = "simple", columns: list[str] | None = None) -> str:
    columns = columns or (list(rows[0]) if rows else [])
    if fmt == "json":
        return strictjson.dumps([{c: row.get(c) for c in columns} for row in rows], indent=2)
    if fmt == "csv":
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, fieldnames=columns, extrasaction="ignore", lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
        return buffer.getvalue().rstrip("\n")
    table = [[readable(row.get(c), c) for c in columns] for row in rows]
    if fmt == "simple":
        simple = simple_table(table, columns)
        if simple is not None:
            return simple
    from tabulate import tabulate

    return tabulate(table, headers=columns, tablefmt=fmt, disable_numparse=True)


def simple_table(table: list[list[str]], headers: list[str]) -> str | None:
    """What tabulate's `simple` format makes of these cells (left-aligned text), ten times
    faster for thousands of rows; None where tabulate must do it (no rows, rows of another
    length, or text other than printable ASCII, whose width tabulate works out itself)."""
    if not table or any(len(row) != len(headers) for row in table):
        return None
    if not all(text.isascii() and text.isprintable() for text in chain(headers, *table)):
        return None
    table = [[text.strip() for text in row] for row in table]
    widths = [max(len(header) + 2, *(len(text) for text in column))  # 2: tabulate's padding
              for header, column in zip(headers, zip(*table))]
    lines = [headers, ["-" * width for width in widths], *table]
    return "\n".join("  ".join(text.ljust(width) for text, width in zip(line, widths)).rstrip()
                     for line in lines)


# Columns that say what a row is rather than what it measured, in the order a table too wide
# for the terminal gives them up (to the line above it where every row has the same value).
LABEL_COLUMNS = ("optimizer", "task", "workers", "status", "clock", "aggregator")
# Columns that name a row: given up last of all.
NAME_COLUMNS = ("experiment", "id")
# Columns a narrow table keeps before all others: they say how far to trust the numbers, or
# what to do instead (`dsgd advise`).
KEPT_COLUMNS = ("timing", "warning", "advice")


def fitted(rows: list[dict[str, Any]], columns: list[str], width: int | None = None,
           picked: list[str] | None = None, every: str = "all runs",
           labels: tuple[str, ...] | list[str] = LABEL_COLUMNS) -> str:
    """A `simple` table for the terminal, made to fit `width` characters (default: the
    terminal's, or $COLUMNS): columns that hold the same value in every row go to one line
    above the table (`all runs: optimizer sgd, task mnist1d_mlp`), long texts are shortened
    in the middle, and columns that still do not fit are left out, saying which: first the
    `labels` (in their order; one equal in every row, as with a single row, goes to the line
    above instead), then the others from the right, the row's name (NAME_COLUMNS) last, never
    KEPT_COLUMNS. `every` names what the
    rows are in that line. `picked` (`--columns`) chooses the columns and their order, and
    none of them is left out. csv and json never come here: they keep every column, raw."""
    if picked:
        unknown = [name for name in picked if name not in columns]
        if unknown:
            raise DsgdError(f"--columns: no column {unknown[0]!r} (columns: {', '.join(columns)})")
        columns = list(picked)
    width = width or shutil.get_terminal_size((100, 24)).columns
    header = []
    empty = [c for c in columns if rows and all(row.get(c) in (None, "") for row in rows)]
    if empty and not picked:  # a column blank in every row says nothing but its name
        columns = [c for c in columns if c not in empty]
    if len(rows) > 1 and not picked:
        same = [c for c in columns if _same_in_every_row(rows, c)]
        header = [f"{c} {readable(rows[0].get(c), c)}" for c in same]
        columns = [c for c in columns if c not in same]
    left_out = []
    if not picked:
        for column in _give_up_order(columns, labels):
            if _table_width(_cells(rows, columns, width), columns) <= width or len(columns) == 1:
                break
            columns.remove(column)
            if _same_in_every_row(rows, column):
                header.append(f"{column} {readable(rows[0].get(column), column)}")
            else:
                left_out.append(column)
    table = _cells(rows, columns, width)
    lines = []
    if header:
        lines += textwrap.wrap(f"{every}: " + ", ".join(header), width, subsequent_indent="  ")
    lines.append(simple_table(table, columns) or _tabulated(table, columns))
    if empty and not picked:
        lines += textwrap.wrap(f"(not recorded by any of these runs: {', '.join(empty)})", width)
    if left_out:
        lines += textwrap.wrap(f"({len(left_out)} more columns: {', '.join(left_out)}; "
                               f"choose with --columns, or -f csv)", width)
    return "\n".join(lines)


def _same_in_every_row(rows: list[dict[str, Any]], column: str) -> bool:
    return (bool(rows) and rows[0].get(column) is not None
            and len({cell(row.get(column)) for row in rows}) == 1)


def _give_up_order(columns: list[str], labels: tuple[str, ...] | list[str]) -> list[str]:
    """Which columns a table too wide gives up, first to last: the labels, then the others
    from the right, the row's name last; never KEPT_COLUMNS."""
    first = [c for c in labels if c in columns and c not in KEPT_COLUMNS]
    last = [c for c in NAME_COLUMNS if c in columns and c not in first]
    rest = [c for c in reversed(columns) if c not in first + last and c not in KEPT_COLUMNS]
    return first + rest + last


def _cells(rows: list[dict[str, Any]], columns: list[str], width: int) -> list[list[str]]:
    """The rows' texts for `columns`, the widest shortened towards `width`."""
    table = [[readable(row.get(c), c) for c in columns] for row in rows]
    return _shortened(table, columns, width)


MIN_CELL = 24  # texts are shortened in the middle down to this width, no further


def _shortened(table: list[list[str]], columns: list[str], width: int) -> list[list[str]]:
    """The widest columns' texts shortened in the middle (`sgp-ring-…-lr0.1`), widest first,
    as far as the table is too wide and no column below MIN_CELL."""
    while table and (excess := _table_width(table, columns) - width) > 0:
        widths = [max(len(line[i]) for line in table) for i in range(len(columns))]
        widest = max(range(len(columns)), key=lambda i: widths[i])
        limit = max(MIN_CELL, len(columns[widest]) + 2, widths[widest] - excess)
        if limit >= widths[widest]:
            break  # nothing left to shorten: columns go instead
        table = [[_middle(text, limit) if i == widest else text for i, text in enumerate(line)]
                 for line in table]
    return table


def _middle(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    keep = limit - 1
    return text[: (keep + 1) // 2] + "…" + text[len(text) - keep // 2:]


def _table_width(table: list[list[str]], columns: list[str]) -> int:
    widths = [max(len(header) + 2, *(len(line[i]) for line in table)) if table else len(header) + 2
              for i, header in enumerate(columns)]
    return sum(widths) + 2 * (len(widths) - 1)


def _tabulated(table: list[list[str]], columns: list[str]) -> str:
    from tabulate import tabulate

    return tabulate(table, headers=columns, tablefmt="simple", disable_numparse=True)


# -- prose wrapped to the terminal ---------------------------------------------------------------

def terminal_width() -> int | None:
    """The width that lines of prose (`run --dry-run`'s plan, `show`'s header) wrap to: the
    terminal's when standard output is one, or $COLUMNS when it is set; None when neither (a
    pipe, a file, a script's capture): lines stay whole then, one item per line, for grep and
    scripts. Tables (`fitted`) always fit the terminal's width or $COLUMNS, else 100."""
    if os.environ.get("COLUMNS") or sys.stdout.isatty():
        return shutil.get_terminal_size((100, 24)).columns
    return None


def wrap_lines(lines: list[str], width: int | None = None) -> list[str]:
    """Each line no wider than `width` (default: `terminal_width()`, and when that is None,
    every line whole), its continuation lines indented four spaces more than it (past the
    lines it introduces, indented two); words (paths, options, a number with its unit) are
    never split. A shell command (`torchrun ...`, or `$ ...` after the indent) continues
    with ` \\` so that it can still be pasted."""
    width = terminal_width() if width is None else width
    if width is None:
        return list(lines)
    result = []
    for line in lines:
        if len(line) <= width:
            result.append(line)
            continue
        indent = line[: len(line) - len(line.lstrip(" "))]
        command = line.lstrip().startswith(("$ ", "torchrun "))
        # A number stays with its unit (`12.5 MB/s`): textwrap breaks at plain spaces only.
        # The first line keeps its indent: textwrap drops only the whitespace it breaks at.
        glued = _NUMBER_UNIT.sub(lambda m: m.group(1) + _GLUE, line)
        wrapped = [part.replace(_GLUE, " ") for part in textwrap.wrap(
            glued, width - (2 if command else 0), subsequent_indent=indent + "    ",
            break_long_words=False, break_on_hyphens=False)]
        if command:
            wrapped = [part + " \\" for part in wrapped[:-1]] + wrapped[-1:]
        result.extend(wrapped)
    return result


_GLUE = "\ue000"  # a character of no text: a space no line breaks at, while wrapping
_NUMBER_UNIT = re.compile(r"(\d) (?=[A-Za-zµ%])")


def wrap_text(text: str, width: int | None = None) -> str:
    """`wrap_lines` over the lines of `text`."""
    return "\n".join(wrap_lines(text.split("\n"), width))


BYTE_UNITS = ("B", "kB", "MB", "GB", "TB", "PB")


def readable(value: Any, column: str) -> str:
    """`value` for a table, by what its column holds: bytes, seconds, a rate or anything."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        return cell(value)
    if "bytes" in column and not column.endswith("_ratio"):
        return readable_bytes(value)
    if column.endswith("seconds") or column.startswith("time_"):  # time_to_target, time_low
        return readable_seconds(value)
    if column.endswith("_per_second"):
        return f"{value:.0f}"
    return cell(value)


def readable_bytes(value: float) -> str:
    """`21902400` -> `21.9 MB`, `512` -> `512 B`."""
    size, unit = abs(value), 0
    # Compare what will be shown: 999,999 bytes are `1 MB`, not `1e+03 kB`.
    while float(f"{size:.3g}") >= 1000 and unit < len(BYTE_UNITS) - 1:
        size, unit = size / 1000, unit + 1
    sign = "-" if value < 0 else ""
    if unit == 0:
        return f"{sign}{size:.0f} B"
    return f"{sign}{size:.3g} {BYTE_UNITS[unit]}"


def readable_seconds(value: float) -> str:
    """Three significant digits (`0.394`, `2.77`, `12.3`), whole seconds from 100 on."""
    return f"{value:.0f}" if abs(value) >= 100 else f"{value:.3g}"


def cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        if value == int(value) and abs(value) < 1e15:
            return f"{value:.0f}"
        if abs(value) >= 1e6 or abs(value) < 1e-3:
            return f"{value:.4g}"
        return f"{value:.1f}" if abs(value) >= 100 else f"{value:.4f}"
    return str(value)
