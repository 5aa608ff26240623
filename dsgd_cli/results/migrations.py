"""Upgrading a results database of an older schema in place: one step per version
(`MIGRATIONS[v]` turns version v - 1 into v), run by the writer in one transaction under the
lock that makes schema changes take turns (`lock_for_migration`), so concurrent dsgd processes
neither race nor see half a migration."""

from __future__ import annotations

from typing import Iterable

from sqlalchemy import select, text
from sqlalchemy.engine import Connection

from dsgd_cli.results.models import Meta
from dsgd_cli.results.reader import schema_version

# Key of the PostgreSQL advisory lock that serializes schema creation and migrations.
MIGRATION_LOCK = 0x64736764  # "dsgd"


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


class CannotUpgrade(Exception):
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
            raise CannotUpgrade(
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


def stored_version(connection: Connection, url: str) -> int | None:
    return schema_version(connection.scalar(select(Meta.value).where(Meta.key == "schema_version")), url)


def lock_for_migration(connection: Connection) -> None:
    """Begin the transaction holding the lock that makes schema changes take turns."""
    dialect = connection.dialect.name
    if dialect == "sqlite":
        # Foreign keys off while a migration builds a table anew (`_migrate_3_to_4`): SQLite
        # takes this only outside a transaction, and the rows it keeps are checked by the ids
        # they keep. On again in `unlock_after_migration`.
        connection.exec_driver_sql("PRAGMA foreign_keys=OFF")
        # The write lock, now rather than at the first write (waits up to the busy timeout).
        # The driver leaves the transaction alone: it begins none itself before DDL.
        connection.exec_driver_sql("BEGIN IMMEDIATE")
    elif dialect == "postgresql":
        # Released at commit or rollback; concurrent CREATE TABLEs would otherwise collide.
        connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK})


def unlock_after_migration(connection: Connection) -> None:
    """After the migration's transaction ended: the connection goes back to the pool with its
    foreign keys on, as every other connection of the engine has them."""
    if connection.dialect.name == "sqlite":
        connection.exec_driver_sql("PRAGMA foreign_keys=ON")
