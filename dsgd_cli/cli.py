"""The `dsgd` command. Exit codes: 0 success, 1 a run failed, 2 bad input."""

from __future__ import annotations

import sys

import typer

from dsgd_cli.commands.compare import compare
from dsgd_cli.commands.plugins import plugins
from dsgd_cli.commands.run import run
from dsgd_cli.commands.runs import runs, show
from dsgd_cli.errors import DsgdError

app = typer.Typer(help="Run, record and compare distributed data-parallel SGD algorithms.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)
app.command()(run)
app.command()(compare)
app.command()(runs)
app.command()(show)
app.command()(plugins)


def main() -> None:
    # Typer reports usage errors itself (exit 2); our own errors of user input come here.
    try:
        app()
    except DsgdError as error:
        print(f"dsgd: error: {error}", file=sys.stderr)
        sys.exit(error.exit_code)
    except KeyboardInterrupt:
        print("dsgd: interrupted", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
