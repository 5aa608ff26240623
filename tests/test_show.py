"""`dsgd show`: one run in the units people read."""

from __future__ import annotations

from conftest import dsgd_in_process as dsgd
from dsgd_cli.results.store import MetricRow, Store


def test_show_reads_as_people_write_numbers_and_bests_only_where_they_mean_something(tmp_path):
    db = tmp_path / "r.db"
    store = Store(str(db))
    config = {"task": {"name": "logreg"}, "aggregator": {"name": "allreduce"},
              "compressor": {"name": "none"}, "optimizer": {"name": "sgd", "lr": 0.1},
              "workers": 2, "network": {"bandwidth": 1.25e9, "latency_s": 100 * 1e-6}}
    assert config["network"]["latency_s"] == 9.999999999999999e-05  # how the parser reads 100us
    run_id = store.create_run("net", config, None, [])
    store.add_metrics(run_id, [
        MetricRow("total_bytes_sent", 60987620.0), MetricRow("wall_seconds", 4.0123),
        *[MetricRow("bytes_sent", value, step=step, epoch=0, seconds=1.0)
          for step, value in ((1, 1000.0), (2, 500.0))],
        *[MetricRow("test_accuracy", value, step=step, epoch=0, seconds=1.0)
          for step, value in ((1, 0.5), (2, 0.75))],
    ])
    store.finish_run(run_id, "interrupted", "interrupted by SIGINT")
    out = dsgd("show", str(run_id), "--db", str(db))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "status: interrupted by SIGINT" in lines
    assert "  latency_s: 0.0001" in lines, out.stdout
    metric_rows = {line.split()[0]: line.split()[1:] for line in lines[lines.index("metrics:") + 3:]}
    assert metric_rows["total_bytes_sent"] == ["61", "MB"]
    assert metric_rows["wall_seconds"] == ["4.01"]
    assert metric_rows["bytes_sent"] == ["500", "B"]  # no best: fewer bytes in a step is no record
    assert metric_rows["test_accuracy"] == ["0.7500", "0.7500"]


def test_a_failure_reason_keeps_its_status_word():
    from dsgd_cli.commands.runs import _status_line

    assert _status_line("failed", "rank 1: exited with code 3") == "failed (rank 1: exited with code 3)"
    assert _status_line("completed", None) == "completed"
