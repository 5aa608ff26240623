"""`dsgd plugins`: every registered plugin by group, with its status."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from dsgd_cli.output import render


def plugins(as_json: Annotated[bool, typer.Option("--json", help="Print JSON")] = False) -> None:
    """List registered aggregators, compressors, optimizers and tasks, and whether each loads."""
    from dsgd_cli import registry  # imports torch: only when asked

    rows = []
    for kind, (group, _) in registry.KINDS.items():
        for name, entry in registry.discover(kind).items():
            rows.append({"group": group, "name": name, "distribution": entry.distribution,
                         "version": entry.version, "status": registry.status(entry)})
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
    else:
        typer.echo(render(rows, "simple", ["group", "name", "distribution", "version", "status"]))
