"""Writing the results database (SQLAlchemy 2.x): runs, their configuration, plugin versions,
metric history, and a summary table holding each metric's final and best value for fast reads.

`--db` takes a path or an SQLAlchemy URL (SQLite, or PostgreSQL with the `postgres` extra:
`postgresql+psycopg://user@host/db`); `DSGD_DB` sets the default; else `./dsgd.db`.
The schema is created on first use and its version stored in `meta`. A writing open of a
database of an older schema upgrades it in place (`dsgd_cli.results.migrations`). The tables
and columns are named in `dsgd_cli.results.schema`, their models in `dsgd_cli.results.models`. A `ResultsWriter` writes and
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

from sqlalchemy import delete, insert, inspect, or_, select, update
from sqlalchemy.engine import Connection
from sqlalchemy.exc import ArgumentError, DatabaseError, IntegrityError, OperationalError
from sqlalchemy.orm import Session

from dsgd_cli import __version__
from dsgd_cli.errors import StoreError
from dsgd_cli.results import strictjson
from dsgd_cli.results.busy import while_busy
from dsgd_cli.results.database import (make_engine, missing_driver_error, one_line, resolve_url,
                                       shown_db, sqlite_path)
from dsgd_cli.results.reader import (EngineReader, ResultsReader, Unreadable, check_schema,
                                     check_version, flatten_config, higher_is_better)
from dsgd_cli.results.migrations import (MIGRATIONS, CannotUpgrade, lock_for_migration,
                                         stored_version, unlock_after_migration)
from dsgd_cli.results.models import (MAX_TAG_LENGTH, Base, Checkpoints, Meta, Metric, Param,
                                     PluginVersion, Run, SlurmJobRow, Summary, Tag)
from dsgd_cli.results.schema import MAX_ID, META, RUNS, SCHEMA_VERSION
from dsgd_cli.results.slurm_ids import SlurmJob, slurm_job_of_this_process


class RunDeleted(StoreError):
    """The run being recorded is no longer in the database: `dsgd runs delete --force`
    deleted it while it ran."""

    def __init__(self, run_id: int):
        super().__init__(f"run {run_id} was deleted from the database while it ran")
        self.run_id = run_id


@dataclass
class MetricRow:
    name: str
    value: float
    step: int | None = None
    epoch: int | None = None
    rank: int | None = None
    seconds: float | None = None


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
        except CannotUpgrade as error:
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
                lock_for_migration(connection)
                tables = set(inspect(connection).get_table_names())
                version = stored_version(connection, self.shown_url) if META.name in tables else None
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
                unlock_after_migration(connection)

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
