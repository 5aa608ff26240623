"""`dsgd plugins`: every registered plugin by group; with `--check`, whether each loads; with a
name, one plugin's description and options, from its own declaration."""

from __future__ import annotations

import json
import shutil
import textwrap
from typing import Annotated, Any, Optional

import typer

from dsgd_cli.commands.reference import (ABSENT, REQUIRED, describe, plugin_markdown,
                                        reference_markdown)
from dsgd_cli.errors import DsgdError


def plugins(
    name: Annotated[Optional[str], typer.Argument(
        help="One plugin (NAME, or KIND:NAME where several kinds have it): its description "
             "and options", show_default=False)] = None,
    check: Annotated[bool, typer.Option(
        "--check", help="Import every plugin and report whether it loads (imports torch: seconds)")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON")] = False,
    markdown: Annotated[bool, typer.Option(
        "--markdown", help="Print the Markdown reference of the built-in plugins and the "
                           "experiment keys (docs/reference.md); with NAME, that plugin's section")] = False,
) -> None:
    """List registered aggregators, compressors, optimizers and tasks from their
    distributions' metadata, without importing them; --check loads each one. With NAME, show
    that plugin: what it does and each option with its type, default, bounds and help."""
    from dsgd_cli.spec import registry

    if markdown and (check or as_json):
        raise DsgdError("--markdown goes with neither --check nor --json")
    if markdown and name is None:
        typer.echo(reference_markdown(), nl=False)
        return
    if name is not None:
        entry = _find(registry, name)
        if markdown:
            typer.echo(plugin_markdown(entry))
            return
        described = describe(entry)
        if as_json:
            typer.echo(json.dumps(described, indent=2, default=str))
        else:
            typer.echo(_as_text(described))
        return
    rows = []
    for kind, (group, _) in registry.KINDS.items():
        for plugin_name, entry in registry.discover(kind).items():
            row = {"group": group, "name": plugin_name, "distribution": entry.distribution,
                   "version": entry.version, "target": entry.target}
            if check:
                row["status"] = registry.status(entry)
            rows.append(row)
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
    else:
        typer.echo(wrapped(rows, list(rows[0]) if rows else ["group", "name"], ("target",)))


def _find(registry, text: str):
    """The entry `text` names: `NAME`, or `KIND:NAME` (`compressor:none`)."""
    kind, _, name = text.rpartition(":")
    kinds = [kind] if kind else list(registry.KINDS)
    if kind and kind not in registry.KINDS:
        raise DsgdError(f"{text!r}: unknown plugin kind {kind!r} (kinds: {', '.join(registry.KINDS)})")
    found = [registry.discover(k)[name] for k in kinds if name in registry.discover(k)]
    if not found:
        raise DsgdError(f"{text!r}: no registered plugin has this name (`dsgd plugins` lists them)")
    if len(found) > 1:
        named = ", ".join(f"{entry.kind}:{name}" for entry in found)
        raise DsgdError(f"{text!r}: several kinds have a plugin of this name: say which ({named})")
    return found[0]


def _as_text(described: dict[str, Any]) -> str:
    lines = [f"{described['kind']} {described['name']} ({described['target']}, from "
             f"{described['distribution']} {described['version']})"]
    if described["description"]:
        width = shutil.get_terminal_size().columns
        lines += ["", *(wrapped_line for line in described["description"].splitlines()
                        for wrapped_line in (textwrap.wrap(line, width) or [""]))]
    lines += ["", "options:" if described["options"] else "options: none"]
    if described["options"]:
        shown = [{**row, "default": json.dumps(row["default"], default=str)
                  if row["default"] not in (REQUIRED, ABSENT) else row["default"]}
                 for row in described["options"]]
        lines.append(wrapped(shown, ["option", "type", "default", "bounds", "help"],
                             ("default", "help")))
    return "\n".join(lines)


def wrapped(rows: list[dict[str, Any]], columns: list[str], wrapping: tuple[str, ...],
            width: int | None = None) -> str:
    """`rows` as a table no wider than the terminal (`width`, else $COLUMNS or the terminal's
    own): the text of the `wrapping` columns (a description, a default, a path) is wrapped
    onto more lines where the table would be wider, each given an equal share of the room
    the other columns, shown whole, leave."""
    from tabulate import tabulate

    width = width or shutil.get_terminal_size().columns
    cells = [[str(row.get(column, "")) for column in columns] for row in rows]
    # tabulate's simple format: a column is as wide as its longest cell, its header and two
    # more; columns are two spaces apart
    widths = [max([len(column) + 2, *(len(row[i]) for row in cells)])
              for i, column in enumerate(columns)]
    kept = sum(w for w, column in zip(widths, columns) if column not in wrapping)
    room = width - kept - 2 * (len(columns) - 1)
    share = max(12, room // len(wrapping))  # narrower is no longer readable
    for index, column in enumerate(columns):
        if column in wrapping and widths[index] > share:
            for row in cells:
                row[index] = "\n".join(textwrap.wrap(row[index], share)) or row[index]
    return tabulate(cells, headers=columns, tablefmt="simple", disable_numparse=True)
