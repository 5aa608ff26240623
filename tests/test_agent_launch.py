"""On one machine dsgd's own agent starts the workers through the fork server, which prepares
them (worker/preload.py); torchrun with a relay per rank remains (`DSGD_LAUNCHER=torchrun`).
Whatever starts them, a run computes the same: the same recorded metrics and, on the CPU,
every worker's final parameters bit for bit."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import write_spec

# Metrics of what was computed and sent; times (step_seconds, comm_seconds, ...) differ.
COMPUTED = ("train_loss", "test_loss", "test_accuracy", "bytes_sent", "bytes_received",
            "total_bytes_sent", "lr")

SPEC = """
defaults:
  task: {{name: logreg, samples: 512}}
  workers: {workers}
  epochs: 1
  steps_per_epoch: 6
  batch_size: 8
  log_interval: 2
  save_dir: {save_dir}
experiments:
  - {{name: allreduce-qsgd, aggregator: {{name: allreduce, compressor: {{name: qsgd, levels: 4}}}}}}
  - {{name: sgp, aggregator: sgp, optimizer: {{name: sgd, lr: 0.1, momentum: 0.9}}}}
"""


def _run(tmp_path: Path, label: str, workers: int, env: dict[str, str]) -> tuple[list, dict]:
    """`dsgd run` of SPEC: its computed metrics, and every worker's saved parameters."""
    save_dir = tmp_path / f"models-{label}"
    spec = write_spec(tmp_path, SPEC.format(workers=workers, save_dir=save_dir),
                      name=f"spec-{label}.yaml")
    db = tmp_path / f"{label}.db"
    done = subprocess.run([sys.executable, "-m", "dsgd_cli", "run", str(spec), "--db", str(db)],
                          env={**os.environ, **env}, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    with sqlite3.connect(db) as connection:
        metrics = connection.execute(
            "select r.experiment, m.name, m.step, m.rank, m.value from metrics m join runs r "
            f"on r.id = m.run_id where m.name in ({','.join('?' * len(COMPUTED))}) "
            "order by r.experiment, m.name, m.step, m.rank", COMPUTED).fetchall()
    models = {path.relative_to(save_dir).as_posix(): torch.load(path, weights_only=True)
              for path in sorted(save_dir.rglob("rank*.pt"))}
    return metrics, models


def _identical(tmp_path: Path, workers: int) -> None:
    agent = _run(tmp_path, "agent", workers, {})
    relays = _run(tmp_path, "torchrun", workers, {"DSGD_LAUNCHER": "torchrun",
                                                  "DSGD_PRELOAD": "0"})
    (agent_metrics, agent_models), (relay_metrics, relay_models) = agent, relays
    assert len(agent_metrics) > 0 and agent_metrics == relay_metrics
    assert sorted(agent_models) == sorted(relay_models)
    assert len(agent_models) == 2 * workers
    for name, state in agent_models.items():
        for key, tensor in state.items():
            assert torch.equal(tensor, relay_models[name][key]), (name, key)


@pytest.mark.slow  # 30 s; every other launched test goes through the agent (CI runs -m slow)
def test_the_agent_and_torchrun_compute_the_same_runs(tmp_path):
    _identical(tmp_path, workers=3)


@pytest.mark.slow
def test_the_agent_and_torchrun_compute_the_same_runs_at_64_workers(tmp_path):
    _identical(tmp_path, workers=64)


def test_a_large_launch_raises_the_open_file_limit_it_needs():
    """A soft limit of 1,024 open files (common) would stop the fork server at about a
    thousand connections: the launch raises it, within the hard limit, before the server
    starts (the server and the workers inherit it)."""
    import resource

    from dsgd_cli.launch.agent import raise_descriptor_limit

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
        raise_descriptor_limit(100)
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == min(4 * 100 + 256, hard)
        raise_descriptor_limit(10)  # never lowered
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == min(4 * 100 + 256, hard)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
