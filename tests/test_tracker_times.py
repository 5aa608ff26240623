"""Issue #48, item 10: an MLflow run's start and end are real while its metrics' times are on
the run's clock (modeled seconds for an emulated cluster); its `dsgd.times` tag says so."""

from __future__ import annotations

from dsgd_cli.results.reader import Results
from dsgd_cli.results.store import Store
from dsgd_cli.results.trackers import run_tags


def test_the_tags_say_which_times_are_real_and_which_modeled(tmp_path):
    path = tmp_path / "r.db"
    store = Store(str(path))
    base = {"task": {"name": "logreg"}, "aggregator": {"name": "allreduce"},
            "compressor": {"name": "none"}, "optimizer": {"name": "sgd", "lr": 0.1}, "workers": 2}
    for name, config in (("emulated", base | {"compute": {"step_seconds": 0.01, "time_scale": 4}}),
                         ("plain", base)):
        store.finish_run(store.create_run(name, config, None, []), "completed")
    emulated, plain = Results(str(path)).runs()
    modeled = run_tags(emulated)
    assert modeled["dsgd.clock"] == "modeled"
    assert modeled["dsgd.times"] == (
        f"start and end times are real (when the run began and ended on {emulated.host}); "
        "metric times are the start plus modeled seconds of the emulated cluster, not when "
        "they were recorded")
    assert run_tags(plain)["dsgd.times"] == (
        f"start and end times are real (when the run began and ended on {plain.host}); "
        "metric times are the start plus measured seconds since training began")
