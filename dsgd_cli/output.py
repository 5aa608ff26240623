"""Tables for the terminal or for scripts: any tabulate format, plus csv and json."""

from __future__ import annotations

import csv
import io
import json
from typing import Any

from tabulate import tabulate, tabulate_formats

from dsgd_cli.errors import DsgdError

EXTRA_FORMATS = ("csv", "json")


def check_format(fmt: str) -> str:
    if fmt not in EXTRA_FORMATS and fmt not in tabulate_formats:
        known = ", ".join(sorted(set(tabulate_formats) | set(EXTRA_FORMATS)))
        raise DsgdError(f"--format: unknown format {fmt!r} (known: {known})")
    return fmt


def render(rows: list[dict[str, Any]], fmt: str = "simple", columns: list[str] | None = None) -> str:
    columns = columns or (list(rows[0]) if rows else [])
    if fmt == "json":
        return json.dumps([{c: row.get(c) for c in columns} for row in rows], indent=2)
    if fmt == "csv":
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, fieldnames=columns, extrasaction="ignore", lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
        return buffer.getvalue().rstrip("\n")
    table = [[cell(row.get(c)) for c in columns] for row in rows]
    return tabulate(table, headers=columns, tablefmt=fmt, disable_numparse=True)


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
