"""What dsgd refuses to trust in its checkpoint and output directories (docs/security.md):
a checkpoint file that would run code when loaded, one without its sum, a run directory that
another user made or others may write to, entries named like a step that are links or files,
a step newer than the run wrote; a model file or experiment directory planted under `save_dir`;
an experiment name that leaves `save_dir`. Resume keeps the earlier checkpoints until the
resumed run has written a newer complete one."""

from __future__ import annotations

import io
import json
import os
import pickle
import pwd
import shutil
import stat
from pathlib import Path

import pytest
import torch

from conftest import dsgd, dsgd_in_process, experiment_config, write_spec
from dsgd_cli.errors import DsgdError
from dsgd_cli.launch.resume import reopen, resumable
from dsgd_cli.results.store import Store
from dsgd_cli.spec.directories import UntrustedDirectory
from dsgd_cli.worker import checkpoint
from dsgd_cli.worker.process import write_model


needs_root = pytest.mark.skipif(os.geteuid() != 0,
                                reason="needs root to make a directory another user owns")


def save_steps(directory: Path, steps: list[int], workers: int = 2) -> None:
    for step in steps:
        for rank in range(workers):
            checkpoint.save(directory, step, rank, {"step": step, "rank": rank}, workers=workers)


def failed_run(tmp_path: Path, directory: Path) -> tuple[Store, int]:
    store = Store(str(tmp_path / "r.db"))
    run_id = store.create_run("a", experiment_config("a"), None, [],
                              checkpoint_dir=str(directory))
    store.finish_run(run_id, "failed", "rank 1: killed by SIGKILL", 1)
    return store, run_id


def give_to_another_user(path: Path) -> str:
    """Make `path` belong to `nobody`; returns how dsgd says so."""
    try:
        uid = pwd.getpwnam("nobody").pw_uid
    except KeyError:
        pytest.skip("no user nobody to give a directory to")
    os.chown(path, uid, -1)
    return f"is owned by user nobody (uid {uid}), not by you"


class RunsCode:
    """Unpickled, it creates the file `marker`: what a planted checkpoint would do."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').close()",)


def forge_sum(path: Path) -> None:
    """Write the sum that a planted file would come with: a sum proves no origin."""
    with open(path, "rb") as file:
        size, digest = checkpoint._size_and_digest(file)
    checkpoint.sum_file(path).write_text(f"{size} {digest}\n")


# -- checkpoint files -----------------------------------------------------------------------


@pytest.mark.parametrize("form", ["pickle", "torch.save"])
def test_a_planted_checkpoint_runs_no_code_when_loaded(tmp_path, form):
    directory, marker = tmp_path / "ck", tmp_path / "marker"
    save_steps(directory, [10])
    planted = checkpoint.rank_file(directory, 10, 0)
    if form == "pickle":
        planted.write_bytes(pickle.dumps({"model": RunsCode(marker)}, protocol=2))
    else:
        torch.save({"model": RunsCode(marker)}, planted)
    forge_sum(planted)
    assert checkpoint.latest_sound(directory, 2) == (10, [])  # its sum matches...
    with pytest.raises(checkpoint.CheckpointRefused) as refused:
        checkpoint.load(directory, 10, 0)  # ...but it is loaded as weights only
    assert str(refused.value).startswith(f"{planted} holds more than tensors and plain data (")
    assert str(refused.value).endswith("): refused, as loading it could run code")
    assert "\n" not in str(refused.value)
    assert not marker.exists()
    assert checkpoint.load(directory, 10, 1) == {"step": 10, "rank": 1}


def test_a_planted_checkpoint_without_its_sum_is_not_resumed_from(tmp_path):
    directory, marker = tmp_path / "ck", tmp_path / "marker"
    save_steps(directory, [10])
    planted = checkpoint.rank_file(directory, 10, 1)
    planted.write_bytes(pickle.dumps({"model": RunsCode(marker)}, protocol=2))
    checkpoint.sum_file(planted).unlink()
    store, run_id = failed_run(tmp_path, directory)
    with pytest.raises(DsgdError) as refused:
        resumable(store, run_id)
    assert str(refused.value) == (f"run {run_id} cannot resume: {planted} has no recorded "
                                  "checksum (rank-1.pt.sum is missing), and it has no earlier "
                                  "complete checkpoint")
    with pytest.raises(checkpoint.CheckpointRefused, match="rank-1.pt.sum is missing"):
        checkpoint.load(directory, 10, 1)
    assert not marker.exists()


def test_state_that_loading_would_refuse_is_named_when_saved(tmp_path):
    """A checkpoint holds what `weights_only` loads; NumPy numbers become Python's, and
    anything else is an error naming where it is, when written rather than on resume."""
    import numpy

    state = {"aggregator": {"count": numpy.int64(3), "mean": numpy.float64(0.5)}}
    checkpoint.save(tmp_path / "ck", 1, 0, state, workers=1)
    loaded = checkpoint.load(tmp_path / "ck", 1, 0)
    assert loaded == {"aggregator": {"count": 3, "mean": 0.5}}
    assert type(loaded["aggregator"]["count"]) is int
    with pytest.raises(TypeError, match=r"cannot hold state\['aggregator'\]\['buffer'\], a "
                                        r"numpy.ndarray: only tensors"):
        checkpoint.save(tmp_path / "ck", 2, 0, {"aggregator": {"buffer": numpy.zeros(2)}}, 1)


def test_the_random_generators_round_trip_through_a_checkpoint(tmp_path):
    import random

    import numpy

    device = torch.device("cpu")
    checkpoint.save(tmp_path / "ck", 1, 0, {"rng": checkpoint.rng_state(device)}, workers=1)
    expected = (torch.rand(3), random.random(), numpy.random.rand(3))
    checkpoint.set_rng_state(checkpoint.load(tmp_path / "ck", 1, 0)["rng"], device)
    again = (torch.rand(3), random.random(), numpy.random.rand(3))
    assert torch.equal(expected[0], again[0]) and expected[1] == again[1]
    assert (expected[2] == again[2]).all()


# -- the run's directory ---------------------------------------------------------------------


def test_a_run_directory_is_made_private(tmp_path):
    directory = tmp_path / "root" / "a-123"
    save_steps(directory, [10])
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(checkpoint.step_directory(directory, 10)).st_mode) == 0o700


def test_a_run_directory_others_may_write_to_is_refused(tmp_path):
    directory = tmp_path / "ck"
    save_steps(directory, [10])
    directory.chmod(0o777)
    expected = f"checkpoint directory {directory} is writable by other users (mode 777): refused"
    with pytest.raises(checkpoint.CheckpointRefused) as refused:
        checkpoint.save(directory, 20, 0, {"step": 20}, workers=2)
    assert str(refused.value) == expected
    with pytest.raises(checkpoint.CheckpointRefused):
        checkpoint.load(directory, 10, 0)
    store, run_id = failed_run(tmp_path, directory)
    with pytest.raises(DsgdError) as refused:
        resumable(store, run_id)
    assert str(refused.value) == f"run {run_id} cannot resume: {expected}"
    assert checkpoint.steps(directory) == [10]


@needs_root
def test_a_run_directory_another_user_made_is_refused(tmp_path):
    """Another user who read the run's directory name made it first and planted a step:
    the workers neither write there nor load from it, and `--resume` refuses on one line."""
    root = tmp_path / "shared"
    root.mkdir(mode=0o1777)
    directory = root / "a-123"
    save_steps(directory, [9999999999])  # the planted step
    owner = give_to_another_user(directory)
    with pytest.raises(checkpoint.CheckpointRefused) as refused:
        checkpoint.save(directory, 10, 0, {"step": 10}, workers=2)
    assert str(refused.value) == f"checkpoint directory {directory} {owner}: refused"
    assert checkpoint.steps(directory) == [9999999999]
    with pytest.raises(checkpoint.CheckpointRefused):
        checkpoint.load(directory, 9999999999, 0)
    failed_run(tmp_path, directory)
    result = dsgd_in_process("run", "--resume", "1", "--db", str(tmp_path / "r.db"))
    assert (result.returncode, result.stderr) == (
        2, f"dsgd: error: run 1 cannot resume: checkpoint directory {directory} {owner}: "
           "refused\n")


def test_a_later_step_that_this_run_did_not_write_is_never_pruned_against(tmp_path):
    """A complete step newer than the one a rank wrote is none of its doing: the rank keeps
    its two latest complete steps up to the one it wrote."""
    directory = tmp_path / "ck"
    save_steps(directory, [10, 20])
    save_steps(directory, [9999999999])  # as if planted
    save_steps(directory, [30])
    assert checkpoint.complete_steps(directory, 2) == [20, 30, 9999999999]


# -- resume ------------------------------------------------------------------------------------


def test_resume_keeps_the_earlier_steps_until_a_newer_one_is_complete(tmp_path):
    """Resumed from step 20 (an earlier attempt left rank 0's file of step 30): step 30 goes
    at once, the sound step 10 only once the resumed run has written step 30 again, whole.
    A load that fails in between can still fall back on it."""
    directory = tmp_path / "ck"
    save_steps(directory, [10, 20])
    checkpoint.save(directory, 30, 0, {"step": 30}, workers=2)
    store, run_id = failed_run(tmp_path, directory)
    experiment = resumable(store, run_id)
    assert experiment.resume_step == 20
    reopen(store, experiment)
    assert checkpoint.steps(directory) == [10, 20]
    assert checkpoint.complete_steps(directory, 2) == [10, 20]
    checkpoint.save(directory, 30, 0, {"step": 30}, workers=2)
    assert checkpoint.complete_steps(directory, 2) == [10, 20]  # 30 not yet complete
    checkpoint.save(directory, 30, 1, {"step": 30}, workers=2)
    assert checkpoint.complete_steps(directory, 2) == [20, 30]


def test_step_entries_that_are_links_or_files_are_skipped_never_followed(tmp_path, capsys):
    """Links named like steps (older and newer than the step resumed from) and a file: reported
    on one line each, never read, followed or deleted; what a link points to is untouched."""
    directory, elsewhere = tmp_path / "ck", tmp_path / "elsewhere"
    save_steps(directory, [10, 20])
    elsewhere.mkdir()
    victims = {name: f"{name} of someone else" for name in ("rank-0.pt", "rank-0.pt.sum", "notes")}
    for name, text in victims.items():
        (elsewhere / name).write_text(text)
    older, newer = directory / "step-0000000001", directory / "step-0000000030"
    older.symlink_to(elsewhere)
    newer.symlink_to(elsewhere)
    (directory / "step-0000000040").write_text("a file")
    store, run_id = failed_run(tmp_path, directory)

    experiment = resumable(store, run_id)
    assert experiment.resume_step == 20
    assert capsys.readouterr().err.splitlines() == [
        f"dsgd: run {run_id}: skipped {older} is a symbolic link, not a checkpoint folder",
        f"dsgd: run {run_id}: skipped {newer} is a symbolic link, not a checkpoint folder",
        f"dsgd: run {run_id}: skipped {directory / 'step-0000000040'} is a file, not a "
        "checkpoint folder"]
    reopen(store, experiment)
    save_steps(directory, [22, 24, 26])  # each prunes the steps older than the two latest
    assert checkpoint.steps(directory) == [22, 24, 26]  # rank 0 drops its 22 at its next save
    assert older.is_symlink() and newer.is_symlink()
    assert {p.name: p.read_text() for p in elsewhere.iterdir()} == victims
    with pytest.raises(checkpoint.CheckpointRefused, match="is a symbolic link, not a checkpoint"):
        checkpoint.save(directory, 30, 0, {"step": 30}, workers=2)
    assert {p.name: p.read_text() for p in elsewhere.iterdir()} == victims


def test_removing_a_step_never_follows_a_link(tmp_path):
    directory, elsewhere = tmp_path / "ck", tmp_path / "elsewhere"
    save_steps(directory, [10])
    elsewhere.mkdir()
    (elsewhere / "kept").write_text("someone else's")
    (directory / "step-0000000020").symlink_to(elsewhere)
    (directory / "step-0000000030").write_text("a file")
    checkpoint._remove_tree(directory / "step-0000000020")
    checkpoint._remove_tree(directory / "step-0000000030")
    assert (elsewhere / "kept").read_text() == "someone else's"
    checkpoint.remove_later(directory, 5)
    assert checkpoint.steps(directory) == []


# -- save_dir and experiment names -----------------------------------------------------------


def test_a_link_planted_at_the_model_file_is_replaced_not_written_through(tmp_path):
    directory, victim = tmp_path / "models" / "a", tmp_path / "victim"
    directory.mkdir(parents=True)
    victim.write_bytes(b"not the model")
    (directory / "rank0.pt").symlink_to(victim)
    state = {"weight": torch.arange(3.0)}
    write_model(state, directory, 0)
    assert victim.read_bytes() == b"not the model"
    assert not (directory / "rank0.pt").is_symlink()
    assert torch.equal(torch.load(directory / "rank0.pt", weights_only=True)["weight"],
                       state["weight"])
    assert sorted(p.name for p in directory.iterdir()) == ["rank0.pt"]  # no temporary left


def test_an_experiment_directory_that_is_a_link_is_refused(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "a").symlink_to(elsewhere)
    directory = tmp_path / "models" / "a"
    with pytest.raises(UntrustedDirectory) as refused:
        write_model({"weight": torch.zeros(1)}, directory, 0)
    assert str(refused.value) == (f"save_dir: the experiment's directory {directory} is a "
                                  "symbolic link, not a directory: refused")
    assert list(elsewhere.iterdir()) == []


@needs_root
def test_an_experiment_directory_of_another_user_is_refused(tmp_path):
    directory = tmp_path / "models" / "a"
    directory.mkdir(parents=True)
    owner = give_to_another_user(directory)
    with pytest.raises(UntrustedDirectory) as refused:
        write_model({"weight": torch.zeros(1)}, directory, 0)
    assert str(refused.value) == (f"save_dir: the experiment's directory {directory} {owner}: "
                                  "refused")
    assert list(directory.iterdir()) == []


@pytest.mark.parametrize("name", [".", "..", "a/b", "../up", "a\\b", "a\0b"])
def test_an_experiment_name_that_leaves_save_dir_is_refused(tmp_path, name):
    spec = write_spec(tmp_path, f"""
        experiments:
          - {{name: {json.dumps(name)}, task: logreg, save_dir: {tmp_path / "models"}}}
    """)
    result = dsgd_in_process("run", str(spec), "--dry-run")
    assert (result.returncode, result.stderr) == (2, (
        f"dsgd: error: {spec}: experiments[0].name: expected a name without '/', '\\' or a NUL "
        f"character, other than '.' and '..', got {name!r}\n"))


def test_an_experiment_name_longer_than_a_file_name_is_refused(tmp_path):
    """A name of more than 255 bytes (UTF-8), or a grid point's name that grows past it, can
    name no directory under `save_dir`: refused before launch, not after training."""
    long_name = "é" * 128  # 256 bytes
    spec = write_spec(tmp_path, f"""
        experiments:
          - {{name: {long_name}, task: logreg}}
    """)
    result = dsgd_in_process("run", str(spec), "--dry-run")
    assert (result.returncode, result.stderr) == (2, (
        f"dsgd: error: {spec}: experiments[0].name: expected a name of at most 255 bytes "
        f"(UTF-8), the longest file name, got {long_name[:40]!r}... of 256 bytes\n"))
    spec = write_spec(tmp_path, f"""
        experiments:
          - {{name: {"a" * 240}, task: logreg, save_dir: {tmp_path / "models"},
              grid: {{optimizer.lr: [0.5, 0.25]}}}}
    """)
    result = dsgd_in_process("run", str(spec), "--dry-run")
    assert result.returncode == 2
    assert result.stderr.startswith(f"dsgd: error: {spec}: experiments[0].grid: expected a name "
                                    "of at most 255 bytes"), result.stderr


# -- roots that hold directories dsgd trusts: the checkpoint root and save_dir ----------------


def test_a_checkpoint_root_others_may_write_to_without_the_sticky_bit_is_refused(tmp_path):
    """In such a root another user can rename this user's run directory and put theirs in its
    place between a check and a use: refused before launch, and when saving or loading."""
    root = tmp_path / "shared"
    root.mkdir()
    save_steps(root / "a-123", [10])
    root.chmod(0o777)
    why = ("is writable by other users without the sticky bit (mode 777), so they could swap "
           "what is in it")
    with pytest.raises(DsgdError) as refused:
        checkpoint.usable_root(root, "sqlite:///r.db")
    assert str(refused.value) == f"--checkpoint-dir {root} {why}: refused"
    with pytest.raises(checkpoint.CheckpointRefused) as refused:
        checkpoint.save(root / "a-123", 20, 0, {"step": 20}, workers=2)
    assert str(refused.value) == f"checkpoint root {root} {why}: refused"
    with pytest.raises(checkpoint.CheckpointRefused, match="without the sticky bit"):
        checkpoint.load(root / "a-123", 10, 0)
    root.chmod(0o1777)  # like /tmp: only an entry's owner may rename it
    assert checkpoint.usable_root(root, "sqlite:///r.db") == root
    checkpoint.save(root / "a-123", 20, 0, {"step": 20}, workers=2)
    assert checkpoint.load(root / "a-123", 10, 0) == {"step": 10, "rank": 0}


@needs_root
def test_a_checkpoint_root_of_another_user_is_refused(tmp_path):
    root = tmp_path / "theirs"
    root.mkdir()
    save_steps(root / "a-123", [10])
    owner = give_to_another_user(root).replace("not by you", "not by you or root")
    with pytest.raises(DsgdError) as refused:
        checkpoint.usable_root(root, "sqlite:///r.db")
    assert str(refused.value) == f"--checkpoint-dir {root} {owner}: refused"
    with pytest.raises(checkpoint.CheckpointRefused) as refused:
        checkpoint.save(root / "a-123", 20, 0, {"step": 20}, workers=2)
    assert str(refused.value) == f"checkpoint root {root} {owner}: refused"
    store, run_id = failed_run(tmp_path, root / "a-123")
    with pytest.raises(DsgdError) as refused:
        resumable(store, run_id)
    assert str(refused.value) == f"run {run_id} cannot resume: checkpoint root {root} {owner}: refused"


def test_the_checkpoint_root_made_on_trial_is_kept(tmp_path):
    """Removed after the trial, its name would be free for another user to make it theirs
    before the workers write there."""
    root = tmp_path / "c" / "d"
    assert checkpoint.usable_root(root, "sqlite:///r.db") == root
    assert root.is_dir() and root.stat().st_uid == os.getuid()


def test_a_save_dir_others_may_write_to_without_the_sticky_bit_is_refused(tmp_path):
    models = tmp_path / "models"
    models.mkdir()
    models.chmod(0o777)
    why = ("is writable by other users without the sticky bit (mode 777), so they could swap "
           "what is in it")
    spec = write_spec(tmp_path, f"""
        experiments:
          - {{name: a, task: logreg, save_dir: {models}}}
    """)
    result = dsgd_in_process("run", str(spec), "--dry-run")
    assert (result.returncode, result.stderr) == (2, (
        f"dsgd: error: {spec}: experiments[0].save_dir: cannot save models in {models}: it "
        f"{why}\n"))
    with pytest.raises(UntrustedDirectory) as refused:
        write_model({"weight": torch.zeros(1)}, models / "a", 0)
    assert str(refused.value) == f"save_dir {models} {why}: refused"
    models.chmod(0o1777)
    write_model({"weight": torch.zeros(1)}, models / "a", 0)
    assert (models / "a" / "rank0.pt").is_file()


def test_a_model_is_written_where_its_directory_was_checked(tmp_path, monkeypatch):
    """The experiment's directory swapped for a link after it was checked: the model is not
    written where the link points (the directory is opened once, without following a link,
    and the files made relative to it)."""
    from dsgd_cli.spec import directories
    from dsgd_cli.worker import process

    directory, elsewhere = tmp_path / "models" / "a", tmp_path / "elsewhere"
    elsewhere.mkdir()

    def check_then_swap(path):
        directories.make_experiment_directory(path)
        path.rmdir()
        path.symlink_to(elsewhere)

    monkeypatch.setattr(process, "make_experiment_directory", check_then_swap)
    with pytest.raises(UntrustedDirectory, match="cannot be opened"):
        write_model({"weight": torch.zeros(1)}, directory, 0)
    assert list(elsewhere.iterdir()) == []


@needs_root
def test_a_model_is_not_written_in_another_users_directory_swapped_in_after_the_check(
        tmp_path, monkeypatch):
    from dsgd_cli.spec import directories
    from dsgd_cli.worker import process

    directory = tmp_path / "models" / "a"

    def check_then_swap(path):
        directories.make_experiment_directory(path)
        path.rename(path.with_name("checked"))
        path.mkdir()
        give_to_another_user(path)

    monkeypatch.setattr(process, "make_experiment_directory", check_then_swap)
    with pytest.raises(UntrustedDirectory) as refused:
        write_model({"weight": torch.zeros(1)}, directory, 0)
    assert str(refused.value) == (f"save_dir: the experiment's directory {directory} is not "
                                  "your own: refused")
    assert list(directory.iterdir()) == []

@needs_root
def test_an_experiment_directory_planted_under_save_dir_is_refused_before_launch(tmp_path):
    models = tmp_path / "models"
    (models / "a").mkdir(parents=True)
    owner = give_to_another_user(models / "a")
    spec = write_spec(tmp_path, f"""
        experiments:
          - {{name: a, task: logreg, workers: 2, steps_per_epoch: 2, epochs: 1,
              save_dir: {models}}}
    """)
    result = dsgd_in_process("run", str(spec), "--db", str(tmp_path / "r.db"))
    assert (result.returncode, result.stderr) == (2, (
        f"dsgd: error: save_dir: the experiment's directory {models / 'a'} {owner}: refused\n"))
    assert Store(str(tmp_path / "r.db")).runs() == []  # nothing launched


def swap_after_the_check(monkeypatch, directory: Path, replacement) -> None:
    """Make every `check_directory` of the run's `directory` check the real one, then swap it
    for `replacement(directory)`: what another user renaming entries in the root in a loop
    would do between a check and a use."""
    check, checked = checkpoint.check_directory, directory.with_name("checked")

    def check_then_swap(path):
        if checked.exists():  # put back the real one, as the attacker's loop would
            shutil.rmtree(directory) if not directory.is_symlink() else directory.unlink()
            checked.rename(directory)
        check(path)
        if Path(path) == directory:
            directory.rename(checked)
            replacement(directory)

    monkeypatch.setattr(checkpoint, "check_directory", check_then_swap)


def test_a_run_directory_swapped_for_a_link_after_its_check_is_not_used(tmp_path, monkeypatch):
    """The run's directory is opened once, without following a link, and everything is done
    relative to it: a link put in its place after the check is neither written to nor read."""
    directory, elsewhere = tmp_path / "root" / "a-123", tmp_path / "elsewhere"
    save_steps(elsewhere, [10])  # what the link points to: a sound step, someone else's
    planted = sorted(str(p.relative_to(elsewhere)) for p in elsewhere.rglob("*"))
    save_steps(directory, [10])
    swap_after_the_check(monkeypatch, directory, lambda path: path.symlink_to(elsewhere))
    with pytest.raises(checkpoint.CheckpointRefused, match="cannot be opened"):
        checkpoint.save(directory, 20, 0, {"step": 20}, workers=2)
    assert sorted(str(p.relative_to(elsewhere)) for p in elsewhere.rglob("*")) == planted
    with pytest.raises(checkpoint.CheckpointRefused, match="cannot be opened"):
        checkpoint.load(directory, 10, 0)


@needs_root
def test_a_run_directory_swapped_for_another_users_after_its_check_is_not_used(tmp_path, monkeypatch):
    directory = tmp_path / "root" / "a-123"
    save_steps(directory, [10])

    def theirs(path):
        shutil.copytree(path.with_name("checked"), path)
        give_to_another_user(path)

    swap_after_the_check(monkeypatch, directory, theirs)
    with pytest.raises(checkpoint.CheckpointRefused) as refused:
        checkpoint.load(directory, 10, 0)
    assert str(refused.value) == f"checkpoint directory {directory} changed since it was checked: refused"


# -- resume and delete trust the recorded path, not where a link there points -----------------


def test_resume_refuses_a_run_directory_that_is_a_link(tmp_path):
    """The recorded directory replaced by a link: refused, never followed (and recorded) to
    where it points, which `dsgd runs delete` would later delete."""
    real, recorded = tmp_path / "real", tmp_path / "ck"
    save_steps(real, [10])
    recorded.symlink_to(real)
    store, run_id = failed_run(tmp_path, recorded)
    with pytest.raises(DsgdError) as refused:
        resumable(store, run_id)
    assert str(refused.value) == (f"run {run_id} cannot resume: checkpoint directory {recorded} "
                                  "is a symbolic link, not a directory: refused")
    with pytest.raises(DsgdError, match="is a symbolic link"):
        resumable(store, run_id, checkpoint_dir=tmp_path / "ck")
    assert store.checkpoint_dir(run_id) == str(recorded)
    assert checkpoint.steps(real) == [10]


def test_deleting_a_run_removes_only_its_checkpoint_files(tmp_path):
    """The database names the directory: only the step folders' rank files go (then the
    folders and the directory, when empty); nothing else in it, nothing a link points to."""
    directory, elsewhere = tmp_path / "ck", tmp_path / "elsewhere"
    save_steps(directory, [10, 20])
    (directory / "notes.txt").write_text("not a checkpoint")
    (checkpoint.step_directory(directory, 20) / "plot.png").write_text("not a checkpoint")
    elsewhere.mkdir()
    (elsewhere / "rank-0.pt").write_text("someone else's")
    (directory / "step-0000000030").symlink_to(elsewhere)
    failed_run(tmp_path, directory)
    result = dsgd_in_process("runs", "delete", "1", "--db", str(tmp_path / "r.db"))
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in directory.rglob("*")) == [
        "notes.txt", "plot.png", "step-0000000020", "step-0000000030"]
    assert result.stderr == f"dsgd: left {directory}: Directory not empty\n"
    assert (elsewhere / "rank-0.pt").read_text() == "someone else's"


def test_deleting_a_run_whose_directory_is_a_link_leaves_it(tmp_path):
    real, recorded = tmp_path / "real", tmp_path / "ck"
    save_steps(real, [10])
    recorded.symlink_to(real)
    failed_run(tmp_path, recorded)
    result = dsgd_in_process("runs", "delete", "1", "--db", str(tmp_path / "r.db"))
    assert (result.returncode, result.stderr) == (0, f"dsgd: left {recorded}: it is a symbolic "
                                                  "link, not a checkpoint directory\n")
    assert checkpoint.steps(real) == [10]


# -- what a checkpoint directory may hold ----------------------------------------------------


def test_only_ascii_digits_name_a_step(tmp_path):
    directory = tmp_path / "ck"
    save_steps(directory, [10])
    (directory / "step-\u0661\u0660").mkdir()  # Arabic-Indic "10"
    (directory / "step-0000000010\n").mkdir()
    assert checkpoint.steps(directory) == [10]


def torch_bytes(value) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


@pytest.mark.parametrize("content, why", [
    (lambda whole: whole[: len(whole) // 2], "is damaged: it cannot be loaded ("),
    (lambda whole: torch_bytes([1, 2]), "is damaged: it holds a list, not a worker's state")])
def test_a_checkpoint_that_is_not_a_state_is_damage_on_one_line(tmp_path, content, why):
    directory = tmp_path / "ck"
    save_steps(directory, [10])
    path = checkpoint.rank_file(directory, 10, 0)
    path.write_bytes(content(path.read_bytes()))
    forge_sum(path)
    with pytest.raises(checkpoint.CheckpointRefused) as refused:
        checkpoint.load(directory, 10, 0)
    assert str(refused.value).startswith(f"{path} {why}"), refused.value
    assert "\n" not in str(refused.value)


def test_a_later_step_that_cannot_be_removed_is_one_line(tmp_path, monkeypatch):
    directory = tmp_path / "ck"
    save_steps(directory, [10])
    checkpoint.save(directory, 20, 0, {"step": 20}, workers=2)
    store, run_id = failed_run(tmp_path, directory)
    experiment = resumable(store, run_id)

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(checkpoint.os, "unlink", refuse)
    with pytest.raises(DsgdError) as refused:
        reopen(store, experiment)
    assert str(refused.value) == (f"cannot remove the later checkpoint "
                                  f"{checkpoint.step_directory(directory, 20)}: Permission denied")


# -- end to end --------------------------------------------------------------------------------


@pytest.mark.slow  # two tiny launches; the parts are tested in-process above
def test_resume_refuses_a_planted_checkpoint_and_keeps_the_earlier_one(tmp_path):
    """The latest checkpoint of a failed run replaced by code with a matching sum: the
    resumed workers refuse it without running it, and the earlier checkpoint is still there
    to resume from once the planted one is gone."""
    spec = write_spec(tmp_path, """
        defaults: {task: logreg, workers: 2, epochs: 1, steps_per_epoch: 5, checkpoint_every: 2}
        experiments: [{name: a}]
    """)
    db, marker = tmp_path / "r.db", tmp_path / "marker"
    options = ("--db", str(db), "--checkpoint-dir", str(tmp_path / "ck"))
    result = dsgd("run", str(spec), *options)
    assert result.returncode == 0, result.stdout + result.stderr
    store = Store(str(db))
    store.finish_run(1, "failed", "rank 0: RuntimeError: boom", 0)
    directory = Path(store.checkpoint_dir(1))
    planted = checkpoint.rank_file(directory, 4, 0)
    torch.save({"model": RunsCode(marker)}, planted)
    forge_sum(planted)

    result = dsgd("run", "--resume", "1", "--db", str(db))
    assert result.returncode == 1
    (run,) = Store(str(db)).runs()
    assert run.status == "failed" and "CheckpointRefused" in run.reason, run.reason
    assert run.reason.endswith("refused, as loading it could run code"), run.reason
    assert not marker.exists()
    assert checkpoint.complete_steps(directory, 2) == [2, 4]

    shutil.rmtree(checkpoint.step_directory(directory, 4))
    result = dsgd("run", "--resume", "1", "--db", str(db))
    assert result.returncode == 0, result.stdout + result.stderr
    assert [r["step"] for r in Store(str(db)).resumes(1)] == [4, 2]
