"""Every shipped spec is valid: the default experiments.yaml and each examples/*.yaml."""

from pathlib import Path

import pytest

from dsgd_cli.spec.experiments import load_spec

ROOT = Path(__file__).resolve().parent.parent
SPECS = [ROOT / "experiments.yaml", *sorted((ROOT / "examples").glob("*.yaml"))]


@pytest.fixture
def data(tmp_path, monkeypatch):
    """Where the examples that read data sets find them ($DSGD_DATA): a small CIFAR-10 in
    its own format and a generated text in place of tiny Shakespeare."""
    from test_cifar import write_cifar

    write_cifar(tmp_path / "cifar-10-batches-py")
    (tmp_path / "tinyshakespeare.txt").write_text("To be, or not to be: that is the question.\n" * 400)
    monkeypatch.setenv("DSGD_DATA", str(tmp_path))
    return tmp_path


@pytest.mark.parametrize("spec", SPECS, ids=[p.name for p in SPECS])
def test_spec_validates(spec, data, quick_gamma_tuning):
    """Valid, whichever γ CHOCO's `gamma: auto` tunes (tuned quickly here)."""
    assert load_spec(spec)


def test_cifar10_example_is_he_et_als_setup(data):
    configs = {e.name: e.config for e in load_spec(ROOT / "examples" / "cifar10.yaml")}
    assert {c["aggregator"]["name"] for c in configs.values()} == {"allreduce", "local_sgd", "dpsgd"}
    assert configs["powersgd"]["compressor"]["name"] == "powersgd"
    for config in configs.values():
        assert config["task"] == {"name": "cifar10_resnet", "depth": 20, "augment": True,
                                  "data_dir": str((data / "cifar-10-batches-py").resolve())}
        assert config["workers"] * config["batch_size"] == 128 and config["epochs"] == 164
        assert config["optimizer"]["lr"] * config["workers"] == pytest.approx(0.1)
        assert config["lr_scaling"] == "linear"
        assert config["lr_schedule"]["milestone_epochs"] == [82, 123]


def test_default_spec_compares_allreduce_and_local_sgd_on_mnist1d_mlp():
    configs = [e.config for e in load_spec(ROOT / "experiments.yaml")]
    pairs = {(c["aggregator"]["name"], c["task"]["name"], c["workers"]) for c in configs}
    assert {("allreduce", "mnist1d_mlp", 2), ("local_sgd", "mnist1d_mlp", 2)} <= pairs
