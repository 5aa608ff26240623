"""The results store through SQLAlchemy on a real SQLite file, and the commands that read it."""

import csv
import io
import json

import pytest

from conftest import dsgd
from dsgd_cli.errors import StoreError
from dsgd_cli.store import Meta, MetricRow, Store
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
    assert set(rows[0]) == {"id", "experiment", "aggregator", "optimizer", "task", "workers", "status",
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
    (["plugins", "extra"], "unexpected extra argument"),
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
