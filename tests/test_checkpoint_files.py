"""Checkpoint files are verified before a run resumes: each has its size and SHA-256 recorded
when written (a file without one is damaged); a damaged latest checkpoint falls back to the
previous complete one, and with none to fall back to, `--resume` refuses on one line naming
the file and changes nothing. `--resume` finds checkpoints that were moved through
`--checkpoint-dir`."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from conftest import dsgd, dsgd_in_process, write_spec
from dsgd_cli.worker import checkpoint
from dsgd_cli.launch.resume import locate
from dsgd_cli.results.store import Store


def save_steps(directory: Path, steps: list[int], workers: int = 2) -> None:
    for step in steps:
        for rank in range(workers):
            checkpoint.save(directory, step, rank, {"step": step, "rank": rank}, workers=workers)


def test_each_rank_keeps_two_complete_steps_with_their_sums(tmp_path):
    save_steps(tmp_path, [10, 20, 30])
    assert checkpoint.complete_steps(tmp_path, 2) == [20, 30]
    # Rank 1 saved last and dropped its file of step 10; rank 0 drops its own at its next save.
    assert sorted(p.name for p in (tmp_path / "step-0000000010").iterdir()) == [
        "rank-0.pt", "rank-0.pt.sum"]
    assert sorted(p.name for p in (tmp_path / "step-0000000030").iterdir()) == [
        "rank-0.pt", "rank-0.pt.sum", "rank-1.pt", "rank-1.pt.sum"]
    size, digest = (tmp_path / "step-0000000030" / "rank-1.pt.sum").read_text().split()
    assert int(size) == (tmp_path / "step-0000000030" / "rank-1.pt").stat().st_size
    assert len(digest) == 64
    assert checkpoint.latest_sound(tmp_path, 2) == (30, [])


@pytest.mark.parametrize("damage, expected", [
    ("truncate", "is damaged ({size} bytes, {written} when written)"),
    ("overwrite", "is damaged (its checksum differs from the one recorded when written)"),
])
def test_a_damaged_latest_step_falls_back_to_the_one_before(tmp_path, damage, expected):
    save_steps(tmp_path, [10, 20])
    file = checkpoint.rank_file(tmp_path, 20, 1)
    written = file.stat().st_size
    if damage == "truncate":
        file.write_bytes(file.read_bytes()[:100])
    else:
        file.write_bytes(b"\0" * written)
    problem = f"{file} " + expected.format(size=file.stat().st_size, written=written)
    assert checkpoint.latest_sound(tmp_path, 2) == (10, [problem])
    checkpoint.rank_file(tmp_path, 10, 0).write_bytes(b"")
    assert checkpoint.latest_sound(tmp_path, 2) == (None, [
        problem, f"{checkpoint.rank_file(tmp_path, 10, 0)} is damaged (0 bytes, "
                 f"{checkpoint.rank_file(tmp_path, 20, 0).stat().st_size} when written)"])


def test_a_file_without_its_sum_is_damaged(tmp_path):
    """Nothing says such a file is what dsgd wrote (a sum is put in place before its file):
    it is never trusted, whoever removed the sum."""
    save_steps(tmp_path, [10, 20])
    latest = checkpoint.rank_file(tmp_path, 20, 0)
    checkpoint.sum_file(latest).unlink()
    problem = f"{latest} has no recorded checksum (rank-0.pt.sum is missing)"
    assert checkpoint.latest_sound(tmp_path, 2) == (10, [problem])
    with pytest.raises(checkpoint.CheckpointRefused, match="rank-0.pt.sum is missing"):
        checkpoint.load(tmp_path, 20, 0)


def test_checkpoints_are_located_where_they_were_moved(tmp_path, monkeypatch):
    monkeypatch.delenv(checkpoint.ENV_ROOT, raising=False)
    recorded = tmp_path / "old" / "a-123"
    moved = tmp_path / "new"
    save_steps(moved / "a-123", [10])
    assert locate(str(recorded), moved) == str(moved / "a-123")  # the root holding it
    assert locate(str(recorded), moved / "a-123") == str(moved / "a-123")  # the directory itself
    assert locate(str(recorded), None) == str(recorded)  # not found: where it was recorded
    monkeypatch.setenv(checkpoint.ENV_ROOT, str(moved))
    assert locate(str(recorded), None) == str(moved / "a-123")
    save_steps(recorded, [10])
    assert locate(str(recorded), None) == str(recorded)  # still there: the recorded place
    assert locate(None, moved) is None  # a run that never checkpointed


# -- end to end: a run that failed after two checkpoints -------------------------------------------

SPEC = """
defaults:
  task: {name: logreg}
  workers: 2
  epochs: 1
  steps_per_epoch: 5
  log_interval: 1
  checkpoint_every: 2
experiments:
  - name: a
"""


def content(db: Path) -> list[str]:
    with sqlite3.connect(db) as connection:
        return list(connection.iterdump())


# slow: end to end. In process (default): the fallback, test_a_damaged_latest_step_falls_back_to_
# the_one_before and test_a_file_without_its_sum_is_damaged; moved checkpoints,
# test_checkpoints_are_located_where_they_were_moved. A real --resume: test_resume's [ar].
@pytest.mark.slow
def test_resume_verifies_checkpoints_and_finds_moved_ones(tmp_path):
    spec = write_spec(tmp_path, SPEC)
    db, temporary = tmp_path / "r.db", tmp_path / "tmp"
    temporary.mkdir()
    env = {"TMPDIR": str(temporary)}
    result = dsgd("run", str(spec), "--db", str(db), "--checkpoint-dir", str(tmp_path / "ck"),
                  env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    store = Store(str(db))
    store.finish_run(1, "failed", "rank 0: RuntimeError: boom", 0)  # as if it had failed
    recorded = Path(store.checkpoint_dir(1))
    assert checkpoint.steps(recorded) == [2, 4]
    (tmp_path / "ck").rename(tmp_path / "moved")
    moved = tmp_path / "moved" / recorded.name

    # Moved away: not found where recorded...
    result = dsgd_in_process("run", "--resume", "1", "--db", str(db))  # refused: no launch
    assert (result.returncode, result.stderr) == (2, f"dsgd: error: run 1 has no checkpoint to "
                                                     f"resume from (none complete in {recorded})\n")
    # ...and with both steps damaged, nothing to resume from: the file named, nothing changed.
    latest, earlier = checkpoint.rank_file(moved, 4, 1), checkpoint.rank_file(moved, 2, 0)
    written = latest.stat().st_size
    latest.write_bytes(latest.read_bytes()[: written // 2])
    kept = earlier.read_bytes()
    earlier.write_bytes(bytes(reversed(kept)))
    before = content(db)
    result = dsgd_in_process("run", "--resume", "1", "--db", str(db), "--checkpoint-dir",
                             str(tmp_path / "moved"))
    assert (result.returncode, result.stderr) == (2, (
        f"dsgd: error: run 1 cannot resume: {latest} is damaged ({written // 2} bytes, {written} "
        "when written), as is its earlier checkpoint\n"))
    assert content(db) == before
    assert checkpoint.steps(moved) == [2, 4]

    # The earlier one sound again: the run resumes from it and completes.
    earlier.write_bytes(kept)
    result = dsgd("run", "--resume", "1", "--db", str(db), "--checkpoint-dir", str(tmp_path / "moved"),
                  env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"dsgd: run 1: {latest} is damaged" in result.stderr
    assert "resuming from the checkpoint of step 2" in result.stderr
    store = Store(str(db))
    (run,) = store.runs()
    assert run.status == "completed"
    assert [r["step"] for r in store.resumes(1)] == [2]
    assert store.checkpoint_dir(1) == str(moved)
    steps = [m.step for m in store.metric_history(1, "train_loss") if m.rank == 0]
    assert steps == [1, 2, 3, 4, 5]  # every step once: those after step 2 recorded again
    # No launch or torchelastic directory left (torch's own caches, torchinductor_*, may be).
    assert [p.name for p in temporary.iterdir() if p.name.startswith(("dsgd-launch-", "torchelastic_"))] == []
