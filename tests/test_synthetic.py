"""The `synthetic` task: its model has the requested parameter count within 1%, written as an
integer or with a suffix; impossible or malformed counts are one line and exit 2."""

from __future__ import annotations

import pytest

from conftest import dsgd_in_process, write_spec
from dsgd_cli.spec.experiments import build_plugin, load_spec
from plugins.tasks.synthetic import mlp_params, parse_count


def count(model) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("written, expected", [
    ("25M", 25_000_000), ("1.5M", 1_500_000), ("250k", 250_000), ("2G", 2_000_000_000),
    ("3b", 3_000_000_000), (" 40 K ", 40_000), ("12345", 12_345), (777, 777)])
def test_counts_with_suffixes(written, expected):
    assert parse_count(written) == expected


@pytest.mark.parametrize("options, target", [
    ({"params": "25M"}, 25_000_000),  # a ResNet-50-sized message
    ({"params": "1.5M", "layers": 4}, 1_500_000),
    ({"params": 12345, "layers": 1, "features": 7}, 12_345),
    ({"params": "250k", "layers": 1, "features": 100, "classes": 3}, 250_000)])
def test_the_model_has_the_requested_parameter_count_within_one_percent(tmp_path, options, target):
    task = build_plugin("task", {"name": "synthetic", **_resolved(tmp_path, options)})
    model = task.build_model()
    assert abs(count(model) - target) <= 0.01 * target
    o = task.options
    assert count(model) == mlp_params(o.features, task.width(), o.layers, o.classes)
    for other in (task.width() - 1, task.width() + 1):  # no other width comes closer
        assert abs(mlp_params(o.features, other, o.layers, o.classes) - target) >= abs(
            count(model) - target)


def test_data_is_seeded_and_shaped(tmp_path):
    task = build_plugin("task", {"name": "synthetic", **_resolved(
        tmp_path, {"params": "10k", "samples": 100, "features": 5, "classes": 3})})
    data, again = task.load_data(0), task.load_data(1)  # the run's seed does not matter
    assert data.train_x.shape == (100, 5) and data.test_x.shape == (25, 5)
    assert (data.train_x == again.train_x).all() and (data.train_y == again.train_y).all()
    assert set(data.train_y.tolist()) <= {0, 1, 2} and len(set(data.train_y.tolist())) > 1
    assert task.train_examples() == 100


@pytest.mark.parametrize("params, message", [
    ("'25X'", "params: expected a count such as 25M, 250k or 1000000, got '25X'"),
    ("'1.5'", "params: '1.5' is not a whole number of parameters"),
    ("0", "params: expected between 1 and 10,000,000,000, got 0"),
    ("20", "params: 20 cannot be reached within 1% with layers 2, features 64 and classes 10"),
    ("true", "experiments[0].task.params: expected an integer or a string, got True"),
])
def test_bad_counts_are_one_line_and_exit_2(tmp_path, params, message):
    spec = write_spec(tmp_path, f"""
        experiments:
          - {{name: a, task: {{name: synthetic, params: {params}}}}}
    """)
    result = dsgd_in_process("run", str(spec), "--db", str(tmp_path / "r.db"))
    assert result.returncode == 2
    assert message in result.stderr and "experiments[0].task" in result.stderr, result.stderr
    assert len(result.stderr.splitlines()) == 1
    assert not (tmp_path / "r.db").exists()


def _resolved(tmp_path, options: dict) -> dict:
    """The task section as the spec loader resolves it (options checked, defaults filled)."""
    items = ", ".join(f"{k}: {v!r}" if isinstance(v, str) else f"{k}: {v}" for k, v in options.items())
    spec = write_spec(tmp_path, f"""
        experiments:
          - {{name: a, workers: 1, task: {{name: synthetic, {items}}}}}
    """)
    section = load_spec(spec)[0].config["task"]
    return {k: v for k, v in section.items() if k != "name"}
