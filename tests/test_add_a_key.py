"""Adding an experiment key takes one `option()` in the declaration plus its use
(docs/architecture.md, "Adding an experiment key"). Here a test-only key, `probe_every`, is
declared as a newcomer would declare one in `dsgd_cli/spec/experiment_options.py`, without
editing dsgd: a `sitecustomize` on PYTHONPATH adds it to `ExperimentOptions` in every process
of the run (the command, the launcher and the workers), and a third-party aggregator reads it
in the workers through `ctx.experiment`. Nothing else is written for it: the spec validates
it, the run's configuration stores it, `dsgd show` prints it, and the worker's typed
experiment holds it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import dsgd, write_spec

# The declaration: what a newcomer adds to ExperimentOptions (here in a subclass, put in its
# place before anything else of dsgd is imported).
DECLARATION = '''
from dataclasses import dataclass

from dsgd_cli.options import option, option_fields
from dsgd_cli.spec import experiment_options


@dataclass(frozen=True)
class WithProbe(experiment_options.ExperimentOptions):
    probe_every: int | None = option(None, min=1, max=100, expect="an integer between 1 and 100",
                                     help="steps between probes (a test-only key)")


experiment_options.ExperimentOptions = WithProbe
defaults = experiment_options.EXPERIMENT_DEFAULTS
defaults.pop("grid")
defaults["probe_every"] = None
defaults["grid"] = None
'''

# Its use: a plugin that reads the key from the typed experiment in each worker.
PLUGIN = '''
import os
from pathlib import Path

from plugins.aggregators.allreduce import AllReduce


class ReadsTheKey(AllReduce):
    def setup(self, ctx):
        super().setup(ctx)
        value = ctx.experiment.probe_every
        out = Path(os.environ["PROBE_OUT"]) / f"{ctx.experiment_name}-rank{ctx.rank}.txt"
        out.write_text(f"{type(value).__name__} {value}")
'''

ENTRY_POINTS = """[dsgd.aggregators]
reads_the_key = key_fixture_plugin:ReadsTheKey
"""


@pytest.fixture
def declared(tmp_path: Path) -> dict[str, str]:
    """The environment of a dsgd whose declaration has `probe_every`."""
    site = tmp_path / "site"
    (site / "key_fixture-0.1.dist-info").mkdir(parents=True)
    (site / "sitecustomize.py").write_text(DECLARATION)
    (site / "key_fixture_plugin.py").write_text(PLUGIN)
    info = site / "key_fixture-0.1.dist-info"
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: key-fixture\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(ENTRY_POINTS)
    out = tmp_path / "probes"
    out.mkdir()
    return {"PYTHONPATH": str(site), "PROBE_OUT": str(out)}


SPEC = """
defaults:
  task: {name: logreg}
  workers: 2
  epochs: 1
  steps_per_epoch: 2
  aggregator: {name: reads_the_key}
experiments:
  - {name: probed, probe_every: %s}
"""
BOTH = SPEC % "5" + "  - {name: unprobed}\n"  # the second leaves the key out


def test_a_key_declared_once_is_validated(tmp_path, declared):
    spec = write_spec(tmp_path, SPEC % "0")
    result = dsgd("run", str(spec), "--db", str(tmp_path / "r.db"), env=declared)
    assert result.returncode == 2
    assert "experiments[0].probe_every" in result.stderr
    assert "expected an integer between 1 and 100, got 0" in result.stderr
    assert not (tmp_path / "r.db").exists()


def test_a_key_declared_once_is_stored_shown_and_read_by_the_workers(tmp_path, declared):
    """One launch of two experiments: one sets the key, the other leaves it out and reads
    its default."""
    spec = write_spec(tmp_path, BOTH)
    db = tmp_path / "r.db"
    result = dsgd("run", str(spec), "--db", str(db), env=declared)
    assert result.returncode == 0, result.stderr
    listed = dsgd("compare", "--db", str(db), "--format", "json", "--where", "probe_every=5",
                  env=declared)
    assert listed.returncode == 0, listed.stderr
    (row,) = json.loads(listed.stdout)
    shown = dsgd("show", str(row["id"]), "--db", str(db), env=declared)
    assert shown.returncode == 0, shown.stderr
    assert "probe_every: 5" in shown.stdout
    probes = Path(declared["PROBE_OUT"])
    assert sorted(path.read_text() for path in probes.iterdir()) == [
        "NoneType None", "NoneType None", "int 5", "int 5"]
