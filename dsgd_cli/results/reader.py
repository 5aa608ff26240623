"""Reading the results database: `ResultsReader` answers the commands that only read (runs,
show, compare, plot, export) in plain SQL, without loading SQLAlchemy for an SQLite file.

SQLAlchemy takes longer to import than such a command takes to run (0.5 s of a 1 s `dsgd runs`
on a slow machine), so an SQLite database given as a path (or `sqlite:///PATH`) is read through
Python's own sqlite3, opened read-only; any other URL (PostgreSQL) goes through SQLAlchemy. The
queries are the same text on both: `:name` parameters and SQL that SQLite and PostgreSQL share.
The tables and columns are named in `dsgd_cli.results.schema`. The writing side, with the
schema's models and migrations, is `dsgd_cli.results.store`: its `ResultsWriter` reads back what
it wrote through a `ResultsReader` over its own engine.
"""

from __future__ import annotations

import sqlite3
import sys
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from functools import cached_property
from typing import Any, Iterable, Iterator, NamedTuple

from dsgd_cli.errors import DsgdError, StoreError
from dsgd_cli.results import strictjson
from dsgd_cli.results.database import (missing_driver_error, one_line, read_only_uri, resolve_url,
                                       shown_db, sqlite_path)
from dsgd_cli.results.schema import (CHECKPOINTS, MAX_ID, META, METRICS, PARAMS, PLUGIN_VERSIONS,
                                     RUNS, SCHEMA_VERSION, SLURM_JOBS, SUMMARIES, TABLE_COLUMNS,
                                     TAGS, tables_of_version)
from dsgd_cli.results.slurm_ids import SlurmJob
from dsgd_cli.spec.config_versions import upgrade_config

IN_LIST_LIMIT = 10_000  # beyond this many ids, reading a whole table beats a huge IN list
RUN_FIELDS = RUNS.columns


def higher_is_better(name: str) -> bool:
    return "accuracy" in name or name == "samples_per_second"


def has_direction(name: str) -> bool:
    """Whether a best value of this metric means something: accuracies and throughput are
    better higher, losses and perplexities lower; bytes, counts, rates and times are what they
    are (a run that sent fewer bytes in one step did not do better)."""
    return higher_is_better(name) or "loss" in name or "perplexity" in name


def flatten_config(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat.update(flatten_config(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


# -- what a read returns -------------------------------------------------------------------------

class Record(NamedTuple):  # a tuple: hundreds of thousands may be read at once
    """One recorded metric value (a row of the metrics table)."""

    step: int | None
    epoch: int | None
    rank: int | None
    seconds: float | None
    value: float


class SummaryRecord(NamedTuple):
    name: str
    final: float
    best: float


class PluginRecord(NamedTuple):
    kind: str
    name: str
    distribution: str
    version: str


class ParamRecord(NamedTuple):
    key: str
    value: str  # JSON


@dataclass(eq=False)  # compared and hashed by identity: `query` caches per run object
class RunRecord:
    """One run of an experiment with its tags (sorted names); read with `details`, also its
    parameters, plugin versions and metric summaries (each sorted by name). `config` is the
    run's whole configuration in the current version's layout, whatever version of dsgd stored
    it (`config_versions.upgrade_config`)."""

    id: int
    experiment: str
    spec_file: str | None
    status: str  # running, completed, failed, diverged, interrupted
    reason: str | None
    failed_rank: int | None
    task: str
    aggregator: str
    compressor: str
    optimizer: str
    workers: int
    config: dict
    dsgd_version: str
    host: str
    started_at: datetime
    ended_at: datetime | None
    tag_names: list[str] = field(default_factory=list)
    slurm_jobs: list[SlurmJob] = field(default_factory=list)  # the SLURM jobs it ran in
    params: list[ParamRecord] = field(default_factory=list)
    plugins: list[PluginRecord] = field(default_factory=list)
    summaries: list[SummaryRecord] = field(default_factory=list)
    overrun_steps: float | None = None  # its summary of that name, read with every run

    @property
    def timing(self) -> str:
        """Whether the run's times are what its clock says: `overran` for a modeled run where
        more than OVERRUN_ADVICE_STEPS of the steps' real work overran their modeled time (its
        times are partly this machine's, not the modeled cluster's; `dsgd run` said so when it
        ended), `ok` otherwise. (`comm_overrun` and `comm_overrun_time` are no part of it: a
        collective's real time holds the wait for its last member, which the model holds
        too, so under stragglers they are high where the timing is the model's.)"""
        from dsgd_cli.spec.compute_model import OVERRUN_ADVICE_STEPS

        overran = self.overrun_steps is not None and self.overrun_steps > OVERRUN_ADVICE_STEPS
        return "overran" if overran else "ok"

    @property
    def clock(self) -> str:
        """Which clock the run's times are on: `modeled` on an emulated cluster (a compute
        model: every recorded time is modeled seconds, real time ÷ time_scale), `measured`
        otherwise (seconds of this machine's clock, as noisy as the machine)."""
        return "modeled" if self.config.get("compute") else "measured"


# -- the reader ----------------------------------------------------------------------------------

class ResultsReader:
    """The results database, read. The database must exist and hold dsgd's tables; it is
    opened read-only and never changed, not even upgraded: what an older schema lacks reads as
    empty (a schema-1 database has no tags). A run whose row cannot be read (written by another
    program, or edited by hand) is left out of every list of runs, and said on stderr once:
    one bad row must not hide the others."""

    def __init__(self, db: str | None = None, writer_engine=None):
        """`writer_engine`: read through the engine of a `ResultsWriter` that has just created
        or upgraded the schema (so nothing is left to check), rather than open `db` read-only."""
        self.url = resolve_url(db)
        self.shown_url = shown_db(db)  # for messages
        self._skipped: set[int] = set()  # the ids of the unreadable runs left out so far
        if writer_engine is not None:
            self.engine = writer_engine  # (in place of the read-only engine made on first use)
            self._sql = EngineReader(writer_engine, self.shown_url)
            self.has_tags = self.has_checkpoints = self.has_slurm_jobs = True
            return
        path = sqlite_path(self.url)
        try:
            self._sql = (SQLiteReader(path, self.shown_url) if path is not None
                         else EngineReader(self.engine, self.shown_url))
            tables = check_schema(self._sql, self.shown_url, missing_ok=False)
        except Unreadable as error:
            raise StoreError(f"cannot open results database {self.shown_url}: "
                             f"{error.reason}") from None
        except (sqlite3.Error, *_sqlalchemy_errors()) as error:
            reason = getattr(error, "orig", None) or error
            raise StoreError(f"cannot open results database {self.shown_url}: "
                             f"{one_line(reason)}") from None
        except ModuleNotFoundError as error:
            raise missing_driver_error(self.shown_url, error) from None
        self.has_tags = TAGS.name in tables
        self.has_checkpoints = CHECKPOINTS.name in tables
        self.has_slurm_jobs = SLURM_JOBS.name in tables

    @cached_property
    def engine(self):
        """A read-only SQLAlchemy engine, made on first use: for the queries over metric
        histories (`dsgd_cli.results.history`, `dsgd export`), which are built with SQLAlchemy."""
        from dsgd_cli.results.database import read_only_engine

        return read_only_engine(self.url)

    @contextmanager
    def connect(self):
        """A connection of the engine (for queries built with SQLAlchemy); a database error
        while it is used becomes a one-line StoreError naming the database."""
        from sqlalchemy.exc import DBAPIError

        try:
            with self.engine.connect() as connection:
                yield connection
        except DBAPIError as error:
            raise Unreadable(self.shown_url, error) from None

    # -- runs --------------------------------------------------------------------------------

    def runs(self, experiments: list[str] | None = None, last: int | None = None,
             ids: list[int] | None = None, details: bool = True) -> list[RunRecord]:
        """Runs, oldest first; `last` keeps the newest N; `experiments` filters by name (a
        grid's base name matches all its points); `ids` by run id. Each run comes with its
        tags. `details`: also each run's summaries, plugins and parameters; without them
        thousands of runs load much faster (`finals` gives their metrics). An unreadable run is
        skipped (see `_skip`)."""
        runs = []
        for row in self._run_rows(experiments, last, ids):
            try:
                runs.append(self._read_run(row))
            except UnreadableRun as unreadable:
                self._skip(unreadable)
        self._attach(runs, details)
        return runs

    def get_run(self, run_id: int) -> RunRecord | None:
        """The run with its details, or None (also for an id no database integer can hold);
        UnreadableRun for a run whose row cannot be read."""
        rows = self._run_rows(ids=[run_id])
        if not rows:
            return None
        run = self._read_run(rows[0])
        self._attach([run], details=True)
        return run

    def _skip(self, unreadable: UnreadableRun) -> None:
        """Leave out an unreadable run, saying so on stderr the first time (a command may
        read the runs more than once)."""
        if unreadable.run_id not in self._skipped:
            self._skipped.add(unreadable.run_id)
            print(f"dsgd: {unreadable}: skipped", file=sys.stderr)

    def _run_rows(self, experiments: list[str] | None = None, last: int | None = None,
                  ids: list[int] | None = None) -> list[tuple]:
        """The rows of `runs` that `runs()` asks for, oldest first."""
        conditions, params = [], {}
        if ids is not None:
            ids = [i for i in ids if 0 < i <= MAX_ID]
            if not ids:
                return []
            conditions.append(_in_list("id", ids, params))
        if experiments:
            alternatives = []
            for index, name in enumerate(experiments):
                params[f"name{index}"], params[f"point{index}"] = name, f"{name}[%"
                alternatives.append(f"experiment = :name{index} OR experiment LIKE :point{index}")
            conditions.append(" OR ".join(f"({a})" for a in alternatives))
        sql = RUNS.select()
        if conditions:
            sql += " WHERE " + " AND ".join(f"({c})" for c in conditions)
        sql += " ORDER BY id DESC"
        if last:
            sql += " LIMIT :last"
            params["last"] = last
        return list(reversed(self._sql.rows(sql, params)))

    def _read_run(self, row: tuple) -> RunRecord:
        """The run of a row of `runs`; UnreadableRun, naming it, where a value cannot be read."""
        run_id = row[RUN_FIELDS.index("id")]
        try:
            return _run(row)
        except BadValue as bad:
            raise self._unreadable(run_id, f"{RUNS}.{bad}") from None
        except DsgdError as error:  # a configuration stored by a newer dsgd
            raise UnreadableRun(run_id, f"run {run_id}: {error}") from None

    def _unreadable(self, run_id: int, problem: str) -> UnreadableRun:
        return UnreadableRun(run_id, f"run {run_id} in {self.shown_url} is unreadable ({problem})")

    def _attach(self, runs: list[RunRecord], details: bool) -> None:
        """Give each run its tags and SLURM jobs and, with `details`, its parameters, plugins
        and summaries."""
        by_id = {run.id: run for run in runs}
        self._attach_overruns(by_id)
        if self.has_tags:
            for run_id, tag in self._for_runs(TAGS.select("run_id", "tag"), by_id, "tag"):
                by_id[run_id].tag_names.append(tag)
        if self.has_slurm_jobs:
            for run_id, *job in self._for_runs(
                    SLURM_JOBS.select("run_id", "job_id", "array_job_id", "array_task_id"),
                    by_id, "job_id"):
                by_id[run_id].slurm_jobs.append(SlurmJob(*job))
        if not details:
            return
        for run_id, key, value in self._for_runs(PARAMS.select("run_id", "key", "value"),
                                                 by_id, "key"):
            by_id[run_id].params.append(ParamRecord(key, value))
        for run_id, *plugin in self._for_runs(
                PLUGIN_VERSIONS.select("run_id", "kind", "name", "distribution", "version"),
                by_id, "kind"):
            by_id[run_id].plugins.append(PluginRecord(*plugin))
        for run_id, *summary in self._for_runs(SUMMARIES.select("run_id", "name", "final", "best"),
                                               by_id, "name"):
            by_id[run_id].summaries.append(SummaryRecord(*summary))

    def _attach_overruns(self, by_id: dict[int, RunRecord]) -> None:
        """Each run's `overrun_steps` summary, which its `timing` mark is made of (one row per
        run with a compute model)."""
        if not by_id:
            return
        rows = self._sql.rows(SUMMARIES.select("run_id", "final") + " WHERE name = :name",
                              {"name": "overrun_steps"})
        for run_id, final in rows:
            if run_id in by_id:
                by_id[run_id].overrun_steps = final

    def _for_runs(self, select: str, run_ids: Iterable[int], order: str) -> Iterator[tuple]:
        """The rows of `select` (whose first column is run_id) that belong to `run_ids`, in
        order of `order` within each run."""
        wanted = set(run_ids)
        if not wanted:
            return
        params: dict[str, Any] = {}
        where = f" WHERE {_in_list('run_id', sorted(wanted), params)}" if len(wanted) <= IN_LIST_LIMIT else ""
        for row in self._sql.rows(f"{select}{where} ORDER BY run_id, {order}", params):
            if row[0] in wanted:
                yield row

    def finals(self, run_ids: list[int]) -> dict[int, dict[str, float]]:
        """The final value of every metric of the runs, by run id and metric name."""
        finals: dict[int, dict[str, float]] = defaultdict(dict)
        for run_id, name, final in self._for_runs(SUMMARIES.select("run_id", "name", "final"),
                                                  run_ids, "name"):
            finals[run_id][name] = final
        return finals

    # -- a run's other records ----------------------------------------------------------------

    def checkpoint_dir(self, run_id: int) -> str | None:
        """Where the run keeps its checkpoints (None: it keeps none, or the schema predates
        them)."""
        if not self.has_checkpoints:
            return None
        rows = self._sql.rows(CHECKPOINTS.select("directory") + " WHERE run_id = :run_id",
                              {"run_id": run_id})
        return rows[0][0] if rows else None

    def resumes(self, run_id: int) -> list[dict]:
        """When the run resumed from which step: [{"at": ISO time, "step": step}, ...]."""
        if not self.has_checkpoints:
            return []
        rows = self._sql.rows(CHECKPOINTS.select("resumes") + " WHERE run_id = :run_id",
                              {"run_id": run_id})
        if not rows:
            return []
        try:
            return _resumes(rows[0][0])
        except BadValue as bad:
            raise self._unreadable(run_id, f"{CHECKPOINTS}.{bad}") from None

    def metric_history(self, run_id: int, name: str) -> list[Record]:
        """A metric's records for the run, in the order they were recorded."""
        rows = self._sql.rows(METRICS.select("step", "epoch", "rank", "seconds", "value")
                              + " WHERE run_id = :run_id AND name = :name ORDER BY id",
                              {"run_id": run_id, "name": name})
        return [Record(*row) for row in rows]

    def step_curves(self, run_ids: list[int],
                    name: str) -> dict[int, list[tuple[int, float, float | None]]]:
        """Each run's course of metric `name`, by run id: (step, value, seconds) per recorded
        step in step order, where the value is the mean over the ranks that recorded the
        step (a per-run metric: as recorded) and the seconds the latest of theirs. The points
        `compare --target` reads, here in plain SQL (`dsgd advise` over SQLite loads no
        SQLAlchemy); runs without a record of the metric are absent."""
        wanted = set(run_ids)
        if not wanted:
            return {}
        params: dict[str, Any] = {"name": name}
        where = (f" AND {_in_list('run_id', sorted(wanted), params)}"
                 if len(wanted) <= IN_LIST_LIMIT else "")
        rows = self._sql.rows(
            f"SELECT run_id, step, avg(value), max(seconds) FROM {METRICS} "
            f"WHERE name = :name AND step IS NOT NULL{where} "
            "GROUP BY run_id, step ORDER BY run_id, step", params)
        curves: dict[int, list[tuple[int, float, float | None]]] = defaultdict(list)
        for run_id, step, value, seconds in rows:
            if run_id in wanted:
                curves[run_id].append((step, float(value), None if seconds is None else float(seconds)))
        return dict(curves)

    def metric_names(self, run_ids: list[int]) -> list[str]:
        """The names of the metrics the runs recorded, sorted."""
        return sorted({name for _, name in self._for_runs(
            f"SELECT DISTINCT run_id, name FROM {METRICS}", run_ids, "name")})


Results = ResultsReader  # its name before the writer was parted from it (commands, benchmarks)


# -- is it dsgd's database? ---------------------------------------------------------------------

def check_schema(sql: SQLiteReader | EngineReader, shown_url: str, missing_ok: bool) -> set[str]:
    """The tables of the database `sql` reads, once it is known to be a dsgd database this
    version can use. Every dsgd table already there has dsgd's columns (another program's
    `runs` table must not be read, or written to, as if it were ours) and the schema is not
    newer than this dsgd's. Unless `missing_ok` (a writer, which creates what is missing), the
    database holds every table of its schema version."""
    columns = sql.columns()
    if not missing_ok and RUNS.name not in columns:
        raise StoreError(f"{shown_url} holds no dsgd results (no table 'runs')")
    for table, expected in TABLE_COLUMNS.items():
        if table not in columns:
            continue
        lacking = [column for column in expected if column not in columns[table]]
        if lacking:
            more = f" and {len(lacking) - 3} more" if len(lacking) > 3 else ""
            raise StoreError(f"{shown_url} is not a dsgd results database: its table "
                             f"'{table}' lacks the columns "
                             f"{', '.join(map(repr, lacking[:3]))}{more}")
    version = stored_version(sql, shown_url) if META.name in columns else None
    check_version(version, shown_url)
    if not missing_ok:
        _check_complete(columns, version or 1, shown_url)  # no meta: a schema-1 database
    return set(columns)


def _check_complete(columns: dict[str, set[str]], version: int, shown_url: str) -> None:
    """A database lacking a table its schema version has (dropped by hand, or by a tool) is
    damaged: refused at once rather than failing at the first query that needs it."""
    missing = [table for table in tables_of_version(version) if table not in columns]
    if missing:
        raise StoreError(f"results database {shown_url} is damaged: it lacks the "
                         f"table{'s' if len(missing) > 1 else ''} "
                         f"{', '.join(map(repr, missing))} of schema version {version}")


def stored_version(sql: SQLiteReader | EngineReader, shown_url: str) -> int | None:
    rows = sql.rows(META.select("value") + " WHERE key = 'schema_version'")
    return schema_version(rows[0][0] if rows else None, shown_url)


def check_version(version: int | None, shown_url: str) -> None:
    if version is not None and version > SCHEMA_VERSION:
        raise StoreError(f"results database {shown_url} has schema version {version}, "
                         f"newer than this dsgd understands ({SCHEMA_VERSION}); upgrade dsgd")


def schema_version(value: str | None, shown_url: str) -> int | None:
    """The schema version `meta` holds (None: none yet)."""
    if value is None:
        return None
    if not value.strip().isdigit():
        raise StoreError(f"{shown_url} is not a dsgd results database: its schema version is "
                         f"{value!r}")
    return int(value)


def _run(row: tuple) -> RunRecord:
    """The run of a row of `runs`: BadValue where a value cannot be read, DsgdError for a
    configuration stored by a newer dsgd."""
    values = dict(zip(RUN_FIELDS, row))
    values["config"] = _config(values["config"])
    values["started_at"] = _time(values["started_at"], "started_at")
    if values["ended_at"] is not None:
        values["ended_at"] = _time(values["ended_at"], "ended_at")
    return RunRecord(**values)


class BadValue(Exception):
    """A stored value that cannot be read: `column: reason`."""

    def __init__(self, column: str, reason: str):
        super().__init__(f"{column}: {reason}")


class UnreadableRun(StoreError):
    """A run whose records cannot be read; the message names the run."""

    def __init__(self, run_id: int, message: str):
        super().__init__(message)
        self.run_id = run_id


MAX_CONFIG_NESTING = 64  # a configuration dsgd writes nests a few levels; Python's recursion ~1000


def _config(stored: Any) -> dict:
    """A stored configuration, decoded, in the current version's layout."""
    try:
        config = _json(stored)
    except strictjson.NotJson as error:
        raise BadValue("config", str(error)) from None
    if not isinstance(config, dict):
        raise BadValue("config", "not a JSON object")
    # Deeper, copying, flattening or showing it would end in a RecursionError.
    if _nesting(config) > MAX_CONFIG_NESTING:
        raise BadValue("config", "JSON nested too deep")
    try:
        return upgrade_config(config)
    except (AttributeError, TypeError):  # a section of another shape than dsgd writes
        raise BadValue("config", "not a configuration dsgd wrote") from None


def _nesting(value: Any) -> int:
    """How deep objects and lists nest in `value` (0: neither), counted without recursion."""
    deepest, pending = 0, [(value, 1)]
    while pending:
        item, depth = pending.pop()
        if isinstance(item, dict):
            item = list(item.values())
        if isinstance(item, list):
            deepest = max(deepest, depth)
            pending.extend((child, depth + 1) for child in item)
    return deepest


def _resumes(stored: Any) -> list[dict]:
    """A run's stored resumes: a list of {"at": ISO time, "step": step}."""
    try:
        resumes = _json(stored) or []
    except strictjson.NotJson as error:
        raise BadValue("resumes", str(error)) from None
    if not (isinstance(resumes, list)
            and all(isinstance(r, dict) and {"at", "step"} <= r.keys() for r in resumes)):
        raise BadValue("resumes", "not a list of resumes")
    return resumes


def _time(stored: Any, column: str) -> datetime:
    """A stored time as an aware UTC datetime. SQLite holds the UTC time as text without an
    offset; PostgreSQL's driver gives a datetime in its session's time zone."""
    try:
        value = datetime.fromisoformat(stored) if isinstance(stored, str) else stored
        if isinstance(value, datetime):
            return (value.replace(tzinfo=timezone.utc) if value.tzinfo is None
                    else value.astimezone(timezone.utc))
    except (ValueError, OverflowError):  # (OverflowError: before year 1 once in UTC)
        pass
    raise BadValue(column, "not a time")


def _in_list(column: str, values: list, params: dict[str, Any]) -> str:
    """`column IN (:v0, :v1, ...)`, adding the values to `params`."""
    start = len(params)
    names = [f"v{start + index}" for index in range(len(values))]
    params.update(zip(names, values))
    return f"{column} IN ({', '.join(':' + name for name in names)})"


def _json(value: Any) -> Any:
    """A JSON column's value: SQLite gives its text, PostgreSQL's driver the decoded value;
    strictjson.NotJson for text that is not JSON."""
    return strictjson.loads(value) if isinstance(value, (str, bytes)) else value


# -- the two ways in -----------------------------------------------------------------------------

class Unreadable(StoreError):
    """A database error met while reading (a damaged file, a table gone), on one line."""

    def __init__(self, shown_url: str, error: Exception):
        self.reason = one_line(getattr(error, "orig", None) or error)
        super().__init__(f"cannot read results database {shown_url}: {self.reason}")


class SQLiteReader:
    """An SQLite file through the sqlite3 module, read-only."""

    def __init__(self, path: str, shown_url: str):
        self.shown_url = shown_url
        self.connection = sqlite3.connect(read_only_uri(path), uri=True)

    def rows(self, sql: str, params: dict[str, Any] | None = None) -> list[tuple]:
        try:
            return self.connection.execute(sql, params or {}).fetchall()
        except sqlite3.Error as error:
            raise Unreadable(self.shown_url, error) from None

    def columns(self) -> dict[str, set[str]]:
        tables = [name for (name,) in self.rows(
            "SELECT name FROM sqlite_master WHERE type = 'table'")]
        # Table names come from the database itself; quoted as SQLite identifiers.
        return {table: {row[1] for row in self.rows(
            'PRAGMA table_info("' + table.replace('"', '""') + '")')} for table in tables}


class EngineReader:
    """Any database through an SQLAlchemy engine (PostgreSQL; SQLite given by another URL)."""

    def __init__(self, engine, shown_url: str):
        self.engine = engine
        self.shown_url = shown_url

    def rows(self, sql: str, params: dict[str, Any] | None = None) -> list[tuple]:
        from sqlalchemy import text
        from sqlalchemy.exc import DBAPIError

        try:
            with self.engine.connect() as connection:
                return [tuple(row) for row in connection.execute(text(sql), params or {})]
        except DBAPIError as error:
            raise Unreadable(self.shown_url, error) from None

    def columns(self) -> dict[str, set[str]]:
        from sqlalchemy import inspect

        inspector = inspect(self.engine)
        return {table: {column["name"] for column in inspector.get_columns(table)}
                for table in inspector.get_table_names()}


def _sqlalchemy_errors() -> tuple[type[Exception], ...]:
    """SQLAlchemy's errors of opening a database, where SQLAlchemy is loaded (else none)."""
    import sys

    exc = sys.modules.get("sqlalchemy.exc")
    return (exc.ArgumentError, exc.DatabaseError, exc.OperationalError) if exc else ()


