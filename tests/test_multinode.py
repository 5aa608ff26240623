"""Runs over several machines, played by two `dsgd run` launchers on loopback that meet in one
torchrun c10d rendezvous: the run is recorded once, by node rank 0, with the metrics of every
worker of every node."""

from __future__ import annotations

import socket
import subprocess
import sys
import tempfile

import pytest

from conftest import dsgd_in_process, write_spec
from dsgd_cli.results.store import Store

SPEC = """
    defaults: {{task: logreg, workers: 4, epochs: 1, steps_per_epoch: 6, log_interval: 2}}
    launch: {{nnodes: 2, rdzv_endpoint: "127.0.0.1:{port}", rdzv_timeout: {timeout}}}
    experiments:
      - {{name: allreduce}}
      - {{name: wagma, aggregator: {{name: wagma}}}}
"""


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _start(spec, db, node_rank: int, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "dsgd_cli", "run", str(spec), "--db", str(db),
         "--node-rank", str(node_rank), *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tempfile.gettempdir())


# In the default suite (about 10 s): the only guard of the path users take when they outgrow one
# machine. A plan that lost the run id hung both launchers here until their timeout.
def test_two_nodes_record_one_run_with_every_ranks_metrics(tmp_path):
    spec = write_spec(tmp_path, SPEC.format(port=_free_port(), timeout=120))
    db = tmp_path / "r.db"
    nodes = [_start(spec, db, rank) for rank in (1, 0)]  # the order they start in is no matter
    try:
        outputs = [node.communicate(timeout=300) for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    for node, (stdout, stderr) in zip(nodes, outputs):
        assert node.returncode == 0, stdout + stderr
    store = Store(str(db))
    runs = store.runs()
    assert [(r.experiment, r.status, r.workers) for r in runs] == [
        ("allreduce", "completed", 4), ("wagma", "completed", 4)]
    for run in runs:
        assert run.config["nnodes"] == 2
        losses = store.metric_history(run.id, "train_loss")
        assert {m.rank for m in losses} == {0, 1, 2, 3}
        assert sorted((m.rank, m.step) for m in losses) == [
            (rank, step) for rank in range(4) for step in (2, 4, 6)]
        # The run-level metrics came from whichever node has global rank 0; the summaries
        # include them either way.
        assert {"wall_seconds", "test_accuracy", "train_loss"} <= {s.name for s in run.summaries}


@pytest.mark.slow  # waits out the rendezvous timeout; CI runs -m slow
def test_a_node_that_never_joins_fails_the_run_within_the_rendezvous_timeout(tmp_path):
    port = _free_port()
    spec = write_spec(tmp_path, SPEC.format(port=port, timeout=2))  # seconds the test waits
    db = tmp_path / "r.db"
    node = _start(spec, db, 0, "-e", "allreduce")
    stdout, stderr = node.communicate(timeout=300)
    assert node.returncode == 1, stdout + stderr
    (run,) = Store(str(db)).runs()
    assert (run.status, run.failed_rank) == ("failed", None)
    assert run.reason == (f"rendezvous at 127.0.0.1:{port} timed out: not all 2 nodes joined "
                          "within 2 s")
    assert stderr.strip().splitlines()[-1].endswith(run.reason)


@pytest.mark.parametrize("launch,args,message", [
    ('{nnodes: 3, rdzv_endpoint: "h:1"}', [],
     "defaults.workers: 4 workers cannot be split evenly over 3 nodes"),
    ('{nnodes: 2, rdzv_endpoint: "h:1"}', ["--node-rank", "2"],
     "launch.node_rank: expected a node rank below nnodes (2), got 2"),
    ("{nnodes: 2}", [], "launch.rdzv_endpoint: expected HOST:PORT where the nodes meet, got None"),
    ('{nnodes: 2, rdzv_endpoint: "h:1", hosts: 2}', [], "launch.hosts: unknown key"),
    ("{}", ["--nnodes", "2", "--rdzv-endpoint", "nohost"],
     "launch.rdzv_endpoint: expected HOST:PORT where the nodes meet, got 'nohost'"),
])
def test_a_bad_launch_is_one_line_and_exit_2(tmp_path, launch, args, message):
    spec = write_spec(tmp_path, f"""
        defaults: {{task: logreg, workers: 4}}
        launch: {launch}
        experiments: [{{name: a}}]
    """)
    result = dsgd_in_process("run", str(spec), "--dry-run", *args)
    assert result.returncode == 2, result.stdout
    assert len(result.stderr.splitlines()) == 1 and message in result.stderr, result.stderr
