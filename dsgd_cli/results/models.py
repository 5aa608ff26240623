"""The results database's tables as SQLAlchemy models (their names and columns are declared in
`dsgd_cli.results.schema`): runs, their parameters, plugin versions, tags, checkpoints, SLURM
jobs, the metric history and each metric's summary."""

from __future__ import annotations

from datetime import datetime, timezone
from sqlalchemy import (JSON, BigInteger, DateTime, Float, ForeignKey, Index, Integer, String,
                        Text)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship
from sqlalchemy.types import TypeDecorator

from dsgd_cli.results.schema import (CHECKPOINTS, META, METRICS, PARAMS, PLUGIN_VERSIONS, RUNS,
                                     SLURM_JOBS, SUMMARIES, TAGS)

MAX_TAG_LENGTH = 128


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
