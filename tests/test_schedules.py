"""Learning-rate schedules and lr_scaling: the `lr` recorded at chosen steps equals each
schedule's formula, in real runs under allreduce and under an asynchronous aggregator, with
the scaling applied; a resumed run continues the schedule where it stopped; bad input is one
line and exit 2."""

from __future__ import annotations

import math

import pytest

from conftest import dsgd, dsgd_in_process, write_spec
from dsgd_cli.results.store import Store

LR = 0.1
# 4 workers, 12 steps each (log_interval 1: every step's lr is recorded), in one launch; the
# last experiment's schedule comes from the test plugin package (`plugin_env`).
SPEC = """
    defaults:
      task: {{name: logreg}}
      workers: 4
      epochs: 1
      steps_per_epoch: 12
      log_interval: 1
      optimizer: {{name: sgd, lr: 0.1}}
    experiments:
      - name: cosine-allreduce
        lr_schedule: {{name: cosine, warmup_steps: 4, final_lr: 0.01}}
        lr_scaling: linear
        checkpoint_every: 5
      - name: step-adpsgd
        aggregator: {{name: adpsgd}}
        lr_schedule: {{name: step, milestones: [6, 9], factor: 0.5, warmup_steps: 2}}
        lr_scaling: sqrt
      - name: cosine-budget
        budget: {{samples: 1280}}       # 1280 / (4 workers x 32) = 10 steps
        lr_schedule: {{name: cosine, final_lr: 0.02}}
      - name: constant-warmup-epochs
        aggregator: {{name: local_sgd, period: 2}}
        lr_schedule: {{name: constant, warmup_epochs: 0.5}}   # 16 steps per epoch: 8 steps
        steps_per_epoch: null
        budget: {{samples: 1280}}
      - name: third-party
        steps_per_epoch: 5
        optimizer: {{name: sgd, lr: 0.2}}
        lr_schedule: {{name: exponential, warmup_steps: 1, gamma: 0.5}}
"""


def lr_by_rank(db, run_id) -> dict[int, dict[int, float]]:
    """rank -> {step: lr}"""
    history: dict[int, dict[int, float]] = {}
    for m in Store(str(db)).metric_history(run_id, "lr"):
        history.setdefault(m.rank, {})[m.step] = m.value
    return history


@pytest.fixture(scope="module")
def runs(tmp_path_factory, plugin_env):
    tmp = tmp_path_factory.mktemp("schedules")
    spec = write_spec(tmp, SPEC.format())
    db = tmp / "r.db"
    result = dsgd("run", str(spec), "--db", str(db), "--checkpoint-dir", str(tmp / "ck"),
                  env=plugin_env)
    assert result.returncode == 0, result.stdout + result.stderr
    return db, {run.experiment: run.id for run in Store(str(db)).runs()}


def cosine(step, peak, final, warmup, total):
    return final + (peak - final) * (1 + math.cos(math.pi * (step - warmup) / (total - warmup))) / 2


def test_cosine_with_warmup_and_linear_scaling_under_allreduce(runs):
    db, ids = runs
    peak = 4 * LR  # linear scaling at 4 workers
    history = lr_by_rank(db, ids["cosine-allreduce"])
    assert sorted(history) == [0, 1, 2, 3]
    for rank, lrs in history.items():
        assert sorted(lrs) == list(range(1, 13))
        assert lrs[1] == pytest.approx(peak / 4)          # warm-up starts at peak / W
        assert lrs[2] == pytest.approx(peak * 2 / 4)
        assert lrs[4] == pytest.approx(peak)              # and ends at the peak
        assert lrs[8] == pytest.approx((peak + 0.01) / 2)  # midpoint of (4, 12]
        assert lrs[12] == pytest.approx(0.01)             # the last step: final_lr
        for step in range(5, 13):
            assert lrs[step] == pytest.approx(cosine(step, peak, 0.01, 4, 12)), step


def test_step_decay_with_warmup_and_sqrt_scaling_under_an_asynchronous_aggregator(runs):
    db, ids = runs
    peak = 2 * LR  # sqrt scaling at 4 workers
    history = lr_by_rank(db, ids["step-adpsgd"])
    assert sorted(history) == [0, 1, 2, 3]
    for rank, lrs in history.items():
        assert sorted(lrs) == list(range(1, 13))  # each worker's own steps
        assert lrs[1] == pytest.approx(peak / 2)
        assert lrs[2] == pytest.approx(peak)
        assert lrs[6] == pytest.approx(peak)           # milestone 6: decays after it
        assert lrs[7] == pytest.approx(peak * 0.5)
        assert lrs[9] == pytest.approx(peak * 0.5)
        assert lrs[10] == pytest.approx(peak * 0.25)
        assert lrs[12] == pytest.approx(peak * 0.25)


def test_cosine_under_a_samples_budget_ends_at_the_budgets_last_step(runs):
    db, ids = runs
    for rank, lrs in lr_by_rank(db, ids["cosine-budget"]).items():
        assert sorted(lrs) == list(range(1, 11))
        assert lrs[1] == pytest.approx(cosine(1, LR, 0.02, 0, 10))
        assert lrs[5] == pytest.approx((LR + 0.02) / 2)
        assert lrs[10] == pytest.approx(0.02)


def test_warmup_in_epochs(runs):
    db, ids = runs
    # logreg: 2048 examples / 4 workers / 32 = 16 steps per epoch; 0.5 epochs = 8 steps.
    for rank, lrs in lr_by_rank(db, ids["constant-warmup-epochs"]).items():
        assert [round(lrs[s], 10) for s in (1, 4, 8, 9, 10)] == [
            round(LR * 1 / 8, 10), round(LR * 4 / 8, 10), LR, LR, LR]


def test_a_resumed_run_continues_the_schedule(runs):
    """Recorded as failed after it completed, the run resumes from its checkpoint of step 10
    (the optimizer's lr in the checkpoint is step 10's): steps 11 and 12 get the same rates."""
    db, ids = runs
    run_id = ids["cosine-allreduce"]
    before = lr_by_rank(db, run_id)
    store = Store(str(db))
    store.finish_run(run_id, "failed", "recorded as failed by the test")
    result = dsgd_in_process("run", "--resume", str(run_id), "--db", str(db))
    assert result.returncode == 0, result.stdout + result.stderr
    assert [entry["step"] for entry in store.resumes(run_id)] == [10]
    after = lr_by_rank(db, run_id)
    assert after == before
    assert after[0][11] == pytest.approx(cosine(11, 4 * LR, 0.01, 4, 12))


@pytest.mark.parametrize("experiment, message", [
    ("{name: a, epochs: 2, lr_schedule: {name: cosine, warmup_steps: 65}}",
     "experiments[0].lr_schedule: the warm-up is longer than the run (warmup_steps: 65, "
     "the run has 64 steps per worker)"),
    ("{name: a, lr_schedule: {name: constant, warmup_epochs: 1.5}}",
     "experiments[0].lr_schedule: the warm-up is longer than the run (warmup_epochs: 1.5 "
     "(48 steps), the run has 32 steps per worker)"),
    ("{name: a, lr_schedule: {name: cyclic}}",
     "experiments[0].lr_schedule.name: unknown lr_schedule 'cyclic' (installed: constant, "
     "cosine, step)"),
    ("{name: a, lr_schedule: {name: step, milestone: [3]}}",
     "experiments[0].lr_schedule.milestone: unknown option 'milestone'"),
    ("{name: a, lr_schedule: {name: step, milestones: [9, 3]}}",
     "experiments[0].lr_schedule: milestones: expected increasing positive values"),
    ("{name: a, lr_schedule: {name: step, warmup_steps: 5, warmup_epochs: 1}}",
     "experiments[0].lr_schedule: set warmup_steps or warmup_epochs, not both"),
    ("{name: a, lr_scaling: quadratic}",
     "experiments[0].lr_scaling: expected one of none, linear, sqrt, got 'quadratic'"),
    ("{name: a, budget: {seconds: 5}, lr_schedule: cosine}",
     "experiments[0].lr_schedule: schedule 'cosine' needs the run's length in steps, "
     "which a seconds budget does not give"),
])
def test_bad_schedules_are_one_line_and_exit_2(tmp_path, experiment, message):
    spec = write_spec(tmp_path, f"""
        defaults: {{task: logreg, workers: 2}}
        experiments:
          - {experiment}
    """)
    result = dsgd_in_process("run", str(spec), "--db", str(tmp_path / "r.db"))
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.startswith(f"dsgd: error: {spec}: {message}"), result.stderr
    assert len(result.stderr.splitlines()) == 1
    assert not (tmp_path / "r.db").exists()  # nothing written


def test_each_grid_point_is_checked_against_its_own_length(tmp_path):
    """The same schedule section fits 2 epochs (64 steps) and not 1 (32 steps)."""
    spec = write_spec(tmp_path, """
        defaults: {task: logreg, workers: 2, lr_schedule: {name: cosine, warmup_steps: 40}}
        experiments:
          - {name: a, grid: {epochs: [2, 1]}}
    """)
    result = dsgd_in_process("run", str(spec), "--dry-run")
    assert result.returncode == 2
    assert ("defaults.lr_schedule: the warm-up is longer than the run (warmup_steps: 40, "
            "the run has 32 steps per worker)") in result.stderr


def test_a_third_party_schedule_is_found_validated_and_applied(tmp_path, plugin_env, runs):
    """The test package registers `exponential` under dsgd.schedules, as any distribution
    would; `runs` ran it (its experiment `third-party`)."""
    bad = write_spec(tmp_path, """
        experiments:
          - {name: a, task: logreg, lr_schedule: {name: exponential, gamma: 2}}
    """, name="bad.yaml")
    result = dsgd("run", str(bad), "--dry-run", env=plugin_env)
    assert result.returncode == 2
    assert "experiments[0].lr_schedule.gamma: expected a value <= 1.0, got 2" in result.stderr
    db, ids = runs
    history = lr_by_rank(db, ids["third-party"])
    assert sorted(history) == [0, 1, 2, 3]
    for rank, lrs in history.items():
        assert [lrs[s] for s in range(1, 6)] == pytest.approx([0.2, 0.1, 0.05, 0.025, 0.0125])


def test_steps_past_the_last_stay_at_its_rate_and_param_groups_keep_their_ratio():
    """A worker of an algorithm whose workers run different numbers of steps may run past
    the run's nominal last step T: it keeps step T's rate. A second param group with half the
    first's lr gets half the scheduled rate."""
    import torch

    from dsgd_cli.spec.learning_rate import LearningRate
    from dsgd_cli.spec.experiments import build_plugin

    weight, bias = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([{"params": [weight], "lr": 0.2}, {"params": [bias], "lr": 0.1}])
    schedule = build_plugin("lr_schedule", {"name": "cosine", "warmup_steps": 2,
                                            "warmup_epochs": 0.0, "final_lr": 0.05})
    rate = LearningRate(schedule, optimizer, [0.2, 0.1], "sqrt", 4, total=10, steps_per_epoch=5)
    assert rate.apply(1) == pytest.approx(0.2)            # peak 0.4 (sqrt of 4), step 1 of 2
    assert rate.apply(6) == pytest.approx(cosine(6, 0.4, 0.05, 2, 10))
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx(
        [cosine(6, 0.4, 0.05, 2, 10), cosine(6, 0.4, 0.05, 2, 10) / 2])
    assert rate.apply(10) == pytest.approx(0.05)
    assert rate.apply(13) == pytest.approx(0.05)          # past the last step
    # Any schedule, not only those that clamp themselves: a milestone after T never applies.
    step = build_plugin("lr_schedule", {"name": "step", "warmup_steps": 0, "warmup_epochs": 0.0,
                                        "milestones": [11], "milestone_epochs": [], "factor": 0.1})
    rate = LearningRate(step, optimizer, [0.2, 0.1], "none", 4, total=10, steps_per_epoch=5)
    assert [rate.apply(s) for s in (1, 10, 12, 20)] == pytest.approx([0.2] * 4)
    with pytest.raises(ValueError, match="the warm-up is longer than the run"):
        LearningRate(schedule, optimizer, [0.2, 0.1], "none", 4, total=1, steps_per_epoch=5)
