"""Shared test helpers: run the real `dsgd` CLI, write specs, install the test plugin package."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TEST_PLUGINS = Path(__file__).resolve().parent / "plugin_pkgs" / "dsgd_testplugins"


# The smallest real spec: one experiment of 2 workers, 2 steps (tests append keys to it).
TINY_SPEC = """
defaults:
  task: {name: logreg}
  workers: 2
  epochs: 1
  steps_per_epoch: 2
experiments:
  - name: a
"""


def experiment_config(name: str = "x", **keys) -> dict:
    """The complete configuration `dsgd run` stores for an experiment of 2 workers training
    logreg (3 features, 1 epoch, sgd at lr 0.1), with `keys` set as a spec would set them."""
    from dsgd_cli.spec.experiments import resolve_document

    experiment = {"name": name, "task": {"name": "logreg", "features": 3}, "workers": 2,
                  "epochs": 1, "optimizer": {"name": "sgd", "lr": 0.1}, **keys}
    (resolved,) = resolve_document({"experiments": [experiment]})
    return resolved.config


def pytest_sessionstart(session):
    """With an empty numba cache (a fresh clone) compiling the compressors' kernels takes over
    30 s of CPU: start it in the background now, while pytest collects and runs the first
    tests (tests/distributed.py's `warm_numba_kernels` waits for it before workers start)."""
    if not session.config.option.collectonly:
        import distributed

        distributed.start_compiling_numba_kernels()


def pytest_sessionfinish(session):
    import distributed

    distributed.stop_compiling_numba_kernels()


def dsgd(*args: str, env: dict | None = None, cwd: Path | None = None,
         timeout: float = 300) -> subprocess.CompletedProcess:
    """Run `dsgd ARGS` in a subprocess, as a user would."""
    full_env = {**os.environ, **(env or {})}
    # Not from the repository root: `python -m` would put it first on sys.path, and a stale
    # dsgd.egg-info there would shadow the installed distribution's entry points.
    return subprocess.run([sys.executable, "-m", "dsgd_cli", *args], capture_output=True,
                          text=True, env=full_env, cwd=cwd or tempfile.gettempdir(),
                          timeout=timeout)


def dsgd_in_process(*args: str) -> subprocess.CompletedProcess:
    """`dsgd ARGS` run by `dsgd_cli.cli.main` in this process: the same exit code and output
    as `dsgd`, without starting a process that imports torch (seconds of CPU). Also for runs
    whose launch is what a test checks: the launch's own processes are real either way. Use
    `dsgd` where the command itself must be a process (signals to it, its exit, its
    environment)."""
    from contextlib import redirect_stderr, redirect_stdout
    from io import StringIO

    from dsgd_cli.cli import main

    out, err = StringIO(), StringIO()
    argv, sys.argv = sys.argv, ["dsgd", *args]
    try:
        with redirect_stdout(out), redirect_stderr(err):
            main()
        code = 0
    except SystemExit as exit:
        code = exit.code if isinstance(exit.code, int) else 1
    finally:
        sys.argv = argv
    return subprocess.CompletedProcess(["dsgd", *args], code, out.getvalue(), err.getvalue())


def write_spec(directory: Path, text: str, name: str = "spec.yaml") -> Path:
    path = directory / name
    path.write_text(textwrap.dedent(text))
    return path


def compare_json(db: Path, *args: str, env: dict | None = None) -> list[dict]:
    result = dsgd("compare", "--db", str(db), "--format", "json", *args, env=env)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def quick_gamma_tuning():
    """CHOCO's `gamma: auto` tunes during validation: 13 step sizes × 100 consensus steps on
    vectors of the model's length, 10 s and more for the CNN of examples/choco.yaml. For tests
    of what validation says, not of which γ it picks: the same tuning code runs, on short
    vectors for a few steps (tests/test_choco checks the tuning itself)."""
    from plugins.aggregators.gossip import choco

    tune = choco.tune_gamma
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(choco, "TUNING_DIMENSION_CAP", 64)
        patch.setattr(choco, "tune_gamma", lambda *args, **kwargs: tune(*args, **kwargs, steps=5))
        yield


@pytest.fixture(scope="session")
def plugin_env(tmp_path_factory) -> dict:
    """Installs tests/plugin_pkgs/dsgd_testplugins into a private site dir, as a real
    distribution with entry points; returns the environment that puts it on the path."""
    site = tmp_path_factory.mktemp("site")
    build = tmp_path_factory.mktemp("build")
    source = build / "dsgd_testplugins"
    subprocess.run(["cp", "-r", str(TEST_PLUGINS), str(source)], check=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                    "--no-build-isolation", "--target", str(site), str(source)],
                   check=True, capture_output=True)
    path = os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return {"PYTHONPATH": path}
