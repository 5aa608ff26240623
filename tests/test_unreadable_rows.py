"""One bad row of `runs` (written by another program, or edited by hand) must not make the
database unreadable: the listing commands say on one line that they skip it and list the others,
and `dsgd show` of that run exits 2 on one line naming it."""

from __future__ import annotations

import json
import sqlite3

import pytest

from conftest import dsgd, dsgd_in_process
from dsgd_cli.results.store import MetricRow, Store

CONFIG = {"task": {"name": "logreg"}, "aggregator": {"name": "allreduce"},
          "compressor": {"name": "none"}, "optimizer": {"name": "sgd", "lr": 0.1}, "workers": 2}
GOOD_EXPERIMENTS = ["good-first", "good-last"]
BAD_RUN_ID = 2  # between the two good runs

# column, the value stored there, and what the message says of it
BAD_VALUES = {
    "not JSON": ("config", "{not json", "runs.config: not JSON"),
    "nested 100,000 deep": ("config", "[" * 100_000 + "]" * 100_000,
                            "runs.config: JSON nested too deep"),
    "an object nested 500 deep": ("config", '{"a": ' * 500 + "1" + "}" * 500,
                                  "runs.config: JSON nested too deep"),
    "a 5,001-digit integer": ("config", '{"lr": ' + "9" * 5001 + "}",
                              "runs.config: a number too long to read"),
    "a list": ("config", "[1, 2]", "runs.config: not a JSON object"),
    "a garbage start time": ("started_at", "garbage", "runs.started_at: not a time"),
}


def insert_run(db, experiment: str, **stored) -> int:
    """A run inserted with raw SQL, as another program would: a good run's values, but for
    the columns given in `stored`."""
    values = {"experiment": experiment, "status": "completed", "task": "logreg",
              "aggregator": "allreduce", "compressor": "none", "optimizer": "sgd",
              "workers": 2, "config": json.dumps(CONFIG), "dsgd_version": "0.1.0",
              "host": "elsewhere", "started_at": "2024-05-01 12:00:00.000000",
              "ended_at": "2024-05-01 12:00:10.000000", **stored}
    columns = ", ".join(values)
    placeholders = ", ".join(f":{column}" for column in values)
    with sqlite3.connect(db) as connection:
        cursor = connection.execute(f"INSERT INTO runs ({columns}) VALUES ({placeholders})", values)
        return cursor.lastrowid


def make_db(tmp_path, column: str, value: str):
    """Runs 1 and 3 recorded by dsgd, run 2 inserted with `column` holding `value`."""
    db = tmp_path / "r.db"
    store = Store(str(db))
    first = store.create_run(GOOD_EXPERIMENTS[0], CONFIG, None, [])
    store.add_metrics(first, [MetricRow("test_accuracy", 0.5, step=1, epoch=0, seconds=1.0)])
    store.finish_run(first, "completed")
    assert insert_run(db, "bad", **{column: value}) == BAD_RUN_ID
    last = store.create_run(GOOD_EXPERIMENTS[1], CONFIG, None, [])
    store.finish_run(last, "completed")
    return db


@pytest.fixture(params=list(BAD_VALUES), ids=list(BAD_VALUES))
def bad(request, tmp_path):
    """A database with one bad run between two good ones, and what a message says of it."""
    column, value, problem = BAD_VALUES[request.param]
    return make_db(tmp_path, column, value), problem


def skipped_line(db, problem: str) -> str:
    return f"dsgd: run {BAD_RUN_ID} in sqlite:///{db} is unreadable ({problem}): skipped"


@pytest.mark.parametrize("command", [["runs"], ["compare"], ["export"]])
def test_a_listing_skips_the_bad_run_on_one_line_and_lists_the_others(bad, command):
    db, problem = bad
    result = dsgd_in_process(*command, "--db", str(db), "--format", "json")
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines() == [skipped_line(db, problem)]
    if command == ["export"]:  # the good runs' metric records
        assert [row["run_id"] for row in json.loads(result.stdout)] == [1]
    else:
        assert [row["experiment"] for row in json.loads(result.stdout)] == GOOD_EXPERIMENTS


def test_the_table_of_runs_lists_the_others(bad):
    db, problem = bad
    result = dsgd_in_process("runs", "--db", str(db))
    assert result.returncode == 0, result.stderr
    assert all(name in result.stdout for name in GOOD_EXPERIMENTS), result.stdout
    assert "bad" not in result.stdout
    assert result.stderr.splitlines() == [skipped_line(db, problem)]


def test_show_of_the_bad_run_exits_2_on_one_line_naming_it(bad):
    db, problem = bad
    result = dsgd_in_process("show", str(BAD_RUN_ID), "--db", str(db))
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [
        f"dsgd: error: run {BAD_RUN_ID} in sqlite:///{db} is unreadable ({problem})"]
    assert result.stdout == ""


def test_show_of_a_good_run_beside_it_shows_it(bad):
    db, _ = bad
    result = dsgd_in_process("show", "1", "--db", str(db))
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"run 1: {GOOD_EXPERIMENTS[0]}\n")
    assert result.stderr == ""


def test_the_bad_run_can_still_be_tagged_and_deleted(bad):
    """What a user does about it works: the run is tagged and deleted by its id alone."""
    db, _ = bad
    tagged = dsgd_in_process("runs", "tag", str(BAD_RUN_ID), "broken", "--db", str(db))
    assert tagged.returncode == 0, tagged.stderr
    assert tagged.stdout == f"run {BAD_RUN_ID}: tags broken\n"
    deleted = dsgd_in_process("runs", "delete", str(BAD_RUN_ID), "--db", str(db))
    assert deleted.returncode == 0, deleted.stderr
    listed = dsgd_in_process("runs", "--db", str(db), "--format", "json")
    assert (listed.returncode, listed.stderr) == (0, "")
    assert [row["id"] for row in json.loads(listed.stdout)] == [1, 3]


def test_dsgd_prints_no_traceback_for_any_of_them(tmp_path):
    """As a process: every kind of bad row at once (and a bad end time), each said on its own
    line."""
    db = make_db(tmp_path, "ended_at", "later")
    bad_ids = [BAD_RUN_ID, *(insert_run(db, "bad", **{column: value})
                             for column, value, _ in BAD_VALUES.values())]
    result = dsgd("runs", "--db", str(db), "--format", "json")
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert [row["experiment"] for row in json.loads(result.stdout)] == GOOD_EXPERIMENTS
    lines = result.stderr.splitlines()
    assert [line.split()[2] for line in lines] == [str(run_id) for run_id in bad_ids], lines
    assert all(line.endswith(": skipped") for line in lines), lines
