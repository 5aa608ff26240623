"""Schema migrations, from tests/fixtures/schema1.sqlitedb: a database dsgd 0.1.0 wrote before
tags (schema 1), made by tests/fixtures/make_schema1_db.py. A writing open upgrades it in place
without losing anything; a reading open reads it as it is and changes nothing."""

from __future__ import annotations

import json
import shutil
import sqlite3
from pathlib import Path

import pytest
from sqlalchemy import create_engine, inspect
from sqlalchemy.exc import OperationalError

from conftest import dsgd, dsgd_in_process
from dsgd_cli.results.reader import Results
from dsgd_cli.results import migrations
from dsgd_cli.results import store as store_module
from dsgd_cli.errors import StoreError
from dsgd_cli.results.store import SCHEMA_VERSION, Store
from results_helpers import count_metrics

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "schema1.sqlitedb"


@pytest.fixture
def old_db(tmp_path) -> Path:
    path = tmp_path / "old.db"
    shutil.copyfile(FIXTURE, path)
    return path


def version(path: Path) -> str:
    with sqlite3.connect(path) as connection:
        return connection.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()[0]


def tables(path: Path) -> set[str]:
    with sqlite3.connect(path) as connection:
        return {name for (name,) in connection.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}


def table_sql(path: Path, table: str) -> str:
    """The table's CREATE TABLE as SQLite keeps it, blanks and quotes aside."""
    with sqlite3.connect(path) as connection:
        sql = connection.execute("SELECT sql FROM sqlite_master WHERE type = 'table' AND name = ?",
                                 (table,)).fetchone()[0]
    return " ".join(sql.replace('"', "").split())


def test_the_fixture_is_schema_1():
    assert version(FIXTURE) == "1"
    assert tables(FIXTURE) == {"meta", "runs", "params", "plugin_versions", "metrics", "summaries"}


def test_a_writing_open_upgrades_in_place_keeping_everything(old_db):
    store = Store(str(old_db))
    assert version(old_db) == str(SCHEMA_VERSION) == "5"
    assert {"tags", "checkpoints"} <= tables(old_db)

    runs = store.runs()
    assert [(r.id, r.experiment, r.status, r.reason) for r in runs] == [
        (1, "allreduce", "completed", None),
        (2, "local[aggregator.period=4]", "failed", "rank 1: RuntimeError: boom")]
    first = runs[0]
    assert first.config["task"] == {"name": "logreg", "features": 3}
    assert {p.key: json.loads(p.value) for p in first.params}["optimizer.lr"] == 0.05
    assert [(p.kind, p.name, p.version) for p in first.plugins] == [("aggregator", "allreduce", "0.1.0")]
    assert (first.ended_at - first.started_at).total_seconds() == 90.5
    assert first.started_at.isoformat() == "2024-05-01T10:00:00+00:00"
    assert first.tag_names == []
    assert count_metrics(store, 1) == count_metrics(store, 2) == 6
    assert [(m.step, m.rank, m.value) for m in store.metric_history(1, "train_loss")] == [
        (10, 0, 1.0), (10, 1, 1.0), (20, 0, 0.0), (20, 1, 0.0)]
    assert store.finals([1, 2]) == {1: {"train_loss": 0.0, "test_accuracy": 0.75},
                                    2: {"train_loss": 0.0, "test_accuracy": 0.5}}

    assert store.tag_run(1, ["baseline", "v1"]) == ["baseline", "v1"]
    assert store.get_run(1).tag_names == ["baseline", "v1"]
    rows = json.loads(dsgd_in_process("compare", "--db", str(old_db), "-f", "json",
                                      "--where", "tag=baseline").stdout)
    assert [row["id"] for row in rows] == [1]

    new_run = store.create_run("after", first.config, None, [])
    store.finish_run(new_run, "completed")
    assert new_run == 3
    Store(str(old_db))  # opening it again changes nothing more
    assert version(old_db) == str(SCHEMA_VERSION) and Store(str(old_db)).get_run(1).tag_names == ["baseline", "v1"]
    assert store.checkpoint_dir(1) is None and store.resumes(1) == []


def test_an_upgraded_database_has_the_schema_of_a_new_one(old_db, tmp_path):
    Store(str(old_db))
    Store(str(tmp_path / "new.db"))

    def schema(path: Path) -> dict:
        inspector = inspect(create_engine(f"sqlite:///{path}"))
        return {table: (
            [(c["name"], str(c["type"]), c["nullable"]) for c in inspector.get_columns(table)],
            inspector.get_pk_constraint(table)["constrained_columns"],
            sorted((fk["constrained_columns"], fk["referred_table"], fk["options"].get("ondelete"))
                   for fk in inspector.get_foreign_keys(table)),
            sorted((ix["name"], ix["column_names"]) for ix in inspector.get_indexes(table)),
        ) for table in inspector.get_table_names()}

    upgraded, new = schema(old_db), schema(tmp_path / "new.db")
    assert upgraded == new
    assert table_sql(old_db, "runs") == table_sql(tmp_path / "new.db", "runs")  # AUTOINCREMENT too
    assert new["tags"][1:3] == (["run_id", "tag"], [(["run_id"], "runs", "CASCADE")])
    assert new["checkpoints"][1:3] == (["run_id"], [(["run_id"], "runs", "CASCADE")])


def test_a_reading_open_reads_an_old_database_as_it_is(old_db):
    before = old_db.read_bytes()
    store = Results(str(old_db))
    assert [run.tag_names for run in store.runs()] == [[], []]
    assert [run.tag_names for run in store.runs(details=False)] == [[], []]
    assert store.get_run(2).tag_names == []

    for args in (["runs", "-f", "json"], ["compare", "--where", "tag=x"], ["show", "1"],
                 ["export"], ["compare", "--by", "aggregator"]):
        result = dsgd_in_process(*args, "--db", str(old_db))
        assert (result.returncode, result.stderr) == (0, ""), args
    listed = json.loads(dsgd_in_process("runs", "-f", "json", "--db", str(old_db)).stdout)
    assert [(row["id"], row["tags"], row["real_seconds"]) for row in listed] == [(1, [], 90.5), (2, [], 10.0)]
    assert old_db.read_bytes() == before and version(old_db) == "1"
    assert not Path(f"{old_db}-wal").exists()


def test_a_writing_command_upgrades_an_old_database(old_db):
    result = dsgd("runs", "tag", "2", "flaky", "--db", str(old_db))
    assert (result.returncode, result.stdout, result.stderr) == (0, "run 2: tags flaky\n", "")
    assert version(old_db) == str(SCHEMA_VERSION)


def test_a_failed_migration_leaves_the_database_as_it_was(old_db, monkeypatch):
    def half_done(connection):  # the real step, then something goes wrong
        real(connection)
        raise OperationalError("ALTER ...", {}, sqlite3.OperationalError("disk I/O error"))

    real = migrations.MIGRATIONS[2]
    monkeypatch.setitem(migrations.MIGRATIONS, 2, half_done)
    with pytest.raises(StoreError, match="cannot open results database .*disk I/O error"):
        Store(str(old_db))
    assert version(old_db) == "1" and "tags" not in tables(old_db)  # one transaction: all or nothing
    monkeypatch.undo()
    assert Store(str(old_db)).runs()[0].experiment == "allreduce"
    assert version(old_db) == str(SCHEMA_VERSION)


def test_a_database_of_a_newer_schema_is_refused(old_db):
    with sqlite3.connect(old_db) as connection:
        connection.execute("UPDATE meta SET value = '6' WHERE key = 'schema_version'")
    for opening in (Results, Store):
        with pytest.raises(StoreError, match="has schema version 6, newer than this dsgd "
                                             r"understands \(5\); upgrade dsgd"):
            opening(str(old_db))
    assert version(old_db) == "6" and "tags" not in tables(old_db)  # not "upgraded" to 5


def test_every_version_step_has_a_migration():
    assert sorted(migrations.MIGRATIONS) == list(range(2, SCHEMA_VERSION + 1))


# -- schema 3 to 4: run ids never given again ---------------------------------------------------

SCHEMA_3 = Path(__file__).resolve().parent / "fixtures" / "schema3.sqlitedb"
READING_COMMANDS = (["compare", "-f", "json"], ["compare"], ["compare", "--by", "aggregator"],
                    ["compare", "--target", "train_loss=1.5", "-f", "json"], ["show", "1"],
                    ["show", "3"], ["show", "4"], ["runs", "-f", "json"], ["export"],
                    ["export", "-f", "json", "-c", "optimizer.lr"])


@pytest.fixture
def db_3(tmp_path) -> Path:
    path = tmp_path / "three.db"
    shutil.copyfile(SCHEMA_3, path)
    return path


def every_row(path: Path) -> dict[str, list[tuple]]:
    """Every row of every dsgd table, in order of its columns' values."""
    with sqlite3.connect(path) as connection:
        return {table: sorted(connection.execute(f"SELECT * FROM {table}").fetchall(), key=repr)
                for table in sorted(tables(path) - {"sqlite_sequence"})}


def reading_commands(path: Path) -> list[tuple[int, str, str]]:
    return [(result.returncode, result.stdout, result.stderr) for result in
            (dsgd_in_process(*args, "--db", str(path)) for args in READING_COMMANDS)]


def test_the_schema_3_fixture_has_reusable_ids():
    """As dsgd wrote it before schema 4: runs 1, 3 and 4 (2 deleted), ids without AUTOINCREMENT."""
    assert version(SCHEMA_3) == "3"
    assert [row[0] for row in every_row(SCHEMA_3)["runs"]] == [1, 3, 4]
    assert "AUTOINCREMENT" not in table_sql(SCHEMA_3, "runs")


def test_a_schema_3_database_is_upgraded_keeping_every_row_and_reading_the_same(db_3):
    rows, shown = every_row(db_3), reading_commands(db_3)
    assert all(code == 0 and error == "" for code, _, error in shown)
    Store(str(db_3))
    assert version(db_3) == str(SCHEMA_VERSION) and "AUTOINCREMENT" in table_sql(db_3, "runs")
    rows_after = every_row(db_3)
    assert rows_after.pop("meta") == [("schema_version", str(SCHEMA_VERSION))]
    assert rows_after.pop("slurm_jobs") == []  # schema 5's table, new and empty
    rows.pop("meta")
    assert rows_after == rows and len(rows["metrics"]) == 32 and len(rows["tags"]) == 3
    assert reading_commands(db_3) == shown
    with sqlite3.connect(db_3) as connection:
        assert connection.execute("PRAGMA foreign_key_check").fetchall() == []
        assert connection.execute("PRAGMA integrity_check").fetchall() == [("ok",)]


def test_the_upgraded_runs_table_keeps_its_foreign_keys(db_3):
    """The tables that refer to runs still do: deleting a run takes its tags and checkpoints
    along (ON DELETE CASCADE), and no metric can be written for a run that is not there."""
    store = Store(str(db_3))
    store.delete_runs([3])
    with sqlite3.connect(db_3) as connection:
        for table in ("tags", "checkpoints", "metrics", "params"):
            left = connection.execute(f"SELECT DISTINCT run_id FROM {table} ORDER BY 1").fetchall()
            assert 3 not in {run_id for (run_id,) in left}, table
    with pytest.raises(store_module.RunDeleted):
        store.add_metrics(3, [store_module.MetricRow("train_loss", 1.0)])


def test_after_the_upgrade_a_deleted_runs_id_is_not_given_again(db_3):
    store = Store(str(db_3))
    assert [run.id for run in store.runs()] == [1, 3, 4]
    store.delete_runs([4], force=True)  # the newest, still running
    assert store.create_run("next", store.get_run(1).config, None, []) == 5
    with store.engine.connect() as connection:  # the migration's connection, back in the pool
        assert connection.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1


def test_a_failed_upgrade_to_schema_4_leaves_the_database_as_it_was(db_3, monkeypatch):
    def half_done(connection):  # the table built anew, then something goes wrong
        real(connection)
        raise OperationalError("ALTER ...", {}, sqlite3.OperationalError("disk I/O error"))

    before = every_row(db_3)
    real = migrations.MIGRATIONS[4]
    monkeypatch.setitem(migrations.MIGRATIONS, 4, half_done)
    with pytest.raises(StoreError, match="cannot open results database .*disk I/O error"):
        Store(str(db_3))
    assert every_row(db_3) == before and "AUTOINCREMENT" not in table_sql(db_3, "runs")
    monkeypatch.undo()
    assert [run.id for run in Store(str(db_3)).runs()] == [1, 3, 4]
    assert version(db_3) == str(SCHEMA_VERSION)


# -- schema 3 to 4 keeps what a user added: views, columns, indexes, triggers --------------------

def add_to(path: Path, sql: str) -> None:
    with sqlite3.connect(path) as connection:
        connection.executescript(sql)


def rows_of(path: Path, query: str) -> list[tuple]:
    with sqlite3.connect(path) as connection:
        return connection.execute(query).fetchall()


def users_objects(path: Path) -> list[tuple]:
    """The views, triggers and indexes not dsgd's, as SQLite keeps them."""
    return rows_of(path, "SELECT type, name, tbl_name, sql FROM sqlite_master WHERE type != 'table' "
                         "AND sql IS NOT NULL AND name NOT IN ('ix_runs_experiment', "
                         "'ix_metrics_run_name') ORDER BY name")


def check_sound_and_ids_never_reused(path: Path) -> None:
    """The upgraded database passes SQLite's checks, and the newest run's id, deleted, is not
    given again."""
    assert version(path) == str(SCHEMA_VERSION) and "AUTOINCREMENT" in table_sql(path, "runs")
    assert rows_of(path, "PRAGMA foreign_key_check") == []
    assert rows_of(path, "PRAGMA integrity_check") == [("ok",)]
    store = Store(str(path))
    store.delete_runs([4], force=True)
    assert store.create_run("next", store.get_run(1).config, None, []) == 5


def test_a_view_over_runs_does_not_stop_the_upgrade(db_3):
    add_to(db_3, "CREATE VIEW finished AS SELECT id FROM runs WHERE status = 'completed';"
                 "CREATE VIEW finished_count AS SELECT count(*) FROM finished;")
    objects = users_objects(db_3)
    Store(str(db_3))
    assert users_objects(db_3) == objects
    assert rows_of(db_3, "SELECT * FROM finished ORDER BY id") == [(1,), (3,)]
    check_sound_and_ids_never_reused(db_3)
    assert rows_of(db_3, "SELECT * FROM finished_count") == [(2,)]


def test_columns_a_user_added_to_runs_are_kept_with_their_values(db_3):
    add_to(db_3, """ALTER TABLE runs ADD COLUMN notes TEXT;
                    ALTER TABLE runs ADD COLUMN "priority level" DECIMAL(4, 1) NOT NULL DEFAULT 3;
                    ALTER TABLE runs ADD COLUMN answer DEFAULT -42;
                    UPDATE runs SET notes = 'run ' || id WHERE id != 3;
                    UPDATE runs SET "priority level" = 7.5 WHERE id = 4;""")
    runs_before = rows_of(db_3, "SELECT * FROM runs ORDER BY id")
    columns_before = rows_of(db_3, "PRAGMA table_info(runs)")
    shown = reading_commands(db_3)
    assert all(code == 0 and error == "" for code, _, error in shown)
    Store(str(db_3))
    assert reading_commands(db_3) == shown
    assert rows_of(db_3, "PRAGMA table_info(runs)") == columns_before  # type, NOT NULL, default
    assert rows_of(db_3, "SELECT * FROM runs ORDER BY id") == runs_before
    assert rows_of(db_3, 'SELECT id, notes, "priority level" FROM runs ORDER BY id') == [
        (1, "run 1", 3), (3, None, 3), (4, "run 4", 7.5)]
    check_sound_and_ids_never_reused(db_3)
    assert rows_of(db_3, 'SELECT notes, "priority level", answer FROM runs WHERE id = 5') == [
        (None, 3, -42)]  # the new run took the defaults


def test_indexes_and_triggers_a_user_made_on_runs_are_kept_and_work(db_3):
    add_to(db_3, """CREATE INDEX my_status ON runs (status, id DESC);
                    CREATE UNIQUE INDEX my_host_started ON runs (host, started_at);
                    CREATE TABLE deleted_runs (id INTEGER, experiment TEXT);
                    CREATE TABLE reviews (run_id INTEGER REFERENCES runs (id) ON DELETE CASCADE);
                    INSERT INTO reviews VALUES (1), (4);
                    CREATE TRIGGER remember_deleted AFTER DELETE ON runs
                    BEGIN INSERT INTO deleted_runs VALUES (old.id, old.experiment); END;""")
    objects = users_objects(db_3)
    assert [name for _, name, _, _ in objects] == ["my_host_started", "my_status", "remember_deleted"]
    Store(str(db_3))
    assert users_objects(db_3) == objects
    check_sound_and_ids_never_reused(db_3)
    assert rows_of(db_3, "SELECT * FROM deleted_runs") == [(4, "live")]
    assert rows_of(db_3, "SELECT * FROM reviews") == [(1,)]  # a user's foreign key too
    assert rows_of(db_3, "SELECT name FROM pragma_index_list('runs') ORDER BY name") == [
        ("ix_runs_experiment",), ("my_host_started",), ("my_status",)]


def test_triggers_naming_runs_from_other_tables_and_views_are_kept_and_work(db_3):
    """A trigger on another table that names runs stops the new table's renaming as a view
    does; an INSTEAD OF trigger goes with its view when the view is dropped."""
    add_to(db_3, """CREATE TRIGGER tagging_notes AFTER INSERT ON tags
                    BEGIN UPDATE runs SET reason = 'tagged ' || new.tag WHERE id = new.run_id; END;
                    CREATE VIEW run_reasons AS SELECT id, reason FROM runs;
                    CREATE TRIGGER set_reason INSTEAD OF UPDATE ON run_reasons
                    BEGIN UPDATE runs SET reason = new.reason WHERE id = old.id; END;""")
    objects = users_objects(db_3)
    store = Store(str(db_3))
    assert users_objects(db_3) == objects
    store.tag_run(3, ["kept"])
    add_to(db_3, "UPDATE run_reasons SET reason = 'by the view' WHERE id = 1")
    assert rows_of(db_3, "SELECT id, reason FROM runs ORDER BY id") == [
        (1, "by the view"), (3, "tagged kept"), (4, None)]
    check_sound_and_ids_never_reused(db_3)


def test_a_generated_column_on_runs_stops_the_upgrade_rather_than_being_lost(db_3):
    add_to(db_3, "ALTER TABLE runs ADD COLUMN double_id INTEGER GENERATED ALWAYS AS (id * 2) VIRTUAL")
    before = every_row(db_3)
    with pytest.raises(StoreError, match=(
            r"^cannot upgrade results database .*three\.db: its table 'runs' has the generated "
            r"column 'double_id', which the upgrade to schema 4 cannot copy; drop it \(ALTER TABLE "
            r'runs DROP COLUMN "double_id"\), open the database again, then add it again$')):
        Store(str(db_3))
    assert version(db_3) == "3" and every_row(db_3) == before
    assert rows_of(db_3, "SELECT double_id FROM runs ORDER BY id") == [(2,), (6,), (8,)]
    add_to(db_3, "ALTER TABLE runs DROP COLUMN double_id")  # as the message says
    Store(str(db_3))
    check_sound_and_ids_never_reused(db_3)
