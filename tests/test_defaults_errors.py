"""Issue #48: a bad value written in `defaults` is reported where it was written
(`defaults.network.bandwidth`), not as the first experiment's key (`experiments[0]...`);
one line, exit 2."""

from __future__ import annotations

import pytest

from conftest import dsgd_in_process as dsgd, write_spec
from dsgd_cli.spec.specfile import defaults_path

BANDWIDTH = "expected a bandwidth such as 1Gbit, 100Mbit or 10GB/s, got 'fast'"


def _refusal(tmp_path, text: str) -> str:
    spec = write_spec(tmp_path, text)
    result = dsgd("run", str(spec), "--dry-run")
    assert (result.returncode, result.stdout) == (2, ""), result.stderr
    assert len(result.stderr.splitlines()) == 1, result.stderr
    prefix = f"dsgd: error: {spec}: "
    assert result.stderr.startswith(prefix)
    return result.stderr[len(prefix):].rstrip("\n")


def test_a_bad_value_in_defaults_is_named_at_defaults(tmp_path):
    assert _refusal(tmp_path, """
        defaults:
          task: {name: logreg}
          workers: 2
          network: {bandwidth: fast, latency: 1ms}
        experiments:
          - name: a
          - name: b
    """) == f"defaults.network.bandwidth: {BANDWIDTH}"


def test_a_value_the_experiment_wrote_is_named_in_the_experiment(tmp_path):
    assert _refusal(tmp_path, """
        defaults:
          task: {name: logreg}
          network: {bandwidth: 1Gbit}
        experiments:
          - name: a
          - name: b
            network: {bandwidth: fast}
    """) == f"experiments[1].network.bandwidth: {BANDWIDTH}"
    assert _refusal(tmp_path, """
        defaults:
          task: {name: logreg}
          network: {bandwidth: 1Gbit}
        experiments:
          - name: a
            grid: {network.bandwidth: [1Gbit, fast]}
    """) == f"experiments[0].network.bandwidth: {BANDWIDTH}"


def test_a_default_met_in_a_later_experiment_says_which(tmp_path):
    assert _refusal(tmp_path, """
        defaults:
          task: {name: logreg}
          compute: {step_seconds: 0.01, time_scale: 0.5}
        experiments:
          - name: a
            compute: {step_seconds: 0.01, time_scale: 2}
          - name: b
    """) == ("defaults.compute.time_scale: expected a number >= 1 and <= 100000, got 0.5 "
             "(in experiments[1])")


@pytest.mark.parametrize("path, defaults, entry, expected", [
    ("experiments[0].optimizer.lr", {"optimizer": {"name": "sgd", "lr": -1}}, {},
     "defaults.optimizer.lr"),
    ("experiments[0].optimizer.lr", {"optimizer": {"name": "sgd", "lr": -1}},
     {"optimizer": {"lr": -1}}, None),  # the experiment's own
    ("experiments[0].optimizer.lr", {"optimizer": {"name": "sgd", "lr": -1}},
     {"optimizer": {"name": "adam"}}, None),  # another plugin: the default's options go
    ("experiments[0].network", {"network": 5}, {"name": "a"}, "defaults.network"),
    ("experiments[0].workers", {}, {"name": "a"}, None),  # dsgd's own default
    ("experiments[0].failures.events[0].at", {"failures": {"events": [{"at": -1}]}}, {},
     "defaults.failures.events[0].at"),
    ("experiments[0].failures.events[0].at", {"failures": {"events": [{"at": -1}]}},
     {"failures": {"events": [{"at": -1}]}}, None),  # the experiment's list replaced it
    ("experiments[3].workers", {"workers": 0}, {}, None),  # no such experiment
    ("defaults.workers", {"workers": 0}, {}, None),
])
def test_where_a_value_was_written(path, defaults, entry, expected):
    assert defaults_path(path, defaults, [entry]) == expected
