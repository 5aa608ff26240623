"""`dsgd export` never writes through a link another user planted where it writes, as
`save_dir` does not: a file is written beside the output and renamed over it (a rename replaces
a link, never follows it), and a run's TensorBoard directory that is a link is refused."""

from __future__ import annotations

import json
import os

import pytest

from conftest import dsgd_in_process as dsgd
from dsgd_cli.results.store import MetricRow, Store

CONFIG = {"task": {"name": "logreg"}, "aggregator": {"name": "allreduce"},
          "compressor": {"name": "none"}, "optimizer": {"name": "sgd", "lr": 0.1}, "workers": 2}
PRECIOUS = "another user's file: must not change\n"


@pytest.fixture(scope="module")
def db(tmp_path_factory):
    """Runs 1 and 2, each with two recorded accuracies."""
    path = tmp_path_factory.mktemp("export-links") / "r.db"
    store = Store(str(path))
    for experiment in ("first", "second"):
        run_id = store.create_run(experiment, CONFIG, None, [])
        store.add_metrics(run_id, [MetricRow("test_accuracy", 0.25 * step, step=step, epoch=0,
                                             seconds=float(step)) for step in (1, 2)])
        store.finish_run(run_id, "completed")
    return path


@pytest.fixture
def planted(tmp_path):
    """`out/` with a link planted as out/exported pointing at another user's file."""
    victim = tmp_path / "victim.txt"
    victim.write_text(PRECIOUS)
    out = tmp_path / "out"
    out.mkdir()
    (out / "exported").symlink_to(victim)
    return out / "exported", victim


def read_csv(path) -> list[list[str]]:
    return [line.split(",") for line in path.read_text().splitlines()]


def read_json(path) -> list[dict]:
    return json.loads(path.read_text())


def read_parquet(path) -> list[dict]:
    import pyarrow.parquet

    return pyarrow.parquet.read_table(path).to_pylist()


# what each format's file holds, read back: the 4 records of runs 1 and 2 (csv: and a header)
READERS = {"csv": read_csv, "json": read_json, "parquet": read_parquet}


@pytest.mark.parametrize("fmt", list(READERS))
def test_a_planted_output_link_is_replaced_and_its_target_untouched(db, planted, fmt):
    if fmt == "parquet":
        pytest.importorskip("pyarrow")
    output, victim = planted
    result = dsgd("export", "--db", str(db), "-f", fmt, "-o", str(output))
    assert result.returncode == 0, result.stderr
    assert victim.read_text() == PRECIOUS
    assert not output.is_symlink() and output.is_file()
    records = READERS[fmt](output)
    assert len(records) == 4 + (fmt == "csv")
    if fmt == "csv":
        assert records[0][:2] == ["run_id", "experiment"]
        assert [row[0] for row in records[1:]] == ["1", "1", "2", "2"]
    else:
        assert [record["run_id"] for record in records] == [1, 1, 2, 2]
    assert os.listdir(output.parent) == [output.name]  # no temporary file left


def test_an_existing_output_file_is_replaced_whole(db, tmp_path):
    output = tmp_path / "e.csv"
    output.write_text("an older, longer export\n" * 100)
    result = dsgd("export", "--db", str(db), "-o", str(output))
    assert result.returncode == 0, result.stderr
    assert len(read_csv(output)) == 5
    assert os.listdir(tmp_path) == ["e.csv"]


def test_an_output_that_is_a_directory_is_refused_on_one_line(db, tmp_path):
    result = dsgd("export", "--db", str(db), "-o", str(tmp_path))
    assert result.returncode == 2
    assert result.stderr == f"dsgd: error: --output {tmp_path}: is a directory; name the file to write\n"
    assert os.listdir(tmp_path) == []


def test_a_planted_tensorboard_run_directory_link_is_refused(db, tmp_path):
    pytest.importorskip("tensorboard")
    elsewhere = tmp_path / "elsewhere"  # where the planted link points: another user's
    elsewhere.mkdir()
    target = tmp_path / "tb"
    target.mkdir()
    (target / "run-2-second").symlink_to(elsewhere, target_is_directory=True)
    result = dsgd("export", "--db", str(db), "-f", "tensorboard", "-o", str(target))
    assert result.returncode == 2, result.stderr
    assert result.stderr == (f"dsgd: error: --output: the run's directory {target}/run-2-second "
                             "is a symbolic link, not a directory: refused\n")
    assert os.listdir(elsewhere) == []
    assert sorted(os.listdir(target)) == ["run-2-second"]  # refused before run 1 was written


def test_tensorboard_run_directories_are_real_directories(db, tmp_path):
    pytest.importorskip("tensorboard")
    target = tmp_path / "tb"
    result = dsgd("export", "--db", str(db), "-f", "tensorboard", "-o", str(target))
    assert result.returncode == 0, result.stderr
    for name in ("run-1-first", "run-2-second"):
        run_dir = target / name
        assert run_dir.is_dir() and not run_dir.is_symlink()
        assert any(entry.startswith("events.out.tfevents.") for entry in os.listdir(run_dir))
