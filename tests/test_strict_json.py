"""No number that JSON cannot hold (NaN, infinity) is stored as JSON or written in a json
output: an emulated network without a bandwidth is unlimited, stored as null, and values an
older dsgd stored as `Infinity` come out as null."""

from __future__ import annotations

import json
import sqlite3

import pytest

from conftest import dsgd_in_process, write_spec
from dsgd_cli.results import strictjson
from dsgd_cli.spec.experiments import load_spec, network_model
from dsgd_cli.results.store import MetricRow, Store

LATENCY_ONLY = """
defaults:
  task: {name: logreg}
  workers: 2
  epochs: 1
  steps_per_epoch: 3
experiments:
  - name: a
    network: {latency: 1ms}
"""


def strict_loads(text: str):
    """json.loads that refuses NaN and Infinity, as PostgreSQL and browsers do."""
    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")
    return json.loads(text, parse_constant=refuse)


def test_finite_only_replaces_every_non_finite_float_with_null():
    value = {"a": float("inf"), "b": [1.5, float("nan"), (float("-inf"), 2)], "c": "inf", "d": 3}
    assert strictjson.finite_only(value) == {"a": None, "b": [1.5, None, [None, 2]], "c": "inf", "d": 3}
    assert strict_loads(strictjson.dumps(value)) == {"a": None, "b": [1.5, None, [None, 2]],
                                                     "c": "inf", "d": 3}


def test_a_network_without_bandwidth_is_unlimited_and_stored_as_null(tmp_path):
    (experiment,) = load_spec(write_spec(tmp_path, LATENCY_ONLY))
    assert experiment.config["network"] == {"bytes_per_second": None, "latency_s": 0.001}
    model = network_model(experiment.config)
    assert model.duration(10**12, messages=2) == pytest.approx(0.002)
    # An older run's stored configuration says infinity: the same model.
    older = {"network": {"bytes_per_second": float("inf"), "latency_s": 0.001}}
    assert network_model(older).duration(10**12, messages=2) == pytest.approx(0.002)

    db = tmp_path / "r.db"
    store = Store(str(db))
    run_id = store.create_run("a", {**experiment.config, "extra": [float("nan")]}, None, [])
    with sqlite3.connect(db) as connection:
        (config,) = connection.execute("SELECT config FROM runs").fetchone()
        params = dict(connection.execute("SELECT key, value FROM params WHERE run_id = ?", (run_id,)))
    assert strict_loads(config)["network"] == {"bytes_per_second": None, "latency_s": 0.001}
    assert strict_loads(config)["extra"] == [None]
    assert params["network.bytes_per_second"] == "null"
    assert params["extra"] == "[null]"


@pytest.fixture
def older_db(tmp_path):
    """A database whose run's configuration an older dsgd stored with a bare `Infinity`."""
    db = tmp_path / "old.db"
    store = Store(str(db))
    config = {"name": "a", "workers": 2, "task": {"name": "logreg"}, "optimizer": {"name": "sgd"},
              "aggregator": {"name": "allreduce"}, "compressor": {"name": "none"},
              "network": {"bytes_per_second": 1.0, "latency_s": 0.001}}
    run_id = store.create_run("a", config, None, [])
    store.add_metrics(run_id, [MetricRow("train_loss", 0.5, step=1, epoch=0, rank=0)])
    store.finish_run(run_id, "completed")
    with sqlite3.connect(db) as connection:
        connection.execute("UPDATE runs SET config = replace(config, '\"bytes_per_second\": 1.0', "
                           "'\"bytes_per_second\": Infinity')")
        connection.execute("UPDATE params SET value = 'Infinity' WHERE key = 'network.bytes_per_second'")
    return db


def test_json_outputs_hold_null_for_infinity(older_db):
    exported = dsgd_in_process("export", "1", "--db", str(older_db), "--format", "json",
                               "--config", "network.bytes_per_second")
    assert exported.returncode == 0, exported.stderr
    assert [(r["network.bytes_per_second"], r["metric"], r["value"])
            for r in strict_loads(exported.stdout)] == [(None, "train_loss", 0.5)]

    compared = dsgd_in_process("compare", "--db", str(older_db), "--by",
                               "network.bytes_per_second", "--format", "json")
    assert compared.returncode == 0, compared.stderr
    (row,) = strict_loads(compared.stdout)
    assert row["network.bytes_per_second"] is None and row["train_loss"] == 0.5

