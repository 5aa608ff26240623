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
from dsgd_cli.results import store as store_module
from dsgd_cli.errors import StoreError
from dsgd_cli.results.store import SCHEMA_VERSION, Store

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


def test_the_fixture_is_schema_1():
    assert version(FIXTURE) == "1"
    assert tables(FIXTURE) == {"meta", "runs", "params", "plugin_versions", "metrics", "summaries"}


def test_a_writing_open_upgrades_in_place_keeping_everything(old_db):
    store = Store(str(old_db))
    assert version(old_db) == str(SCHEMA_VERSION) == "3"
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
    assert store.count_metrics(1) == store.count_metrics(2) == 6
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
    assert version(old_db) == "3" and Store(str(old_db)).get_run(1).tag_names == ["baseline", "v1"]
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
    assert version(old_db) == "3"


def test_a_failed_migration_leaves_the_database_as_it_was(old_db, monkeypatch):
    def half_done(connection):  # the real step, then something goes wrong
        real(connection)
        raise OperationalError("ALTER ...", {}, sqlite3.OperationalError("disk I/O error"))

    real = store_module.MIGRATIONS[2]
    monkeypatch.setitem(store_module.MIGRATIONS, 2, half_done)
    with pytest.raises(StoreError, match="cannot open results database .*disk I/O error"):
        Store(str(old_db))
    assert version(old_db) == "1" and "tags" not in tables(old_db)  # one transaction: all or nothing
    monkeypatch.undo()
    assert Store(str(old_db)).runs()[0].experiment == "allreduce"
    assert version(old_db) == "3"


def test_a_database_of_a_newer_schema_is_refused(old_db):
    with sqlite3.connect(old_db) as connection:
        connection.execute("UPDATE meta SET value = '4' WHERE key = 'schema_version'")
    for opening in (Results, Store):
        with pytest.raises(StoreError, match="has schema version 4, newer than this dsgd "
                                             r"understands \(3\); upgrade dsgd"):
            opening(str(old_db))
    assert version(old_db) == "4" and "tags" not in tables(old_db)  # not "upgraded" to 3


def test_every_version_step_has_a_migration():
    assert sorted(store_module.MIGRATIONS) == list(range(2, SCHEMA_VERSION + 1))
