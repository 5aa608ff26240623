"""Real 2-worker torchrun runs of the built-in aggregators, checked against their definitions."""

from __future__ import annotations

import pytest
import torch

from conftest import compare_json, dsgd, dsgd_in_process, write_spec
from dsgd_cli.results.store import Store
from plugins.tasks.logreg import LogisticRegression


LOGREG = ["allreduce", "allreduce-no-overlap", "local-1", "local-4", "third-party", "momentum",
          "momentum-before-compression", "slow-network"]
BUILTIN = ["mlp-allreduce", "mlp-local", "digits-adam"]


@pytest.fixture(scope="module")
def all_runs(tmp_path_factory, plugin_env):
    """One `dsgd run` of every experiment of these tests: several aggregators on the convex
    problem (models saved), the other built-in tasks, then a run whose worker crashes and one
    after it. Consecutive experiments share a torchrun launch: the crash ends the first launch,
    and `after` runs in a second."""
    tmp = tmp_path_factory.mktemp("runs")
    spec = write_spec(tmp, f"""
        defaults:
          task: {{name: logreg}}
          workers: 2
          epochs: 3
          batch_size: 32
          optimizer: {{name: sgd, lr: 0.5}}
          save_dir: {tmp / "models"}
          target_accuracy: 0.7
        experiments:
          - name: allreduce
            aggregator: {{name: allreduce}}
          - name: allreduce-no-overlap
            aggregator: {{name: allreduce, overlap: false}}
          - name: local-1
            aggregator: {{name: local_sgd, period: 1}}
          - name: local-4
            aggregator: {{name: local_sgd, period: 4}}
          - name: third-party
            aggregator: {{name: model_average, every: 1}}
          - name: momentum
            optimizer: {{name: sgd, lr: 0.05, momentum: 0.9}}
            aggregator: {{name: allreduce}}
          - name: momentum-before-compression
            optimizer: {{name: sgd, lr: 0.05}}
            aggregator: {{name: allreduce, momentum_before_compression: 0.9}}
          - name: slow-network
            steps_per_epoch: 5
            network: {{bandwidth: 1Mbit, latency: 1ms}}
            aggregator: {{name: allreduce, overlap: false}}
          - name: mlp-allreduce
            task: {{name: mnist1d_mlp}}
            epochs: 2
            steps_per_epoch: 40
            optimizer: {{name: sgd, lr: 0.05, momentum: 0.9}}
            save_dir: null
            target_accuracy: null
            aggregator: {{name: allreduce}}
          - name: mlp-local
            task: {{name: mnist1d_mlp}}
            epochs: 2
            steps_per_epoch: 40
            optimizer: {{name: sgd, lr: 0.05, momentum: 0.9}}
            save_dir: null
            target_accuracy: null
            aggregator: {{name: local_sgd, period: 2}}
          - name: digits-adam
            task: {{name: digits_cnn}}
            epochs: 2
            steps_per_epoch: 40
            optimizer: {{name: adam, lr: 0.003}}
            save_dir: null
            target_accuracy: null
            aggregator: {{name: allreduce}}
          - name: crashes
            epochs: 1
            log_interval: 2
            optimizer: {{name: sgd, lr: 0.05}}
            save_dir: null
            target_accuracy: null
            aggregator: {{name: crash, rank: 1, step: 5}}
          - name: after
            epochs: 1
            steps_per_epoch: 3
            optimizer: {{name: sgd, lr: 0.05}}
            save_dir: null
            target_accuracy: null
    """)
    db = tmp / "results.db"
    result = dsgd("run", str(spec), "--db", str(db), env=plugin_env)
    # Only `crashes` fails (see test_worker_crash_fails_run_and_keeps_metrics).
    assert "1 of 13 runs failed: crashes" in result.stderr, result.stdout + result.stderr

    def weights(name: str, rank: int) -> torch.Tensor:
        return torch.load(tmp / "models" / name / f"rank{rank}.pt")["weight"][0]

    # `dsgd compare` of every run, with the metrics some tests ask for besides the usual ones.
    rows = {r["experiment"]: r for r in compare_json(
        db, "--metric", "time_to_accuracy", "--metric", "comm_seconds", "--metric",
        "step_seconds", env=plugin_env)}
    return result, db, weights, rows


@pytest.fixture(scope="module")
def logreg_runs(all_runs):
    """The runs on the convex problem: the database, their saved models, `dsgd compare`'s
    rows."""
    _, db, weights, rows = all_runs
    return db, weights, rows


def test_allreduce_keeps_models_identical(logreg_runs):
    _, weights, _ = logreg_runs
    assert torch.equal(weights("allreduce", 0), weights("allreduce", 1))


def test_local_sgd_period_1_equals_allreduce(logreg_runs):
    _, weights, _ = logreg_runs
    reference = weights("allreduce", 0)
    for name in ("local-1", "third-party", "allreduce-no-overlap"):
        for rank in (0, 1):
            torch.testing.assert_close(weights(name, rank), reference, rtol=1e-5, atol=1e-6)


def test_momentum_before_compression_without_a_compressor_equals_momentum_sgd(logreg_runs):
    """The mean of the workers' momenta is the momentum of the mean gradient (it is linear),
    so with nothing compressed, moving momentum in front of the averaging changes nothing."""
    _, weights, _ = logreg_runs
    reference = weights("momentum", 0)
    assert not torch.allclose(reference, weights("allreduce", 0), atol=1e-3)
    for rank in (0, 1):
        torch.testing.assert_close(weights("momentum-before-compression", rank), reference,
                                   rtol=1e-5, atol=1e-6)


def test_local_sgd_with_longer_period_differs_but_converges(logreg_runs):
    _, weights, _ = logreg_runs
    optimum = LogisticRegression().optimum().float()
    start_gap = optimum.norm()
    local = weights("local-4", 0)
    assert not torch.allclose(local, weights("allreduce", 0), atol=1e-4)
    for name in ("allreduce", "local-4"):
        assert (weights(name, 0) - optimum).norm() < 0.25 * start_gap


def test_bytes_counted_as_ring_allreduce_traffic(logreg_runs):
    _, _, rows = logreg_runs
    steps = 3 * (2048 // 2 // 32)
    model_bytes = 10 * 4
    # Ring all-reduce over n=2 sends 2(n-1)/n = 1 model's worth per worker per step.
    assert rows["allreduce"]["total_bytes_sent"] == steps * model_bytes * 2
    assert rows["local-1"]["total_bytes_sent"] == steps * model_bytes * 2
    assert rows["local-4"]["total_bytes_sent"] == steps // 4 * model_bytes * 2
    for row in (rows[name] for name in LOGREG):
        assert row["status"] == "completed"
        assert row["test_accuracy"] > 0.75
        assert row["samples_per_second"] > 0 and row["wall_seconds"] > 0


def test_time_to_accuracy_and_emulated_network(logreg_runs):
    _, _, rows = logreg_runs
    reached = rows["allreduce"]["time_to_accuracy"]
    assert 0 < reached <= rows["allreduce"]["wall_seconds"]
    # Each all-reduce of 40 bytes over n = 2 is 2 messages of 1 ms plus 40 bytes at 1 Mbit/s:
    # the emulation never lets it finish sooner, so no step is shorter.
    emulated = 2 * 1e-3 + 40 * 8 / 1e6
    slow = rows["slow-network"]
    assert slow["step_seconds"] >= emulated
    # comm_seconds counts the time blocked waiting: all of it but the moments between issuing
    # the all-reduce and waiting for it (microseconds, unless the scheduler steps in).
    assert 0.5 * emulated <= slow["comm_seconds"] <= slow["step_seconds"]


def test_metric_history_per_rank_and_epoch(logreg_runs):
    db, _, _ = logreg_runs
    store = Store(str(db))
    run = [r for r in store.runs() if r.experiment == "local-4"][0]
    losses = store.metric_history(run.id, "train_loss")
    assert {m.rank for m in losses} == {0, 1}
    assert {m.step for m in losses} == set(range(10, 97, 10)) | {32, 64, 96}
    epochs = store.metric_history(run.id, "test_accuracy")
    assert [m.epoch for m in epochs] == [0, 1, 2] and {m.rank for m in epochs} == {None}
    names = {s.name for s in run.summaries}
    assert {"consensus_distance", "test_accuracy_workers", "test_loss_workers", "bytes_sent",
            "comm_seconds", "compute_seconds", "step_seconds", "lr"} <= names
    identical = [r for r in store.runs() if r.experiment == "allreduce"][0]
    assert "consensus_distance" not in {s.name for s in identical.summaries}
    assert {(p.kind, p.name, p.distribution) for p in run.plugins} >= {
        ("aggregator", "local_sgd", "dsgd"), ("task", "logreg", "dsgd")}
    third = [r for r in store.runs() if r.experiment == "third-party"][0]
    assert ("aggregator", "model_average", "dsgd-testplugins", "1.2.3") in {
        (p.kind, p.name, p.distribution, p.version) for p in third.plugins}
    assert {s.name: s.final for s in third.summaries}["averages"] == 1.0


def test_each_builtin_aggregator_and_task_trains(all_runs):
    _, _, _, rows = all_runs
    assert [rows[name]["status"] for name in BUILTIN] == ["completed"] * 3
    for row in (rows[name] for name in BUILTIN):
        assert row["test_accuracy"] > 0.2  # chance is 0.1
        assert row["train_loss"] < 2.2    # log(10) = 2.30 at the start


def test_worker_crash_fails_run_and_keeps_metrics(all_runs):
    result, db, _, _ = all_runs
    assert result.returncode == 1
    store = Store(str(db))
    runs = {run.experiment: run for run in store.runs()}
    crashed, after = runs["crashes"], runs["after"]
    assert (f"1 of {len(runs)} runs failed: crashes (run {crashed.id}): rank 1: RuntimeError: "
            "injected failure at step 5") in result.stderr
    assert "Traceback" not in result.stderr
    assert (crashed.status, crashed.failed_rank) == ("failed", 1)
    assert crashed.reason == "rank 1: RuntimeError: injected failure at step 5"
    steps = {(m.rank, m.step) for m in store.metric_history(crashed.id, "train_loss")}
    assert {(0, 2), (0, 4), (1, 2), (1, 4)} <= steps
    assert after.status == "completed"  # one failed run does not stop the rest


@pytest.mark.slow
def test_mnist1d_cnn_reaches_80_percent(tmp_path):
    spec = write_spec(tmp_path, """
        experiments:
          - name: cnn
            task: {name: mnist1d_cnn}
            workers: 2
            epochs: 15
            batch_size: 32
            optimizer: {name: sgd, lr: 0.05, momentum: 0.9}
            aggregator: {name: allreduce}
    """)
    db = tmp_path / "r.db"
    result = dsgd_in_process("run", str(spec), "--db", str(db))
    assert result.returncode == 0, result.stderr
    assert compare_json(db)[0]["test_accuracy"] >= 0.80
