"""The `dsgd` command. Exit codes: 0 success, 1 a run failed, 2 bad input."""

from __future__ import annotations

import signal
import sys

import typer

from dsgd_cli.commands.advise import advise
from dsgd_cli.commands.compare import compare
from dsgd_cli.commands.export import export
from dsgd_cli.commands.plot import plot
from dsgd_cli.commands.plugins import plugins
from dsgd_cli.commands.run import run
from dsgd_cli.commands.runs import runs_app, show
from dsgd_cli.commands.submit import submit
from dsgd_cli.errors import DsgdError, Interrupted

INTERRUPTING = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

app = typer.Typer(help="Run, record and compare distributed data-parallel SGD algorithms.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)
app.command()(run)
app.command()(submit)
app.command()(compare)
app.command()(advise)
app.command()(plot)
app.command()(export)
app.add_typer(runs_app, name="runs")  # the listing, and `runs delete`, `runs tag`
app.command()(show)
app.command()(plugins)


def _interrupt(signum, _frame) -> None:
    name = signal.Signals(signum).name
    raise Interrupted(name, 128 + signum)


def main() -> None:
    # SIGINT, SIGTERM and SIGHUP (the terminal or SSH session went away) become one exception
    # that a running launch turns into an `interrupted` run (it stops the run's processes
    # first), and that click does not swallow.
    for signum in INTERRUPTING:
        signal.signal(signum, _interrupt)
    # Typer reports usage errors itself (exit 2); our own errors of user input come here.
    try:
        app()
    except Interrupted as interrupted:
        try:
            print("dsgd: interrupted", file=sys.stderr)
        except OSError:  # after SIGHUP the terminal may be gone
            pass
        sys.exit(interrupted.exit_code)
    except DsgdError as error:
        print(f"dsgd: error: {error}", file=sys.stderr)
        sys.exit(error.exit_code)


if __name__ == "__main__":
    main()
