"""`dsgd export --format tensorboard|mlflow`: runs with known metric histories, written to each
tracker and read back with the tracker's own reader (TensorBoard's EventAccumulator, MLflow's
client). Each tracker's tests skip where its package is not installed."""

from __future__ import annotations

import os
import sys
from unittest import mock

import pytest

from conftest import dsgd_in_process as dsgd
from dsgd_cli.results.store import MetricRow, Store

LONG_NOTE = "n" * 7000  # longer than MLflow's 6000-character limit on a parameter value


def config(aggregator: str, **extra) -> dict:
    return {"task": {"name": "logreg"}, "optimizer": {"name": "sgd", "lr": 0.05},
            "aggregator": {"name": aggregator}, "compressor": {"name": "none"},
            "workers": 2, "seed": 0, **extra}


# experiment, configuration, status, reason, tags
RUNS = [
    ("allreduce", config("allreduce"), "completed", None, ["baseline"]),
    ("grid[lr=0.1]", config("sgp", compute={"time_scale": 8}, notes=LONG_NOTE, list=[1, 2]),
     "failed", "rank 1 died", []),
    ("local/sgd", config("local_sgd"), "interrupted", None, []),
]


@pytest.fixture(scope="module")
def db(tmp_path_factory):
    path = tmp_path_factory.mktemp("trackers") / "r.db"
    store = Store(str(path))
    for experiment, run_config, status, reason, tags in RUNS:
        run_id = store.create_run(experiment, run_config, "spec.yaml", [])
        store.tag_run(run_id, tags)
        if run_id in (1, 2):
            rows = [MetricRow("wall_seconds", 4.0 * run_id), MetricRow("total_bytes_sent", 300.0)]
            rows += [MetricRow("test_accuracy", 0.25 * step / 10, step=step, epoch=0,
                               seconds=step / 10) for step in (10, 20)]
            rows += [MetricRow("bytes_sent", 10.0 * rank + step, step=step, epoch=0, rank=rank,
                               seconds=step / 10) for step in (10, 20) for rank in (0, 1)]
            store.add_metrics(run_id, rows)
        store.finish_run(run_id, status, reason)
    return path


def export(db, *args: str):
    return dsgd("export", "--db", str(db), *args)


# -- TensorBoard ---------------------------------------------------------------------------------

def accumulator(directory):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulated = EventAccumulator(str(directory), size_guidance={"scalars": 0, "tensors": 0})
    accumulated.Reload()
    return accumulated


def scalars(accumulated, tag) -> list[tuple[int, float]]:
    return [(event.step, pytest.approx(event.value)) for event in accumulated.Scalars(tag)]


def hparams_data(accumulated):
    from tensorboard.plugins.hparams import plugin_data_pb2

    return {tag: plugin_data_pb2.HParamsPluginData.FromString(content)
            for tag, content in accumulated.PluginTagToContent("hparams").items()}


def test_tensorboard_writes_a_run_per_directory_with_scalars_at_their_steps(db, tmp_path):
    pytest.importorskip("tensorboard")
    result = export(db, "--format", "tensorboard", "-o", str(tmp_path / "tb"))
    assert result.returncode == 0, result.stderr
    names = ["run-1-allreduce", "run-2-grid[lr=0.1]", "run-3-local_sgd"]
    assert sorted(p.name for p in (tmp_path / "tb").iterdir()) == names
    assert result.stdout.splitlines() == [f"wrote {tmp_path / 'tb' / name}" for name in names]

    first = accumulator(tmp_path / "tb" / "run-1-allreduce")
    assert sorted(first.Tags()["scalars"]) == ["bytes_sent/rank_0", "bytes_sent/rank_1",
                                               "test_accuracy", "total_bytes_sent",
                                               "wall_seconds"]
    assert scalars(first, "test_accuracy") == [(10, 0.25), (20, 0.5)]
    assert scalars(first, "bytes_sent/rank_1") == [(10, 20.0), (20, 30.0)]
    assert scalars(first, "wall_seconds") == [(0, 4.0)]  # a whole-run value: step 0
    # the events' wall time: the run's start plus the value's seconds on the run's clock
    times = [event.wall_time for event in first.Scalars("test_accuracy")]
    assert times[1] - times[0] == pytest.approx(1.0)
    assert accumulator(tmp_path / "tb" / "run-3-local_sgd").Tags()["scalars"] == []


def test_tensorboard_writes_the_configuration_as_text_and_hparams(db, tmp_path):
    pytest.importorskip("tensorboard")
    assert export(db, "-f", "tensorboard", "-o", str(tmp_path)).returncode == 0
    second = accumulator(tmp_path / "run-2-grid[lr=0.1]")
    text = second.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "    experiment: grid[lr=0.1]" in text and "    clock: modeled" in text
    assert "      time_scale: 8" in text

    data = hparams_data(second)
    hparams = data["_hparams_/session_start_info"].session_start_info.hparams
    assert hparams["optimizer.lr"].number_value == 0.05
    assert hparams["compute.time_scale"].number_value == 8
    assert hparams["aggregator.name"].string_value == "sgp"
    assert hparams["list"].string_value == "[1, 2]"
    assert hparams["dsgd.clock"].string_value == "modeled"
    assert hparams["dsgd.run_id"].number_value == 2
    metrics = data["_hparams_/experiment"].experiment.metric_infos
    assert sorted(m.name.tag for m in metrics) == ["total_bytes_sent", "wall_seconds"]

    def status(run_dir):
        return hparams_data(accumulator(tmp_path / run_dir))[
            "_hparams_/session_end_info"].session_end_info.status

    from tensorboard.plugins.hparams import api_pb2
    assert status("run-1-allreduce") == api_pb2.STATUS_SUCCESS
    assert status("run-2-grid[lr=0.1]") == api_pb2.STATUS_FAILURE
    assert status("run-3-local_sgd") == api_pb2.STATUS_UNKNOWN


def test_tensorboard_export_again_skips_the_runs_already_there(db, tmp_path):
    pytest.importorskip("tensorboard")
    assert export(db, "-f", "tensorboard", "-o", str(tmp_path), "allreduce").returncode == 0
    result = export(db, "-f", "tensorboard", "-o", str(tmp_path), "-m", "test_accuracy")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0] == (
        f"skipped run 1: {tmp_path / 'run-1-allreduce'} already has event files")
    assert len(list((tmp_path / "run-1-allreduce").iterdir())) == 1
    assert accumulator(tmp_path / "run-2-grid[lr=0.1]").Tags()["scalars"] == ["test_accuracy"]


# -- MLflow --------------------------------------------------------------------------------------

@pytest.fixture
def file_store(monkeypatch):
    """MLflow 3 opens its file store (a directory) only with MLFLOW_ALLOW_FILE_STORE set:
    export sets it for itself, the tests' reader sets it for its own."""
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)


def reading_file_store():
    return mock.patch.dict(os.environ, MLFLOW_ALLOW_FILE_STORE="true")


def mlflow_runs(uri: str, experiment: str = "dsgd") -> dict:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    found = client.get_experiment_by_name(experiment)
    runs = client.search_runs([found.experiment_id])
    return {int(run.data.tags["dsgd.run_id"]): run for run in runs}, client


def check_mlflow_runs(uri: str) -> None:
    from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

    runs, client = mlflow_runs(uri)
    assert sorted(runs) == [1, 2, 3]
    assert [runs[i].info.run_name for i in (1, 2, 3)] == ["allreduce", "grid[lr=0.1]", "local/sgd"]
    assert [runs[i].info.status for i in (1, 2, 3)] == ["FINISHED", "FAILED", "KILLED"]

    second = runs[2]
    assert second.data.params["optimizer.lr"] == "0.05"
    assert second.data.params["compute.time_scale"] == "8"
    assert second.data.params["aggregator.name"] == "sgp"
    notes = second.data.params["notes"]
    assert len(notes) == MAX_PARAM_VAL_LENGTH and notes.endswith("n...")
    tags = second.data.tags
    assert (tags["dsgd.experiment"], tags["dsgd.clock"], tags["dsgd.status"],
            tags["dsgd.reason"]) == ("grid[lr=0.1]", "modeled", "failed", "rank 1 died")
    assert runs[1].data.tags["dsgd.tags"] == "baseline"
    assert runs[1].data.tags["dsgd.clock"] == "measured"
    # the run's start and end are real, its metrics' times modeled: the tags say so
    assert "metric times are the start plus modeled seconds" in tags["dsgd.times"]
    assert "measured seconds" in runs[1].data.tags["dsgd.times"]

    def history(run, key):
        return [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]

    assert history(second, "test_accuracy") == [(10, 0.25), (20, 0.5)]
    assert history(second, "bytes_sent/rank_1") == [(10, 20.0), (20, 30.0)]
    assert history(second, "wall_seconds") == [(0, 8.0)]
    assert sorted(second.data.metrics) == ["bytes_sent/rank_0", "bytes_sent/rank_1",
                                           "test_accuracy", "total_bytes_sent", "wall_seconds"]
    assert runs[3].data.metrics == {}


def test_mlflow_logs_each_run_to_a_directory(db, tmp_path, file_store):
    pytest.importorskip("mlflow")
    uri = str(tmp_path / "mlruns")
    result = export(db, "--format", "mlflow", "-o", uri)
    assert result.returncode == 0, result.stderr
    assert "MLFLOW_ALLOW_FILE_STORE" not in os.environ  # set for the export only
    assert [line.split(" (")[0] for line in result.stdout.splitlines()] == [
        f"logged run {i} to {uri}" for i in (1, 2, 3)]
    with reading_file_store():
        check_mlflow_runs(uri)

    again = export(db, "--format", "mlflow", "-o", uri, "allreduce")
    assert again.stdout.splitlines() == [f"skipped run 1: already in {uri}"]
    with reading_file_store():
        assert len(mlflow_runs(uri)[0]) == 3


def test_mlflow_names_its_experiment_from_mlflows_variable(db, tmp_path, file_store, monkeypatch):
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "study")
    uri = (tmp_path / "mlruns").as_uri()  # a file: URI
    assert export(db, "-f", "mlflow", "-o", uri, "allreduce").returncode == 0
    with reading_file_store():
        assert sorted(mlflow_runs(uri, "study")[0]) == [1]


def test_mlflow_logs_each_run_to_sqlite(db, tmp_path, file_store):
    pytest.importorskip("mlflow")
    pytest.importorskip("alembic")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    result = export(db, "--format", "mlflow", "-o", uri)
    assert result.returncode == 0, result.stderr
    check_mlflow_runs(uri)


# -- without the extras, and bad input -----------------------------------------------------------

def without_package(monkeypatch, package: str) -> None:
    """Make `package` fail to import, as if it were not installed: torch's TensorBoard writer,
    which imports it, is unloaded, to be imported again (and fail) when asked for."""
    for name in list(sys.modules):
        if name.startswith((f"{package}.", "torch.utils.tensorboard")):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, package, None)


@pytest.mark.parametrize("fmt", ["tensorboard", "mlflow"])
def test_a_missing_extra_is_one_line_naming_the_install(db, tmp_path, monkeypatch, fmt):
    without_package(monkeypatch, fmt)
    result = export(db, "-f", fmt, "-o", str(tmp_path / "out"))
    assert result.returncode == 2, result.stderr
    assert result.stderr == (f"dsgd: error: --format {fmt} needs the {fmt} package: "
                             f"pip install 'dsgd[{fmt}]'\n")
    assert not (tmp_path / "out").exists()


def test_an_interrupt_caught_by_mlflow_still_exits_as_interrupted(db, tmp_path, file_store,
                                                                   monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    from dsgd_cli.errors import Interrupted

    def retrying_a_server(*args, **kwargs):  # as MLflow's HTTP client does on SIGTERM
        try:
            raise Interrupted("SIGTERM", 143)
        except Exception as error:
            raise MlflowException(f"API request failed with exception {error}")

    monkeypatch.setattr(MlflowClient, "get_experiment_by_name", retrying_a_server)
    result = export(db, "-f", "mlflow", "-o", str(tmp_path))
    assert result.returncode == 143, result.stderr
    assert result.stderr == "dsgd: interrupted\n"


def test_sqlite_without_alembic_names_the_missing_package(db, tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    for name in list(sys.modules):  # mlflow's SQL store imports alembic when first loaded
        if name.startswith("mlflow"):
            monkeypatch.delitem(sys.modules, name)
    without_package(monkeypatch, "alembic")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    result = export(db, "-f", "mlflow", "-o", uri)
    assert result.returncode == 2, result.stderr
    assert result.stderr == (f"dsgd: error: --format mlflow: {uri} needs the alembic package: "
                             "pip install 'dsgd[mlflow]'\n")


@pytest.mark.parametrize("args, message", [
    (["-f", "tensorboard"], "--format tensorboard: give the directory with -o"),
    (["-f", "mlflow"], "--format mlflow: give the tracking URI with -o"),
    (["-f", "mlflow", "-o", "x", "-c", "seed"], "--config: --format mlflow writes the whole"),
    (["-f", "tensorboardx"], "--format: expected one of csv, json, parquet, tensorboard, mlflow"),
])
def test_bad_tracker_arguments_exit_2_in_one_line(db, args, message):
    result = export(db, *args)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and message in result.stderr, result.stderr


@pytest.mark.parametrize("fmt, target", [("tensorboard", "{file}/tb"), ("mlflow", "{file}/mlruns"),
                                         ("mlflow", "sqlite:///{file}/mlflow.db")])
def test_a_target_that_cannot_be_made_exits_2(db, tmp_path, file_store, fmt, target):
    pytest.importorskip(fmt)
    (tmp_path / "f").write_text("")
    target = target.format(file=tmp_path / "f")
    result = export(db, "-f", fmt, "-o", target)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith(f"dsgd: error: --output {target}: "), result.stderr
    assert result.stderr.count("\n") == 1, result.stderr


def test_tensorboard_into_a_file_exits_2(db, tmp_path):
    pytest.importorskip("tensorboard")
    (tmp_path / "f").write_text("")
    result = export(db, "-f", "tensorboard", "-o", str(tmp_path / "f"))
    assert result.returncode == 2
    assert "not a directory" in result.stderr and result.stderr.count("\n") == 1
