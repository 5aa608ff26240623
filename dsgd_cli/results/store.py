"""Writing the results database (SQLAlchemy 2.x): runs, their configuration, plugin versions,
metric history, and a summary table holding each metric's final and best value for fast reads.

`--db` takes a path or an SQLAlchemy URL (SQLite, or PostgreSQL with the `postgres` extra:
`postgresql+psycopg://user@host/db`); `DSGD_DB` sets the default; else `./dsgd.db`.
The schema is created on first use and its version stored in `meta`. A writing open of a
database of an older schema upgrades it in place, one step per version (`MIGRATIONS`), in one
transaction under a lock, so concurrent dsgd processes neither race nor see half a migration.
The tables and columns are named in `dsgd_cli.results.schema`. A `ResultsWriter` writes and
reads back what it wrote through its `reader`, a `dsgd_cli.results.reader.ResultsReader` over
the writer's engine; a reading command opens a `ResultsReader` alone, which changes nothing.
"""

from __future__ import annotations

import math
import socket
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterable

from sqlalchemy import (JSON, BigInteger, DateTime, Float, ForeignKey, Index, Integer, String,
                        Text, or_, delete, insert, inspect, select, text, update)
from sqlalchemy.engine import Connection
from sqlalchemy.exc import ArgumentError, DatabaseError, IntegrityError, OperationalError
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, relationship
from sqlalchemy.types import TypeDecorator

from dsgd_cli import __version__
from dsgd_cli.errors import StoreError
from dsgd_cli.results import strictjson
from dsgd_cli.results.busy import while_busy
from dsgd_cli.results.database import (make_engine, missing_driver_error, one_line, resolve_url,
                                       shown_db, sqlite_path)
from dsgd_cli.results.reader import (EngineReader, ResultsReader, Unreadable, check_schema,
                                     check_version, flatten_config, higher_is_better,
                                     schema_version)
from dsgd_cli.results.schema import (CHECKPOINTS, MAX_ID, META, METRICS, PARAMS, PLUGIN_VERSIONS,
                                     RUNS, SCHEMA_VERSION, SLURM_JOBS, SUMMARIES, TAGS)
from dsgd_cli.results.slurm_ids import SlurmJob, slurm_job_of_this_process

MAX_TAG_LENGTH = 128
# Key of the PostgreSQL advisory lock that serializes schema creation and migrations.
MIGRATION_LOCK = 0x64736764  # "dsgd"


class RunDeleted(StoreError):
    """The run being recorded is no longer in the database: `dsgd runs delete --force`
    deleted it while it ran."""

    def __init__(self, run_id: int):
        super().__init__(f"run {run_id} was deleted from the database while it ran")
        self.run_id = run_id


class UTCDateTime(TypeDecorator):
    """A timezone-aware UTC datetime on every database: SQLite stores no offset (values are
    written in UTC and read back as UTC), PostgreSQL returns its session's time zone."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value, dialect):
        if value is not None and value.tzinfo is not None:
            value = value.astimezone(timezone.utc)
        return value

    def process_result_value(self, value, dialect):
        if value is None:
            return None
        return value.replace(tzinfo=timezone.utc) if value.tzinfo is None else value.astimezone(timezone.utc)


class Base(DeclarativeBase):
    pass


class Meta(Base):
    __tablename__ = META.name
    key: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[str] = mapped_column(Text)


class Run(Base):
    """One run of an experiment (read back as a `dsgd_cli.results.reader.RunRecord`)."""

    __tablename__ = RUNS.name
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    experiment: Mapped[str] = mapped_column(String(256), index=True)
    spec_file: Mapped[str | None] = mapped_column(Text)
    status: Mapped[str] = mapped_column(String(16))  # running, completed, failed, diverged, interrupted
    reason: Mapped[str | None] = mapped_column(Text)
    failed_rank: Mapped[int | None] = mapped_column(Integer)
    task: Mapped[str] = mapped_column(String(128))
    aggregator: Mapped[str] = mapped_column(String(128))
    compressor: Mapped[str] = mapped_column(String(128))
    optimizer: Mapped[str] = mapped_column(String(128))
    workers: Mapped[int] = mapped_column(Integer)
    config: Mapped[dict] = mapped_column(JSON)
    dsgd_version: Mapped[str] = mapped_column(String(32))
    host: Mapped[str] = mapped_column(String(256))
    started_at: Mapped[datetime] = mapped_column(UTCDateTime)
    ended_at: Mapped[datetime | None] = mapped_column(UTCDateTime)

    # AUTOINCREMENT: a deleted run's id is never given to another run (SQLite's plain rowid
    # takes the largest id + 1, which is the deleted run's when it was the newest).
    __table_args__ = {"sqlite_autoincrement": True}

    params: Mapped[list["Param"]] = relationship(cascade="all, delete-orphan")
    plugins: Mapped[list["PluginVersion"]] = relationship(cascade="all, delete-orphan")
    summaries: Mapped[list["Summary"]] = relationship(cascade="all, delete-orphan")
    tags: Mapped[list["Tag"]] = relationship(cascade="all, delete-orphan", passive_deletes=True)


class Param(Base):
    """The configuration flattened to dotted keys, for filtering runs by a setting."""

    __tablename__ = PARAMS.name
    run_id: Mapped[int] = mapped_column(ForeignKey(Run.id), primary_key=True)
    key: Mapped[str] = mapped_column(String(256), primary_key=True)
    value: Mapped[str] = mapped_column(Text)  # JSON


class PluginVersion(Base):
    __tablename__ = PLUGIN_VERSIONS.name
    run_id: Mapped[int] = mapped_column(ForeignKey(Run.id), primary_key=True)
    kind: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str] = mapped_column(String(128))
    distribution: Mapped[str] = mapped_column(String(256))
    version: Mapped[str] = mapped_column(String(64))


class Tag(Base):
    """A label a user gave a run (`dsgd runs tag`); schema version 2."""

    __tablename__ = TAGS.name
    run_id: Mapped[int] = mapped_column(ForeignKey(Run.id, ondelete="CASCADE"), primary_key=True)
    tag: Mapped[str] = mapped_column(String(MAX_TAG_LENGTH), primary_key=True)


class Checkpoints(Base):
    """Where a run keeps its checkpoints, and when it resumed from which step; schema 3.
    `resumes`: a list of {"at": ISO time, "step": the step it went on from}."""

    __tablename__ = CHECKPOINTS.name
    run_id: Mapped[int] = mapped_column(ForeignKey(Run.id, ondelete="CASCADE"), primary_key=True)
    directory: Mapped[str] = mapped_column(Text)
    resumes: Mapped[list] = mapped_column(JSON, default=list)


class SlurmJobRow(Base):
    """A SLURM job the run ran in: the one that created it, and each that resumed it; schema 5.
    `array_job_id` and `array_task_id`: the job's array and its index there (`12_3`), if any."""

    __tablename__ = SLURM_JOBS.name
    run_id: Mapped[int] = mapped_column(ForeignKey(Run.id, ondelete="CASCADE"), primary_key=True)
    job_id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    array_job_id: Mapped[int | None] = mapped_column(BigInteger)
    array_task_id: Mapped[int | None] = mapped_column(BigInteger)


class Metric(Base):
    """One recorded value. `rank` is null for values that describe the whole run."""

    __tablename__ = METRICS.name
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey(Run.id))
    name: Mapped[str] = mapped_column(String(128))
    value: Mapped[float] = mapped_column(Float)
    step: Mapped[int | None] = mapped_column(Integer)
    epoch: Mapped[int | None] = mapped_column(Integer)
    rank: Mapped[int | None] = mapped_column(Integer)
    seconds: Mapped[float | None] = mapped_column(Float)  # since the worker started training

    __table_args__ = (Index("ix_metrics_run_name", "run_id", "name"),)


class Summary(Base):
    """Final and best value of each metric of a run, written when the run ends."""

    __tablename__ = SUMMARIES.name
    run_id: Mapped[int] = mapped_column(ForeignKey(Run.id), primary_key=True)
    name: Mapped[str] = mapped_column(String(128), primary_key=True)
    final: Mapped[float] = mapped_column(Float)
    best: Mapped[float] = mapped_column(Float)


@dataclass
class MetricRow:
    name: str
    value: float
    step: int | None = None
    epoch: int | None = None
    rank: int | None = None
    seconds: float | None = None


def _migrate_1_to_2(connection: Connection) -> None:
    """Schema 2 adds `tags`: labels users give runs, deleted with their run."""
    connection.execute(text(
        "CREATE TABLE tags (run_id INTEGER NOT NULL, tag VARCHAR(128) NOT NULL, "
        "PRIMARY KEY (run_id, tag), FOREIGN KEY (run_id) REFERENCES runs (id) ON DELETE CASCADE)"))


def _migrate_2_to_3(connection: Connection) -> None:
    """Schema 3 adds `checkpoints`: a run's checkpoint directory and its resumes."""
    connection.execute(text(
        "CREATE TABLE checkpoints (run_id INTEGER NOT NULL, directory TEXT NOT NULL, "
        "resumes JSON NOT NULL, PRIMARY KEY (run_id), "
        "FOREIGN KEY (run_id) REFERENCES runs (id) ON DELETE CASCADE)"))


# The table `runs` of schema 4, as the models create it on SQLite (but for blanks).
_RUNS_4 = """CREATE TABLE runs (
    id INTEGER NOT NULL PRIMARY KEY AUTOINCREMENT,
    experiment VARCHAR(256) NOT NULL,
    spec_file TEXT,
    status VARCHAR(16) NOT NULL,
    reason TEXT,
    failed_rank INTEGER,
    task VARCHAR(128) NOT NULL,
    aggregator VARCHAR(128) NOT NULL,
    compressor VARCHAR(128) NOT NULL,
    optimizer VARCHAR(128) NOT NULL,
    workers INTEGER NOT NULL,
    config JSON NOT NULL,
    dsgd_version VARCHAR(32) NOT NULL,
    host VARCHAR(256) NOT NULL,
    started_at DATETIME NOT NULL,
    ended_at DATETIME
)"""
_RUN_COLUMNS_4 = ("id", "experiment", "spec_file", "status", "reason", "failed_rank", "task",
                  "aggregator", "compressor", "optimizer", "workers", "config", "dsgd_version",
                  "host", "started_at", "ended_at")
_RUNS_INDEX_4 = "ix_runs_experiment"


class _CannotUpgrade(Exception):
    """A database that a migration cannot bring to the new schema without losing something."""


def _migrate_3_to_4(connection: Connection) -> None:
    """Schema 4 never gives a run's id again (exported rows, tracker runs `run-ID-...` and a
    user's notes name runs by it). PostgreSQL never did: a serial id comes from a sequence, which only
    goes up. SQLite gives a new row the largest id + 1, the id of the newest run if it was just
    deleted, unless the table is AUTOINCREMENT, which takes building it anew, as SQLite's
    manual says (https://www.sqlite.org/lang_altertable.html#otheralter): the views and
    triggers saved and dropped, a copy with every row and its id, and every column a user
    added, the old table dropped, the copy renamed, the indexes, views and triggers made
    again. Foreign keys are off for the migration's transaction (`_lock_for_migration`), so
    that dropping the old table takes no row of the tables that refer to it along. The ids
    deleted before this step are not recorded anywhere: the next run takes the largest id
    kept + 1, as it did before."""
    if connection.dialect.name != "sqlite":
        return
    added_columns = _columns_added_to_runs(connection)
    saved = _save_objects_over_runs(connection)
    connection.exec_driver_sql(_create_runs_4("runs_rebuilt", added_columns.values()))
    copied = ", ".join(map(_quoted, (*_RUN_COLUMNS_4, *added_columns)))
    connection.exec_driver_sql(f"INSERT INTO runs_rebuilt ({copied}) SELECT {copied} FROM runs")
    connection.exec_driver_sql("DROP TABLE runs")
    connection.exec_driver_sql("ALTER TABLE runs_rebuilt RENAME TO runs")
    connection.exec_driver_sql(f"CREATE INDEX {_RUNS_INDEX_4} ON runs (experiment)")
    for sql in saved:
        connection.exec_driver_sql(sql)


def _create_runs_4(table: str, added_columns: Iterable[str]) -> str:
    """CREATE TABLE `table` as schema 4's `runs`, with the definitions of `added_columns` last."""
    columns = _RUNS_4.removesuffix("\n)") + "".join(f",\n    {column}" for column in added_columns)
    return columns.replace("CREATE TABLE runs", f"CREATE TABLE {table}", 1) + "\n)"


def _columns_added_to_runs(connection: Connection) -> dict[str, str]:
    """The columns of `runs` that schema 3 lacks (added by a user), by name, each with its
    definition: declared type, NOT NULL and default. A generated column cannot be copied
    (its expression is nowhere but in the table's SQL) and stops the upgrade instead."""
    added = {}
    for _, name, declared_type, not_null, default, _, hidden in connection.exec_driver_sql(
            "PRAGMA table_xinfo(runs)"):
        if name in _RUN_COLUMNS_4:
            continue
        if hidden:
            raise _CannotUpgrade(
                f"its table 'runs' has the generated column {name!r}, which the upgrade to "
                f"schema 4 cannot copy; drop it (ALTER TABLE runs DROP COLUMN {_quoted(name)}), "
                "open the database again, then add it again")
        definition = f"{_quoted(name)} {declared_type}".rstrip()
        if not_null:
            definition += " NOT NULL"
        if default is not None:  # its SQL, less the parentheses an expression needs
            definition += f" DEFAULT ({default})"
        added[name] = definition
    return added


def _save_objects_over_runs(connection: Connection) -> list[str]:
    """Drop what could stop `runs` being built anew and return the SQL that makes it again,
    in the order it was made (which each object's dependencies allow): the indexes a user
    made on `runs`; every view and every trigger, as any of them may name `runs` (renaming
    the new table checks them all, and fails on one that names a table not there) and a
    view's INSTEAD OF triggers go with it. Dropping the old `runs` takes its indexes and
    triggers along."""
    saved = connection.exec_driver_sql(
        "SELECT type, name, sql FROM sqlite_master WHERE sql IS NOT NULL AND "
        "(type IN ('view', 'trigger') OR (type = 'index' AND tbl_name = 'runs' AND name != ?)) "
        "ORDER BY rowid", (_RUNS_INDEX_4,)).all()
    for kind, name, _ in saved:
        if kind != "index":
            connection.exec_driver_sql(f"DROP {kind.upper()} IF EXISTS {_quoted(name)}")
    return [sql for _, _, sql in saved]


def _quoted(name: str) -> str:
    """An SQL identifier, whatever characters it holds."""
    return '"' + name.replace('"', '""') + '"'


def _migrate_4_to_5(connection: Connection) -> None:
    """Schema 5 adds `slurm_jobs`: the SLURM jobs (and array tasks) a run ran in."""
    connection.execute(text(
        "CREATE TABLE slurm_jobs (run_id INTEGER NOT NULL, job_id BIGINT NOT NULL, "
        "array_job_id BIGINT, array_task_id BIGINT, PRIMARY KEY (run_id, job_id), "
        "FOREIGN KEY (run_id) REFERENCES runs (id) ON DELETE CASCADE)"))


# The step that brings a database to each version from the one before. Written out as each
# version's SQL rather than taken from the models, which describe only the newest version.
MIGRATIONS = {2: _migrate_1_to_2, 3: _migrate_2_to_3, 4: _migrate_3_to_4, 5: _migrate_4_to_5}


class _Read:
    """A method of a writer's reader, asked of the writer (`store.runs()`): what `dsgd run`
    and a resume read back of what they wrote."""

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, writer, owner=None):
        if writer is None:
            return self
        return getattr(writer.reader, self.name)


class ResultsWriter:
    """The results database, written; `reader` reads it back. The schema is created on first
    use or upgraded to this version, and a database dsgd cannot write to is refused at once,
    before anything is launched."""

    def __init__(self, db: str | None = None, create: bool = True):
        """`create`: make a new database where there is none (`dsgd run` recording runs);
        without it, a command that only changes recorded runs refuses a missing database, or
        one without dsgd's tables, and creates nothing."""
        self.url = resolve_url(db)
        self.shown_url = shown_db(db)  # for messages
        # Whether to stop waiting for a busy database (busy.py); the launcher sets it while it
        # notes signals instead of raising them.
        self.interrupted: Callable[[], bool] = lambda: False
        path = sqlite_path(self.url)
        if not create and path is not None and not Path(path).is_file():
            raise StoreError(f"no results database at {path} (`dsgd run` creates one)")
        try:
            self.engine = make_engine(self.url, readonly=False)
            check_schema(EngineReader(self.engine, self.shown_url), self.shown_url,
                         missing_ok=create)
            self._migrate()
        except Unreadable as error:
            raise StoreError(f"cannot open results database {self.shown_url}: {error.reason}") from None
        except _CannotUpgrade as error:
            raise StoreError(f"cannot upgrade results database {self.shown_url}: {error}") from None
        except (ArgumentError, DatabaseError, OperationalError) as error:
            reason = getattr(error, "orig", None) or error
            verb = "write to" if _read_only_error(error) else "open"
            raise StoreError(f"cannot {verb} results database {self.shown_url}: {one_line(reason)}") from None
        except ModuleNotFoundError as error:
            raise missing_driver_error(self.shown_url, error) from None
        self.reader = ResultsReader(db, writer_engine=self.engine)

    # What the writer reads back, answered by its reader (see `ResultsReader`).
    runs = _Read()
    get_run = _Read()
    finals = _Read()
    metric_history = _Read()
    step_curves = _Read()
    metric_names = _Read()
    checkpoint_dir = _Read()
    resumes = _Read()
    connect = _Read()

    @while_busy
    def _migrate(self) -> None:
        """Create the schema of a new database, or upgrade an older one one version at a time,
        then probe that the database can be written. One transaction, holding the database's
        write lock (SQLite) or an advisory lock (PostgreSQL) from the start: dsgd processes
        opening one database at once take turns, the first creates or upgrades it, the others
        find it done, and none sees half a schema."""
        with self.engine.connect() as connection:
            try:
                _lock_for_migration(connection)
                tables = set(inspect(connection).get_table_names())
                version = _stored_version(connection, self.shown_url) if META.name in tables else None
                if version is None and RUNS.name in tables:
                    version = 1  # a schema-1 database whose creation was cut short
                check_version(version, self.shown_url)
                if version is not None:
                    for step in range(version + 1, SCHEMA_VERSION + 1):
                        MIGRATIONS[step](connection)
                Base.metadata.create_all(connection)  # a new database, or what a crash left out
                if version is None:
                    connection.execute(insert(Meta).values(key="schema_version",
                                                           value=str(SCHEMA_VERSION)))
                self._check_writable(connection)
                connection.commit()
            finally:
                connection.rollback()  # nothing is left after the commit; all of it after a failure
                _unlock_after_migration(connection)

    def _check_writable(self, connection: Connection) -> None:
        """Write the version row: fails now, rather than after training, when the file, its
        directory or the database user is read-only."""
        connection.execute(update(Meta).where(Meta.key == "schema_version")
                           .values(value=str(SCHEMA_VERSION)))

    # -- writing ------------------------------------------------------------------------------

    @while_busy
    def create_run(self, experiment: str, config: dict[str, Any], spec_file: str | None,
                   plugins: Iterable[tuple[str, str, str, str]],
                   checkpoint_dir: str | None = None) -> int:
        """Record a run as `running`; `plugins` are (kind, name, distribution, version);
        `checkpoint_dir`: where its workers write checkpoints, if they do. Inside a SLURM job
        the run records the job (and its array task)."""
        with Session(self.engine) as session, session.begin():
            run = Run(experiment=experiment, spec_file=spec_file, status="running",
                      task=config["task"]["name"], aggregator=config["aggregator"]["name"],
                      compressor=config["compressor"]["name"], optimizer=config["optimizer"]["name"],
                      workers=config["workers"], config=config, dsgd_version=__version__,
                      host=socket.gethostname(), started_at=datetime.now(timezone.utc))
            run.params = [Param(key=k, value=strictjson.dumps(v)) for k, v in flatten_config(config).items()]
            run.plugins = [PluginVersion(kind=k, name=n, distribution=d, version=v)
                           for k, n, d, v in plugins]
            session.add(run)
            session.flush()
            if checkpoint_dir is not None:
                session.add(Checkpoints(run_id=run.id, directory=checkpoint_dir, resumes=[]))
            _add_slurm_job(session, run.id, slurm_job_of_this_process())
            return run.id

    @while_busy
    def resume_run(self, run_id: int, step: int, directory: str | None = None) -> None:
        """Reopen an interrupted or failed run at its checkpoint of `step`: the metrics recorded
        after that step (and the run-level ones, written at its end) go, as the resumed
        workers record them again; the run is `running` and the resume is noted, with the
        checkpoints' `directory` when they were moved."""
        with Session(self.engine) as session, session.begin():
            session.execute(delete(Metric).where(
                Metric.run_id == run_id, or_(Metric.step > step, Metric.step.is_(None))))
            session.execute(delete(Summary).where(Summary.run_id == run_id))
            run = session.get(Run, run_id)
            run.status, run.reason, run.failed_rank, run.ended_at = "running", None, None, None
            record = session.get(Checkpoints, run_id)
            at = datetime.now(timezone.utc).isoformat(timespec="seconds")
            record.resumes = [*(record.resumes or []), {"at": at, "step": step}]
            if directory is not None:
                record.directory = directory
            _add_slurm_job(session, run_id, slurm_job_of_this_process())

    @while_busy
    def add_metrics(self, run_id: int, rows: list[MetricRow]) -> None:
        """Store `rows`, dropping any whose value is not a finite number (NaN is no value)."""
        rows = [row for row in rows if finite_number(row.value)]
        if not rows:
            return
        try:
            with Session(self.engine) as session, session.begin():
                session.execute(insert(Metric), [{"run_id": run_id, **row.__dict__} for row in rows])
        except IntegrityError:  # its run is gone (a foreign key), or another problem
            self._check_exists(run_id)
            raise

    def _check_exists(self, run_id: int) -> None:
        """RunDeleted unless the run is in the database."""
        with Session(self.engine) as session:
            if session.get(Run, run_id) is None:
                raise RunDeleted(run_id) from None

    @while_busy
    def finish_run(self, run_id: int, status: str, reason: str | None = None,
                   failed_rank: int | None = None) -> None:
        """Close a run and write its summaries from the metric history."""
        with Session(self.engine) as session, session.begin():
            run = session.get(Run, run_id)
            if run is None:
                raise RunDeleted(run_id)
            run.status, run.reason, run.failed_rank = status, reason, failed_rank
            run.ended_at = datetime.now(timezone.utc)
            _write_summaries(session, run_id)

    @while_busy
    def refresh_summaries(self, run_id: int) -> None:
        """Write a run's summaries again from its metric history, changing nothing else (a
        node of a run over several machines whose last metrics came after the run ended)."""
        with Session(self.engine) as session, session.begin():
            _write_summaries(session, run_id)

    @while_busy
    def delete_runs(self, run_ids: Iterable[int], force: bool = False) -> list[int]:
        """Delete runs with everything of theirs (metrics, summaries, parameters, plugin
        versions, tags), all or, when an id is unknown or (without `force`) a run is still
        `running`, none. Returns the ids deleted."""
        ids = sorted(set(run_ids))
        with Session(self.engine) as session, session.begin():
            status = dict(session.execute(select(Run.id, Run.status).where(
                Run.id.in_([i for i in ids if 0 < i <= MAX_ID]))).all())
            unknown = [i for i in ids if i not in status]
            if unknown:
                raise StoreError(f"no {_naming(unknown, 'run with id', 'runs with ids')}; nothing deleted")
            running = [i for i in ids if status[i] == "running"]
            if running and not force:
                raise StoreError(f"{_naming(running, 'run', 'runs')} still running (its `dsgd run` may still "
                                 "be writing to it; --force deletes it anyway); nothing deleted")
            for model in (Metric, Summary, Param, PluginVersion, Tag, Checkpoints, SlurmJobRow):
                session.execute(delete(model).where(model.run_id.in_(ids)))
            session.execute(delete(Run).where(Run.id.in_(ids)))
        return ids

    @while_busy
    def tag_run(self, run_id: int, tags: Iterable[str], remove: bool = False) -> list[str]:
        """Add `tags` to a run (those it has already are kept once), or with `remove` take
        them away (those it lacks are ignored). Returns the run's tags afterwards, sorted."""
        tags = sorted(set(check_tag(tag) for tag in tags))
        with Session(self.engine) as session, session.begin():
            # Only its id: a run whose other values cannot be read can still be tagged.
            if not (0 < run_id <= MAX_ID
                    and session.scalar(select(Run.id).where(Run.id == run_id))):
                raise StoreError(f"no run with id {run_id}")
            if remove:
                session.execute(delete(Tag).where(Tag.run_id == run_id, Tag.tag.in_(tags)))
            elif tags:
                session.execute(_insert_ignoring_duplicates(self.engine.dialect.name, Tag),
                                [{"run_id": run_id, "tag": tag} for tag in tags])
            return list(session.scalars(select(Tag.tag).where(Tag.run_id == run_id).order_by(Tag.tag)))


Store = ResultsWriter  # its name before it was parted from the reader (launcher, tests, benchmarks)


def _add_slurm_job(session: Session, run_id: int, job: SlurmJob | None) -> None:
    """Note that the run ran in SLURM job `job` (None: not in a SLURM job), once."""
    if job is not None and session.get(SlurmJobRow, (run_id, job.job_id)) is None:
        session.add(SlurmJobRow(run_id=run_id, job_id=job.job_id, array_job_id=job.array_job_id,
                                array_task_id=job.array_task_id))


def _write_summaries(session: Session, run_id: int) -> None:
    session.execute(delete(Summary).where(Summary.run_id == run_id))
    metrics = session.execute(select(Metric.name, Metric.rank, Metric.value)
                              .where(Metric.run_id == run_id).order_by(Metric.id)).all()
    session.add_all(Summary(run_id=run_id, name=name, final=final, best=best)
                    for name, (final, best) in summarize(metrics).items())


def check_tag(tag: str) -> str:
    """A tag is 1 to 128 printable characters, no comma (lists of tags are written joined by
    commas), neither starting nor ending with a blank."""
    if (not tag or tag != tag.strip() or len(tag) > MAX_TAG_LENGTH or not tag.isprintable()
            or "," in tag):
        raise StoreError(f"bad tag {tag!r}: a tag is 1 to {MAX_TAG_LENGTH} printable characters, "
                         "no comma, neither starting nor ending with a blank")
    return tag


def _naming(ids: list[int], one: str, many: str) -> str:
    """`run 3`, `runs 3, 4`."""
    return f"{one} {ids[0]}" if len(ids) == 1 else f"{many} {', '.join(map(str, ids))}"


def summarize(metrics: Iterable[tuple[str, int | None, float]]) -> dict[str, tuple[float, float]]:
    """(final, best) per metric. Final of a per-rank metric: the mean of each rank's last value.
    Values that are not finite numbers are ignored."""
    last: dict[str, dict[int | None, float]] = defaultdict(dict)
    values: dict[str, list[float]] = defaultdict(list)
    for name, rank, value in metrics:
        if not finite_number(value):
            continue
        last[name][rank] = value
        values[name].append(value)
    result = {}
    for name, by_rank in last.items():
        final = sum(by_rank.values()) / len(by_rank)
        best = max(values[name]) if higher_is_better(name) else min(values[name])
        result[name] = (final, best)
    return result


def finite_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _read_only_error(error: Exception) -> bool:
    text = str(getattr(error, "orig", None) or error).lower()
    return any(words in text for words in ("readonly", "read-only", "read only", "permission denied"))


def _stored_version(connection: Connection, url: str) -> int | None:
    return schema_version(connection.scalar(select(Meta.value).where(Meta.key == "schema_version")), url)


def _lock_for_migration(connection: Connection) -> None:
    """Begin the transaction holding the lock that makes schema changes take turns."""
    dialect = connection.dialect.name
    if dialect == "sqlite":
        # Foreign keys off while a migration builds a table anew (`_migrate_3_to_4`): SQLite
        # takes this only outside a transaction, and the rows it keeps are checked by the ids
        # they keep. On again in `_unlock_after_migration`.
        connection.exec_driver_sql("PRAGMA foreign_keys=OFF")
        # The write lock, now rather than at the first write (waits up to the busy timeout).
        # The driver leaves the transaction alone: it begins none itself before DDL.
        connection.exec_driver_sql("BEGIN IMMEDIATE")
    elif dialect == "postgresql":
        # Released at commit or rollback; concurrent CREATE TABLEs would otherwise collide.
        connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK})


def _unlock_after_migration(connection: Connection) -> None:
    """After the migration's transaction ended: the connection goes back to the pool with its
    foreign keys on, as every other connection of the engine has them."""
    if connection.dialect.name == "sqlite":
        connection.exec_driver_sql("PRAGMA foreign_keys=ON")


def _insert_ignoring_duplicates(dialect: str, model):
    """INSERT that skips rows whose primary key is there already (another process may have
    added the same tag a moment ago)."""
    if dialect == "sqlite":
        from sqlalchemy.dialects.sqlite import insert as dialect_insert
    elif dialect == "postgresql":
        from sqlalchemy.dialects.postgresql import insert as dialect_insert
    else:
        return insert(model)
    return dialect_insert(model).on_conflict_do_nothing()
