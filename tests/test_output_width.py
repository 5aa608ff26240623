"""Issue #48, item 8: prose output fits the terminal. `run --dry-run`'s plan and `show`'s
header wrap to the terminal's width or $COLUMNS (at COLUMNS=100 they were 234 and 106 columns
wide); piped without $COLUMNS, every line stays whole for scripts (tests/test_budgets.py
parses them). `dsgd plugins` is tests/test_plugins_command.py's."""

from __future__ import annotations

from conftest import ROOT, dsgd_in_process as dsgd
from dsgd_cli.commands.output import wrap_lines
from dsgd_cli.results.store import MetricRow, Store

EXAMPLE = ROOT / "examples" / "hierarchy.yaml"


def _widest(text: str) -> int:
    return max(len(line) for line in text.splitlines())


def test_the_dry_run_wraps_to_columns_and_stays_whole_for_scripts(monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    whole = dsgd("run", str(EXAMPLE), "--dry-run")
    assert whole.returncode == 0, whole.stderr
    assert _widest(whole.stdout) > 100  # one line per item: `grep 'cluster:'` finds it whole
    cluster = next(line for line in whole.stdout.splitlines() if "cluster:" in line)
    assert cluster.endswith("latency 1 ms; NIC shared")
    monkeypatch.setenv("COLUMNS", "100")
    wrapped = dsgd("run", str(EXAMPLE), "--dry-run")
    assert wrapped.returncode == 0, wrapped.stderr
    assert _widest(wrapped.stdout) <= 100
    assert wrapped.stdout.split() == whole.stdout.split()  # the same words, nothing lost
    lines = wrapped.stdout.splitlines()
    at = next(index for index, line in enumerate(lines) if line.startswith("    cluster:"))
    assert lines[at + 1].startswith("      ") and "12.5 MB/s" in lines[at] + lines[at + 1]


def test_show_wraps_to_columns(tmp_path, monkeypatch):
    db = tmp_path / "r.db"
    store = Store(str(db))
    config = {"task": {"name": "logreg"}, "aggregator": {"name": "allreduce"},
              "compressor": {"name": "none"}, "optimizer": {"name": "sgd", "lr": 0.1},
              "workers": 2, "compute": {"step_seconds": 0.01, "time_scale": 1}}
    run_id = store.create_run("a", config, "spec.yaml", [])
    store.add_metrics(run_id, [MetricRow("wall_seconds", 1.0)])
    store.finish_run(run_id, "completed")
    monkeypatch.setenv("COLUMNS", "100")
    shown = dsgd("show", str(run_id), "--db", str(db))
    assert shown.returncode == 0, shown.stderr
    assert _widest(shown.stdout) <= 100
    assert ("clock: modeled (an emulated cluster: every time below is modeled seconds, real "
            "time ÷\n    compute.time_scale)") in shown.stdout
    monkeypatch.delenv("COLUMNS")
    assert "real time ÷ compute.time_scale)" in dsgd("show", str(run_id), "--db", str(db)).stdout


def test_wrapped_lines_keep_numbers_with_units_and_commands_pasteable():
    link = wrap_lines(["  link: 12.5 MB/s = 100 Mbit/s, latency 1 ms"], 20)
    assert link == ["  link: 12.5 MB/s =", "      100 Mbit/s,", "      latency 1 ms"]
    command = "  torchrun --nnodes 2 --nproc-per-node 4 -m dsgd_cli.launch.relay /tmp/e.json"
    wrapped = wrap_lines([command], 40)
    assert all(len(line) <= 40 for line in wrapped)
    assert all(line.endswith(" \\") for line in wrapped[:-1])
    assert " ".join(part.rstrip("\\").strip() for part in wrapped) == command.strip()
    assert wrap_lines(["x" * 50], 20) == ["x" * 50]  # a word is never split
