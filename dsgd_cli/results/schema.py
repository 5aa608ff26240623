"""The results database's tables and columns, named once.

The SQLAlchemy models that create and write the tables (`dsgd_cli.results.store`) take their
table names from here and declare exactly these columns (a test holds the two together); the
plain SQL of the reader (`dsgd_cli.results.reader`) builds its SELECT lists from here. This
module imports nothing: a reading command over an SQLite file never loads SQLAlchemy.
"""

from __future__ import annotations

from dataclasses import dataclass

# The newest schema. 2 added `tags`, 3 `checkpoints`, 4 made SQLite's run ids AUTOINCREMENT
# (an id, once given, is never given again; see `migrations.MIGRATIONS`), 5 added `slurm_jobs`.
SCHEMA_VERSION = 5
MAX_ID = 2**63 - 1  # the largest id a database integer holds


@dataclass(frozen=True)
class Table:
    """A table of the newest schema: its name, its columns in order, and the schema version
    that added it."""

    name: str
    columns: tuple[str, ...]
    added_in: int = 1

    def __str__(self) -> str:
        return self.name

    def select(self, *columns: str) -> str:
        """`SELECT a, b FROM table` (all its columns when none are named); a column the table
        lacks is a ValueError, so a misspelt name fails on the first query, not in a user's
        hands."""
        unknown = [column for column in columns if column not in self.columns]
        if unknown:
            raise ValueError(f"table {self.name!r} has no column {', '.join(map(repr, unknown))}")
        return f"SELECT {', '.join(columns or self.columns)} FROM {self.name}"


META = Table("meta", ("key", "value"))
RUNS = Table("runs", (
    "id", "experiment", "spec_file", "status", "reason", "failed_rank", "task", "aggregator",
    "compressor", "optimizer", "workers", "config", "dsgd_version", "host", "started_at",
    "ended_at"))
PARAMS = Table("params", ("run_id", "key", "value"))
PLUGIN_VERSIONS = Table("plugin_versions", ("run_id", "kind", "name", "distribution", "version"))
TAGS = Table("tags", ("run_id", "tag"), added_in=2)
CHECKPOINTS = Table("checkpoints", ("run_id", "directory", "resumes"), added_in=3)
# The SLURM jobs a run ran in (`dsgd submit --slurm`, or any `dsgd run` inside a SLURM job):
# the job that created it and each job that resumed it; the array's job id and task id when
# the job is a task of an array.
SLURM_JOBS = Table("slurm_jobs", ("run_id", "job_id", "array_job_id", "array_task_id"),
                   added_in=5)
METRICS = Table("metrics", ("id", "run_id", "name", "value", "step", "epoch", "rank", "seconds"))
SUMMARIES = Table("summaries", ("run_id", "name", "final", "best"))

TABLES = (META, RUNS, PARAMS, PLUGIN_VERSIONS, TAGS, CHECKPOINTS, SLURM_JOBS, METRICS, SUMMARIES)
# Each table's columns by its name: a table of one of these names lacking one is not dsgd's.
TABLE_COLUMNS = {table.name: table.columns for table in TABLES}


def tables_of_version(version: int) -> list[str]:
    """The tables a dsgd database of schema `version` has."""
    return [table.name for table in TABLES if table.added_in <= version]
