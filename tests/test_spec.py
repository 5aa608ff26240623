"""The spec loader: defaults, grids, and every class of bad input (exit 2, one line, nothing written)."""

from pathlib import Path

import pytest

from conftest import dsgd, write_spec
from dsgd_cli.spec import load_spec

GOOD = """
defaults:
  task: {name: logreg, features: 4}
  workers: 2
  optimizer: {name: sgd, lr: 0.1, momentum: 0.9}
  network: {bandwidth: 1Gbit, latency: 100us}
experiments:
  - name: plain
    aggregator: {name: allreduce}
  - name: other-optimizer
    optimizer: {name: adam}
  - name: sweep
    aggregator: {name: local_sgd, period: 2}
    grid: {optimizer.lr: [0.01, 0.1], workers: [1, 2]}
"""


def test_defaults_merge_and_grid(tmp_path):
    experiments = load_spec(write_spec(tmp_path, GOOD))
    names = [e.name for e in experiments]
    assert names == ["plain", "other-optimizer", "sweep[optimizer.lr=0.01,workers=1]",
                     "sweep[optimizer.lr=0.01,workers=2]", "sweep[optimizer.lr=0.1,workers=1]",
                     "sweep[optimizer.lr=0.1,workers=2]"]
    plain = experiments[0].config
    assert plain["task"] == {"name": "logreg", "features": 4, "samples": 2048, "data_seed": 0}
    assert plain["optimizer"]["momentum"] == 0.9 and plain["optimizer"]["lr"] == 0.1
    assert plain["compressor"] == {"name": "none"}
    assert plain["network"] == pytest.approx({"bytes_per_second": 1e9 / 8, "latency_s": 1e-4})
    # A section naming another plugin replaces the default's options instead of merging them.
    assert experiments[1].config["optimizer"] == {"name": "adam", "lr": 0.001, "beta1": 0.9,
                                                  "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0}
    sweep = experiments[2].config
    assert sweep["optimizer"]["lr"] == 0.01 and sweep["workers"] == 1
    assert sweep["aggregator"]["period"] == 2 and sweep["optimizer"]["momentum"] == 0.9


def test_grid_over_plugin_names(tmp_path):
    spec = write_spec(tmp_path, """
defaults:
  task: {name: logreg}
experiments:
  - name: compressors
    aggregator: {name: allreduce, error_feedback: true, compressor: {name: topk, ratio: 0.1}}
    grid: {aggregator.compressor.name: [topk, ef_sign]}
  - name: optimizers
    optimizer: {name: sgd, lr: 0.3}
    grid: {optimizer.name: [sgd, adam]}
""")
    topk, ef_sign, sgd, adam = load_spec(spec)
    assert topk.name == "compressors[aggregator.compressor.name=topk]"
    assert topk.config["compressor"] == {"name": "topk", "ratio": 0.1}  # same plugin: kept
    assert ef_sign.config["compressor"] == {"name": "ef_sign"}  # another plugin: its own defaults
    assert ef_sign.config["aggregator"]["error_feedback"] is True
    assert sgd.config["optimizer"]["lr"] == 0.3 and adam.config["optimizer"]["lr"] == 0.001


def test_selection_and_worker_override(tmp_path):
    spec = write_spec(tmp_path, GOOD)
    chosen = load_spec(spec, only=["sweep"], workers=3)
    assert len(chosen) == 4 and {e.workers for e in chosen} == {3}


BAD = [
    ("yaml syntax", "experiments: [\n  - {name: a\n", "invalid YAML: line 2, column 3: expected the node content"),
    ("unknown top-level key", "experiment: []\n", "experiment: unknown key (expected one of defaults, experiments)"),
    ("unknown experiment key", "experiments:\n  - {name: a, task: logreg, epocs: 2}\n",
     "experiments[0].epocs: unknown key"),
    ("unknown plugin", "experiments:\n  - {name: a, task: logreg, aggregator: {name: alreduce}}\n",
     "experiments[0].aggregator.name: unknown aggregator 'alreduce' (installed: "),
    ("unknown option", "experiments:\n  - {name: a, task: logreg, aggregator: {name: local_sgd, perod: 2}}\n",
     "experiments[0].aggregator.perod: unknown option 'perod' (known options: error_feedback, period, sync_buffers)"),
    ("wrong option type", "experiments:\n  - {name: a, task: logreg, aggregator: {name: local_sgd, period: two}}\n",
     "experiments[0].aggregator.period: expected an integer, got 'two'"),
    ("wrong option value", "experiments:\n  - {name: a, task: logreg, optimizer: {name: sgd, lr: -1}}\n",
     "experiments[0].optimizer.lr: expected a value >= 0.0, got -1"),
    ("bad worker count", "experiments:\n  - {name: a, task: logreg, workers: 0}\n",
     "experiments[0].workers: expected an integer between 1 and 1024, got 0"),
    ("workers not a number", "defaults: {workers: many}\nexperiments:\n  - {name: a, task: logreg}\n",
     "experiments[0].workers: expected an integer, got 'many'"),
    ("missing task", "experiments:\n  - {name: a}\n", "experiments[0].task: required"),
    ("bad bandwidth", "experiments:\n  - {name: a, task: logreg, network: {bandwidth: fast}}\n",
     "experiments[0].network.bandwidth: expected a bandwidth"),
    ("straggler rank", "experiments:\n  - {name: a, task: logreg, stragglers: {ranks: [5]}}\n",
     "experiments[0].stragglers.ranks[0]: expected a rank between 0 and 1, got 5"),
    ("duplicate names", "experiments:\n  - {name: a, task: logreg}\n  - {name: a, task: logreg}\n",
     "experiments: duplicate experiment name 'a'"),
    ("empty grid", "experiments:\n  - {name: a, task: logreg, grid: {optimizer.lr: []}}\n",
     "experiments[0].grid.optimizer.lr: expected a non-empty list"),
    ("grid over names", "experiments:\n  - {name: a, task: logreg, grid: {name: [b, c]}}\n",
     "experiments[0].grid.name: grid key must name an experiment key, a plugin option or a plugin section's name"),
    ("cross-field check", "experiments:\n  - {name: a, task: logreg, optimizer: {name: sgd, nesterov: true}}\n",
     "experiments[0].optimizer: nesterov: true needs momentum > 0"),
]


@pytest.mark.parametrize("label, text, expected", BAD, ids=[b[0] for b in BAD])
def test_bad_input_exits_2_with_one_line_and_writes_nothing(tmp_path, label, text, expected):
    spec = tmp_path / "bad.yaml"
    spec.write_text(text)
    db = tmp_path / "results.db"
    result = dsgd("run", str(spec), "--db", str(db))
    assert result.returncode == 2, result.stderr
    message = result.stderr.strip()
    assert "\n" not in message and "Traceback" not in message
    assert message.startswith(f"dsgd: error: {spec}: "), message
    assert expected in message
    assert not db.exists()


def test_missing_spec_file(tmp_path):
    result = dsgd("run", str(tmp_path / "nope.yaml"), "--db", str(tmp_path / "r.db"))
    assert result.returncode == 2
    assert "nope.yaml: cannot read spec: No such file or directory" in result.stderr


def test_unknown_experiment_selected(tmp_path):
    spec = write_spec(tmp_path, GOOD)
    result = dsgd("run", str(spec), "-e", "nothere", "--dry-run")
    assert result.returncode == 2
    assert "no experiment named 'nothere' (the spec has: plain, other-optimizer, sweep[" in result.stderr


def test_dry_run_prints_plan_and_commands(tmp_path):
    spec = write_spec(tmp_path, GOOD)
    result = dsgd("run", str(spec), "--dry-run", "--db", str(tmp_path / "r.db"))
    assert result.returncode == 0, result.stderr
    assert "plain: 2 workers, task logreg, aggregator allreduce" in result.stdout
    assert "torch.distributed.run --standalone --nproc-per-node=2" in result.stdout
    assert result.stdout.count("dsgd_cli.runtime") == 6
    assert not (tmp_path / "r.db").exists()
