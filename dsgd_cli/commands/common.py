"""Options shared by several commands."""

from typing import Annotated, Optional

import typer

DbOption = Annotated[Optional[str], typer.Option(
    "--db", help="Results database: a path or an SQLAlchemy URL [default: $DSGD_DB or ./dsgd.db]")]
FormatOption = Annotated[str, typer.Option(
    "--format", "-f", help="Any tabulate format (simple, github, grid, ...), csv or json")]
ExperimentOption = Annotated[Optional[list[str]], typer.Option(
    "--experiment", "-e", help="Only this experiment (repeatable; a grid's base name selects all its points)")]
ColumnsOption = Annotated[Optional[str], typer.Option(
    "--columns", help="The table's columns, in this order (a,b,c); csv and json keep them all")]
LastOption = Annotated[Optional[int], typer.Option("--last", min=1, help="Only the newest N runs")]
WhereOption = Annotated[Optional[list[str]], typer.Option(
    "--where", "-w", help="Only runs where KEY OP VALUE holds: a column (status, aggregator, "
    "workers, tag, ...) or a configuration key (optimizer.lr); OP is = != < <= > >= (repeatable)")]


def split_columns(text: str | None) -> list[str] | None:
    return [name.strip() for name in text.split(",") if name.strip()] if text else None
