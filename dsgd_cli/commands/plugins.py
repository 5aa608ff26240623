"""`dsgd plugins`: every registered plugin by group; with `--check`, whether each loads."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from dsgd_cli.commands.output import render


def plugins(
    check: Annotated[bool, typer.Option(
        "--check", help="Import every plugin and report whether it loads (imports torch: seconds)")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON")] = False,
) -> None:
    """List registered aggregators, compressors, optimizers and tasks from their
    distributions' metadata, without importing them; --check loads each one."""
    from dsgd_cli.spec import registry

    rows = []
    for kind, (group, _) in registry.KINDS.items():
        for name, entry in registry.discover(kind).items():
            row = {"group": group, "name": name, "distribution": entry.distribution,
                   "version": entry.version, "target": entry.target}
            if check:
                row["status"] = registry.status(entry)
            rows.append(row)
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
    else:
        typer.echo(render(rows, "simple", list(rows[0]) if rows else ["group", "name"]))
