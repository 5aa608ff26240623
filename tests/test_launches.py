"""Several experiments in one torchrun launch: the same results as one launch each, and a
failure in the middle ends only its own experiment."""

from __future__ import annotations

import pytest
import torch

from conftest import dsgd, dsgd_in_process, experiment_config, write_spec
from dsgd_cli.launch.launcher import plan_launches
from dsgd_cli.spec.experiments import load_spec
from dsgd_cli.results.store import Store

SWEEP = """
defaults:
  task: {{name: logreg, samples: 512}}
  workers: 2
  steps_per_epoch: 6
  log_interval: 2
  save_dir: {models}
experiments:
  - name: lr
    grid: {{optimizer.lr: [0.5]}}
  - name: gossip
    aggregator: {{name: sgp}}
    optimizer: {{name: sgd, lr: 0.1, momentum: 0.9}}
"""
# Values that depend on the arithmetic only, not on timing.
EXACT_METRICS = ("train_loss", "test_loss", "test_accuracy", "bytes_sent", "bytes_received",
                 "total_bytes_sent", "consensus_distance", "lr")


def test_plan_shares_a_launch_between_experiments_that_fit(tmp_path):
    spec = write_spec(tmp_path, """
    defaults: {task: logreg}
    experiments:
      - {name: a}
      - {name: b, aggregator: {name: sgp}}
      - {name: c, workers: 3}
      - {name: d, workers: 3}
      - {name: e, workers: 3, timeout: 30}
      - {name: f}
    """)
    experiments = load_spec(spec)
    names = [[e.name for e in launch.experiments] for launch in plan_launches(experiments)]
    assert names == [["a", "b"], ["c", "d"], ["e"], ["f"]]
    alone = [[e.name for e in launch.experiments] for launch in plan_launches(experiments, shared=False)]
    assert alone == [["a"], ["b"], ["c"], ["d"], ["e"], ["f"]]


def _record(db) -> dict[str, tuple]:
    """Per experiment: status, and the exact history of every arithmetic metric."""
    store = Store(str(db))
    # Sorted: the order the launcher stores the ranks' rows in depends on when it reads them.
    return {run.experiment: (run.status, {name: sorted(
        (-1 if m.rank is None else m.rank, m.step, m.value)
        for m in store.metric_history(run.id, name)) for name in EXACT_METRICS})
            for run in store.runs()}


@pytest.mark.slow  # end to end; test_the_first_experiment_of_a_launch_is_timed_as_the_others and the stragglers fixture run shared launches
def test_a_shared_launch_gives_what_separate_launches_give(tmp_path):
    records, models = {}, {}
    for mode, flags in (("shared", []), ("isolated", ["--isolate"])):
        directory = tmp_path / mode
        directory.mkdir()
        spec = write_spec(directory, SWEEP.format(models=directory / "models"))
        plan = dsgd("run", str(spec), "--dry-run", *flags)
        launches = 1 if mode == "shared" else 2
        assert plan.stdout.count("launch ") == launches, plan.stdout
        result = dsgd("run", str(spec), "--db", str(directory / "r.db"), *flags, timeout=240)
        assert result.returncode == 0, result.stderr
        records[mode] = _record(directory / "r.db")
        models[mode] = {path.relative_to(directory): torch.load(path)
                        for path in sorted((directory / "models").rglob("*.pt"))}
    assert list(records["shared"]) == ["lr[optimizer.lr=0.5]", "gossip"]
    assert records["shared"] == records["isolated"]
    assert all(history for _, metrics in records["shared"].values()
               for name, history in metrics.items() if name in ("train_loss", "test_accuracy"))
    assert len(models["shared"]) == 4
    for path, state in models["shared"].items():
        twin = models["isolated"][path]
        assert all(torch.equal(state[key], twin[key]) for key in state), path


# slow: test_training's test_worker_crash_fails_run_and_keeps_metrics (default) takes the same
# path: rank 1 crashes in a shared launch, its run is failed, the experiments after it complete
@pytest.mark.slow
def test_a_failure_in_a_shared_launch_ends_only_its_experiment(tmp_path, plugin_env):
    spec = write_spec(tmp_path, """
        defaults: {task: {name: logreg, samples: 512}, steps_per_epoch: 4, log_interval: 2}
        experiments:
          - name: before
          - name: crashes
            aggregator: {name: crash, rank: 1, step: 2}
          - name: after
          - name: last
    """)
    db = tmp_path / "r.db"
    plan = dsgd("run", str(spec), "--dry-run", env=plugin_env)
    assert "launch 1: 4 experiments on 2 workers" in plan.stdout
    result = dsgd("run", str(spec), "--db", str(db), env=plugin_env, timeout=240)
    assert result.returncode == 1, result.stderr
    runs = Store(str(db)).runs()
    assert [(r.experiment, r.status, r.failed_rank) for r in runs] == [
        ("before", "completed", None), ("crashes", "failed", 1), ("after", "completed", None),
        ("last", "completed", None)]
    assert runs[1].reason == "rank 1: RuntimeError: injected failure at step 2"
    assert result.stderr.strip().endswith(
        "1 of 4 runs failed: crashes (run 2): rank 1: RuntimeError: injected failure at step 2")


@pytest.mark.parametrize("flags", [[], ["--isolate"]], ids=["shared", "isolated"])
def test_dry_run_shows_the_launch_plan(tmp_path, flags):
    spec = write_spec(tmp_path, "experiments: [{name: a, task: logreg}, {name: b, task: logreg}]\n")
    result = dsgd_in_process("run", str(spec), "--dry-run", *flags)
    lines = [line for line in result.stdout.splitlines() if line.startswith("launch")]
    assert lines == (["launch 1: 2 experiments on 2 workers (cpu)"] if not flags else
                     ["launch 1: 1 experiment on 2 workers (cpu)",
                      "launch 2: 1 experiment on 2 workers (cpu)"])


def test_the_first_experiment_of_a_launch_is_timed_as_the_others(tmp_path):
    """What only a launch's first experiment pays (joining the process group, first-use
    imports and warm-up) stays out of every clock: two identical experiments record their
    evaluations at comparable `seconds`, and no metric of a run is later than its own
    `wall_seconds`, which counts from the same common start."""
    spec = write_spec(tmp_path, """
        defaults:
          task: {name: mnist1d_mlp}
          workers: 2
          epochs: 4
          steps_per_epoch: 25
          log_interval: 25
          optimizer: {name: sgd, lr: 0.05}
        experiments:
          - {name: first}
          - {name: second}
    """)
    db = tmp_path / "r.db"
    result = dsgd_in_process("run", str(spec), "--db", str(db))
    assert result.returncode == 0, result.stdout + result.stderr
    store = Store(str(db))
    runs = {run.experiment: run for run in store.runs()}
    evaluations = {}
    for name, run in runs.items():
        history = store.metric_history(run.id, "test_accuracy")
        assert [point.step for point in history] == [25, 50, 75, 100]
        evaluations[name] = [point.seconds for point in history]
        wall = {s.name: s.final for s in run.summaries}["wall_seconds"]
        # wall_seconds is rank 0's clock; another rank's clock starts when it leaves the common
        # barrier, which may be a fraction of a millisecond before or after rank 0 does.
        latest = max(m.seconds for m in store.metric_history(run.id, "train_loss") if m.rank == 0)
        assert max(evaluations[name]) <= wall and latest <= wall, (name, evaluations, wall)
    # The same step at comparable times (a wide margin: the machine may be busy).
    for first, second in zip(evaluations["first"], evaluations["second"]):
        assert 1 / 4 < first / second < 4, evaluations


def test_advance_records_each_completed_experiment_and_begins_the_next(tmp_path):
    """In process, with no torchrun: what the launcher does between the experiments of a
    shared launch as their workers' events arrive."""
    from types import SimpleNamespace

    from dsgd_cli.comm.events import EventWriter, events_path, experiment_dir
    from dsgd_cli.launch.launcher import Callbacks, DevicePlan, _Launcher
    from dsgd_cli.spec.experiments import Experiment

    heard = []
    callbacks = Callbacks(started=lambda experiment, device: heard.append(("started", experiment.name)),
                          progress=lambda experiment, progress: heard.append(
                              ("progress", experiment.name, progress.train_loss)),
                          ended=lambda result: heard.append(("ended", result.experiment, result.status)))
    store = Store(str(tmp_path / "r.db"))
    experiments = [Experiment(name, experiment_config(name)) for name in ("a", "b")]
    launcher = _Launcher(experiments, DevicePlan("cpu"), store, None, callbacks)
    launcher.torchrun = SimpleNamespace(dir=tmp_path)

    def write(index, rank, *events):
        directory = experiment_dir(tmp_path, index)
        directory.mkdir(exist_ok=True)
        writer = EventWriter(events_path(directory, rank), rank)
        for kind, fields in events:
            writer.write(kind, **fields) if kind != "metric" else writer.metric(**fields)
        writer.close()

    launcher.begin(0)
    write(0, 0, ("metric", {"name": "train_loss", "value": 0.5, "step": 1}), ("done", {}))
    launcher.advance()
    assert launcher.running.index == 0 and launcher.results == []  # rank 1 is not done
    write(0, 1, ("done", {}))
    write(1, 0, ("metric", {"name": "train_loss", "value": 0.25, "step": 1}))
    launcher.advance()  # a done, b begun, and b's first metric read at once
    assert launcher.running.index == 1
    assert [(r.experiment, r.status) for r in launcher.results] == [("a", "completed")]
    assert heard == [("started", "a"), ("progress", "a", 0.5), ("ended", "a", "completed"),
                     ("started", "b"), ("progress", "b", 0.25)]
    assert [(run.experiment, run.status) for run in store.runs()] == [
        ("a", "completed"), ("b", "running")]
