"""`dsgd plugins NAME`: one plugin's description and options, from its own declaration."""

from __future__ import annotations

import json

from conftest import dsgd_in_process as dsgd


def test_a_plugin_shows_each_option_with_type_default_bounds_and_help():
    result = dsgd("plugins", "local_sgd")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("aggregator local_sgd (plugins.aggregators.local_sgd:LocalSGD, from dsgd ")
    period = next(line for line in lines if line.startswith("period"))
    assert period.split()[:6] == ["period", "an", "integer", "4", ">=", "1"]
    assert period.endswith("local steps between model averages (H)")


def test_json_holds_the_declaration_and_the_docstring():
    described = json.loads(dsgd("plugins", "compressor:qsgd", "--json").stdout)
    assert (described["kind"], described["name"]) == ("compressor", "qsgd")
    assert described["description"].startswith("`qsgd` (Alistarh et al., 2017)")
    levels = next(row for row in described["options"] if row["option"] == "levels")
    assert levels == {"option": "levels", "type": "an integer", "default": 16, "bounds": "1 to 127",
                      "help": "quantization levels s"}


def test_an_unknown_plugin_or_kind_is_exit_2():
    unknown = dsgd("plugins", "allreduc")
    assert unknown.returncode == 2
    assert unknown.stderr == ("dsgd: error: 'allreduc': no registered plugin has this name "
                              "(`dsgd plugins` lists them)\n")
    kind = dsgd("plugins", "aggregators:allreduce")
    assert kind.returncode == 2 and "unknown plugin kind 'aggregators'" in kind.stderr
