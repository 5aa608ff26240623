"""Checkpoints and `dsgd run --resume`: a run stopped part-way and resumed ends with exactly the
parameters and metric history of a run never stopped (synchronous algorithms, CPU, same seed);
third-party state resumes through the default `state_dict()`; a torn checkpoint is never
loaded."""

from __future__ import annotations

import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
import torch

from checkpoint_helpers import latest_complete
from conftest import dsgd, dsgd_in_process, experiment_config, write_spec
from dsgd_cli.worker import checkpoint
from dsgd_cli.launch.resume import resumable
from dsgd_cli.results.store import Store

# 12 epochs of 32 steps on logistic regression; the emulated latency makes each step of
# `ar` take 10 ms and of `local` about 5 ms, time enough to interrupt the run part-way.
SPEC = """
    defaults:
      task: {{name: logreg}}
      workers: 2
      epochs: 12
      log_interval: 10
      checkpoint_every: 50
      optimizer: {{name: sgd, lr: 0.1, momentum: 0.9}}
      network: {{latency: 10ms}}
      save_dir: {save_dir}
    experiments:
      - name: ar
        aggregator: {{name: allreduce, error_feedback: true,
                     compressor: {{name: topk, ratio: 0.5}}}}
      - name: local
        aggregator: {{name: local_sgd, period: 2}}
"""


def _models(directory: Path, name: str) -> list[dict]:
    return [torch.load(directory / name / f"rank{rank}.pt") for rank in (0, 1)]


def _history(db: Path, run_id: int) -> list[tuple]:
    """Every recorded metric of a run but the clock-dependent ones, in a stable order."""
    store = Store(str(db))
    rows = []
    for name in ("train_loss", "lr", "test_accuracy", "test_loss", "consensus_distance",
                 "bytes_sent"):
        rows += [(name, m.rank, m.step, m.epoch, m.value) for m in store.metric_history(run_id, name)]
    return sorted(rows, key=lambda row: (row[0], row[2], -1 if row[1] is None else row[1]))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """`reference(name)`: experiment `name` run without interruption, launched once, on first
    use (the default suite resumes only `ar`: `local`'s reference is not run there)."""
    made: dict[str, tuple[Path, int]] = {}

    def uninterrupted(name: str) -> tuple[Path, int]:
        if name not in made:
            tmp = tmp_path_factory.mktemp(f"reference-{name}")
            spec = write_spec(tmp, SPEC.format(save_dir=tmp / "models"))
            result = dsgd("run", str(spec), "-e", name, "--db", str(tmp / "r.db"),
                          "--checkpoint-dir", str(tmp / "ck"))
            assert result.returncode == 0, result.stdout + result.stderr
            (run,) = Store(str(tmp / "r.db")).runs()
            made[name] = tmp, run.id
        return made[name]

    return uninterrupted


def _interrupt_after_a_checkpoint(spec: Path, db: Path, checkpoints: Path, name: str) -> None:
    """Start `dsgd run -e name`, SIGINT it once its workers wrote the checkpoint of step 50:
    they save a last one where they are and leave."""
    process = subprocess.Popen(
        [sys.executable, "-m", "dsgd_cli", "run", str(spec), "-e", name, "--db", str(db),
         "--checkpoint-dir", str(checkpoints)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tempfile.gettempdir())
    try:
        deadline = time.monotonic() + 240
        while not list(checkpoints.glob("*/step-0000000050/rank-1.pt")):
            assert process.poll() is None and time.monotonic() < deadline, process.communicate()
            time.sleep(0.05)
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 130, stderr
    assert stderr.strip().splitlines()[-1] == "dsgd: interrupted"


# Both slow (22 s each; CI runs -m slow): by default, test_emulation's overrun run and
# test_schedules' cosine run are resumed end to end.
@pytest.mark.parametrize("name", [pytest.param("ar", marks=pytest.mark.slow),
                                  pytest.param("local", marks=pytest.mark.slow)])
def test_an_interrupted_run_resumes_to_the_uninterrupted_result(reference, tmp_path, name):
    ref_dir, ref_run = reference(name)
    spec = write_spec(tmp_path, SPEC.format(save_dir=tmp_path / "models"))
    db, checkpoints = tmp_path / "r.db", tmp_path / "ck"
    _interrupt_after_a_checkpoint(spec, db, checkpoints, name)
    (run,) = Store(str(db)).runs()
    assert run.status == "interrupted"
    # Asked to stop, the workers agreed on a step after the one they were at and saved a
    # last checkpoint there.
    stopped_at = latest_complete(Store(str(db)).checkpoint_dir(run.id), 2)
    assert 50 < stopped_at < 384

    result = dsgd("run", "--resume", str(run.id), "--db", str(db))
    assert result.returncode == 0, result.stdout + result.stderr
    store = Store(str(db))
    assert [r.status for r in store.runs()] == ["completed"]  # the same run, not a new one
    assert [entry["step"] for entry in store.resumes(run.id)] == [stopped_at]

    for resumed, uninterrupted in zip(_models(tmp_path / "models", name),
                                      _models(ref_dir / "models", name)):
        assert resumed.keys() == uninterrupted.keys()
        for key in resumed:
            assert torch.equal(resumed[key], uninterrupted[key]), key
    # Every step once, with the values of the run never interrupted.
    history = _history(db, run.id)
    assert history == _history(ref_dir / "r.db", ref_run)
    steps = [(rank, step) for metric, rank, step, *_ in history if metric == "train_loss"]
    assert len(steps) == len(set(steps)) and max(step for _, step in steps) == 384
    assert {s.name for s in store.get_run(run.id).summaries} >= {"wall_seconds", "test_accuracy"}


@pytest.mark.slow  # end to end; the default state dict round trip is also resumed bit for bit by test_an_interrupted_run_resumes_to_the_uninterrupted_result
def test_third_party_state_resumes_through_the_default_state_dict(tmp_path, plugin_env):
    """The test package's `slow_momentum` keeps a step counter and two vectors in plain
    attributes and writes no `state_dict()`. A run that fails at step 23 resumes from its
    checkpoint of step 20, between two averages (every 3 steps): losing the counter or the
    vectors would change the result."""
    text = """
        defaults: {{task: logreg, workers: 2, epochs: 2, checkpoint_every: 5,
                   save_dir: {save}, aggregator: {{name: slow_momentum, every: 3}}}}
        experiments: [{{name: sm}}]
    """
    reference = write_spec(tmp_path, text.format(save=tmp_path / "ref"), "ref.yaml")
    result = dsgd("run", str(reference), "--db", str(tmp_path / "ref.db"), env=plugin_env)
    assert result.returncode == 0, result.stdout + result.stderr

    spec = write_spec(tmp_path, text.format(save=tmp_path / "models"))
    db = tmp_path / "r.db"
    failing = dsgd("run", str(spec), "--db", str(db), env={**plugin_env, "DSGD_TESTPLUGINS_FAIL_AT": "23"})
    assert failing.returncode == 1
    (run,) = Store(str(db)).runs()
    assert (run.status, run.failed_rank) == ("failed", 1)
    assert "injected failure at step 23" in run.reason

    result = dsgd("run", "--resume", str(run.id), "--db", str(db), env=plugin_env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert [entry["step"] for entry in Store(str(db)).resumes(run.id)] == [20]
    for resumed, uninterrupted in zip(_models(tmp_path / "models", "sm"), _models(tmp_path / "ref", "sm")):
        assert all(torch.equal(resumed[key], uninterrupted[key]) for key in resumed)


def test_a_torn_checkpoint_is_never_loaded(tmp_path):
    """A worker killed while writing its checkpoint of step 20 leaves a temporary file only:
    step 20 is incomplete, and the run resumes from step 10."""
    directory = tmp_path / "ck"
    for rank in (0, 1):
        checkpoint.save(directory, 10, rank, {"step": 10, "rank": rank}, workers=2)
    checkpoint.save(directory, 20, 0, {"step": 20, "rank": 0}, workers=2)
    writer = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import time, torch
        from dsgd_cli.worker import checkpoint

        def stuck(state, file):  # writes half a file, then hangs until killed
            file.write(b"PK" + bytes(4096))
            file.flush()
            time.sleep(600)

        torch.save = stuck
        checkpoint.save({str(directory)!r}, 20, 1, {{"step": 20}}, workers=2)
    """)])
    try:
        deadline = time.monotonic() + 60
        while not list((directory / "step-0000000020").glob(".rank-1.pt.*.tmp")):
            assert writer.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        writer.send_signal(signal.SIGKILL)
        writer.wait(timeout=30)
    finally:
        writer.kill()
    assert latest_complete(directory, 2) == 10
    assert checkpoint.load(directory, 10, 1) == {"step": 10, "rank": 1}
    # Rank 0 kept its step-10 file: step 20 never became complete.
    assert checkpoint.load(directory, 10, 0) == {"step": 10, "rank": 0}

    store = Store(str(tmp_path / "r.db"))
    run_id = store.create_run("a", experiment_config("a"), None, [], checkpoint_dir=str(directory))
    store.finish_run(run_id, "failed", "rank 1: killed by SIGKILL", 1)
    experiment = resumable(store, run_id)
    assert (experiment.resume_step, experiment.checkpoint_dir) == (10, str(directory))


def test_what_cannot_resume_is_one_line_and_exit_2(tmp_path):
    store = Store(str(tmp_path / "r.db"))
    config = {"task": {"name": "logreg"}, "aggregator": {"name": "allreduce"},
              "compressor": {"name": "none"}, "optimizer": {"name": "sgd"}, "workers": 2}
    done = store.create_run("done", config, None, [])
    store.finish_run(done, "completed")
    unsaved = store.create_run("unsaved", config, None, [])
    store.finish_run(unsaved, "failed", "boom")
    for run_id, message in [
            (done, f"run {done} is completed: only interrupted or failed runs resume"),
            (unsaved, f"run {unsaved} has no checkpoint to resume from (its spec set no checkpoint_every)"),
            (99, "no run with id 99 in ")]:
        result = dsgd_in_process("run", "--resume", str(run_id), "--db", str(tmp_path / "r.db"))
        assert result.returncode == 2
        assert result.stderr.startswith(f"dsgd: error: {message}"), result.stderr
        assert len(result.stderr.splitlines()) == 1


def test_checkpoints_are_refused_with_a_budget(tmp_path):
    spec = write_spec(tmp_path, """
        experiments:
          - {name: a, task: logreg, checkpoint_every: 5, budget: {samples: 1000}}
    """)
    result = dsgd_in_process("run", str(spec), "--dry-run")
    assert result.returncode == 2
    assert "experiments[0].checkpoint_every: checkpoints are not supported with a budget" in result.stderr


@pytest.mark.slow  # a minute on 2 cores: `make test-all`
def test_synchronous_algorithms_resume_exactly_from_a_checkpoint(tmp_path):
    """Each run is recorded failed after it completed, and resumed from its last checkpoint
    (step 84 of 96, between two averages and with an average in flight): the steps after it
    are trained again to the same parameters. Covers what each algorithm keeps between steps:
    backup's update count, push-sum's weights, DaSGD's average in flight, LSGD's losses since
    the last election."""
    spec = write_spec(tmp_path, f"""
        defaults: {{task: logreg, workers: 2, epochs: 3, checkpoint_every: 21,
                   save_dir: {tmp_path / "models"}}}
        experiments:
          - {{name: backup, aggregator: {{name: backup, backups: 0}}}}
          - {{name: sgp, aggregator: {{name: sgp}}}}
          - {{name: dasgd, aggregator: {{name: dasgd, period: 2, delay: 1}}}}
          - {{name: lsgd, aggregator: {{name: lsgd, period: 2, global_period: 5}}}}
    """)
    db = tmp_path / "r.db"
    result = dsgd("run", str(spec), "--db", str(db), "--checkpoint-dir", str(tmp_path / "ck"))
    assert result.returncode == 0, result.stdout + result.stderr
    (tmp_path / "models").rename(tmp_path / "uninterrupted")
    store = Store(str(db))
    runs = store.runs()
    for run in runs:
        store.finish_run(run.id, "failed", "recorded as failed by the test")
        result = dsgd("run", "--resume", str(run.id), "--db", str(db))
        assert result.returncode == 0, result.stdout + result.stderr
        assert [entry["step"] for entry in store.resumes(run.id)] == [84]
        for resumed, uninterrupted in zip(_models(tmp_path / "models", run.experiment),
                                          _models(tmp_path / "uninterrupted", run.experiment)):
            assert all(torch.equal(resumed[key], uninterrupted[key]) for key in resumed), run.experiment
