"""`dsgd export`: the metric history of runs in long form, one row per recorded value, for
pandas, polars or a spreadsheet."""

from __future__ import annotations

import csv
import os
import secrets
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import IO, TYPE_CHECKING, Annotated, Iterator, Optional

import typer

from dsgd_cli.results import strictjson
from dsgd_cli.commands.common import DbOption, WhereOption
from dsgd_cli.errors import DsgdError

if TYPE_CHECKING:
    from dsgd_cli.results.reader import Results, RunRecord

TRACKER_FORMATS = ("tensorboard", "mlflow")  # dsgd_cli/results/trackers.py writes them
FORMATS = ("csv", "json", "parquet", *TRACKER_FORMATS)
HISTORY_COLUMNS = ["metric", "step", "epoch", "rank", "seconds", "value"]


def export(
    runs: Annotated[Optional[list[str]], typer.Argument(
        help="Run ids or experiment names (a grid's base name selects all its points); "
             "default: all runs")] = None,
    db: DbOption = None,
    where: WhereOption = None,
    metric: Annotated[Optional[list[str]], typer.Option(
        "--metric", "-m", help="Only this metric (repeatable); default: all")] = None,
    config: Annotated[Optional[list[str]], typer.Option(
        "--config", "-c", help="Add a column with this configuration key or run column "
                               "(optimizer.lr, aggregator, seed; repeatable)")] = None,
    fmt: Annotated[str, typer.Option(
        "--format", "-f", help="csv, json, parquet, tensorboard or mlflow")] = "csv",
    output: Annotated[Optional[str], typer.Option(
        "--output", "-o", metavar="FILE|DIR|URI",
        help="The file to write (csv and json: stdout without it); "
             "tensorboard: a directory; mlflow: a tracking URI")] = None,
) -> None:
    """Export the recorded metric history: run id, experiment, clock, the configuration columns
    asked for, metric, step, epoch, rank, seconds, value; or, with --format tensorboard or
    mlflow, each run with its configuration to that tracker."""
    from dsgd_cli.results.query import check_keys, parse_where, pick, select_runs
    from dsgd_cli.results.reader import Results

    if fmt not in FORMATS:
        raise DsgdError(f"--format: expected one of {', '.join(FORMATS)}, got {fmt!r}")
    if fmt == "parquet" and output is None:
        raise DsgdError("--format parquet: give the file to write with -o")
    if fmt in TRACKER_FORMATS and output is None:
        raise DsgdError(f"--format {fmt}: give the "
                        f"{'directory' if fmt == 'tensorboard' else 'tracking URI'} with -o")
    if fmt in TRACKER_FORMATS and config:
        raise DsgdError(f"--config: --format {fmt} writes the whole configuration; "
                        "leave --config out")
    conditions = [parse_where(text) for text in where or []]
    keys = config or []
    store = Results(db)
    recorded = store.runs(details=False)
    chosen = select_runs(pick(recorded, runs or []), conditions)
    check_keys(keys, recorded, "--config")
    # clock: whether the seconds column is modeled (an emulated cluster) or measured; timing:
    # `overran` where those modeled seconds are partly this machine's
    columns = ["run_id", "experiment", "clock", "timing", *keys, *HISTORY_COLUMNS]
    rows = _rows(store, chosen, keys, metric)
    if fmt in TRACKER_FORMATS:
        from dsgd_cli.results import trackers

        for line in trackers.write(fmt, output, chosen, rows):
            typer.echo(line)
        return
    if output is not None:
        _check_file_name(output)
    try:
        if output is None:
            _write_text(rows, columns, fmt, sys.stdout)
        elif fmt == "parquet":
            with _replacing(output, "wb") as file:
                _write_parquet(rows, columns, file)
        else:
            with _replacing(output, "w") as file:
                _write_text(rows, columns, fmt, file)
    except BrokenPipeError:
        raise  # stdout's reader left (`| head`): click ends quietly
    except OSError as error:
        raise DsgdError(f"--output {output}: {error.strerror}") from None
    if output is not None:
        typer.echo(f"wrote {output}")


def _rows(store: Results, runs: list[RunRecord], keys: list[str],
          metrics: list[str] | None) -> Iterator[list]:
    from sqlalchemy import select

    from dsgd_cli.results.query import run_value
    from dsgd_cli.results.store import Metric

    by_id = {run.id: run for run in runs}
    fixed = {run.id: [run.id, run.experiment, run.clock, run.timing,
                      *[_plain(run_value(run, k)) for k in keys]] for run in runs}
    query = (select(Metric.run_id, Metric.name, Metric.step, Metric.epoch, Metric.rank,
                    Metric.seconds, Metric.value)
             .where(Metric.run_id.in_(list(by_id))).order_by(Metric.run_id, Metric.id))
    if metrics:
        query = query.where(Metric.name.in_(metrics))
    with store.connect() as connection:
        for run_id, *history in connection.execute(query).yield_per(10_000):
            yield fixed[run_id] + history


def _plain(value):
    """A value a csv cell or a parquet column can hold: lists and tag sets as text."""
    if isinstance(value, set):
        return ",".join(sorted(value))
    if isinstance(value, (list, dict)):
        return strictjson.dumps(value)
    return value


def _write_text(rows: Iterator[list], columns: list[str], fmt: str, file) -> None:
    if fmt == "csv":
        writer = csv.writer(file, lineterminator="\n")
        writer.writerow(columns)
        writer.writerows(rows)
        return
    # A JSON array of records, written as it is read: pandas.read_json(path) loads it.
    file.write("[")
    for index, row in enumerate(rows):
        file.write(("," if index else "") + "\n" + strictjson.dumps(dict(zip(columns, row))))
    file.write("\n]\n")


def _write_parquet(rows: Iterator[list], columns: list[str], output: IO[bytes]) -> None:
    try:
        import pyarrow
        import pyarrow.parquet
    except ModuleNotFoundError:
        raise DsgdError("--format parquet needs pyarrow: pip install 'dsgd[parquet]'") from None
    table = list(zip(*rows)) or [[] for _ in columns]
    arrays = {name: pyarrow.array(list(values)) for name, values in zip(columns, table)}
    pyarrow.parquet.write_table(pyarrow.table(arrays), output)


def _check_file_name(output: str) -> None:
    """--output names a file to write, not a directory (`-o ''` is the current one)."""
    if Path(output).is_dir():
        raise DsgdError(f"--output {output}: is a directory; name the file to write")


@contextmanager
def _replacing(output: str, mode: str) -> Iterator[IO]:
    """A file to write that becomes `output` once whole: a new file beside it, renamed over
    it. A rename replaces whatever is at `output`, a link another user planted there included,
    and never writes through it; on an error `output` is left as it was."""
    path = Path(output)
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    # O_EXCL: a file made now, never one (or a link) already there; 0o666 less the umask, as
    # any file the user writes.
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)
    try:
        with os.fdopen(descriptor, mode, **({} if "b" in mode else {"newline": ""})) as file:
            yield file
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
