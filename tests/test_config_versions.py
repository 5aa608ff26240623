"""Stored configurations read back through one ladder (`upgrade_config`), the run plan beside
the configuration, and the worker built without the spec validator."""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from torch import nn

from conftest import dsgd_in_process, write_spec
from dsgd_cli.api import WorkerContext
from dsgd_cli.comm.communicator import Comm
from dsgd_cli.errors import DsgdError
from dsgd_cli.launch.resume import resumable
from dsgd_cli.results.store import Store
from dsgd_cli.spec import registry
from dsgd_cli.spec.config_versions import CONFIG_VERSION, upgrade_config
from dsgd_cli.spec.resolved import ResolvedExperiment
from dsgd_cli.spec.experiments import load_spec
from dsgd_cli.spec.run_plan import RunPlan, read_only
from dsgd_cli.worker import checkpoint

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "configs_before_version.json").read_text())
SCHEMA_1_DB = Path(__file__).parent / "fixtures" / "schema1.sqlitedb"  # runs dsgd 0.1.0 stored

# A configuration as the first versions stored it (tests/fixtures/make_schema1_db.py's runs):
# no lr_schedule, lr_scaling, data_split, timeout, budget, ..., and an unlimited bandwidth
# stored as infinity.
OLDEST = {"name": "old", "task": {"name": "logreg", "samples": 64, "features": 3, "data_seed": 0},
          "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.0, "nesterov": False,
                        "weight_decay": 0.0},
          "aggregator": {"name": "allreduce", "error_feedback": False, "sync_buffers": True},
          "compressor": {"name": "none"}, "workers": 2, "epochs": 1, "batch_size": 8, "seed": 0,
          "network": {"bytes_per_second": float("inf"), "latency_s": 0.001}}


def as_version_3(stored: dict) -> dict:
    """A fixture configuration (stored before the version) with what version 3 added: its
    compute section's `ring_max`, 64 (how all-reduces moved before the key)."""
    config = copy.deepcopy(stored)
    if config["compute"] is not None:
        config["compute"]["ring_max"] = 64
    return config


def test_todays_specs_resolve_to_the_configurations_stored_before_the_version(tmp_path):
    """The layout of a configuration is what main stored before `config_version` (the
    fixture), plus the version."""
    spec = tmp_path / "spec.yaml"
    spec.write_text(FIXTURE["spec"])
    resolved = {experiment.name: experiment.config for experiment in load_spec(spec)}
    assert resolved == {name: {**as_version_3(stored), "config_version": CONFIG_VERSION}
                        for name, stored in FIXTURE["configs"].items()}
    for name, stored in FIXTURE["configs"].items():  # and in the same order
        assert list(resolved[name]) == ["config_version", *stored]


@pytest.mark.parametrize("name", sorted(FIXTURE["configs"]))
def test_a_configuration_stored_by_yesterdays_main_upgrades_to_itself(name):
    stored = FIXTURE["configs"][name]
    assert upgrade_config(stored) == {**as_version_3(stored), "config_version": CONFIG_VERSION}


def test_a_version_2_compute_section_gets_the_ring_it_all_reduced_by():
    stored = {**FIXTURE["configs"]["today-network"], "config_version": 2}
    upgraded = upgrade_config(stored)
    assert upgraded["compute"] == {"step_seconds": 0.01, "variation": None, "time_scale": 2.0,
                                   "ring_max": 64}
    assert "ring_max" not in stored["compute"]  # the stored one is left as it was


def test_an_older_configuration_gets_what_each_missing_key_meant():
    stored = copy.deepcopy(OLDEST)
    upgraded = upgrade_config(stored)
    assert stored == OLDEST  # the stored one is left as it was
    assert upgraded["config_version"] == CONFIG_VERSION
    assert upgraded["lr_schedule"] == {"name": "constant", "warmup_steps": 0, "warmup_epochs": 0.0}
    assert (upgraded["lr_scaling"], upgraded["data_split"], upgraded["timeout"]) == ("none", "random", 600.0)
    assert [upgraded[key] for key in ("stragglers", "compute", "cluster", "budget",
                                      "checkpoint_every", "steps_per_epoch")] == [None] * 6
    assert upgraded["network"] == {"bytes_per_second": None, "latency_s": 0.001}
    # Every key today's spec resolves to is there, and the plugins build from it.
    assert set(FIXTURE["configs"]["today-network"]) | {"config_version"} == set(upgraded)
    registry.build("lr_schedule", upgraded["lr_schedule"])
    assert upgrade_config(upgraded) == upgraded


def test_a_configuration_of_a_newer_dsgd_is_refused():
    with pytest.raises(DsgdError, match="stored by a newer dsgd"):
        upgrade_config({**OLDEST, "config_version": CONFIG_VERSION + 1})


def test_an_older_run_resumes_with_its_configuration_upgraded_and_the_run_plan_apart(tmp_path):
    directory = tmp_path / "checkpoints"
    for rank in (0, 1):
        checkpoint.save(directory, 10, rank, {"step": 10, "rank": rank}, workers=2)
    store = Store(str(tmp_path / "r.db"))
    run_id = store.create_run("old", OLDEST, None, [], checkpoint_dir=str(directory))
    store.finish_run(run_id, "failed", "rank 1: killed", 1)
    experiment = resumable(store, run_id)
    assert experiment.config == upgrade_config(OLDEST)
    entry = experiment.worker_config()  # what the launch plan gives the workers
    assert entry == {"config": experiment.config,
                     "run": {"run_id": run_id, "resume_step": 10, "checkpoint_dir": str(directory)}}
    assert not {"run_id", "resume_step", "checkpoint_dir"} & set(entry["config"])


def test_a_fresh_experiment_plans_no_resume(tmp_path):
    (experiment,) = load_spec(write_spec(tmp_path, "experiments: [{name: a, task: logreg}]"))
    assert experiment.worker_config() == {
        "config": experiment.config,
        "run": {"run_id": None, "resume_step": None, "checkpoint_dir": None}}


def test_plugins_see_the_configuration_read_only():
    config = read_only({"name": "a", "task": {"name": "logreg", "sizes": [1, 2]}})
    assert config["task"]["name"] == "logreg" and config.get("seed") is None
    with pytest.raises(TypeError):
        config["name"] = "b"
    with pytest.raises(TypeError):
        config["task"]["name"] = "other"


def _dcd_context(run: RunPlan) -> WorkerContext:
    model = nn.Linear(3, 2, dtype=torch.float64)
    return WorkerContext(rank=0, world_size=1, device=torch.device("cpu"), model=model,
                         optimizer=torch.optim.SGD(model.parameters(), lr=0.1), comm=Comm(0, 1),
                         metrics=None, seed=0,
                         compressor=registry.build("compressor", {"name": "none"}), run=run)


@pytest.mark.parametrize("resume_step, exchanges", [(None, True), (4, False)])
def test_dcd_exchanges_the_models_at_setup_unless_the_run_resumes(resume_step, exchanges):
    """A resumed dcd takes its mix of the neighbours' models from the checkpoint: it learns
    that the run resumes from the run plan (`ctx.run`), not from the configuration."""
    dcd = registry.build("aggregator", {"name": "dcd", "error_feedback": False,
                                        "sync_buffers": True, "topology": "ring",
                                        "mixing": "uniform"})
    ctx = _dcd_context(RunPlan(resume_step=resume_step))
    dcd.setup(ctx)
    assert (dcd.mixed is not None) == exchanges


def test_the_worker_builds_its_plugins_without_the_spec_validator():
    code = ("import sys, dsgd_cli.worker.process; "
            "print('dsgd_cli.spec.experiments' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


@pytest.mark.parametrize("name", sorted(FIXTURE["configs"]))
def test_the_typed_experiment_reads_and_writes_the_configuration_key_for_key(name):
    config = upgrade_config(FIXTURE["configs"][name])
    typed = ResolvedExperiment.from_config(config)
    assert json.dumps(typed.to_dict()) == json.dumps(config)  # the same keys in the same order
    aggregator = registry.load("aggregator", config["aggregator"]["name"])
    assert isinstance(typed.aggregator.options, aggregator.Options)
    assert typed.workers == 4 and typed.compute.step_seconds == 0.01


def test_an_older_configuration_reads_as_a_typed_experiment():
    typed = ResolvedExperiment.from_config(upgrade_config(OLDEST))
    assert typed.network.bytes_per_second is None and typed.lr_schedule.name == "constant"
    written, upgraded = typed.to_dict(), upgrade_config(OLDEST)
    plugins = ("task", "optimizer", "aggregator", "compressor", "lr_schedule")
    assert {k: v for k, v in written.items() if k not in plugins} == {
        k: v for k, v in upgraded.items() if k not in plugins}
    for kind in plugins:  # an option added since the run was stored reads as its default
        assert written[kind].items() >= upgraded[kind].items()


# -- commands that read stored runs --------------------------------------------------------------

def _shown_configuration(output: str) -> dict:
    """The configuration `dsgd show` prints (between "configuration:" and "plugins:")."""
    text = output.split("\nconfiguration:\n", 1)[1].split("\nplugins:\n", 1)[0]
    return yaml.safe_load(text)


def test_commands_read_runs_of_dsgd_0_1_with_todays_keys(tmp_path):
    """Runs stored by dsgd 0.1.0 (no lr_scaling, lr_schedule, timeout, ...): `compare`
    selects them by keys added since, and `show` prints what each key meant then."""
    db = tmp_path / "old.db"
    shutil.copy(SCHEMA_1_DB, db)
    selected = dsgd_in_process("compare", "--db", str(db), "--where", "lr_scaling=none",
                               "--where", "lr_schedule.name=constant", "--format", "json")
    assert selected.returncode == 0, selected.stderr
    assert [row["id"] for row in json.loads(selected.stdout)] == [1, 2]
    shown = dsgd_in_process("show", "1", "--db", str(db))
    assert shown.returncode == 0, shown.stderr
    configuration = _shown_configuration(shown.stdout)
    assert list(configuration)[0] == "config_version"
    assert configuration["config_version"] == CONFIG_VERSION
    assert (configuration["lr_scaling"], configuration["timeout"]) == ("none", 600.0)
    assert configuration["lr_schedule"] == {"name": "constant", "warmup_steps": 0,
                                            "warmup_epochs": 0.0}


def test_commands_read_a_run_stored_before_the_version_as_todays(tmp_path):
    """Configurations as main stored them before `config_version` (the fixture) read as
    today's: the version first, then every key as stored."""
    store = Store(str(tmp_path / "r.db"))
    ids = {name: store.create_run(name, config, None, [])
           for name, config in FIXTURE["configs"].items()}
    selected = dsgd_in_process("compare", "--db", str(tmp_path / "r.db"), "--where",
                               f"config_version={CONFIG_VERSION}", "--format", "json")
    assert selected.returncode == 0, selected.stderr
    assert sorted(row["id"] for row in json.loads(selected.stdout)) == sorted(ids.values())
    for name, run_id in ids.items():
        shown = dsgd_in_process("show", str(run_id), "--db", str(tmp_path / "r.db"))
        assert shown.returncode == 0, shown.stderr
        configuration = _shown_configuration(shown.stdout)
        assert list(configuration) == ["config_version", *FIXTURE["configs"][name]]
        assert configuration["config_version"] == CONFIG_VERSION


def test_a_run_stored_by_a_newer_dsgd_is_refused_by_name(tmp_path):
    store = Store(str(tmp_path / "r.db"))
    run_id = store.create_run("new", {**OLDEST, "config_version": CONFIG_VERSION + 1}, None, [])
    shown = dsgd_in_process("show", str(run_id), "--db", str(tmp_path / "r.db"))
    assert shown.returncode == 2
    assert f"run {run_id}: this configuration was stored by a newer dsgd" in shown.stderr
