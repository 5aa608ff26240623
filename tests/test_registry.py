"""Plugin discovery through a real installed distribution with good and broken entry points."""

import json
import subprocess
import sys

import pytest

from conftest import dsgd, write_spec


@pytest.fixture(scope="module")
def checked_rows(plugin_env) -> dict:
    """`dsgd plugins --check --json` with the test package installed (it imports every
    plugin: run once for the tests that read it), by (group, name)."""
    result = dsgd("plugins", "--check", "--json", env=plugin_env)
    assert result.returncode == 0, result.stderr
    return {(r["group"], r["name"]): r for r in json.loads(result.stdout)}


def test_plugins_lists_builtins_and_third_party(checked_rows):
    rows = checked_rows
    builtin = rows[("dsgd.aggregators", "allreduce")]
    assert (builtin["distribution"], builtin["status"]) == ("dsgd", "ok")
    for group, name in [("dsgd.aggregators", "local_sgd"), ("dsgd.compressors", "none"),
                        ("dsgd.optimizers", "sgd"), ("dsgd.optimizers", "adam"),
                        ("dsgd.tasks", "mnist1d_mlp"), ("dsgd.tasks", "mnist1d_cnn"),
                        ("dsgd.tasks", "digits_cnn"), ("dsgd.tasks", "logreg")]:
        assert rows[(group, name)]["status"] == "ok"
    good = rows[("dsgd.aggregators", "model_average")]
    assert (good["distribution"], good["version"], good["status"]) == ("dsgd-testplugins", "1.2.3", "ok")
    broken = rows[("dsgd.aggregators", "broken_import")]["status"]
    assert broken == "broken: ModuleNotFoundError: No module named 'a_module_that_does_not_exist'"
    wrong = rows[("dsgd.aggregators", "wrong_base")]["status"]
    assert wrong.startswith("broken: ") and "is not a subclass of dsgd_cli.api.Aggregator" in wrong


def test_plain_listing_is_a_table(plugin_env):
    result = dsgd("plugins", "--check", env=plugin_env)
    assert result.returncode == 0
    assert "dsgd-testplugins" in result.stdout and "broken: ModuleNotFoundError" in result.stdout


def test_listing_without_check_reads_metadata_only(plugin_env):
    """Without --check nothing is imported: the broken plugins are listed like the others,
    with where they point, and no status."""
    result = dsgd("plugins", "--json", env=plugin_env)
    assert result.returncode == 0, result.stderr
    rows = {(r["group"], r["name"]): r for r in json.loads(result.stdout)}
    assert rows[("dsgd.aggregators", "allreduce")] == {
        "group": "dsgd.aggregators", "name": "allreduce", "distribution": "dsgd",
        "version": rows[("dsgd.aggregators", "allreduce")]["version"],
        "target": "plugins.aggregators.allreduce:AllReduce"}
    assert rows[("dsgd.aggregators", "broken_import")]["target"] == "dsgd_testplugins.broken:Anything"
    assert all("status" not in row for row in rows.values())


def test_the_registry_finds_plugins_without_importing_torch():
    """What keeps `dsgd plugins` quick: discovery reads metadata, loading imports."""
    code = ("import sys; from dsgd_cli.spec import registry; registry.discover('aggregator'); "
            "print('torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.stdout.strip() == "False", result.stderr


def test_spec_naming_a_broken_plugin_is_bad_input(plugin_env, tmp_path):
    spec = write_spec(tmp_path, """
        experiments:
          - {name: a, task: logreg, aggregator: {name: broken_import}}
    """)
    result = dsgd("run", str(spec), "--db", str(tmp_path / "r.db"), env=plugin_env)
    assert result.returncode == 2
    line = result.stderr.strip()
    assert "\n" not in line
    assert ("experiments[0].aggregator.name: aggregator plugin 'broken_import' "
            "(dsgd_testplugins.broken:Anything, from dsgd-testplugins 1.2.3) failed to import: "
            "ModuleNotFoundError") in line
    assert not (tmp_path / "r.db").exists()


def test_broken_plugins_do_not_break_a_spec_that_does_not_use_them(plugin_env, tmp_path):
    spec = write_spec(tmp_path, """
        experiments:
          - {name: a, task: logreg, aggregator: {name: model_average, every: 2}}
    """)
    result = dsgd("run", str(spec), "--dry-run", env=plugin_env)
    assert result.returncode == 0, result.stderr
    assert "aggregator options: error_feedback=False, sync_buffers=True, every=2" in result.stdout


def test_plugin_option_defaults_obey_their_own_declaration(checked_rows, plugin_env, tmp_path):
    """A default below the option's minimum, or of the wrong type, is a broken plugin: in
    `plugins --check`, and as bad input (exit 2) in a spec that uses it."""
    rows = checked_rows
    bound = ("broken: aggregator plugin 'bad_default_bound' (dsgd_testplugins.misbehave:BadBound, "
             "from dsgd-testplugins 1.2.3): the default of option 'period' is invalid: "
             "expected a value >= 1, got -3")
    assert rows[("dsgd.aggregators", "bad_default_bound")]["status"] == bound
    assert rows[("dsgd.aggregators", "bad_default_type")]["status"].endswith(
        "the default of option 'period' is invalid: expected an integer, got 'four'")
    assert rows[("dsgd.aggregators", "misbehave")]["status"] == "ok"
    spec = write_spec(tmp_path, """
        experiments:
          - {name: a, task: logreg, aggregator: {name: bad_default_bound}}
    """)
    result = dsgd("run", str(spec), "--dry-run", env=plugin_env)
    assert result.returncode == 2
    assert result.stderr.strip() == (
        f"dsgd: error: {spec}: experiments[0].aggregator.name: " + bound[len("broken: "):])
