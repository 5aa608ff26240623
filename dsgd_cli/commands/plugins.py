"""`dsgd plugins`: every registered plugin by group; with `--check`, whether each loads; with a
name, one plugin's description and options, from its own declaration."""

from __future__ import annotations

import json
from typing import Annotated, Any, Optional

import typer

from dsgd_cli.commands.output import render
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
        typer.echo(render(rows, "simple", list(rows[0]) if rows else ["group", "name"]))


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
        lines += ["", described["description"]]
    lines += ["", "options:" if described["options"] else "options: none"]
    if described["options"]:
        shown = [{**row, "default": json.dumps(row["default"], default=str)
                  if row["default"] not in (REQUIRED, ABSENT) else row["default"]}
                 for row in described["options"]]
        lines.append(render(shown, "simple", ["option", "type", "default", "bounds", "help"]))
    return "\n".join(lines)
