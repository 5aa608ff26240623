"""`dsgd plot` and `dsgd export` on the database of known histories that tests/test_compare.py
fills: the lines, legends and axes of the figure, and the exported rows."""

from __future__ import annotations

import csv
import io
import json

import numpy as np
import pytest

from conftest import dsgd_in_process as dsgd
from dsgd_cli.results.reader import Results
from dsgd_cli.results.plotting import differences, figure, group_lines, legend_labels, run_lines
from test_compare import db  # noqa: F401  (the fixture)
from results_helpers import count_metrics


def test_one_line_per_run_labelled_by_its_experiment(db):
    store = Results(str(db))
    runs = [run for run in store.runs() if run.id in (1, 3, 5)]
    labels = legend_labels(runs)
    assert labels == {1: "base", 3: "q", 5: "gossip"}
    fig = figure(run_lines(store, runs, "test_accuracy", "step"), "test_accuracy", "step", "measured")
    (ax,) = fig.axes
    (legend,) = fig.legends  # beside the axes, never over the curves
    assert [text.get_text() for text in legend.get_texts()] == ["base", "q", "gossip"]
    assert [list(line.get_xdata()) for line in ax.get_lines()] == [[10, 20, 30], [10, 20], [10, 20]]
    assert list(ax.get_lines()[0].get_ydata()) == [0.5, 0.85, 0.8]
    assert len({line.get_marker() for line in ax.get_lines()}) == 3  # a marker of its own each
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("step", "test_accuracy")
    assert ax.get_title() == "test_accuracy against step"


def test_runs_of_one_experiment_are_told_apart_by_what_differs_or_their_id(db):
    runs = [run for run in Results(str(db)).runs() if run.id in (1, 2)]
    assert legend_labels(runs) == {1: "base: seed=0", 2: "base: seed=1"}
    assert differences(runs) == {1: "seed=0", 2: "seed=1"}
    assert set(differences([runs[0], runs[0]]).values()) == {"run 1"}


def test_seconds_and_bytes_axes_say_their_clock_and_unit(db):
    store = Results(str(db))
    runs = [run for run in store.runs() if run.id in (1, 3)]
    timed = figure(run_lines(store, runs, "test_accuracy", "seconds"), "test_accuracy", "seconds",
                   "modeled")
    assert timed.axes[0].get_xlabel() == "modeled seconds"
    assert figure([], "wall_seconds", "step", "measured").axes[0].get_ylabel() == "wall_seconds (measured s)"
    mixed = figure([], "test_accuracy", "seconds", "mixed").axes[0].get_xlabel()
    assert mixed == "seconds (modeled and measured: not comparable)"
    (line,) = run_lines(store, [store.get_run(1)], "test_accuracy", "bytes")
    drawn = figure([line], "test_accuracy", "bytes").axes[0]
    assert drawn.get_xlabel() == "kB sent by all workers"
    assert list(drawn.get_lines()[0].get_xdata()) == pytest.approx([0.1, 0.2, 0.3])
    line.x = line.x * 1e5  # 10, 20 and 30 MB
    drawn = figure([line], "test_accuracy", "bytes").axes[0]
    assert drawn.get_xlabel() == "MB sent by all workers"
    assert list(drawn.get_lines()[0].get_xdata()) == pytest.approx([10, 20, 30])


def test_bytes_on_the_x_axis_are_cumulative_over_all_workers(db):
    store = Results(str(db))
    (line,) = run_lines(store, [store.get_run(1)], "test_accuracy", "bytes")
    # two ranks sending 5 bytes a step: 100 bytes by step 10, 200 by 20, 300 by 30
    assert list(line.x) == [100.0, 200.0, 300.0]


def test_groups_plot_the_mean_with_the_interval_of_the_mean_or_one_std(db):
    store = Results(str(db))
    lines = group_lines(store, store.runs(), ["compressor"], "test_accuracy", "step")
    assert [line.label for line in lines] == ["compressor=none (mean ± 95% CI, 3 runs)",
                                              "compressor=qsgd (mean ± 95% CI, 2 runs)"]
    plain = lines[0]
    assert list(plain.x) == [10, 20, 30]
    # runs 1, 2 and 5 at step 10: 0.5, 0.9, 0.86; at 20: 0.85, 0.84, 0.7; at 30 only run 1
    assert plain.y == pytest.approx([np.mean([0.5, 0.9, 0.86]), np.mean([0.85, 0.84, 0.7]), 0.8])
    at_10 = [0.5, 0.9, 0.86]
    assert plain.std[:2] == pytest.approx([np.std(at_10, ddof=1), np.std([0.85, 0.84, 0.7], ddof=1)])
    half = 4.302652729749464 * np.std(at_10, ddof=1) / np.sqrt(3)  # t(0.975, 2)
    assert (plain.low[0], plain.high[0]) == pytest.approx((np.mean(at_10) - half, np.mean(at_10) + half))
    assert np.isnan(plain.std[2]) and np.isnan(plain.low[2])  # one run: no spread
    fig = figure(lines, "test_accuracy", "step", "measured", ["compressor"])
    (ax,) = fig.axes
    assert len(ax.get_lines()) == 2 and len(ax.collections) == 2  # a shaded band per group
    assert ax.get_title() == "test_accuracy against step, by compressor"
    (spread,) = [line for line in group_lines(store, store.runs(), ["compressor"], "test_accuracy",
                                              "step", band="std") if "none" in line.label]
    assert spread.label == "compressor=none (mean ± 1 std, 3 runs)"
    assert spread.high[0] - spread.y[0] == pytest.approx(np.std(at_10, ddof=1))


def test_plot_writes_a_png_and_draws_in_the_terminal(db, tmp_path):
    out = tmp_path / "curves.png"
    result = dsgd("plot", "--db", str(db), "base", "q", "--x", "seconds", "-o", str(out))
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"wrote {out}\n"
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    result = dsgd("plot", "--db", str(db), "--by", "aggregator", "--metric", "test_accuracy")
    assert result.returncode == 0, result.stderr
    assert "aggregator=allreduce (mean ± 95% CI, 4 runs)" in result.stdout
    assert "aggregator=sgp (1 run)" in result.stdout


@pytest.mark.parametrize("args, message", [
    (["--x", "time"], "--x: expected one of step, epoch, seconds, bytes, got 'time'"),
    (["--metric", "nosuch"], "--metric: none of the 5 selected runs recorded 'nosuch' with a step"),
    (["nosuch"], "'nosuch': no recorded run has this id or experiment name"),
    (["--where", "seed>5"], "no recorded run matches: nothing to plot"),
    (["-o", "/nonexistent/dir/x.png"], "--output /nonexistent/dir/x.png"),
])
def test_plot_errors_are_one_line(db, args, message):
    result = dsgd("plot", "--db", str(db), *args)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and message in result.stderr, result.stderr


def test_export_csv_is_the_long_history_with_the_columns_asked_for(db):
    result = dsgd("export", "--db", str(db), "--where", "compressor.name=qsgd",
                  "-c", "optimizer.lr", "-c", "status", "-m", "test_accuracy")
    assert result.returncode == 0, result.stderr
    rows = list(csv.DictReader(io.StringIO(result.stdout)))
    assert list(rows[0]) == ["run_id", "experiment", "clock", "timing", "optimizer.lr", "status", "metric",
                             "step", "epoch", "rank", "seconds", "value"]
    assert [(r["run_id"], r["optimizer.lr"], r["status"], r["step"], r["value"]) for r in rows] == [
        ("3", "0.05", "completed", "10", "0.7"), ("3", "0.05", "completed", "20", "0.78"),
        ("4", "0.2", "failed", "10", "0.6")]


def test_export_json_and_parquet_hold_every_record(db, tmp_path):
    store = Results(str(db))
    total = sum(count_metrics(store, run.id) for run in store.runs())
    result = dsgd("export", "--db", str(db), "--format", "json")
    records = json.loads(result.stdout)
    assert len(records) == total
    assert records[0] == {"run_id": 1, "experiment": "base", "clock": "measured", "timing": "ok",
                          "metric": "samples_per_second",
                          "step": None, "epoch": None, "rank": None, "seconds": None,
                          "value": 100.0}
    pyarrow_parquet = pytest.importorskip("pyarrow.parquet")
    out = tmp_path / "history.parquet"
    result = dsgd("export", "--db", str(db), "base", "-c", "seed", "-f", "parquet", "-o", str(out))
    assert result.returncode == 0, result.stderr
    table = pyarrow_parquet.read_table(out).to_pylist()
    assert len(table) == count_metrics(store, 1) + count_metrics(store, 2)
    assert {row["seed"] for row in table} == {0, 1}


def test_plot_spec_takes_the_newest_run_of_each_experiment(db, tmp_path):
    from dsgd_cli.commands.plot import newest_of

    runs = Results(str(db)).runs()
    assert [run.id for run in newest_of(runs, ["base", "gossip", "absent"])] == [2, 5]
    spec = tmp_path / "spec.yaml"
    spec.write_text("experiments:\n  - {name: q, task: logreg}\n  - {name: base, task: logreg}\n")
    out = tmp_path / "latest.png"
    result = dsgd("plot", "--db", str(db), "--spec", str(spec), "-o", str(out))
    assert result.returncode == 0, result.stderr
    assert out.exists()
