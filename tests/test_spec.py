"""The spec loader: defaults, grids, and every class of bad input (exit 2, one line, nothing written)."""

from pathlib import Path

import pytest

from conftest import dsgd, dsgd_in_process, write_spec
from dsgd_cli.spec import registry
from dsgd_cli.spec.experiments import load_spec

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


def test_plugin_sections_are_the_configs_plugins(tmp_path):
    """PLUGIN_SECTIONS (whose plugin versions the launcher records with a run) is every section
    of a resolved config that names a plugin, one per registry kind."""
    from dsgd_cli.spec.experiments import PLUGIN_SECTIONS

    assert sorted(PLUGIN_SECTIONS) == sorted(registry.KINDS)
    for experiment in load_spec(write_spec(tmp_path, GOOD)):
        named = [key for key, value in experiment.config.items()
                 if isinstance(value, dict) and "name" in value]
        assert sorted(named) == sorted(PLUGIN_SECTIONS)


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


def test_set_changes_every_experiment_and_wins_over_spec_and_grid(tmp_path):
    from dsgd_cli.spec.specfile import parse_set

    spec = write_spec(tmp_path, GOOD)
    changed = load_spec(spec, overrides=[parse_set("epochs=2"), parse_set("optimizer.lr=0.25")])
    assert len(changed) == 6
    assert {e.config["epochs"] for e in changed} == {2}
    assert {e.config["optimizer"]["lr"] for e in changed} == {0.25}  # the grid's values too
    assert parse_set("optimizer={name: adam, lr: 0.001}") == ("optimizer", {"name": "adam", "lr": 0.001})
    assert parse_set("aggregator.topology = ring") == ("aggregator.topology", "ring")


@pytest.mark.parametrize("sets, expected", [
    # errors in a --set value name the --set key, not the spec (tests/test_set_values.py)
    (["optimizer.lrr=0.1"], "dsgd: error: --set optimizer.lrr: unknown option 'lrr'"),
    (["epochs=-1"], "dsgd: error: --set epochs: expected an integer between 1"),
    (["epochs"], "dsgd: error: --set: expected KEY=VALUE, e.g. optimizer.lr=0.1, got 'epochs'"),
    (["epochs=[1"], "dsgd: error: --set epochs: invalid YAML: line 1, column 3: "),
    (["name=x"], "--set name: --set key must name an experiment key, a plugin option"),
])
def test_a_bad_set_is_one_line_exit_2_and_runs_nothing(tmp_path, sets, expected):
    spec = write_spec(tmp_path, GOOD)
    args = [part for text in sets for part in ("--set", text)]
    result = dsgd_in_process("run", str(spec), "--db", str(tmp_path / "r.db"), *args)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and expected in result.stderr, result.stderr
    assert not (tmp_path / "r.db").exists()


def test_set_shows_in_the_dry_run(tmp_path):
    spec = write_spec(tmp_path, GOOD)
    result = dsgd_in_process("run", str(spec), "--dry-run", "--set", "optimizer.lr=0.125")
    assert result.returncode == 0, result.stderr
    options = [line for line in result.stdout.splitlines() if "optimizer options:" in line]
    assert len(options) == 6 and all("lr=0.125," in line for line in options), result.stdout


BAD = [
    ("yaml syntax", "experiments: [\n  - {name: a\n", "invalid YAML: line 2, column 3: expected the node content"),
    ("unknown top-level key", "experiment: []\n", "experiment: unknown key (expected one of defaults, experiments, launch)"),
    ("unknown experiment key", "experiments:\n  - {name: a, task: logreg, epocs: 2}\n",
     "experiments[0].epocs: unknown key"),
    ("unknown plugin", "experiments:\n  - {name: a, task: logreg, aggregator: {name: alreduce}}\n",
     "experiments[0].aggregator.name: unknown aggregator 'alreduce' (did you mean 'allreduce'? installed: "),
    ("unknown option", "experiments:\n  - {name: a, task: logreg, aggregator: {name: local_sgd, perod: 2}}\n",
     "experiments[0].aggregator.perod: unknown option 'perod' (known options: error_feedback, period, sync_buffers)"),
    ("wrong option type", "experiments:\n  - {name: a, task: logreg, aggregator: {name: local_sgd, period: two}}\n",
     "experiments[0].aggregator.period: expected an integer, got 'two'"),
    ("wrong option value", "experiments:\n  - {name: a, task: logreg, optimizer: {name: sgd, lr: -1}}\n",
     "experiments[0].optimizer.lr: expected a value >= 0.0, got -1"),
    ("bad worker count", "experiments:\n  - {name: a, task: logreg, workers: 0}\n",
     "experiments[0].workers: expected an integer between 1 and 1024, got 0"),
    ("workers not a number", "defaults: {workers: many}\nexperiments:\n  - {name: a, task: logreg}\n",
     "defaults.workers: expected an integer, got 'many'"),
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
    """In this process (`dsgd_cli.cli.main`, the same exit code and output); the next test
    checks the same through a real `dsgd` process for one of them."""
    check_bad_input(tmp_path, text, expected, dsgd_in_process)


# slow: test_bad_input_exits_2_with_one_line_and_writes_nothing[yaml syntax] (default) checks the
# same input in process; a bad spec's exit 2 and one line from a real `dsgd` process:
# test_checks_before_launch and test_early_start (default)
@pytest.mark.slow
def test_bad_input_exits_2_from_a_real_process(tmp_path):
    label, text, expected = BAD[0]
    check_bad_input(tmp_path, text, expected, dsgd)


def check_bad_input(tmp_path, text, expected, run):
    spec = tmp_path / "bad.yaml"
    spec.write_text(text)
    db = tmp_path / "results.db"
    result = run("run", str(spec), "--db", str(db))
    assert result.returncode == 2, result.stderr
    message = result.stderr.strip()
    assert "\n" not in message and "Traceback" not in message
    assert message.startswith(f"dsgd: error: {spec}: "), message
    assert expected in message
    assert not db.exists()


def test_missing_spec_file(tmp_path):
    result = dsgd_in_process("run", str(tmp_path / "nope.yaml"), "--db", str(tmp_path / "r.db"))
    assert result.returncode == 2
    assert "nope.yaml: cannot read spec: No such file or directory" in result.stderr


def test_unknown_experiment_selected(tmp_path):
    spec = write_spec(tmp_path, GOOD)
    result = dsgd_in_process("run", str(spec), "-e", "nothere", "--dry-run")
    assert result.returncode == 2
    assert "no experiment named 'nothere' (the spec has: plain, other-optimizer, sweep[" in result.stderr


def test_dry_run_prints_plan_and_commands(tmp_path):
    spec = write_spec(tmp_path, GOOD)
    result = dsgd_in_process("run", str(spec), "--dry-run", "--db", str(tmp_path / "r.db"))
    assert result.returncode == 0, result.stderr
    assert "plain: 2 workers, task logreg, aggregator allreduce" in result.stdout
    # On one machine dsgd's agent starts the workers: no torchrun command is shown
    assert "2 workers forked by dsgd's agent" in result.stdout
    assert "torch.distributed.run" not in result.stdout
    # One line per experiment, one starter per launch: `plain` and `other-optimizer` share
    # one; the grid's worker counts alternate (1, 2, 1, 2), so each point has its own.
    assert result.stdout.count(" workers, task logreg, ") == 6
    assert result.stdout.count("forked by dsgd's agent") == 5


def test_dry_run_shows_torchrun_where_torchrun_starts_the_workers(tmp_path, monkeypatch):
    monkeypatch.setenv("DSGD_LAUNCHER", "torchrun")
    spec = write_spec(tmp_path, GOOD)
    result = dsgd_in_process("run", str(spec), "--dry-run", "--db", str(tmp_path / "r.db"))
    assert result.returncode == 0, result.stderr
    assert "torch.distributed.run --standalone --nproc-per-node=2" in result.stdout
    assert result.stdout.count("dsgd_cli.worker.process") == 5
    assert not (tmp_path / "r.db").exists()
    assert "experiments in" not in result.stderr  # small plans are not announced


def _one_line_error(result, spec, expected):
    """Exit 2 and one line naming the file, with `expected` in it; no traceback."""
    assert result.returncode == 2, (result.stdout, result.stderr)
    message = result.stderr.strip()
    assert "\n" not in message and "Traceback" not in message, message
    assert message.startswith(f"dsgd: error: {spec}: "), message
    assert expected in message, message
    return message


@pytest.mark.parametrize("content", [
    "experiments:\n  - {name: café, task: logreg}\n".encode("latin-1"),
    b"\xff\xfee\x00x\x00p\x00e\x00r\x00",  # UTF-16 with its byte-order mark
], ids=["latin-1", "utf-16"])
def test_spec_that_is_not_utf8(tmp_path, content):
    spec = tmp_path / "bad.yaml"
    spec.write_bytes(content)
    result = dsgd_in_process("run", str(spec), "--dry-run")
    _one_line_error(result, spec, ": not UTF-8 text: byte 0x")


# Bad input found by review and by tests/test_fuzz.py: each once gave a traceback, or passed
# validation and failed in every worker. Checked in-process (fast); the CLI path is the same.
MORE_BAD = [
    ("seed beyond numpy's range", "experiments:\n  - {name: a, task: logreg, seed: 3e13}\n",
     "experiments[0].seed: expected an integer between 0 and 4294967295, got 30000000000000.0"),
    ("seed 2**32", "experiments:\n  - {name: a, task: logreg, seed: 4294967296}\n",
     "experiments[0].seed: expected an integer between 0 and 4294967295"),
    ("epochs beyond 32 bits", "experiments:\n  - {name: a, task: logreg, epochs: 1e12}\n",
     "experiments[0].epochs: expected an integer between 1 and 2147483647"),
    ("steps_per_epoch beyond 32 bits",
     "experiments:\n  - {name: a, task: logreg, steps_per_epoch: 1e12}\n",
     "experiments[0].steps_per_epoch: expected an integer between 1 and 2147483647"),
    ("batch_size beyond 32 bits", "experiments:\n  - {name: a, task: logreg, batch_size: 1e12}\n",
     "experiments[0].batch_size: expected an integer between 1 and 2147483647"),
    ("log_interval beyond 32 bits", "experiments:\n  - {name: a, task: logreg, log_interval: 1e12}\n",
     "experiments[0].log_interval: expected an integer between 1 and 2147483647"),
    ("budget samples beyond 62 bits",
     "experiments:\n  - {name: a, task: logreg, budget: {samples: 1e19}}\n",
     "experiments[0].budget.samples: expected an integer between 1 and 4611686018427387904"),
    ("data_seed beyond numpy's range",
     "experiments:\n  - {name: a, task: {name: mnist1d_mlp, data_seed: 4294967296}}\n",
     "experiments[0].task.data_seed: expected a value <= 4294967295, got 4294967296"),
    ("logreg data_seed", "experiments:\n  - {name: a, task: {name: logreg, data_seed: 1e19}}\n",
     "experiments[0].task.data_seed: expected a value <= 4294967295"),
    ("digits data_seed", "experiments:\n  - {name: a, task: {name: digits_cnn, data_seed: -1}}\n",
     "experiments[0].task.data_seed: expected a value >= 0, got -1"),
    ("integer option beyond 64 bits",
     "experiments:\n  - {name: a, task: logreg, aggregator: {name: local_sgd, period: 1e19}}\n",
     "experiments[0].aggregator.period: expected a value <= 9223372036854775807 (64 bits)"),
    ("float option beyond floats",
     f"experiments:\n  - {{name: a, task: logreg, optimizer: {{name: sgd, lr: 1{'0' * 400}}}}}\n",
     "experiments[0].optimizer.lr: expected a finite number, got 1000"),
    ("bandwidth beyond floats",
     f"experiments:\n  - {{name: a, task: logreg, network: {{bandwidth: 1{'0' * 400}}}}}\n",
     "experiments[0].network.bandwidth: expected a bandwidth"),
    ("latency beyond floats",
     f"experiments:\n  - {{name: a, task: logreg, network: {{latency: '1{'0' * 400}s'}}}}\n",
     "experiments[0].network.latency: expected a duration"),
    ("slowdown beyond floats",
     f"experiments:\n  - {{name: a, task: logreg, stragglers: {{slowdown: 1{'0' * 400}}}}}\n",
     "experiments[0].stragglers.slowdown: expected a number >= 1, got 1000"),
    ("budget seconds beyond floats",
     f"experiments:\n  - {{name: a, task: logreg, budget: {{seconds: 1{'0' * 400}}}}}\n",
     "experiments[0].budget.seconds: expected a number > 0, got 1000"),
    ("integer of 5000 digits", f"experiments:\n  - {{name: a, task: logreg, seed: 1{'0' * 5000}}}\n",
     "invalid YAML: Exceeds the limit (4300 digits)"),
    ("NUL in save_dir", 'experiments:\n  - {name: a, task: logreg, save_dir: "m\\0"}\n',
     "experiments[0].save_dir: expected a directory path, got 'm\\x00' (embedded null byte)"),
    ("line break in a key", 'experiments:\n  - {name: a, task: logreg, "ep\\nochs": 2}\n',
     "experiments[0].ep\\nochs: unknown key"),
    ("alias inside itself", "experiments: &a [*a]\n",
     "nested too deeply, or a YAML alias contains itself"),
    ("deep nesting", "experiments: " + "[" * 3000 + "]" * 3000 + "\n", "nested too deeply"),
    ("defaults not a mapping", "defaults: []\nexperiments:\n  - {name: a, task: logreg}\n",
     "defaults: expected a mapping"),
    ("more workers than logreg samples",
     "experiments:\n  - {name: a, task: {name: logreg, samples: 16}, workers: 17}\n",
     "experiments[0].workers: 17 workers but task 'logreg' has 16 training examples; "
     "each worker needs at least one"),
    ("more workers than digits", "experiments:\n  - {name: a, workers: 1000,"
     " task: {name: digits_cnn, test_fraction: 0.5}}\n",
     "experiments[0].workers: 1000 workers but task 'digits_cnn' has 899 training examples"),
    ("more workers than mnist1d", "defaults: {workers: 81}\nexperiments:\n"
     "  - {name: ok, task: {name: mnist1d_cnn, num_samples: 200}}\n"
     "  - {name: few, task: {name: mnist1d_cnn, num_samples: 109}}\n",
     "defaults.workers: 81 workers but task 'mnist1d_cnn' has 80 training examples"),
    ("--workers beyond the examples", "experiments:\n  - {name: a, task: {name: logreg, samples: 16}}\n",
     "experiments[0].workers: 20 workers but task 'logreg' has 16 training examples"),
]


@pytest.mark.parametrize("label, text, expected", MORE_BAD, ids=[b[0] for b in MORE_BAD])
def test_more_bad_input_is_one_line_exit_2(tmp_path, label, text, expected):
    spec = tmp_path / "bad.yaml"
    spec.write_text(text, encoding="utf-8")
    extra = ["--workers", "20"] if label.startswith("--workers") else []
    result = dsgd_in_process("run", str(spec), "--dry-run", *extra)
    _one_line_error(result, spec, expected)


def test_bounds_are_inclusive(tmp_path):
    spec = write_spec(tmp_path, """
    experiments:
      - {name: a, task: {name: logreg, samples: 16, data_seed: 4294967295}, workers: 16,
         seed: 4294967295, epochs: 2147483647, budget: {samples: 4611686018427387904}}
    """)
    (a,) = load_spec(spec)
    assert a.config["seed"] == 2**32 - 1 and a.config["task"]["data_seed"] == 2**32 - 1


@pytest.mark.parametrize("task, options", [
    ("logreg", {"samples": 16}), ("logreg", {"samples": 333}),
    ("digits_cnn", {}), ("digits_cnn", {"test_fraction": 0.5}), ("digits_cnn", {"test_fraction": 0.33}),
])
def test_train_examples_is_what_load_data_returns(task, options):
    plugin = registry.load("task", task)
    instance = plugin(plugin.Options(**options))
    assert instance.train_examples() == len(instance.load_data(0).train_y)


@pytest.mark.parametrize("num_samples", [100, 109, 1237])
def test_mnist1d_train_examples_is_what_generation_returns(num_samples):
    from plugins.tasks.mnist1d import MNIST1DCNN, make

    task = MNIST1DCNN(MNIST1DCNN.Options(num_samples=num_samples))
    assert task.train_examples() == len(make(num_samples, 0).train_y)


def test_gossip_graph_is_checked_with_the_runs_seed(tmp_path):
    """adpsgd on random_regular with 8 workers: seed 0's graph has an active/passive split,
    seed 2's does not. Validation once built seed 0's graph whatever the seed, so seed 2 passed
    and then failed in every worker."""
    from plugins.aggregators.gossip import graph
    from plugins.aggregators.gossip.adpsgd import ADPSGD, ADPSGDOptions

    options = ADPSGDOptions(topology="random_regular")
    graph.bipartite_split(ADPSGD.make_topology(options, 8, 0))  # what the workers of seed 0 build
    with pytest.raises(ValueError):
        graph.bipartite_split(ADPSGD.make_topology(options, 8, 2))  # ... and of seed 2

    spec = write_spec(tmp_path, """
    defaults: {task: logreg, workers: 8, aggregator: {name: adpsgd, topology: random_regular}}
    experiments:
      - {name: fine, seed: 0}
      - {name: sweep, grid: {seed: [0, 1, 2]}}
    """)
    result = dsgd_in_process("run", str(spec), "--dry-run")
    # The aggregator was written in defaults; the experiment that met the error is named.
    message = _one_line_error(result, spec, "defaults.aggregator: topology 'random_regular' "
                                            "with 8 workers has no usable active/passive split")
    # The error is the seed-2 point's, not a result cached for seed 0 or 1.
    assert message.endswith("(the graph drawn with the run's seed, 2) (in experiments[1])")
    spec.write_text(spec.read_text().replace("[0, 1, 2]", "[0, 1]"))
    assert [e.config["seed"] for e in load_spec(spec)] == [0, 0, 1]


@pytest.mark.slow  # 100,000 grid points: grid expansion itself is tested small above
def test_huge_grid_is_announced_and_dry_run_completes(tmp_path):
    lrs = [round(1e-4 * (i + 1), 6) for i in range(1000)]
    spec = write_spec(tmp_path, f"""
    defaults: {{task: {{name: logreg, features: 4}}, workers: 2}}
    experiments:
      - name: sweep
        aggregator: {{name: local_sgd, period: 2}}
        grid: {{optimizer.lr: {lrs}, seed: {list(range(100))}}}
    """)
    result = dsgd_in_process("run", str(spec), "--dry-run", "--db", str(tmp_path / "r.db"))
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines()[0] == f"dsgd: 100000 experiments in {spec}"
    assert result.stdout.count(" workers, task logreg, aggregator local_sgd") == 100_000
    assert "sweep[optimizer.lr=0.1,seed=99]: 2 workers" in result.stdout
    assert not (tmp_path / "r.db").exists()


def test_check_world_passes_the_seed_where_check_world_takes_it():
    from dsgd_cli.api import Aggregator
    from dsgd_cli.spec import registry
    from dsgd_cli.spec.experiments import check_world

    seen = []

    class TakesSeed(Aggregator):
        @classmethod
        def check_world(cls, options, world_size, seed=0):
            seen.append(("takes seed", seed))

    class Older(Aggregator):  # a third party's, written before check_world had a seed
        @classmethod
        def check_world(cls, options, world_size):
            seen.append(("older", world_size))

    assert check_world(TakesSeed, None, 4, 7) is True  # it may depend on the seed
    assert check_world(Older, None, 4, 9) is False     # called as before, without it
    assert check_world(Aggregator, None, 4, 5) is False
    assert seen == [("takes seed", 7), ("older", 4)]
    # A built-in gossip plugin checks the graph drawn with the seed: only a random one depends on it.
    dpsgd = registry.load("aggregator", "dpsgd")
    assert check_world(dpsgd, dpsgd.Options(topology="random_regular"), 8, 3) is True
    assert check_world(dpsgd, dpsgd.Options(topology="ring"), 8, 3) is False


def test_grid_points_and_yaml_aliases_get_their_own_sections(tmp_path):
    """Validation checks each distinct section once (grid points share them); a section
    written once and used in two places (a YAML alias) is still checked for each place."""
    spec = write_spec(tmp_path, """
    defaults: {task: logreg}
    experiments:
      - name: g
        optimizer: &sgd {name: sgd, momentum: 0.5}
        aggregator: {name: local_sgd}
        grid: {optimizer.lr: [0.1, 0.2], aggregator.period: [1, 3], aggregator.compressor.name: [none]}
      - {name: other, optimizer: *sgd}
    """)
    experiments = load_spec(spec)
    configs = [e.config for e in experiments]
    assert [(c["optimizer"]["lr"], c["aggregator"]["period"]) for c in configs[:4]] == [
        (0.1, 1), (0.1, 3), (0.2, 1), (0.2, 3)]
    assert all(c["optimizer"]["momentum"] == 0.5 for c in configs)
    configs[0]["optimizer"]["lr"] = 99.0  # each configuration is its own
    assert configs[1]["optimizer"]["lr"] == 0.1 and configs[4]["optimizer"]["lr"] == 0.05

    spec.write_text(spec.read_text().replace("{name: other, optimizer: *sgd}",
                                             "{name: other, task: *sgd}"))
    result = dsgd_in_process("run", str(spec), "--dry-run")
    _one_line_error(result, spec, "experiments[1].task.name: unknown task 'sgd'")


def test_unknown_selection_in_a_large_grid_lists_a_few_names(tmp_path):
    spec = write_spec(tmp_path, """
    experiments:
      - {name: g, task: logreg, grid: {seed: [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24]}}
    """)
    result = dsgd_in_process("run", str(spec), "-e", "nothere", "--dry-run")
    message = _one_line_error(result, spec, "no experiment named 'nothere' (the spec has: g[seed=0], ")
    assert message.endswith("g[seed=19], … (25 in all))") and "g[seed=20]" not in message
