"""Mistakes that validation can find are found before anything launches: exit 2 on one line,
no database written, no torchrun or worker left running and no launch directory left behind
(a float option beyond float32, a checkpoint directory or `save_dir` that cannot be written)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
from pathlib import Path

import pytest

from conftest import TINY_SPEC, dsgd, dsgd_in_process, write_spec
from dsgd_cli.worker import checkpoint
from dsgd_cli.errors import DsgdError, SpecError
from dsgd_cli.spec.experiments import load_spec


def processes_mentioning(text: str) -> list[str]:
    """Command lines of live processes that mention `text` (a test's own directory)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                if text in command and "pytest" not in command:
                    found.append(command)
    return found


def run_refused(tmp_path: Path, spec: Path, *args: str, in_process: bool = True) -> str:
    """`dsgd run SPEC ARGS`, which must be refused before anything launches: its message.
    Run by `dsgd_in_process` (what the run starts early, before validating the spec, is then
    this process's child), or with `in_process` False as a `dsgd` process of its own."""
    temporary = tmp_path / "tmp"
    temporary.mkdir(exist_ok=True)
    db = tmp_path / "r.db"
    if in_process:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("TMPDIR", str(temporary))
            patch.setattr(tempfile, "tempdir", None)  # gettempdir() reads TMPDIR anew
            patch.chdir(tmp_path)
            result = dsgd_in_process("run", str(spec), "--db", str(db), *args)
    else:
        result = dsgd("run", str(spec), "--db", str(db), *args, env={"TMPDIR": str(temporary)},
                      cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr
    assert not db.exists()
    # No dsgd-launch-* directory left. torch's own cache directory (torchinductor_USER), which
    # the early-started fork server's `import torch._dynamo` may make, is torch's, as in any
    # torch program.
    assert [p for p in temporary.iterdir() if not p.name.startswith("torchinductor_")] == []
    assert processes_mentioning(str(temporary)) == []  # no torchrun or worker left
    return result.stderr.rstrip("\n")


@contextlib.contextmanager
def unwritable(directory: Path):
    """`directory`, made so that nothing can be created in it, even by root (immutable)."""
    directory.mkdir()
    if os.geteuid() == 0:
        if subprocess.run(["chattr", "+i", str(directory)], capture_output=True).returncode:
            pytest.skip("running as root on a filesystem without chattr +i")
        try:
            yield directory
        finally:
            subprocess.run(["chattr", "-i", str(directory)], check=True)
    else:
        directory.chmod(0o555)
        try:
            yield directory
        finally:
            directory.chmod(0o755)


BEYOND = "expected a number between -3.403e+38 and 3.403e+38 (float32, which training computes in)"


@pytest.mark.parametrize("section, expected", [
    ("optimizer: {name: sgd, lr: 1e300}", f"experiments[0].optimizer.lr: {BEYOND}, got 1e+300"),
    ("optimizer: {name: sgd, lr: 0.1, momentum: -1e39}",
     "experiments[0].optimizer.momentum: expected a value >= 0.0, got -1e+39"),  # bounds first
    ("grid: {optimizer.lr: [0.1, 1e39]}", f"optimizer.lr: {BEYOND}, got 1e+39"),
], ids=["lr", "bounds first", "grid"])
def test_float_options_beyond_float32_are_spec_errors(tmp_path, section, expected):
    spec = write_spec(tmp_path, TINY_SPEC + f"    {section}\n")
    with pytest.raises(SpecError) as caught:
        load_spec(spec)
    assert str(caught.value).endswith(expected), str(caught.value)
    largest = write_spec(tmp_path, TINY_SPEC + "    optimizer: {name: sgd, lr: 3.4e38}\n", "ok.yaml")
    assert load_spec(largest)[0].config["optimizer"]["lr"] == 3.4e38  # within float32: allowed


def test_an_overflowing_learning_rate_is_refused_before_launch(tmp_path):
    spec = write_spec(tmp_path, TINY_SPEC + "    optimizer: {name: sgd, lr: 1e300}\n")
    # In a `dsgd` process of its own: the one real-process check here that what the run
    # started early is stopped and leaves no launch directory (exit code 2, one line).
    assert run_refused(tmp_path, spec, in_process=False) == (
        f"dsgd: error: {spec}: experiments[0].optimizer.lr: expected a number between -3.403e+38 "
        "and 3.403e+38 (float32, which training computes in), got 1e+300")


def test_a_checkpoint_dir_that_is_a_file_is_refused_before_launch(tmp_path):
    spec = write_spec(tmp_path, TINY_SPEC + "    checkpoint_every: 1\n")
    file = tmp_path / "plain-file"
    file.write_text("x")
    assert run_refused(tmp_path, spec, "--checkpoint-dir", str(file)) == (
        f"dsgd: error: --checkpoint-dir {file}: {file} is a file, not a directory")
    assert file.read_text() == "x"
    with pytest.raises(DsgdError) as caught:
        checkpoint.usable_root(file / "below", "sqlite:///r.db")
    assert str(caught.value) == (f"--checkpoint-dir {file / 'below'}: {file} is a file, so no "
                                 "directory can be made under it")


def test_an_unwritable_checkpoint_dir_is_refused_before_launch(tmp_path):
    spec = write_spec(tmp_path, TINY_SPEC + "    checkpoint_every: 1\n")
    with unwritable(tmp_path / "locked") as locked:
        message = run_refused(tmp_path, spec, "--checkpoint-dir", str(locked / "checkpoints"))
        assert message.startswith(f"dsgd: error: --checkpoint-dir {locked / 'checkpoints'}: "
                                  "cannot create it: "), message
        assert list(locked.iterdir()) == []


def test_dsgd_checkpoints_that_is_a_file_is_named(tmp_path, monkeypatch):
    file = tmp_path / "f"
    file.write_text("")
    monkeypatch.setenv("DSGD_CHECKPOINTS", str(file))
    with pytest.raises(DsgdError, match=rf"^\$DSGD_CHECKPOINTS {file}: {file} is a file, not a directory$"):
        checkpoint.usable_root(None, "sqlite:///x.db")
    assert checkpoint.usable_root(tmp_path / "c" / "d", "sqlite:///x.db") == tmp_path / "c" / "d"
    assert (tmp_path / "c" / "d").is_dir()  # tried, and kept: no one else can make it theirs


def test_a_save_dir_that_is_a_file_is_refused_before_launch(tmp_path):
    file = tmp_path / "models"
    file.write_text("x")
    spec = write_spec(tmp_path, TINY_SPEC + f"    save_dir: {file}\n")
    assert run_refused(tmp_path, spec) == (
        f"dsgd: error: {spec}: experiments[0].save_dir: cannot save models in {file}: "
        f"{file} is a file, not a directory")


# -- duplicate keys -----------------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    ("experiments:\n  - {name: a, task: logreg}\nexperiments:\n  - {name: b, task: logreg}\n",
     "experiments: key 'experiments' given twice, on lines 1 and 3"),
    ("defaults:\n  task: logreg\n  workers: 2\n  workers: 3\nexperiments:\n  - name: a\n",
     "defaults.workers: key 'workers' given twice, on lines 3 and 4"),
    ("experiments:\n  - name: a\n    task: logreg\n    optimizer: {name: sgd, lr: 0.1, lr: 0.2}\n",
     "experiments[0].optimizer.lr: key 'lr' given twice, on lines 4 and 4"),
], ids=["experiments", "workers", "flow mapping"])
def test_a_key_given_twice_is_a_spec_error(tmp_path, text, expected):
    spec = tmp_path / "dup.yaml"
    spec.write_text(text)
    with pytest.raises(SpecError) as caught:
        load_spec(spec)
    assert str(caught.value) == f"{spec}: {expected}"


def test_merge_keys_and_aliases_are_not_duplicates(tmp_path):
    spec = tmp_path / "merge.yaml"
    spec.write_text("defaults:\n  optimizer: &sgd {name: sgd, lr: 0.1}\nexperiments:\n"
                    "  - {name: a, task: logreg, optimizer: {<<: *sgd, lr: 0.2}}\n"
                    "  - {name: b, task: logreg, optimizer: *sgd}\n")
    assert [(e.name, e.config["optimizer"]["lr"]) for e in load_spec(spec)] == [("a", 0.2), ("b", 0.1)]
    spec.write_text("experiments:\n  - &a {name: a, task: logreg, optimizer: {name: sgd, lr: 0.2}}\n"
                    "  - {<<: *a, name: b}\n")
    assert [(e.name, e.config["optimizer"]["lr"]) for e in load_spec(spec)] == [("a", 0.2), ("b", 0.2)]


def test_dsgd_run_refuses_a_duplicate_key_before_launch(tmp_path):
    spec = write_spec(tmp_path, TINY_SPEC + "experiments:\n  - name: b\n")
    assert run_refused(tmp_path, spec) == (
        f"dsgd: error: {spec}: experiments: key 'experiments' given twice, on lines 7 and 9")


@pytest.mark.parametrize("name, reason", [("d" * 400, "File name too long"),
                                          ("a\x00b", "it holds a NUL character")])
def test_a_directory_name_the_system_refuses_is_a_problem_not_a_crash(tmp_path, name, reason):
    from dsgd_cli.spec.directories import problem_creating, problem_without_creating

    for check in (problem_creating, problem_without_creating):
        assert check(tmp_path / name) == f"not a usable path: {reason}"
    assert list(tmp_path.iterdir()) == []  # nothing made
