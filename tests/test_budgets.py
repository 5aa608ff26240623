"""Budgets and what a run says of its length before and while it runs: the step a samples
budget stops at (an epoch's short last batch included), the progress bar's count and total
(backup counts updates), and `dsgd run --dry-run`'s description of each experiment."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from conftest import dsgd_in_process, write_spec
from dsgd_cli.api import RunLength
from dsgd_cli.commands.run import _stats
from dsgd_cli.launch.run_events import Progress as BarState, _take_progress, _update_progress
from dsgd_cli.spec.learning_rate import total_steps
from dsgd_cli.spec.sharding import Shard, samples_budget_steps, samples_in_steps, steps_per_epoch
from dsgd_cli.results.store import Store
from dsgd_cli.worker.schedule import Progress, StopRule
from plugins.aggregators.allreduce import AllReduce
from plugins.aggregators.backup import Backup
from plugins.aggregators.gossip.adpsgd import ADPSGD

MNIST1D_TRAIN = 4000  # mnist1d's 5,000 examples, 80% of them for training
LOGREG_TRAIN = 2048


def _batch_lengths(examples: int, workers: int, batch: int, cap: int | None):
    """One worker's batch sizes, step after step, drawn as the training loop draws them."""
    shard = Shard(examples, 0, workers, seed=0)
    per_epoch = steps_per_epoch(shard, batch, cap)
    step = 0
    while True:
        epoch, b = divmod(step, per_epoch)
        yield len(shard.indices(epoch)[b * batch: (b + 1) * batch])
        step += 1


# (training examples, workers, batch_size, steps_per_epoch cap, budget samples, steps)
CASES = [
    (MNIST1D_TRAIN, 8, 32, None, 16_000, 64),  # issue 30: 63 steps hold only 15,840 samples
    (MNIST1D_TRAIN, 2, 32, None, 16_000, 252),  # ceil(16,000 / 64) = 250: four short batches
    (MNIST1D_TRAIN, 2, 32, None, 8_000, 126),
    (MNIST1D_TRAIN, 2, 40, None, 3_200, 40),  # 40 divides the 2,000-example shards
    (LOGREG_TRAIN, 2, 32, None, 1_000, 16),
    (MNIST1D_TRAIN, 3, 32, 10, 5_000, 53),  # capped epochs: every batch full
    (MNIST1D_TRAIN, 8, 1000, None, 9_000, 3),  # a batch larger than the shard
    (MNIST1D_TRAIN, 7, 5, None, 1, 1),
    (MNIST1D_TRAIN, 5, 48, None, 12_345, 53),
]


@pytest.mark.parametrize("examples,workers,batch,cap,samples,expected", CASES)
def test_a_samples_budget_stops_at_the_first_step_that_reaches_it(examples, workers, batch,
                                                                   cap, samples, expected):
    trained, steps = 0, 0
    for length in _batch_lengths(examples, workers, batch, cap):
        trained += workers * length
        steps += 1
        if trained >= samples:
            break
    assert steps == expected
    assert samples <= trained < samples + workers * batch  # within one step per worker
    shard = Shard(examples, 0, workers, seed=0)
    per_epoch = steps_per_epoch(shard, batch, cap)
    assert samples_budget_steps(samples, workers, shard.size, batch, per_epoch) == expected
    assert workers * samples_in_steps(expected, shard.size, batch, per_epoch) == trained


def _config(workers: int, batch: int, samples: int | None, epochs: int = 1) -> dict:
    budget = None if samples is None else {"samples": samples, "seconds": None, "evaluations": 2}
    return {"workers": workers, "batch_size": batch, "epochs": epochs, "budget": budget}


@pytest.mark.parametrize("examples,workers,batch,cap,samples,expected", CASES)
def test_workers_in_step_stop_where_the_bar_and_the_schedule_say(examples, workers, batch, cap,
                                                                  samples, expected):
    """The step the run stops after is the step count the progress bar announces and the
    learning-rate schedule ends at (cosine's last step)."""
    shard = Shard(examples, 0, workers, seed=0)
    per_epoch = steps_per_epoch(shard, batch, cap)
    planned = total_steps(_config(workers, batch, samples), shard.size, per_epoch)
    assert planned == expected
    rule = StopRule(RunLength(samples=samples), AllReduce(), SimpleNamespace(world_size=workers),
                    planned)
    assert rule.expected_steps() == expected
    step = 0
    for length in _batch_lengths(examples, workers, batch, cap):
        step += 1
        done = rule.after_step(step, length)
        assert rule.progress_bar(step) == Progress(step, expected, "steps")
        if done:
            break
    assert step == expected


class _Counter:
    """The rendezvous store's shared counter, for one process."""

    def __init__(self):
        self.total = 0

    def add(self, amount: int) -> int:
        self.total += amount
        return self.total

    def value(self) -> int:
        return self.total


def test_workers_on_their_own_count_the_shared_samples():
    counter = _Counter()
    rule = StopRule(RunLength(samples=100, samples_counter=counter), ADPSGD(),
                    SimpleNamespace(world_size=2), planned_steps=2)
    assert rule.expected_steps() is None  # the planned step is the schedule's, not the stop
    counter.add(64)  # the other worker's steps
    assert not rule.after_step(1, 32)
    assert rule.progress_bar(1) == Progress(96, 100, "samples")
    assert rule.after_step(2, 32)


def _backup(applied: int) -> Backup:
    backup = Backup()
    backup.applied, backup._finished = applied, False
    return backup


def test_backups_bar_counts_the_runs_updates_against_its_length():
    """Issue 30: rank 0, slow, had made 25 steps when the run had made 71 updates: the bar
    counts the updates (its model version), of the run's length in updates."""
    rule = StopRule(RunLength(steps=80), _backup(71), SimpleNamespace(world_size=8), 80)
    rule.after_step(25, 32)
    assert rule.progress_bar(25) == Progress(71, 80, "updates")


def test_backups_bar_under_a_samples_budget_counts_samples_and_says_the_updates():
    counter = _Counter()
    rule = StopRule(RunLength(samples=16_000, samples_counter=counter), _backup(71),
                    SimpleNamespace(world_size=8), 64)
    counter.add(15_000)
    rule.after_step(25, 32)
    assert rule.progress_bar(25) == Progress(15_032, 16_000, "samples", updates=71)


def test_the_launcher_shows_the_workers_progress_not_the_metrics_step():
    bar = BarState(total_steps=None)
    _update_progress(bar, {"name": "train_loss", "value": 0.5, "step": 25, "per_rank": True})
    assert (bar.step, bar.total_steps) == (25, None)  # workers without progress events
    _take_progress(bar, {"done": 71, "total": 80, "unit": "updates"})
    _update_progress(bar, {"name": "train_loss", "value": 0.4, "step": 26, "per_rank": True})
    assert (bar.step, bar.total_steps, bar.train_loss) == (71, 80, 0.4)
    assert _stats(bar).startswith("updates  loss 0.4000")
    _take_progress(bar, {"done": 15_032, "total": 16_000, "unit": "samples", "updates": 71})
    assert _stats(bar).startswith("samples, 71 updates  loss")


def test_a_launched_run_stops_where_it_said_and_backups_bar_counts_updates(tmp_path,
                                                                          monkeypatch):
    """2 workers on MNIST-1D: 8,000 samples of batch 32 are 126 steps (each epoch's last batch
    holds 16), not ceil(8000 / 64) = 125, and cosine reaches final_lr at the last one. backup
    with a slow rank 0 (whose progress is shown): its bar ends at the run's 12 updates."""
    spec = write_spec(tmp_path, """
        defaults:
          task: {name: mnist1d_mlp}
          workers: 2
          batch_size: 32
          log_interval: 5
          optimizer: {name: sgd, lr: 0.05}
        experiments:
          - name: budget
            aggregator: {name: allreduce}
            lr_schedule: {name: cosine}
            budget: {samples: 8000, evaluations: 2}
          - name: backup
            aggregator: {name: backup, backups: 1}
            epochs: 1
            steps_per_epoch: 12
            log_interval: 1
            stragglers: {ranks: [0], slowdown: 8}
            compute: {step_seconds: 0.005, time_scale: 4}
    """)
    db = tmp_path / "runs.db"
    monkeypatch.setenv("COLUMNS", "200")  # room for the bars' text
    result = dsgd_in_process("run", str(spec), "--db", str(db))
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(r"budget .* 126/126 ", result.stdout), result.stdout
    assert re.search(r"backup .* 12/12 +updates ", result.stdout), result.stdout
    store = Store(str(db))
    runs = {run.experiment: run for run in store.runs()}
    lr = {m.step: m.value for m in store.metric_history(runs["budget"].id, "lr") if m.rank == 0}
    assert max(lr) == 126
    assert lr[126] == 0.0 < lr[125]  # cosine's final_lr at the run's last step, not before
    steps = [m.step for m in store.metric_history(runs["backup"].id, "train_loss")
             if m.rank == 0]
    assert max(steps) < 12  # rank 0 skipped updates: its own steps are not the run's


def test_dry_run_shows_each_experiments_length_budget_compute_network_and_stragglers(tmp_path):
    spec = write_spec(tmp_path, """
        defaults:
          task: {name: mnist1d_mlp}
          workers: 8
          batch_size: 32
          log_interval: 5
        experiments:
          - name: issue
            aggregator: {name: allreduce}
            budget: {samples: 16000, evaluations: 8}
            network: {bandwidth: 1GB, latency: 100us}
          - name: async
            aggregator: {name: adpsgd}
            budget: {samples: 16000}
            network: {bandwidth: 1Gb}
            stragglers: {ranks: [0, 3], slowdown: 3, random: {probability: 0.1, slowdown: 2}}
            compute: {step_seconds: 0.05, variation: {distribution: lognormal, sigma: 0.3},
                      time_scale: 4}
          - name: epochs
            aggregator: {name: allreduce}
            epochs: 3
          - name: seconds
            aggregator: {name: allreduce}
            budget: {seconds: 30}
    """)
    result = dsgd_in_process("run", str(spec), "--dry-run")
    assert result.returncode == 0, result.stderr
    described: dict[str, list[str]] = {}
    for line in result.stdout.splitlines():
        if re.match(r"  \S+: \d+ workers", line):
            current = described.setdefault(line.split(":")[0].strip(), [])
        elif line.startswith("    ") and not line.strip().split(":")[0].endswith("options"):
            current.append(line.strip())
    assert described["issue"] == [
        "length: budget 16,000 samples over all workers, batch 32: 64 steps per worker "
        "(16,000 samples), 8 evaluations of the average model; epochs ignored",
        "compute: measured (no compute model: steps take the time they take)",
        "network: 1 GB/s = 8 Gbit/s, latency 100 µs",
        "stragglers: none",
        "failures: none",
        "real time: unknown before the run (measured steps take what this machine takes)"]
    assert described["async"] == [
        "length: budget 16,000 samples over all workers, batch 32: each worker stops once they "
        "are spent (64 steps per worker at equal speed), 10 evaluations of the average model; "
        "epochs ignored",
        "compute: 50 ms per step (modeled), lognormal variation (sigma 0.3), time scale 4 "
        "(real seconds per modeled second)",
        "network: 125 MB/s = 1 Gbit/s, latency 0 s",
        "stragglers: ranks 0, 3 3× slower; each step of each worker 2× slower with "
        "probability 0.1",
        "failures: none",
        "real time: at least 12.8 s of training (3.2 s modeled × time scale 4), plus "
        "communication, evaluation, failures and start-up"]
    assert described["epochs"][0] == "length: 3 epochs × 16 steps = 48 steps per worker, of batch 32"
    assert described["seconds"][0] == ("length: budget 30 s of training (modeled), batch 32, "
                                       "10 evaluations of the average model; epochs ignored")
    assert "1 epochs" not in result.stdout


def test_the_dry_run_shows_the_failures_and_the_least_real_time(tmp_path):
    """Each failure model in words (its mode decides what a failure does), and the real time
    the modeled steps take at least: a failure spec took 9 minutes that nobody saw coming."""
    spec = write_spec(tmp_path, """
        defaults: {task: logreg, workers: 4, compute: {step_seconds: 0.1, time_scale: 2}}
        experiments:
          - {name: restart, failures: {mtbf: 20s, restart: 1s, checkpoint_every: 10,
                                       at: [{node: 1, time: 3s}]}}
          - {name: continue, aggregator: {name: diloco, period: 5},
             failures: {mtbf: 20s, restart: 1s}}
    """)
    result = dsgd_in_process("run", str(spec), "--dry-run")
    assert result.returncode == 0, result.stderr
    lines = [line.strip() for line in result.stdout.splitlines()]
    assert ("failures: mtbf 20 s per worker (exponential, seed 0); worker 1 at 3 s; away 1 s; "
            "every worker rolls back to the checkpoint of every 10 steps (restart mode)") in lines
    assert ("failures: mtbf 20 s per worker (exponential, seed 0); away 1 s; the others go on "
            "without it (continue mode), and it rejoins") in lines
    # logreg: 2,048 examples, 4 workers, batch 32: 16 steps of 0.1 s, at 2 real s each
    assert lines.count("real time: at least 3.2 s of training (1.6 s modeled × time scale 2), "
                       "plus communication, evaluation, failures and start-up") == 2
