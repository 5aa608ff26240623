"""The results store through SQLAlchemy on a real SQLite file, and the commands that read it."""

import csv
import io
import json
import multiprocessing
import sqlite3
import subprocess
import sys

import pytest

from conftest import dsgd, dsgd_in_process
from dsgd_cli.errors import StoreError
from dsgd_cli.results import reader as reader_module
from dsgd_cli.results.reader import Results, ResultsReader
from dsgd_cli.results.schema import TABLE_COLUMNS
from dsgd_cli.results.store import Meta, MetricRow, ResultsWriter, Store
from sqlalchemy.orm import Session


def config(aggregator="allreduce", compressor="none", lr=0.1):
    return {"name": "x", "workers": 2, "epochs": 1, "task": {"name": "logreg", "features": 3},
            "optimizer": {"name": "sgd", "lr": lr}, "aggregator": {"name": aggregator},
            "compressor": {"name": compressor}}


def fill(db) -> Store:
    store = Store(str(db))
    for name, aggregator, compressor, accuracy in [("base", "allreduce", "none", 0.7),
                                                   ("local", "local_sgd", "none", 0.8),
                                                   ("sweep[optimizer.lr=0.1]", "allreduce", "none", 0.9)]:
        run_id = store.create_run(name, config(aggregator, compressor), "spec.yaml",
                                  [("aggregator", aggregator, "dsgd", "0.1.0")])
        store.add_metrics(run_id, [
            MetricRow("train_loss", 2.0, step=10, epoch=0, rank=0),
            MetricRow("train_loss", 1.0, step=10, epoch=0, rank=1),
            MetricRow("train_loss", 0.5, step=20, epoch=0, rank=0),
            MetricRow("train_loss", 0.7, step=20, epoch=0, rank=1),
            MetricRow("test_accuracy", accuracy - 0.1, epoch=0),
            MetricRow("test_accuracy", accuracy, epoch=1),
            MetricRow("total_bytes_sent", 1234.0),
        ])
        store.finish_run(run_id, "completed")
    return store


def test_run_round_trip(tmp_path):
    store = fill(tmp_path / "r.db")
    run = Store(str(tmp_path / "r.db")).get_run(2)
    assert (run.experiment, run.status, run.aggregator, run.workers) == ("local", "completed", "local_sgd", 2)
    assert run.config["task"] == {"name": "logreg", "features": 3}
    assert {p.key: json.loads(p.value) for p in run.params}["optimizer.lr"] == 0.1
    summary = {s.name: (s.final, s.best) for s in run.summaries}
    assert summary["train_loss"] == pytest.approx((0.6, 0.5))  # mean of each rank's last; min
    assert summary["test_accuracy"] == pytest.approx((0.8, 0.8))
    assert len(store.metric_history(2, "train_loss")) == 4


def test_schema_is_versioned(tmp_path):
    store = fill(tmp_path / "r.db")
    with Session(store.engine) as session, session.begin():
        session.get(Meta, "schema_version").value = "99"
    with pytest.raises(StoreError, match="schema version 99, newer than this dsgd understands"):
        Store(str(tmp_path / "r.db"))


def test_compare_filters_and_formats(tmp_path):
    db = tmp_path / "r.db"
    fill(db)
    rows = json.loads(dsgd("compare", "--db", str(db), "-f", "json").stdout)
    assert [r["id"] for r in rows] == [1, 2, 3]
    assert set(rows[0]) == {"id", "experiment", "aggregator", "optimizer", "task", "workers", "clock",
                            "timing", "status",
                            "test_accuracy", "test_loss", "train_loss", "wall_seconds",
                            "samples_per_second", "total_bytes_sent"}
    assert rows[1]["test_accuracy"] == pytest.approx(0.8) and rows[1]["test_loss"] is None

    only = json.loads(dsgd("compare", "--db", str(db), "-f", "json", "-e", "local", "-e", "sweep").stdout)
    assert [r["experiment"] for r in only] == ["local", "sweep[optimizer.lr=0.1]"]
    last = json.loads(dsgd("compare", "--db", str(db), "-f", "json", "--last", "1").stdout)
    assert [r["id"] for r in last] == [3]

    text = dsgd("compare", "--db", str(db), "-f", "csv", "--metric", "lr").stdout
    table = list(csv.DictReader(io.StringIO(text)))
    assert table[0]["experiment"] == "base" and "lr" in table[0]
    github = dsgd("compare", "--db", str(db), "-f", "github").stdout
    assert github.splitlines()[0].startswith("| id ")


def test_db_from_environment(tmp_path):
    db = tmp_path / "env.db"
    fill(db)
    result = dsgd("runs", env={"DSGD_DB": str(db)})
    assert result.returncode == 0 and "sweep[optimizer.lr=0.1]" in result.stdout


# slow: test_show's test_show_reads_as_people_write_numbers_and_bests_only_where_they_mean_something
# (default) prints a run's configuration, status and metrics; test_database_access's
# test_show_of_a_run_that_cannot_exist[-5] (default) refuses an unknown id from a real process
@pytest.mark.slow
def test_show_prints_configuration_and_metrics(tmp_path):
    db = tmp_path / "r.db"
    fill(db)
    result = dsgd("show", "2", "--db", str(db))
    assert result.returncode == 0
    assert "run 2: local" in result.stdout and "status: completed" in result.stdout
    assert "features: 3" in result.stdout and "test_accuracy" in result.stdout
    missing = dsgd("show", "42", "--db", str(db))
    assert missing.returncode == 2 and missing.stderr.strip() == "dsgd: error: no run with id 42"


@pytest.mark.parametrize("args, message", [
    (["compare", "-f", "fancy"], "--format: unknown format 'fancy'"),
    (["compare", "--db", "nosuchdialect://x"], "cannot open results database nosuchdialect://x"),
    (["plugins", "local_sgd", "extra"], "unexpected extra argument"),
    (["compare", "--last", "0"], "Invalid value for '--last'"),
])
def test_bad_command_input_exits_2(tmp_path, args, message):
    result = dsgd(*args, cwd=tmp_path)
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr


def test_unreadable_database_exits_2(tmp_path):
    db = tmp_path / "junk.db"
    db.write_text("this is not a database" * 100)
    result = dsgd("compare", "--db", str(db))
    assert result.returncode == 2
    assert result.stderr.startswith("dsgd: error: cannot open results database")
    assert "file is not a database" in result.stderr and "Traceback" not in result.stderr


def rows_of(db, table: str, run_id: int) -> int:
    import sqlite3

    with sqlite3.connect(db) as connection:
        return connection.execute(f"SELECT count(*) FROM {table} WHERE run_id = ?", (run_id,)).fetchone()[0]


def test_runs_lists_with_its_options_and_tags(tmp_path):
    db = tmp_path / "r.db"
    fill(db).tag_run(2, ["paper", "best"])
    help_text = dsgd_in_process("runs", "--help").stdout
    assert all(word in help_text for word in ("--experiment", "--format", "delete", "tag"))
    rows = json.loads(dsgd_in_process("runs", "--db", str(db), "-e", "local", "--format", "json").stdout)
    assert [(r["id"], r["experiment"], r["status"], r["workers"], r["tags"], r["reason"]) for r in rows] == [
        (2, "local", "completed", 2, ["best", "paper"], None)]
    assert list(rows[0]) == ["id", "experiment", "status", "workers", "clock", "timing", "started",
                            "real_seconds", "tags", "slurm", "reason"]
    table = list(csv.DictReader(io.StringIO(dsgd_in_process("runs", "--db", str(db), "-f", "csv").stdout)))
    assert [(r["id"], r["tags"]) for r in table] == [("1", ""), ("2", "best,paper"), ("3", "")]
    assert "best,paper" in dsgd_in_process("runs", "--db", str(db)).stdout
    assert "tags: best, paper" in dsgd_in_process("show", "2", "--db", str(db)).stdout


def test_runs_delete_removes_everything_of_a_run(tmp_path):
    db = tmp_path / "r.db"
    store = fill(db)
    store.tag_run(1, ["kept"])
    store.tag_run(2, ["x"])
    result = dsgd("runs", "delete", "2", "--db", str(db))
    assert (result.returncode, result.stdout, result.stderr) == (0, "deleted run 2\n", "")
    for table in ("metrics", "summaries", "params", "plugin_versions", "tags"):
        assert (rows_of(db, table, 2), rows_of(db, table, 1) > 0) == (0, True), table
    store = Results(str(db))
    assert [r.id for r in store.runs()] == [1, 3] and store.get_run(2) is None
    # --db before the subcommand means the same; several ids at once
    assert dsgd_in_process("runs", "--db", str(db), "delete", "3", "1").stdout == "deleted runs 1, 3\n"
    assert Results(str(db)).runs() == []


@pytest.mark.parametrize("ids, message", [
    (["1", "42"], "no run with id 42; nothing deleted"),
    (["43", "2", "42"], "no runs with ids 42, 43; nothing deleted"),
    (["0", "-1"], "no runs with ids -1, 0; nothing deleted"),
    (["99999999999999999999999"], "no run with id 99999999999999999999999; nothing deleted"),
])
def test_runs_delete_of_an_unknown_run_deletes_nothing(tmp_path, ids, message):
    db = tmp_path / "r.db"
    fill(db)
    result = dsgd_in_process("runs", "delete", "--db", str(db), "--", *ids)
    assert (result.returncode, result.stdout, result.stderr) == (2, "", f"dsgd: error: {message}\n")
    assert [r.id for r in Results(str(db)).runs()] == [1, 2, 3]


def test_runs_delete_spares_a_running_run_without_force(tmp_path):
    db = tmp_path / "r.db"
    store = fill(db)
    running = store.create_run("live", config(), None, [])
    store.add_metrics(running, [MetricRow("train_loss", 1.0)])
    result = dsgd_in_process("runs", "delete", "1", str(running), "--db", str(db))
    assert result.returncode == 2
    assert result.stderr == (f"dsgd: error: run {running} still running (its `dsgd run` may still be "
                             "writing to it; --force deletes it anyway); nothing deleted\n")
    assert len(Results(str(db)).runs()) == 4
    assert dsgd_in_process("runs", "delete", "--force", str(running), "--db", str(db)).returncode == 0
    assert rows_of(db, "metrics", running) == 0


def test_runs_tag_adds_and_removes(tmp_path):
    db = tmp_path / "r.db"
    fill(db)

    def tag(*args):
        result = dsgd_in_process("runs", "tag", *args, "--db", str(db))
        return result.returncode, (result.stdout or result.stderr).strip()

    assert tag("1", "paper", "v2") == (0, "run 1: tags paper, v2")
    assert tag("1", "paper", "fig 3") == (0, "run 1: tags fig 3, paper, v2")  # no duplicates
    assert tag("3", "paper") == (0, "run 3: tags paper")
    assert tag("1", "v2", "never-had", "--remove") == (0, "run 1: tags fig 3, paper")
    assert tag("3", "paper", "--remove") == (0, "run 3: no tags")
    assert tag("42", "x") == (2, "dsgd: error: no run with id 42")
    for bad in ("", " padded", "a,b", "x" * 129, "tab\there"):
        code, message = tag("1", bad)
        assert code == 2 and message.startswith(f"dsgd: error: bad tag {bad!r}: a tag is 1 to 128 "
                                                "printable characters"), bad
    assert tag("1")[0] == 2  # at least one tag
    assert Results(str(db)).get_run(1).tag_names == ["fig 3", "paper"]
    rows = json.loads(dsgd_in_process("compare", "--db", str(db), "-f", "json", "--where", "tag=paper").stdout)
    assert [r["id"] for r in rows] == [1]


def test_runs_subcommands_take_no_listing_options(tmp_path):
    db = tmp_path / "r.db"
    fill(db)
    result = dsgd_in_process("runs", "-f", "json", "delete", "1", "--db", str(db))
    assert result.returncode == 2
    assert result.stderr == ("dsgd: error: --experiment and --format belong to the listing, not to "
                             "`dsgd runs delete`\n")
    unknown = dsgd_in_process("runs", "purge", "--db", str(db))
    assert unknown.returncode == 2 and "No such command 'purge'" in unknown.stderr
    assert len(Results(str(db)).runs()) == 3


def _open(url: str, barrier, results) -> None:
    barrier.wait()
    try:
        Store(url)
        results.put("ok")
    except Exception as error:  # reported to the test, which shows it
        results.put(f"{type(error).__name__}: {error}")


def test_processes_creating_one_database_at_once(tmp_path):
    """8 processes open a new database at the same moment: all succeed (SQLite answers all
    but one of those switching it to WAL `database is locked` at once; they try again)."""
    context = multiprocessing.get_context("fork")
    for trial in range(20):
        url = f"sqlite:///{tmp_path / f'{trial}.db'}"
        barrier, results = context.Barrier(8), context.Queue()
        processes = [context.Process(target=_open, args=(url, barrier, results)) for _ in range(8)]
        for process in processes:
            process.start()
        outcomes = [results.get(timeout=120) for _ in processes]
        for process in processes:
            process.join()
        assert outcomes == ["ok"] * 8, (trial, outcomes)
        assert Results(url).runs() == []


def model_columns() -> dict[str, tuple[str, ...]]:
    from dsgd_cli.results.store import Base

    return {table.name: tuple(column.name for column in table.columns)
            for table in Base.metadata.sorted_tables}


def test_the_schemas_names_are_the_models_tables():
    assert model_columns() == TABLE_COLUMNS


def test_every_table_and_column_the_reader_reads_is_the_models(tmp_path, monkeypatch):
    """The reader's plain SQL against the models' tables: each question the reader answers is
    asked of a database the models made, and SQLite's authorizer reports every (table, column)
    each query reads. A column named differently in the two fails here."""
    reads: set[tuple[str, str]] = set()

    def authorize(action, table, column, _database, _trigger):
        if action == sqlite3.SQLITE_READ and table != "sqlite_master":
            reads.add((table, column))
        return sqlite3.SQLITE_OK

    def connect_watched(*args, **kwargs):
        connection = real_connect(*args, **kwargs)
        connection.set_authorizer(authorize)
        return connection

    store = fill(tmp_path / "r.db")
    store.tag_run(1, ["paper"])
    store.create_run("kept", config(), None, [], checkpoint_dir=str(tmp_path / "ckpt"))
    real_connect = sqlite3.connect
    monkeypatch.setattr(reader_module.sqlite3, "connect", connect_watched)
    reader = Results(str(tmp_path / "r.db"))
    questions = {
        "runs": lambda: reader.runs(experiments=["base", "sweep"], last=2, ids=[1, 3]),
        "get_run": lambda: reader.get_run(4),
        "finals": lambda: reader.finals([1, 2]),
        "checkpoint_dir": lambda: reader.checkpoint_dir(4),
        "resumes": lambda: reader.resumes(4),
        "metric_history": lambda: reader.metric_history(1, "train_loss"),
        "step_curves": lambda: reader.step_curves([1, 2], "train_loss"),
        "metric_names": lambda: reader.metric_names([1]),
    }
    for answer in questions.values():
        answer()
    assert reader.get_run(1).tag_names == ["paper"] and reader.checkpoint_dir(4)  # rows were read
    methods = {name for name, value in vars(ResultsReader).items()
               if callable(value) and not name.startswith("_")} - {"connect"}
    assert set(questions) == methods  # every question asked (a new one is added above)
    models = model_columns()
    assert {table for table, _ in reads} == set(models)
    assert sorted(read for read in reads if read[1] not in models[read[0]]) == []


def test_the_writer_reads_through_a_reader_of_its_own_engine(tmp_path):
    store = fill(tmp_path / "r.db")
    assert Store is ResultsWriter and not isinstance(store, ResultsReader)
    assert isinstance(store.reader, ResultsReader) and store.reader.engine is store.engine
    assert [run.id for run in store.runs()] == [run.id for run in store.reader.runs()] == [1, 2, 3]


def test_a_deleted_runs_id_is_never_given_again(tmp_path):
    """Not even the newest run's: SQLite without AUTOINCREMENT gave the next run its id."""
    store = fill(tmp_path / "r.db")
    store.delete_runs([3])
    assert store.create_run("next", config(), None, []) == 4
    store.delete_runs([2, 4], force=True)
    assert Store(str(tmp_path / "r.db")).create_run("again", config(), None, []) == 5
    assert [run.id for run in Results(str(tmp_path / "r.db")).runs()] == [1, 5]


def test_sqlite_read_directly_gives_what_sqlalchemy_gives(tmp_path):
    """A reading command reads an SQLite file through sqlite3; a Store reads through its
    SQLAlchemy engine. Both give the same runs, with tags and details, and the same finals."""
    store = fill(tmp_path / "r.db")
    store.tag_run(2, ["paper", "fig 3"])
    store.add_metrics(3, [MetricRow("train_loss", 0.25, step=30, epoch=1, rank=0, seconds=1.5)])
    reader = Results(str(tmp_path / "r.db"))
    for details in (True, False):
        assert [vars(run) for run in reader.runs(details=details)] == [
            vars(run) for run in store.runs(details=details)]
    assert vars(reader.get_run(2)) == vars(store.get_run(2))
    assert reader.get_run(2).tag_names == ["fig 3", "paper"]
    assert reader.get_run(1).started_at.tzinfo is not None
    assert reader.finals([1, 2, 3]) == store.finals([1, 2, 3])
    assert reader.metric_history(3, "train_loss") == store.metric_history(3, "train_loss")
    assert reader.metric_history(3, "train_loss")[-1] == (30, 1, 0, 1.5, 0.25)
    assert [run.id for run in reader.runs(experiments=["sweep"], last=1)] == [3]


@pytest.mark.parametrize("command", [["runs"], ["compare"], ["show", "2"]])
def test_reading_commands_load_neither_sqlalchemy_nor_torch(tmp_path, command):
    """What keeps them quick: an SQLite file is read through sqlite3."""
    fill(tmp_path / "r.db")
    code = ("import sys\nfrom dsgd_cli.cli import app\n"
            f"app({[*command, '--db', str(tmp_path / 'r.db')]!r}, standalone_mode=False)\n"
            "print(sorted({'sqlalchemy', 'torch'} & set(sys.modules)))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "[]"


def test_a_database_whose_file_name_looks_like_uri_syntax_is_read_as_it_is(tmp_path):
    """`#`, `%` and `?` in the path are file name, not SQLite URI syntax, for the sqlite3 reader
    and for the SQLAlchemy engine of the history queries alike."""
    directory = tmp_path / "odd #1"
    directory.mkdir()
    db = directory / "r%41 ?.db"
    fill(db)
    assert [run.id for run in Results(str(db)).runs()] == [1, 2, 3]
    target = dsgd("compare", "--db", str(db), "--target", "train_loss=0.9", "-f", "json")
    assert target.returncode == 0, target.stderr
    assert [row["steps_to_target"] for row in json.loads(target.stdout)] == [20, 20, 20]
    export = dsgd("export", "1", "--db", str(db), "-m", "train_loss")
    assert export.returncode == 0, export.stderr
    assert len(export.stdout.splitlines()) == 1 + 4
