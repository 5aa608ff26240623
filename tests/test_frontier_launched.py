"""The issue-50 plugins through a real `dsgd run` (2 workers on logreg, 12 steps): the runtime
builds them from a spec, records their resolved options, and counts their bytes; DeMo refuses
an optimizer other than plain SGD with one line. Their arithmetic is checked against the
definitions in test_demo.py, test_sparseloco.py, test_desloc.py and test_muon.py."""

from __future__ import annotations

import pytest

from conftest import dsgd_in_process, write_spec
from dsgd_cli.results.store import Store

SPEC = """
defaults:
  task: {name: logreg, features: 8, samples: 512}
  workers: 2
  epochs: 1
  steps_per_epoch: 12
  batch_size: 16
  seed: 0
  optimizer: {name: adamw, lr: 0.01}
experiments:
  - name: demo
    optimizer: {name: sgd, lr: 0.01}
    aggregator: {name: demo, chunk: 4, topk: 2}
  - name: sparseloco
    aggregator: {name: sparseloco, period: 4, chunk: 4, topk: 1}
  - name: desloc
    aggregator: {name: desloc, period: 2}
  - name: muloco
    optimizer: {name: muon, lr: 0.02}
    aggregator: {name: diloco, period: 4}
"""


@pytest.mark.slow  # each plugin's own reference and resume tests run in the default suite
def test_the_frontier_plugins_run_and_record_their_options(tmp_path):
    db = tmp_path / "r.db"
    result = dsgd_in_process("run", str(write_spec(tmp_path, SPEC)), "--db", str(db))
    assert result.returncode == 0, result.stdout + result.stderr
    runs = {run.experiment: run for run in Store(str(db)).runs()}
    assert all(run.status == "completed" for run in runs.values()), runs
    assert runs["desloc"].config["aggregator"]["first_moment_period"] == 6
    assert runs["desloc"].config["aggregator"]["second_moment_period"] == 12
    assert runs["sparseloco"].config["aggregator"]["topk"] == 1
    assert runs["muloco"].config["optimizer"]["name"] == "muon"
    for run in runs.values():
        totals = {summary.name: summary.final for summary in run.summaries}
        assert totals["total_bytes_sent"] > 0, run.experiment


def test_demo_with_adamw_fails_the_run_in_one_line(tmp_path):
    spec = write_spec(tmp_path, SPEC.split("experiments:")[0] + """
experiments:
  - name: demo
    aggregator: {name: demo}
""")
    result = dsgd_in_process("run", str(spec), "--db", str(tmp_path / "r.db"))
    assert result.returncode != 0
    assert "demo steps with sign-SGD through the experiment's optimizer" in result.stdout + result.stderr
