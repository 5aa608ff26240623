"""The results database (SQLAlchemy 2.x): runs, their configuration, plugin versions, metric
history, and a summary table holding each metric's final and best value for fast reads.

`--db` takes a path or an SQLAlchemy URL; `DSGD_DB` sets the default; else `./dsgd.db`.
The schema is created on first use and its version stored in `meta`, so a later release can
migrate it.
"""

from __future__ import annotations

import json
import math
import os
import socket
import time
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable

from sqlalchemy import (JSON, DateTime, Float, ForeignKey, Index, Integer, String, Text, or_,
                        create_engine, delete, event, func, insert, inspect, select, update)
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, DatabaseError, IntegrityError, OperationalError
from sqlalchemy.orm import (DeclarativeBase, Mapped, Session, mapped_column, relationship,
                            selectinload)

from dsgd_cli import __version__
from dsgd_cli.errors import StoreError

SCHEMA_VERSION = 1
DEFAULT_DB = "dsgd.db"
MIGRATE_ATTEMPTS = 5


class Base(DeclarativeBase):
    pass


class Meta(Base):
    __tablename__ = "meta"
    key: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[str] = mapped_column(Text)


class Run(Base):
    __tablename__ = "runs"
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
    started_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    ended_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))

    params: Mapped[list["Param"]] = relationship(cascade="all, delete-orphan")
    plugins: Mapped[list["PluginVersion"]] = relationship(cascade="all, delete-orphan")
    summaries: Mapped[list["Summary"]] = relationship(cascade="all, delete-orphan")


class Param(Base):
    """The configuration flattened to dotted keys, for filtering runs by a setting."""

    __tablename__ = "params"
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id"), primary_key=True)
    key: Mapped[str] = mapped_column(String(256), primary_key=True)
    value: Mapped[str] = mapped_column(Text)  # JSON


class PluginVersion(Base):
    __tablename__ = "plugin_versions"
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id"), primary_key=True)
    kind: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str] = mapped_column(String(128))
    distribution: Mapped[str] = mapped_column(String(256))
    version: Mapped[str] = mapped_column(String(64))


class Metric(Base):
    """One recorded value. `rank` is null for values that describe the whole run."""

    __tablename__ = "metrics"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id"))
    name: Mapped[str] = mapped_column(String(128))
    value: Mapped[float] = mapped_column(Float)
    step: Mapped[int | None] = mapped_column(Integer)
    epoch: Mapped[int | None] = mapped_column(Integer)
    rank: Mapped[int | None] = mapped_column(Integer)
    seconds: Mapped[float | None] = mapped_column(Float)  # since the worker started training

    __table_args__ = (Index("ix_metrics_run_name", "run_id", "name"),)


class Summary(Base):
    """Final and best value of each metric of a run, written when the run ends."""

    __tablename__ = "summaries"
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id"), primary_key=True)
    name: Mapped[str] = mapped_column(String(128), primary_key=True)
    final: Mapped[float] = mapped_column(Float)
    best: Mapped[float] = mapped_column(Float)


def higher_is_better(name: str) -> bool:
    return "accuracy" in name or name == "samples_per_second"


def resolve_url(db: str | None) -> str:
    db = db or os.environ.get("DSGD_DB") or DEFAULT_DB
    return db if "://" in db else f"sqlite:///{Path(db).expanduser()}"


def flatten_config(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat.update(flatten_config(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


@dataclass
class MetricRow:
    name: str
    value: float
    step: int | None = None
    epoch: int | None = None
    rank: int | None = None
    seconds: float | None = None


class Store:
    """The results database. `readonly`: for the commands that only read (runs, compare,
    show): the database must exist already, is opened read-only and is never changed.
    Otherwise the schema is created on first use, and a database dsgd cannot write to is
    refused at once, before anything is launched."""

    def __init__(self, db: str | None = None, *, readonly: bool = False):
        self.url = resolve_url(db)
        self.readonly = readonly
        try:
            self.engine = _engine(self.url, readonly)
            if readonly:
                self._check_schema(missing_ok=False)
            else:
                self._check_schema(missing_ok=True)
                self._migrate()
                self._check_writable()
        except (ArgumentError, DatabaseError, OperationalError) as error:
            reason = getattr(error, "orig", None) or error
            verb = "write to" if not readonly and _read_only_error(error) else "open"
            raise StoreError(f"cannot {verb} results database {self.url}: {reason}") from None
        except ModuleNotFoundError as error:
            raise StoreError(f"cannot open results database {self.url}: driver not installed ({error.name})") from None

    def _check_schema(self, missing_ok: bool) -> None:
        """Every dsgd table already there has dsgd's columns: another program's `runs` table
        must not be read, or written to, as if it were ours."""
        tables = set(inspect(self.engine).get_table_names())
        if not missing_ok and "runs" not in tables:
            raise StoreError(f"{self.url} holds no dsgd results (no table 'runs')")
        for table in Base.metadata.sorted_tables:
            if table.name not in tables:
                continue
            have = {column["name"] for column in inspect(self.engine).get_columns(table.name)}
            lacking = [column.name for column in table.columns if column.name not in have]
            if lacking:
                more = f" and {len(lacking) - 3} more" if len(lacking) > 3 else ""
                raise StoreError(f"{self.url} is not a dsgd results database: its table "
                                 f"'{table.name}' lacks the columns "
                                 f"{', '.join(map(repr, lacking[:3]))}{more}")
        if "meta" in tables:
            with Session(self.engine) as session:
                self._check_version(session.get(Meta, "schema_version"))

    def _check_version(self, row: Meta | None) -> None:
        if row is not None and int(row.value) > SCHEMA_VERSION:
            raise StoreError(f"results database {self.url} has schema version {row.value}, "
                             f"newer than this dsgd understands ({SCHEMA_VERSION}); upgrade dsgd")

    def _migrate(self) -> None:
        # Two dsgd processes may create a new database at once: the loser of a race finds a
        # table or the version row already there, and simply tries again.
        for attempt in range(MIGRATE_ATTEMPTS):
            try:
                self._create_schema()
                return
            except (IntegrityError, OperationalError) as error:
                if attempt == MIGRATE_ATTEMPTS - 1 or _read_only_error(error):
                    raise
                time.sleep(0.05 * (attempt + 1))

    def _create_schema(self) -> None:
        Base.metadata.create_all(self.engine)
        with Session(self.engine) as session, session.begin():
            row = session.get(Meta, "schema_version")
            if row is None:
                session.add(Meta(key="schema_version", value=str(SCHEMA_VERSION)))
            self._check_version(row)

    def _check_writable(self) -> None:
        """Rewrite the version row unchanged: fails now, rather than after training, when the
        file, its directory or the database user is read-only."""
        with Session(self.engine) as session, session.begin():
            session.execute(update(Meta).where(Meta.key == "schema_version")
                            .values(value=Meta.value))

    # -- writing ------------------------------------------------------------------------------

    def create_run(self, experiment: str, config: dict[str, Any], spec_file: str | None,
                   plugins: Iterable[tuple[str, str, str, str]]) -> int:
        """Record a run as `running`; `plugins` are (kind, name, distribution, version)."""
        with Session(self.engine) as session, session.begin():
            run = Run(experiment=experiment, spec_file=spec_file, status="running",
                      task=config["task"]["name"], aggregator=config["aggregator"]["name"],
                      compressor=config["compressor"]["name"], optimizer=config["optimizer"]["name"],
                      workers=config["workers"], config=config, dsgd_version=__version__,
                      host=socket.gethostname(), started_at=datetime.now(timezone.utc))
            run.params = [Param(key=k, value=json.dumps(v)) for k, v in flatten_config(config).items()]
            run.plugins = [PluginVersion(kind=k, name=n, distribution=d, version=v)
                           for k, n, d, v in plugins]
            session.add(run)
            session.flush()
            return run.id

    def add_metrics(self, run_id: int, rows: list[MetricRow]) -> None:
        """Store `rows`, dropping any whose value is not a finite number (NaN is no value)."""
        rows = [row for row in rows if finite_number(row.value)]
        if not rows:
            return
        with Session(self.engine) as session, session.begin():
            session.execute(insert(Metric), [{"run_id": run_id, **row.__dict__} for row in rows])

    def finish_run(self, run_id: int, status: str, reason: str | None = None,
                   failed_rank: int | None = None) -> None:
        """Close a run and write its summaries from the metric history."""
        with Session(self.engine) as session, session.begin():
            run = session.get(Run, run_id)
            run.status, run.reason, run.failed_rank = status, reason, failed_rank
            run.ended_at = datetime.now(timezone.utc)
            session.execute(delete(Summary).where(Summary.run_id == run_id))
            metrics = session.execute(
                select(Metric.name, Metric.rank, Metric.value)
                .where(Metric.run_id == run_id).order_by(Metric.id)).all()
            session.add_all(Summary(run_id=run_id, name=name, final=final, best=best)
                            for name, (final, best) in summarize(metrics).items())

    # -- reading ------------------------------------------------------------------------------

    def runs(self, experiments: list[str] | None = None, last: int | None = None,
             ids: list[int] | None = None, details: bool = True) -> list[Run]:
        """Runs, oldest first; `last` keeps the newest N; `experiments` filters by name (a
        grid's base name matches all its points); `ids` by run id. `details`: load each run's
        summaries, plugins and parameters with it; without them thousands of runs load ten
        times faster (`finals` gives their metrics)."""
        query = select(Run).order_by(Run.id.desc())
        if details:
            query = _with_details(query)
        if ids is not None:
            query = query.where(Run.id.in_(ids))
        if experiments:
            names = [Run.experiment == e for e in experiments]
            grid_points = [Run.experiment.like(f"{e}[%") for e in experiments]
            query = query.where(or_(*names, *grid_points))
        if last:
            query = query.limit(last)
        with Session(self.engine) as session:
            return list(reversed(session.scalars(query).all()))

    def finals(self, run_ids: list[int]) -> dict[int, dict[str, float]]:
        """The final value of every metric of the runs, by run id and metric name."""
        query = select(Summary.run_id, Summary.name, Summary.final)
        if len(run_ids) <= 10_000:  # beyond, reading them all beats a huge IN list
            query = query.where(Summary.run_id.in_(run_ids))
        wanted, finals = set(run_ids), defaultdict(dict)
        with Session(self.engine) as session:
            for run_id, name, final in session.execute(query):
                if run_id in wanted:
                    finals[run_id][name] = final
        return finals

    def get_run(self, run_id: int) -> Run | None:
        with Session(self.engine) as session:
            return session.scalars(_with_details(select(Run).where(Run.id == run_id))).first()

    def metric_history(self, run_id: int, name: str) -> list[Metric]:
        with Session(self.engine) as session:
            return list(session.scalars(select(Metric).where(
                Metric.run_id == run_id, Metric.name == name).order_by(Metric.id)))

    def count_metrics(self, run_id: int) -> int:
        with Session(self.engine) as session:
            return session.scalar(select(func.count()).where(Metric.run_id == run_id))


def _with_details(query):
    """Load a run's summaries, plugins and parameters with it, for use after the session."""
    return query.options(selectinload(Run.summaries), selectinload(Run.plugins),
                         selectinload(Run.params))


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


def _engine(url: str, readonly: bool):
    if not url.startswith("sqlite"):
        return create_engine(url)
    path = make_url(url).database
    in_memory = path in (None, "", ":memory:")
    if readonly and not in_memory:
        if not Path(path).is_file():
            raise StoreError(f"no results database at {path} (`dsgd run` creates one)")
        # SQLite's URI form opens the file read-only. A database in WAL mode needs its
        # shared-memory file even to read; in a directory nobody may write to, no writer can
        # exist either, so the file is opened as immutable instead.
        mode = "mode=ro" if os.access(Path(path).parent, os.W_OK) else "immutable=1"
        url = f"sqlite:///file:{Path(path).resolve()}?{mode}&uri=true"
    # A writer waits up to 30 s for another's lock instead of failing at once.
    engine = create_engine(url, connect_args={"timeout": 30})
    event.listen(engine, "connect", _sqlite_pragmas(journal=not readonly))
    return engine


def _sqlite_pragmas(journal: bool):
    def on_connect(connection, _record) -> None:
        cursor = connection.cursor()
        cursor.execute("PRAGMA foreign_keys=ON")
        if journal:  # changing the journal mode writes to the file
            cursor.execute("PRAGMA journal_mode=WAL")
        cursor.close()
    return on_connect


def _read_only_error(error: Exception) -> bool:
    text = str(getattr(error, "orig", None) or error).lower()
    return any(words in text for words in ("readonly", "read-only", "read only", "permission denied"))
