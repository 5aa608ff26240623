"""`dsgd advise`: the system and convergence models on synthetic data with known answers, and the
command on databases filled with synthetic runs (written straight through the store, no
training), plus one small real run."""

from __future__ import annotations

import csv
import io
import json
import math
import subprocess
import sys

import numpy as np
import pytest

from conftest import dsgd_in_process, write_spec
from dsgd_cli.results.advice import (Observation, convergence_features, fit_convergence,
                                     fit_relative, fit_system, leave_one_out_error,
                                     leave_one_out_errors, mean_step_seconds, nnls,
                                     system_features)
from dsgd_cli.results.store import MetricRow, Store

TARGET = "test_accuracy=0.85"


# -- synthetic runs --------------------------------------------------------------------------

def record(store: Store, aggregator: str, workers: int, step_time: float, steps_to_target: int,
           *, seed: int = 0, last_step: int | None = None, options: dict | None = None,
           epochs: int = 1, tags: list[str] | None = None) -> int:
    """A run that took `step_time` seconds per step on every rank and whose test accuracy,
    evaluated every 10 steps, is 0.5 until step `steps_to_target` and 0.9 from there on; it
    stops at `last_step` (default: 100 steps after the target), reached or not."""
    last_step = last_step if last_step is not None else steps_to_target + 100
    config = {"name": f"{aggregator}-{workers}-{seed}", "workers": workers, "seed": seed,
              "epochs": epochs, "batch_size": 32, "task": {"name": "logreg"},
              "optimizer": {"name": "sgd", "lr": 0.05},
              "aggregator": {"name": aggregator, **(options or {})},
              "compressor": {"name": "none"}}
    run_id = store.create_run(config["name"], config, None, [])
    rows = []
    for step in range(10, last_step + 1, 10):
        rows += [MetricRow("step_seconds", step_time, step=step, epoch=0, rank=rank,
                           seconds=step * step_time) for rank in range(workers)]
        rows.append(MetricRow("test_accuracy", 0.9 if step >= steps_to_target else 0.5,
                              step=step, epoch=0, seconds=step * step_time))
    rows.append(MetricRow("wall_seconds", last_step * step_time))
    store.add_metrics(run_id, rows)
    store.finish_run(run_id, "completed")
    if tags:
        store.tag_run(run_id, tags)
    return run_id


def steps_law(n: int) -> int:
    """Steps to target that fall as 1/n and level off (McCandlish et al.'s form)."""
    return 200 + 1600 // n  # n = 2, 4, 8, 16, 32: 1000, 600, 400, 300, 250


def advise(db, *args: str) -> list[dict]:
    result = dsgd_in_process("advise", "--db", str(db), "--target", TARGET, "--format", "json",
                             *args)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout, parse_constant=_no_bare_constants)


def _no_bare_constants(name: str):
    raise AssertionError(f"json with a bare {name}")


# -- the models ------------------------------------------------------------------------------

def test_nnls_agrees_with_scipy():
    from scipy.optimize import nnls as scipy_nnls

    rng = np.random.default_rng(1)
    for _ in range(50):
        a = rng.normal(size=(8, 4))
        b = rng.normal(size=8)
        ours, theirs = nnls(a, b), scipy_nnls(a, b)[0]
        assert (ours >= 0).all()
        assert np.linalg.norm(a @ ours - b) == pytest.approx(np.linalg.norm(a @ theirs - b),
                                                             rel=1e-9, abs=1e-12)


def test_system_model_recovers_known_coefficients():
    theta = np.array([0.01, 0.05, 0.002, 0.0005])  # 1, 1/n, log n, n
    workers = [1, 2, 4, 8, 16, 32]
    seconds = system_features(workers) @ theta
    assert fit_system(workers, list(seconds)) == pytest.approx(theta, rel=1e-6, abs=1e-10)
    # Relative errors: values 1 and 3 at the same n pull a constant to the θ minimising
    # (θ/1 − 1)² + (θ/3 − 1)², that is (1 + 1/3) / (1 + 1/9) = 1.2, not their mean 2.
    assert fit_relative(np.ones((2, 1)), np.array([1.0, 3.0]))[0] == pytest.approx(1.2)
    # With a coefficient at zero (no log n term) NNLS finds the zero rather than a negative.
    theta = np.array([0.02, 0.0, 0.0, 0.001])
    fitted = fit_system(workers, list(system_features(workers) @ theta))
    assert fitted == pytest.approx(theta, abs=1e-9)


def test_a_runs_step_time_weighs_intervals_by_length_without_the_first():
    # (step, mean step seconds over the interval ending there, seconds)
    assert mean_step_seconds([(10, 1.0, 1), (20, 0.1, 2), (40, 0.2, 6)]) == pytest.approx(
        (0.1 * 10 + 0.2 * 20) / 30)
    assert mean_step_seconds([(10, 1.0, 1), (30, 0.1, 2)]) == pytest.approx(
        (1.0 * 10 + 0.1 * 20) / 30)  # two intervals: both count
    assert mean_step_seconds([]) is None


def test_convergence_fit_predicts_a_held_out_worker_count():
    rng = np.random.default_rng(0)
    workers = [2, 2, 4, 4, 8, 8]
    steps = [steps_law(n) * (1 + 0.03 * rng.standard_normal()) for n in workers]
    beta = fit_convergence(workers, steps, [True] * len(workers))
    predicted = (convergence_features([16]) @ beta)[0]
    assert predicted == pytest.approx(steps_law(16), rel=0.08)


def test_runs_that_never_reached_the_target_push_the_prediction_up():
    workers, steps = [2, 4, 8], [steps_law(n) for n in (2, 4, 8)]
    free = (convergence_features([16]) @ fit_convergence(workers, steps, [True] * 3))[0]
    assert free == pytest.approx(300, rel=1e-6)
    # A run at 16 that ran 450 steps without reaching says S(16) > 450: it pulls the
    # prediction from 300 most of the way up (a squared-hinge loss weighs it like one of the
    # three reached runs that say otherwise).
    censored = fit_convergence(workers + [16], steps + [450], [True, True, True, False])
    assert (convergence_features([16]) @ censored)[0] > 400
    # One that stopped at 150 says nothing new: S(16) = 300 > 150 already.
    loose = fit_convergence(workers + [16], steps + [150], [True, True, True, False])
    assert (convergence_features([16]) @ loose)[0] == pytest.approx(300, rel=1e-6)


def test_the_censored_fit_is_the_minimum_of_its_objective():
    """The alternating fit against a general-purpose bounded minimiser of the same convex
    objective: reached runs' squared relative errors plus censored runs' squared shortfalls."""
    from scipy.optimize import minimize

    rng = np.random.default_rng(3)
    for _ in range(8):
        workers = [2, 2, 4, 4, 8, 8, 16, 32]
        steps = [steps_law(n) * math.exp(0.3 * rng.standard_normal()) for n in workers]
        reached = list(rng.random(len(workers)) < 0.6)
        reached[0] = True
        rows = convergence_features(workers) / np.array(steps)[:, None]
        hit = np.array(reached)

        def objective(beta):
            ratio = rows @ beta
            return (np.sum((ratio[hit] - 1) ** 2)
                    + np.sum(np.maximum(0.0, 1 - ratio[~hit]) ** 2))

        ours = fit_convergence(workers, steps, reached)
        best = min((minimize(objective, start, bounds=[(0, None)] * 3, method="L-BFGS-B",
                             options={"ftol": 1e-15, "gtol": 1e-12})
                    for start in ([100.0, 1000.0, 0.0], [300.0, 0.0, 50.0])),
                   key=lambda result: result.fun)
        assert objective(ours) <= best.fun + 1e-9


def test_leave_one_out_error_is_zero_on_the_model_and_grows_off_it():
    def observation(run_id, n, steps_factor=1.0):
        steps = steps_law(n) * steps_factor
        return Observation(run_id, n, 0.01 + 0.001 * n, steps, True, 0.9)

    exact = [observation(i, n) for i, n in enumerate((2, 4, 8, 16))]
    assert leave_one_out_error(exact) == pytest.approx(0.0, abs=1e-6)
    # A second run at 16 that took 1.5x the steps: held out, it is predicted from the four
    # exact runs, which give the law itself, so its error is |S - 1.5 S| / 1.5 S = 1/3.
    off = exact + [observation(4, 16, steps_factor=1.5)]
    errors = leave_one_out_errors(off)
    assert sorted(errors) == [0, 1, 2, 3, 4]
    assert errors[4] == pytest.approx(1 / 3, rel=1e-6)
    assert leave_one_out_error(off) == pytest.approx(sum(errors.values()) / 5)
    assert leave_one_out_error(off) > 0.1


# -- the command -----------------------------------------------------------------------------

def system_law(n: int) -> float:
    return 0.01 + 0.002 * math.log(n) + 0.0005 * n


@pytest.fixture(scope="module")
def scaling_db(tmp_path_factory):
    """allreduce at n = 2, 4, 8 (two seeds each) on known laws; sgp at 4 only."""
    db = tmp_path_factory.mktemp("advise") / "r.db"
    store = Store(str(db))
    for n in (2, 4, 8):
        for seed in (0, 1):
            record(store, "allreduce", n, system_law(n), steps_law(n), seed=seed,
                   tags=["paper"] if seed == 0 else None)
    record(store, "sgp", 4, 0.02, 500)
    return db


def test_predictions_follow_the_known_laws_and_flag_extrapolation(scaling_db):
    rows = advise(scaling_db, "--where", "aggregator=allreduce", "--workers", "2,4,8,16,64")
    assert [row["workers"] for row in rows] == [2, 4, 8, 16, 64]
    for row in rows:
        n = row["workers"]
        assert row["aggregator"] == "allreduce" and row["compressor"] == "none"
        assert row["seconds_per_step"] == pytest.approx(system_law(n), rel=1e-4)
        assert row["time_to_target"] == pytest.approx(row["seconds_per_step"] * row["steps_to_target"])
        # Runs exactly on the laws: every resample fits them, so the estimate sits on its
        # interval's edge, which is flagged rather than hidden by widening the interval.
        assert row["time_low"] <= row["time_to_target"] * (1 + 1e-9)
        assert row["time_to_target"] <= row["time_high"] * (1 + 1e-9)
        assert row["warning"].startswith("estimate not inside its interval")
        assert row["extrapolated"] is (n > 8)
        assert row["fit_error"] == pytest.approx(0.0, abs=1e-3)
        assert row["advice"] is None and row["rank"] == 1
    for n in (2, 4, 8):  # recorded points: the steps are exact
        assert rows[[2, 4, 8].index(n)]["steps_to_target"] == pytest.approx(steps_law(n), rel=1e-4)
    # S(16) = 200 + 1600/16 on the fitted 1/n law (log n's coefficient stays at 0)
    assert rows[3]["steps_to_target"] == pytest.approx(300, rel=0.02)
    # t·S: 18.2, 9.4, 7.26, 7.06 (extrapolated), 11.3 s: the soonest is at 16, but its
    # interval (7.06 to 8.7) holds n = 8's estimate: no best overall is claimed.
    assert [row["best"] for row in rows] == ["at n"] * 5
    assert rows[3]["warning"].endswith("no clear best overall: intervals overlap allreduce, none at n = 8")


def test_too_few_worker_counts_get_advice_not_a_number(scaling_db):
    rows = advise(scaling_db, "--workers", "4,16")
    sgp = [row for row in rows if row["aggregator"] == "sgp"]
    assert [row["workers"] for row in sgp] == [4, 16]  # one row per (group, n), as every group
    for row in sgp:
        assert row["advice"] == "runs at n = 4 only: run at n = 2 and 8"  # the cheapest counts
        for column in ("seconds_per_step", "steps_to_target", "time_to_target", "time_low",
                       "time_high", "extrapolated", "fit_error", "rank", "best", "warning"):
            assert row[column] is None
    assert {row["aggregator"] for row in rows if row["advice"] is None} == {"allreduce"}


def test_runs_that_never_approach_the_target_get_advice(tmp_path):
    store = Store(str(tmp_path / "r.db"))
    for n in (2, 4, 8):
        record(store, "allreduce", n, 0.01, 10_000, last_step=200)
    rows = advise(tmp_path / "r.db")
    assert [row["workers"] for row in rows] == [2, 4, 8, 16, 32, 64]
    assert all(row["time_to_target"] is None for row in rows)
    assert rows[0]["advice"].startswith("no run reached test_accuracy=0.85 (best 0.5): run longer")
    # Reached at one count only: one point of the convergence curve is no curve.
    record(store, "allreduce", 4, 0.01, 100, seed=1)
    rows = advise(tmp_path / "r.db")
    assert {row["advice"] for row in rows} == {
        "only the runs at n = 4 reached test_accuracy=0.85: run those at n = 2 and 8 longer"}


def test_the_advised_best_switches_where_the_curves_cross(tmp_path):
    """Same convergence; `fast` has cheaper steps that grow quicker with n: allreduce-like
    t = 0.01 + 0.002·n against t = 0.02 + 0.0005·n. They cross at n = 20/3."""
    store = Store(str(tmp_path / "r.db"))
    for n in (2, 4, 8, 16):
        record(store, "local_sgd", n, 0.01 + 0.002 * n, steps_law(n))
        record(store, "sgp", n, 0.02 + 0.0005 * n, steps_law(n))
    rows = advise(tmp_path / "r.db", "--workers", "2,4,6,7,8,16,32")
    best = {row["workers"]: row["aggregator"] for row in rows if row["rank"] == 1}
    assert best == {2: "local_sgd", 4: "local_sgd", 6: "local_sgd", 7: "sgp", 8: "sgp",
                    16: "sgp", 32: "sgp"}
    assert [row["rank"] for row in rows if row["workers"] == 8] == [1, 2]
    # At n = 8 the two intervals are apart (sgp 9.6 s, local_sgd 10.4 s): a best is claimed.
    assert [row["best"] for row in rows if row["workers"] == 8] == ["at n", None]
    # The soonest of all, sgp at 16 (8.4 s), is not claimed: sgp at 32 (extrapolated) has an
    # interval reaching below it.
    soonest = min(rows, key=lambda row: row["time_to_target"])
    assert (soonest["aggregator"], soonest["workers"]) == ("sgp", 16)
    assert not [row for row in rows if row["best"] == "overall"]
    assert soonest["warning"].endswith("no clear best overall: intervals overlap sgp, none at n = 32")


def test_default_groups_split_by_the_options_that_differ(tmp_path):
    store = Store(str(tmp_path / "r.db"))
    for n in (2, 4, 8):
        for period in (2, 8):
            # Each period at two epoch counts: epochs are run length, not the algorithm.
            for epochs in (1, 2):
                record(store, "local_sgd", n, system_law(n), steps_law(n) * period // 2,
                       options={"period": period}, epochs=epochs)
        # An option only sgp has, the same in all its runs, tells no groups apart.
        record(store, "sgp", n, 2 * system_law(n), steps_law(n),
               options={"topology": "ring", "peers_per_step": 1})
    rows = advise(tmp_path / "r.db", "--workers", "4")
    assert [(row["aggregator"], row["aggregator.period"], row["aggregator.topology"])
            for row in rows] == [("local_sgd", 2, None), ("sgp", None, "ring"),
                                 ("local_sgd", 8, None)]
    assert "epochs" not in rows[0] and "seed" not in rows[0]
    assert "aggregator.peers_per_step" not in rows[0]
    # --by overrides: one group over both periods
    merged = advise(tmp_path / "r.db", "--workers", "4", "--by", "aggregator",
                    "--where", "aggregator=local_sgd")
    assert [row["aggregator"] for row in merged] == ["local_sgd"]
    assert list(merged[0])[:2] == ["aggregator", "workers"]


def test_where_and_tags_select_through_the_query_layer(scaling_db):
    tagged = advise(scaling_db, "--where", "tag=paper", "--workers", "8")
    assert [(row["aggregator"], row["advice"] is None) for row in tagged] == [("allreduce", True)]
    narrow = advise(scaling_db, "--where", "workers<=4", "--workers", "8")
    assert narrow[0]["advice"] == "runs at n = 2 and 4 only: run at n = 8"


def test_every_format_has_the_same_rows(scaling_db, monkeypatch):
    as_json = advise(scaling_db)
    assert [row["workers"] for row in as_json if row["advice"] is None] == [2, 4, 8, 16, 32, 64]
    result = dsgd_in_process("advise", "--db", str(scaling_db), "--target", TARGET, "-f", "csv")
    assert result.returncode == 0, result.stderr
    rows = list(csv.DictReader(io.StringIO(result.stdout)))
    assert list(rows[0]) == ["aggregator", "compressor", "workers", "seconds_per_step",
                             "steps_to_target", "time_to_target", "time_low", "time_high",
                             "extrapolated", "rank", "best", "fit_error", "clock",
                             "warning", "advice"]
    assert len(rows) == len(as_json)
    assert float(rows[0]["time_to_target"]) == pytest.approx(as_json[0]["time_to_target"])
    monkeypatch.setenv("COLUMNS", "300")  # room for every column
    table = dsgd_in_process("advise", "--db", str(scaling_db), "--target", TARGET)
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0] == "every row: compressor none, clock measured"  # what all rows share
    assert lines[1].split()[:2] == ["aggregator", "workers"]
    assert "run at n = 2 and 8" in lines[-1] and lines[-1].startswith("sgp")
    assert any(line.split()[1] == "16" and " yes " in line for line in lines[2:])


@pytest.mark.parametrize("args, message", [
    (["--target", "test_accuracy"], "--target 'test_accuracy': expected METRIC=NUMBER"),
    (["--target", "test_accuracy=high"], "expected METRIC=NUMBER"),
    (["--target", "test_acc=0.9"], "--target: no selected run recorded metric 'test_acc' "
     "(recorded: step_seconds, test_accuracy, wall_seconds)"),
    (["--target", "wall_seconds=3"], "--target: metric 'wall_seconds' is recorded once per run"),
    (["--target", TARGET, "--where", "workers>100"], "no recorded run matches the selection"),
    (["--target", TARGET, "-e", "nosuch"], "--experiment 'nosuch': no recorded run has this experiment name"),
    (["--target", TARGET, "--workers", "2,x"], "--workers '2,x': expected positive worker counts"),
    (["--target", TARGET, "--workers", "0"], "expected positive worker counts"),
    (["--target", TARGET, "--by", "optimizer.momentum"], "--by: unknown key 'optimizer.momentum'"),
    (["--target", TARGET, "--where", "lr<1"], "--where: unknown key 'lr'"),
    (["--target", TARGET, "--format", "nosuch"], "--format: unknown format 'nosuch'"),
])
def test_bad_input_exits_2_in_one_line(scaling_db, args, message):
    result = dsgd_in_process("advise", "--db", str(scaling_db), *args)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and message in result.stderr, result.stderr
    assert result.stdout == ""


def test_an_empty_database_and_a_missing_one_exit_2(tmp_path):
    Store(str(tmp_path / "empty.db"))
    for db in ("empty.db", "missing.db"):
        result = dsgd_in_process("advise", "--db", str(tmp_path / db), "--target", TARGET)
        assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr


def test_advise_loads_neither_sqlalchemy_nor_torch(scaling_db):
    code = ("import sys\nfrom dsgd_cli.cli import app\n"
            f"app(['advise', '--db', {str(scaling_db)!r}, '--target', {TARGET!r}], "
            "standalone_mode=False)\n"
            "print(sorted({'sqlalchemy', 'torch', 'scipy'} & set(sys.modules)))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "[]"


def test_a_real_run_is_read(tmp_path):
    """What `dsgd run` records (step_seconds per rank, test_accuracy per epoch) is what the
    advisor reads: one worker count gets advice naming the next two."""
    spec = write_spec(tmp_path, """
        defaults: {task: {name: logreg, samples: 256}, workers: 2, epochs: 2, batch_size: 16,
                   log_interval: 2, steps_per_epoch: 4}
        experiments:
          - name: allreduce
            aggregator: {name: allreduce}
        """)
    db = tmp_path / "r.db"
    result = dsgd_in_process("run", str(spec), "--db", str(db))
    assert result.returncode == 0, result.stderr
    rows = advise(db, "--target", "test_accuracy=0.01", "--workers", "2,4")
    assert [(row["aggregator"], row["workers"], row["advice"]) for row in rows] == [
        ("allreduce", n, "runs at n = 2 only: run at n = 4 and 8") for n in (2, 4)]


def test_intervals_cover_the_recorded_counts_and_widen_beyond_them(tmp_path):
    """Three seeds per count with ±10% noise on steps and step times: the interval at a
    recorded count holds the true time, and is relatively wider far beyond the counts."""
    store = Store(str(tmp_path / "r.db"))
    rng = np.random.default_rng(5)
    for n in (2, 4, 8):
        for seed in range(3):
            noise = 1 + 0.1 * rng.uniform(-1, 1, size=2)
            record(store, "allreduce", n, system_law(n) * noise[0],
                   int(round(steps_law(n) * noise[1] / 10)) * 10, seed=seed)
    rows = {row["workers"]: row for row in advise(tmp_path / "r.db", "--workers", "4,64")}
    assert rows[4]["time_low"] <= system_law(4) * steps_law(4) <= rows[4]["time_high"]
    assert rows[4]["time_low"] < rows[4]["time_to_target"] < rows[4]["time_high"]
    width = {n: (row["time_high"] - row["time_low"]) / row["time_to_target"]
             for n, row in rows.items()}
    assert width[64] > 2 * width[4]
    assert 0 < rows[4]["fit_error"] < 0.3


def test_advise_flags_what_makes_a_number_unsure():
    from dsgd_cli.results.advice import Observation, fit_warnings, next_counts

    three = [Observation(i, n, 0.01 * n, 100.0, True, 0.9) for i, n in enumerate((2, 4, 8))]
    assert fit_warnings(three, 0.41) == ["3 runs for the 4-parameter step-time model", "fit error 41%"]
    assert fit_warnings(three + [Observation(9, 16, 0.2, 90.0, True, 0.9)], 0.1) == []
    assert next_counts([8], 2) == [2, 4]  # the cheap counts, not 16 and 32
    assert next_counts([2, 4], 1) == [8]


def test_runs_whose_timing_overran_are_left_out_of_the_fits(tmp_path):
    """A run whose steps overran their modeled time has seconds partly of this machine: by
    default it is not fitted (said on one line); any --where on timing takes it in."""
    store = Store(str(tmp_path / "r.db"))
    for n in (2, 4, 8):
        record(store, "allreduce", n, 0.01, steps_law(n))
    slow = record(store, "allreduce", 16, 0.05, steps_law(16))
    with store.connect() as connection:  # what a run that overran leaves: its summary
        from sqlalchemy import text
        connection.execute(text("INSERT INTO summaries (run_id, name, final, best) "
                                "VALUES (:id, 'overrun_steps', 0.48, 0.48)"), {"id": slow})
        connection.commit()
    result = dsgd_in_process("advise", "--db", str(tmp_path / "r.db"), "--target", TARGET)
    assert "(left out 1 run whose timing overran" in result.stdout, result.stdout
    fitted_without = advise(tmp_path / "r.db")
    fitted_with = advise(tmp_path / "r.db", "--where", "timing!=none")
    assert fitted_without[0]["seconds_per_step"] != pytest.approx(fitted_with[0]["seconds_per_step"])
    only = dsgd_in_process("advise", "--db", str(tmp_path / "r.db"), "--target", TARGET,
                           "--where", "workers=16")
    assert only.returncode == 2 and "but 1 whose timing overran" in only.stderr


def test_a_narrow_advice_table_keeps_its_caveats(tmp_path, monkeypatch):
    """At 100 columns the warning, fit_error and extrapolated columns stay; a prediction whose
    fit error is over its threshold is not a plain number; a group with runs at one worker
    count is one row of advice, not one per n."""
    store = Store(str(tmp_path / "r.db"))
    for n, steps in ((2, 1000), (4, 200), (8, 900), (16, 150)):  # no law fits these
        record(store, "allreduce", n, 0.01 * n ** 0.5, steps)
    record(store, "sgp", 4, 0.01, 300)
    monkeypatch.setenv("COLUMNS", "100")
    result = dsgd_in_process("advise", "--db", str(tmp_path / "r.db"), "--target", TARGET)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    header = next(line for line in lines if line.startswith("aggregator")).split()
    assert header[-2:] == ["warning", "advice"], result.stdout
    allreduce = [line for line in lines if line.startswith("allreduce")]
    assert allreduce and all("?" in line.split()[2] for line in allreduce), result.stdout
    assert all("error 93" in line for line in allreduce)  # fit_error, said in the warning
    assert allreduce[-1].split()[3].startswith("extrapolated")  # n = 64
    assert any(line.startswith("?: a fit_error above 0.25") for line in lines)
    (sgp,) = [line for line in lines if line.startswith("sgp")]
    assert sgp.split()[:2] == ["sgp", "2-64"] and "at n = 2 and 8" in sgp
