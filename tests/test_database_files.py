"""Which database a command opens, and what it does with one that is missing or damaged: a
`--db` path names exactly that file, only a `dsgd run` that records a run creates one, and a
database lacking a table, or not a database at all, is refused on one line (exit 2)."""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path

import pytest

from conftest import TINY_SPEC, dsgd, dsgd_in_process, write_spec
from dsgd_cli.results.schema import SCHEMA_VERSION
from test_store import fill


def files(directory: Path) -> set[str]:
    """The names in `directory`, less the journal files of an SQLite database in WAL mode."""
    return {path.name for path in directory.iterdir() if not path.name.endswith(("-wal", "-shm"))}


def content(db: Path) -> list[str]:
    """Everything a database holds, as SQL."""
    with sqlite3.connect(db) as connection:
        return list(connection.iterdump())


def one_line_error(result) -> str:
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr
    return result.stderr.rstrip("\n")


# -- a path is a path --------------------------------------------------------------------------


def test_a_db_path_with_percent_question_mark_and_hash_is_that_file(tmp_path):
    name = "a#b%20?q%41.db"
    spec = write_spec(tmp_path, TINY_SPEC)
    result = dsgd("run", str(spec), "--db", name, cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert name in files(tmp_path)
    assert not {"qA.db", "a#b ", "a#b", "a#b%20"} & files(tmp_path)
    compared = dsgd_in_process("compare", "--db", str(tmp_path / name), "-f", "csv")
    assert compared.returncode == 0, compared.stderr
    assert compared.stdout.splitlines()[1].startswith("1,a,allreduce,sgd,logreg,2,measured,ok,completed,")
    # The same file through a URL: its characters percent-encoded, as SQLAlchemy decodes them.
    url = "sqlite:///" + str(tmp_path / "a%23b%2520%3Fq%2541.db")
    tagged = dsgd_in_process("runs", "tag", "1", "t", "--db", url)
    assert (tagged.returncode, tagged.stdout) == (0, "run 1: tags t\n"), tagged.stderr


def test_a_percent_path_is_not_decoded_by_writers_or_readers(tmp_path):
    db = tmp_path / "p%41.db"
    fill(db)
    assert files(tmp_path) == {"p%41.db"}
    for args in (["runs"], ["show", "1"], ["export", "1", "-f", "csv"],
                 ["compare", "--target", "test_accuracy=0.5"], ["runs", "tag", "1", "foo"]):
        result = dsgd_in_process(*args, "--db", str(db))
        assert result.returncode == 0, (args, result.stderr)
    assert not (tmp_path / "pA.db").exists()
    # A path that merely contains `://` is still a path, not a URL of scheme `./x`.
    odd = tmp_path / "x:" / "" / "r.db"
    assert dsgd_in_process("runs", "--db", str(tmp_path / "x://r.db")).stderr == (
        f"dsgd: error: no results database at {odd} (`dsgd run` creates one)\n")


# -- only a run that records creates a database ----------------------------------------------------


@pytest.mark.parametrize("args", [
    ["run", "--resume", "1"], ["runs", "tag", "1", "x"], ["runs", "delete", "1"],
    ["runs", "tag", "1", "foo"], ["runs", "--db", "{db}", "delete", "1"],
], ids=["resume", "tag", "delete", "tag-percent", "delete-db-first"])
@pytest.mark.parametrize("name", ["nonexist.db", "p%41.db"])
def test_commands_that_look_up_a_run_create_no_database(tmp_path, args, name):
    db = tmp_path / name
    args = [arg.replace("{db}", str(db)) for arg in args]
    extra = [] if "--db" in args else ["--db", str(db)]
    message = one_line_error(dsgd_in_process(*args, *extra))
    assert message == f"dsgd: error: no results database at {db} (`dsgd run` creates one)"
    assert files(tmp_path) == set()


def test_an_unknown_run_changes_nothing_in_an_existing_database(tmp_path):
    db = tmp_path / "r.db"
    fill(db)
    before = content(db)
    for args in (["run", "--resume", "9"], ["runs", "tag", "9", "x"], ["runs", "delete", "9"]):
        message = one_line_error(dsgd_in_process(*args, "--db", str(db)))
        assert "9" in message
    assert content(db) == before


# -- missing tables and damaged files --------------------------------------------------------------

READERS = [["compare"], ["show", "1"], ["export"], ["plot", "1", "-o", "{dir}/p.png"],
           ["compare", "--target", "test_accuracy=0.5"], ["runs"]]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> Path:
    db = tmp_path_factory.mktemp("recorded") / "r.db"
    fill(db).engine.dispose()  # the last connection closed: all of it in the file, none in a WAL
    return db


@pytest.mark.parametrize("table", ["summaries", "params", "plugin_versions", "metrics"])
def test_a_database_lacking_a_table_is_refused_on_one_line(tmp_path, recorded, table):
    db = tmp_path / "r.db"
    shutil.copy(recorded, db)
    with sqlite3.connect(db) as connection:
        connection.execute(f"DROP TABLE {table}")
    before = content(db)
    expected = (f"dsgd: error: results database sqlite:///{db} is damaged: it lacks the table "
                f"'{table}' of schema version {SCHEMA_VERSION}")
    for args in READERS + [["runs", "tag", "1", "x"], ["runs", "delete", "1"]]:
        args = [arg.replace("{dir}", str(tmp_path)) for arg in args]
        assert one_line_error(dsgd_in_process(*args, "--db", str(db))) == expected, args
    assert content(db) == before
    assert not (tmp_path / "p.png").exists()


def test_a_file_that_is_no_database_is_refused_on_one_line(tmp_path):
    db = tmp_path / "r.db"
    db.write_bytes(b"not a database at all " * 100)
    for args in READERS:
        args = [arg.replace("{dir}", str(tmp_path)) for arg in args]
        message = one_line_error(dsgd_in_process(*args, "--db", str(db)))
        assert message == (f"dsgd: error: cannot open results database sqlite:///{db}: "
                           "file is not a database"), args
    assert db.read_bytes() == b"not a database at all " * 100


def test_damage_found_while_reading_is_one_line(tmp_path, recorded):
    """A table whose pages are overwritten is found only when a query reads them."""
    db = tmp_path / "r.db"
    shutil.copy(recorded, db)
    with sqlite3.connect(db) as connection:
        connection.execute("PRAGMA journal_mode=DELETE")
        (page,) = connection.execute(
            "SELECT rootpage FROM sqlite_master WHERE name = 'metrics'").fetchone()
        (size,) = connection.execute("PRAGMA page_size").fetchone()
    with open(db, "r+b") as file:
        file.seek((page - 1) * size)
        file.write(b"\xff" * size)
    for args in (["export", "-f", "csv"], ["compare", "--target", "test_accuracy=0.5"],
                 ["plot", "1", "-o", str(tmp_path / "p.png")]):
        message = one_line_error(dsgd_in_process(*args, "--db", str(db)))
        assert message.startswith(f"dsgd: error: cannot read results database sqlite:///{db}: "), args
