"""`dsgd plugins NAME`: one plugin's description and options, from its own declaration."""

from __future__ import annotations

import json

from conftest import dsgd_in_process as dsgd


def test_a_plugin_shows_each_option_with_type_default_bounds_and_help():
    result = dsgd("plugins", "local_sgd")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("aggregator local_sgd (plugins.aggregators.local_sgd:LocalSGD, from dsgd ")
    at = next(index for index, line in enumerate(lines) if line.startswith("period"))
    period = lines[at]
    assert period.split()[:6] == ["period", "an", "integer", "4", ">=", "1"]
    # the help column is wrapped to the terminal: its words go on below, under it
    column = period.index(period.split()[6])
    following = [line for line in lines[at + 1:] if line[:column].strip() == ""]
    help_text = " ".join([period[column:].strip()]
                         + [line[column:].strip() for line in following if line.strip()])
    assert help_text.startswith("local steps between model averages (H)")


def test_tables_are_wrapped_to_the_terminal(monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    for args in [(), ("diloco",), ("allreduce",), ("streaming_diloco",), ("qsgd",)]:
        result = dsgd("plugins", *args)
        assert result.returncode == 0, result.stderr
        widest = max(len(line) for line in result.stdout.splitlines())
        assert widest <= 100, (args, widest)


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
