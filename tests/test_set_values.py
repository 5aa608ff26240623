"""`dsgd run --set KEY=VALUE` reads VALUE as the spec file reads YAML (its numbers, no key
twice, bounded nesting, no NaN) and every error about it names `--set KEY`, on one line,
exit 2 (dsgd_cli/spec/specfile.py `parse_set`, experiments.py `load_spec`)."""

from __future__ import annotations

import pytest

from conftest import TINY_SPEC, dsgd_in_process, write_spec
from dsgd_cli.spec.experiments import load_spec
from dsgd_cli.spec.specfile import parse_set


@pytest.fixture
def spec(tmp_path):
    return write_spec(tmp_path, TINY_SPEC)


def _refused(spec, *sets: str) -> str:
    """The one line of `dsgd run SPEC --dry-run --set ...`'s refusal."""
    args = [arg for value in sets for arg in ("--set", value)]
    result = dsgd_in_process("run", str(spec), "--dry-run", *args)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.count("\n") == 1, result.stderr
    return result.stderr.strip()


def test_a_number_the_spec_file_accepts_is_accepted(spec):
    result = dsgd_in_process("run", str(spec), "--dry-run", "--set", "optimizer.lr=1e-3")
    assert result.returncode == 0, result.stderr
    assert "optimizer options: lr=0.001," in result.stdout
    (experiment,) = load_spec(spec, overrides=[parse_set("optimizer.lr=1e-3")])
    assert experiment.config["optimizer"]["lr"] == 0.001


def test_a_key_given_twice_in_a_value_is_refused(spec):
    assert _refused(spec, "optimizer={name: sgd, lr: 1, lr: 2}") == (
        "dsgd: error: --set optimizer: lr: key 'lr' given twice, on lines 1 and 1")


@pytest.mark.parametrize("value", ["[" * 20_000, "[" * 600 + "]" * 600, "&a [*a]"])
def test_a_value_nested_too_deeply_is_one_line(spec, value):
    line = _refused(spec, f"optimizer.lr={value}")
    assert line.startswith("dsgd: error: --set optimizer.lr: ")
    assert "nested too deeply" in line


def test_a_value_that_is_not_yaml_names_its_position_in_the_value(spec):
    assert _refused(spec, "optimizer.lr=[1") == (
        "dsgd: error: --set optimizer.lr: invalid YAML: line 1, column 3: expected ',' or "
        "']', but got '<stream end>'")


def test_nan_is_refused_as_in_the_spec_file(spec):
    assert _refused(spec, "optimizer.lr=.nan") == (
        "dsgd: error: --set optimizer.lr: expected a finite number, got nan")


@pytest.mark.parametrize("value, message", [
    ("optimizer.lr=abc", "--set optimizer.lr: expected a number, got 'abc'"),
    # within a section set whole: the key path inside the experiment follows
    ("optimizer={name: sgd, lr: x}", "--set optimizer: optimizer.lr: expected a number, got 'x'"),
    ("nope.lr=1", "--set nope.lr: 'nope' is not a section of the experiment"),
])
def test_a_refused_value_names_its_set_key_not_the_spec(spec, value, message):
    line = _refused(spec, value)
    assert line == f"dsgd: error: {message}"
    assert str(spec) not in line


def test_the_last_set_of_a_key_is_the_one_named(spec):
    assert _refused(spec, "optimizer.lr=abc", "optimizer.lr=xyz") == (
        "dsgd: error: --set optimizer.lr: expected a number, got 'xyz'")


def test_an_error_in_the_spec_still_names_the_spec(tmp_path):
    spec = write_spec(tmp_path, TINY_SPEC.replace("workers: 2", "workers: 2\n  batch_size: x"))
    assert _refused(spec, "optimizer.lr=0.1") == (
        f"dsgd: error: {spec}: defaults.batch_size: expected an integer, got 'x'")


DILOCO_AND_ALLREDUCE = """
defaults:
  task: {name: logreg}
  workers: 2
  epochs: 1
  steps_per_epoch: 2
  optimizer: {name: sgd, lr: 0.1, momentum: 0.9}
experiments:
  - {name: allreduce, aggregator: {name: allreduce}}
  - {name: diloco, aggregator: {name: diloco, period: 2}}
"""


def test_set_applies_only_to_the_experiments_selected(tmp_path):
    """allreduce has no `period`: set in diloco alone, it is not refused for allreduce."""
    spec = write_spec(tmp_path, DILOCO_AND_ALLREDUCE)
    (diloco,) = load_spec(spec, only=["diloco"], overrides=[parse_set("aggregator.period=4")])
    assert diloco.config["aggregator"]["period"] == 4
    (allreduce,) = load_spec(spec, only=["allreduce"], overrides=[parse_set("epochs=3")])
    assert allreduce.config["epochs"] == 3
    assert "unknown option 'period'" in _refused(spec, "aggregator.period=4")


def test_set_reaches_a_nested_plugin_section_and_merges_into_it(tmp_path):
    """DiLoCo's outer optimizer is Nesterov momentum 0.9 by default: setting its rate, by key
    path or by a mapping, keeps the rest, as a section in `defaults` would."""
    spec = write_spec(tmp_path, DILOCO_AND_ALLREDUCE)
    for value in ("aggregator.outer_optimizer.lr=0.5",
                  "aggregator.outer_optimizer={name: sgd, lr: 0.5}"):
        (diloco,) = load_spec(spec, only=["diloco"], overrides=[parse_set(value)])
        outer = diloco.config["aggregator"]["outer_optimizer"]
        assert (outer["lr"], outer["momentum"], outer["nesterov"]) == (0.5, 0.9, True), value
    (diloco,) = load_spec(spec, only=["diloco"], overrides=[parse_set("optimizer={lr: 0.2}")])
    assert (diloco.config["optimizer"]["lr"], diloco.config["optimizer"]["momentum"]) == (0.2, 0.9)
    (diloco,) = load_spec(spec, only=["diloco"],
                          overrides=[parse_set("optimizer={name: adam, lr: 0.01}")])
    assert diloco.config["optimizer"]["name"] == "adam"  # another plugin: replaced whole
