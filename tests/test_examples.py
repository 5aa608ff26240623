"""Every shipped spec is valid: the default experiments.yaml and each examples/*.yaml."""

from pathlib import Path

import pytest

from dsgd_cli.spec import load_spec

ROOT = Path(__file__).resolve().parent.parent
SPECS = [ROOT / "experiments.yaml", *sorted((ROOT / "examples").glob("*.yaml"))]


@pytest.mark.parametrize("spec", SPECS, ids=[p.name for p in SPECS])
def test_spec_validates(spec):
    assert load_spec(spec)


def test_default_spec_compares_allreduce_and_local_sgd_on_mnist1d_mlp():
    configs = [e.config for e in load_spec(ROOT / "experiments.yaml")]
    pairs = {(c["aggregator"]["name"], c["task"]["name"], c["workers"]) for c in configs}
    assert {("allreduce", "mnist1d_mlp", 2), ("local_sgd", "mnist1d_mlp", 2)} <= pairs
