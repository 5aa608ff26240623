"""`dsgd compare` answering questions: filters, groups over seeds, baselines and targets, on a
database filled with known metric histories, checked against numbers worked out by hand."""

from __future__ import annotations

import json
import statistics

import pytest

from conftest import dsgd_in_process as dsgd
from dsgd_cli.commands.output import readable
from dsgd_cli.results.store import MetricRow, Store


def config(aggregator: str, compressor: str, seed: int, lr: float) -> dict:
    return {"task": {"name": "logreg"}, "optimizer": {"name": "sgd", "lr": lr},
            "aggregator": {"name": aggregator, "compressor": {"name": compressor}},
            "compressor": {"name": compressor}, "workers": 2, "seed": seed}


# name, aggregator, compressor, seed, lr, status,
# (samples_per_second, wall_seconds, total_bytes_sent),
# test accuracy history [(step, seconds, value)], bytes_sent per step and rank
RUNS = [
    ("base", "allreduce", "none", 0, 0.05, "completed", (100.0, 10.0, 1000.0),
     [(10, 1.0, 0.5), (20, 2.0, 0.85), (30, 3.0, 0.8)], 5.0),
    ("base", "allreduce", "none", 1, 0.05, "completed", (120.0, 8.0, 1000.0),
     [(10, 1.5, 0.9), (20, 2.5, 0.84)], 5.0),
    ("q", "allreduce", "qsgd", 0, 0.05, "completed", (150.0, 6.0, 250.0),
     [(10, 0.8, 0.7), (20, 1.6, 0.78)], 1.25),
    ("q", "allreduce", "qsgd", 1, 0.2, "failed", (140.0, 7.0, 250.0),
     [(10, 0.9, 0.6)], 1.25),
    ("gossip", "sgp", "none", 0, 0.05, "completed", (200.0, 5.0, 500.0),
     [(10, 0.5, 0.86), (20, 1.0, 0.7)], 2.5),
]


@pytest.fixture(scope="module")
def db(tmp_path_factory):
    path = tmp_path_factory.mktemp("compare") / "r.db"
    store = Store(str(path))
    for name, aggregator, compressor, seed, lr, status, finals, accuracy, per_step in RUNS:
        run_id = store.create_run(name, config(aggregator, compressor, seed, lr), None, [])
        sps, wall, total = finals
        rows = [MetricRow("samples_per_second", sps), MetricRow("wall_seconds", wall),
                MetricRow("total_bytes_sent", total)]
        rows += [MetricRow("test_accuracy", value, step=step, epoch=0, seconds=seconds)
                 for step, seconds, value in accuracy]
        # bytes_sent: the mean per step over each 10-step log interval, per rank
        rows += [MetricRow("bytes_sent", per_step, step=step, epoch=0, rank=rank, seconds=1.0)
                 for step in (10, 20, 30) for rank in (0, 1)]
        store.add_metrics(run_id, rows)
        store.finish_run(run_id, status)
    return path


def compare(db, *args: str) -> list[dict]:
    result = dsgd("compare", "--db", str(db), "--format", "json", *args)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_where_filters_on_columns_configuration_and_status(db):
    assert [r["id"] for r in compare(db, "--where", "aggregator=allreduce")] == [1, 2, 3, 4]
    assert [r["id"] for r in compare(db, "--where", "optimizer.lr<0.1",
                                     "--where", "aggregator=allreduce")] == [1, 2, 3]
    assert [r["id"] for r in compare(db, "--where", "status!=completed")] == [4]
    assert [r["id"] for r in compare(db, "--where", "seed>=1", "--where", "workers=2")] == [2, 4]
    assert [r["id"] for r in compare(db, "-w", "compressor.name=qsgd", "--last", "1")] == [4]
    assert compare(db, "--where", "optimizer.lr=1e-3") == []


@pytest.mark.parametrize("args, message", [
    (["--where", "optimizer.lrr<0.1"],
     "--where: unknown key 'optimizer.lrr': no recorded run has it"),
    (["--where", "lr<0.1"], "--where: unknown key 'lr': no recorded run has it (did you mean optimizer.lr?)"),
    (["--where", "workers"], "--where 'workers': expected KEY OP VALUE"),
    (["--where", "tag>x"], "a tag can only be compared with = or !="),
    (["--by", "optimizer.momentum"], "--by: unknown key 'optimizer.momentum'"),
    (["--target", "test_accuracy"], "--target 'test_accuracy': expected METRIC=NUMBER"),
    (["--target", "test_accuracy=nan"], "expected METRIC=NUMBER"),
    (["--baseline", "nosuch"], "--baseline 'nosuch': no recorded run has this id or experiment name"),
    (["--sort", "nosuch"], "--sort: no column 'nosuch'"),
    (["-e", "bsae"], "--experiment 'bsae': no recorded run has this experiment name "
                     "(recorded: base, gossip, q)"),
    (["-e", "base", "-e", "qq"], "--experiment 'qq'"),
])
def test_malformed_questions_exit_2_in_one_line(db, args, message):
    result = dsgd("compare", "--db", str(db), *args)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and message in result.stderr, result.stderr


@pytest.mark.parametrize("command", ["compare", "plot", "export"])
@pytest.mark.parametrize("condition, message", [
    ("workers>>2", "expected KEY OP VALUE with one OP, one of >=, <=, !=, =, >, <, got '>' "
                   "followed by '>'"),
    ("workers=>2", "got '=' followed by '>'"),
    ("workers<>2", "got '<' followed by '>'"),
    ("workers!==2", "got '!=' followed by '='"),
    ("workers>two", "> compares numbers: expected a number after '>', got 'two'"),
    ("optimizer.lr<=x", "<= compares numbers: expected a number after '<=', got 'x'"),
])
def test_a_malformed_where_exits_2_naming_the_condition(db, tmp_path, command, condition, message):
    extra = {"plot": ["-o", str(tmp_path / "p.png")], "export": ["-o", str(tmp_path / "e.csv")]}
    result = dsgd(command, "--db", str(db), "--where", condition, *extra.get(command, []))
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith(f"dsgd: error: --where {condition!r}: "), result.stderr
    assert message in result.stderr, result.stderr
    assert not list(tmp_path.iterdir())


def test_groups_give_mean_and_sample_std_over_their_runs(db):
    rows = compare(db, "--by", "aggregator,compressor")
    # the two qsgd runs differ in optimizer.lr, not only in seed: two groups
    assert [(r["aggregator"], r["compressor"], r["optimizer.lr"], r["runs"]) for r in rows] == [
        ("allreduce", "none", 0.05, 2), ("allreduce", "qsgd", 0.05, 1),
        ("allreduce", "qsgd", 0.2, 1), ("sgp", "none", 0.05, 1)]
    plain, quantized, _, gossip = rows
    assert plain["test_accuracy"] == pytest.approx(0.82)  # finals 0.80 and 0.84
    assert plain["test_accuracy_std"] == pytest.approx(statistics.stdev([0.8, 0.84]))
    assert plain["samples_per_second"] == pytest.approx(110.0)
    assert plain["samples_per_second_std"] == pytest.approx(14.142135623730951)
    assert quantized["wall_seconds"] == pytest.approx(6.0)
    assert gossip["test_accuracy_std"] is None  # a single run has no spread


def test_groups_pool_only_seeds_and_say_what_split_them(db):
    """--by aggregator would pool allreduce with and without qsgd, at two learning rates:
    the group is split by what differs beyond the seed, and the table says so."""
    rows = compare(db, "--by", "aggregator")
    assert [(r["aggregator"], r["compressor.name"], r["optimizer.lr"], r["runs"]) for r in rows] == [
        ("allreduce", "none", 0.05, 2), ("allreduce", "qsgd", 0.05, 1),
        ("allreduce", "qsgd", 0.2, 1), ("sgp", "none", 0.05, 1)]
    table = dsgd("compare", "--db", str(db), "--by", "aggregator")
    header = " ".join(table.stdout.split())
    assert header.startswith("groups split by ") and "only seeds are pooled" in header
    assert "optimizer.lr" in table.stdout.splitlines()[0]
    # runs that differ only in their seed make one group, with nothing said
    seeds = dsgd("compare", "--db", str(db), "--by", "aggregator", "-e", "base")
    assert "split" not in seeds.stdout and "(n=2)" in seeds.stdout


def test_groups_give_the_students_t_interval_of_the_mean_and_its_run_count(db):
    plain, quantized, _, gossip = compare(db, "--by", "aggregator,compressor")
    # finals 0.80 and 0.84: mean 0.82, s = 0.02828, t(0.975, 1) = 12.706: 0.82 ± 0.2541
    half = 12.706204736174707 * statistics.stdev([0.8, 0.84]) / 2 ** 0.5
    assert plain["test_accuracy_ci_low"] == pytest.approx(0.82 - half)
    assert plain["test_accuracy_ci_high"] == pytest.approx(0.82 + half)
    assert plain["test_accuracy_n"] == 2
    assert quantized["test_accuracy_n"] == 1
    assert gossip["test_accuracy_n"] == 1  # a single run: no interval
    assert gossip["test_accuracy_ci_low"] is None and gossip["test_accuracy_ci_high"] is None


def test_a_table_shows_group_means_with_their_spread(db):
    result = dsgd("compare", "--db", str(db), "--by", "compressor", "-e", "base",
                  "--columns", "compressor,runs,test_accuracy,samples_per_second")
    assert result.returncode == 0, result.stderr
    none_row = next(line for line in result.stdout.splitlines() if line.startswith("none"))
    # runs 1 and 2: final test accuracy 0.80 and 0.84, samples/s 100 and 120;
    # ± the half-width of the 95% interval, t(0.975, 1) · s / √2
    assert none_row.split()[:6] == ["none", "2", "0.8200", "±", "0.2541", "(n=2)"], none_row
    assert "110 ± 127 (n=2)" in none_row  # samples per second: no decimals


def test_tables_show_bytes_and_seconds_for_people_and_csv_keeps_raw_values(db):
    result = dsgd("compare", "--db", str(db), "--where", "id<=2", "--columns",
                  "id,test_accuracy,wall_seconds,samples_per_second,total_bytes_sent")
    assert result.returncode == 0, result.stderr
    header, _, first, second = result.stdout.splitlines()
    assert header.split()[-3:] == ["wall_seconds", "samples_per_second", "total_bytes_sent"]
    # runs 1 and 2: 10 and 8 s, 100 and 120 samples/s, 1000 bytes each
    assert first.split()[-4:] == ["10", "100", "1", "kB"]
    assert second.split()[-4:] == ["8", "120", "1", "kB"]
    rows = compare(db, "--where", "id<=2")
    assert [(r["wall_seconds"], r["total_bytes_sent"]) for r in rows] == [(10.0, 1000.0), (8.0, 1000.0)]


@pytest.mark.parametrize("value, column, shown", [
    (21902400.0, "total_bytes_sent", "21.9 MB"), (512.0, "bytes_sent", "512 B"),
    (1.5e9, "bytes_to_target", "1.5 GB"), (999_999.0, "total_bytes_sent", "1 MB"),
    (999.7, "bytes_sent", "1 kB"), (2.5, "bytes_ratio", "2.5000"),
    (0.39374, "wall_seconds", "0.394"), (12.345, "time_to_target", "12.3"),
    (1234.5, "wall_seconds", "1234"), (20298.43, "samples_per_second", "20298"),
    (0.8812, "test_accuracy", "0.8812"), (None, "wall_seconds", ""),
])
def test_readable_numbers_by_column(value, column, shown):
    assert readable(value, column) == shown


def test_baseline_ratios_per_run_and_per_group(db):
    rows = {r["id"]: r for r in compare(db, "--baseline", "base")}
    # base: mean samples/s 110, wall 9 s, bytes 1000, accuracy 0.82
    assert rows[3]["speedup"] == pytest.approx(150 / 110)
    assert rows[3]["wall_ratio"] == pytest.approx(6 / 9)
    assert rows[3]["bytes_ratio"] == pytest.approx(0.25)
    assert rows[3]["accuracy_diff"] == pytest.approx(0.78 - 0.82)
    assert rows[1]["speedup"] == pytest.approx(100 / 110)
    one = {r["id"]: r for r in compare(db, "--baseline", "2")}  # a run id
    assert one[5]["speedup"] == pytest.approx(200 / 120)
    grouped = compare(db, "--by", "aggregator", "--baseline", "base")
    assert grouped[3]["aggregator"] == "sgp"
    assert grouped[3]["bytes_ratio"] == pytest.approx(0.5)
    assert grouped[1]["speedup"] == pytest.approx(150 / 110)


def test_a_baseline_is_matched_to_runs_set_up_alike(db, tmp_path):
    """Run 4 (lr 0.2) has no baseline run at its learning rate: blank, with the reason; a
    run on another task, worker count and clock is never divided by the baseline's."""
    rows = {r["id"]: r for r in compare(db, "--baseline", "base")}
    assert rows[3]["baseline"] == "1,2"
    assert rows[4]["speedup"] is None and rows[4]["accuracy_diff"] is None
    assert rows[4]["baseline"] == "none alike: differs in optimizer.lr"
    path = tmp_path / "r.db"
    store = Store(str(path))
    base = config("allreduce", "none", 0, 0.1) | {"compute": {"step_seconds": 0.1}, "workers": 4}
    other = config("local_sgd", "none", 0, 0.1) | {"task": {"name": "mnist1d_cnn"}}
    alike = config("local_sgd", "none", 1, 0.1) | {"compute": {"step_seconds": 0.1}, "workers": 4}
    for name, cfg, speed in (("base", base, 100.0), ("other", other, 300.0), ("alike", alike, 200.0)):
        run_id = store.create_run(name, cfg, None, [])
        store.add_metrics(run_id, [MetricRow("samples_per_second", speed)])
        store.finish_run(run_id, "completed")
    base_row, other_row, alike_row = compare(path, "--baseline", "base")
    assert alike_row["speedup"] == pytest.approx(2.0)
    assert other_row["speedup"] is None and other_row["wall_ratio"] is None
    assert other_row["baseline"] == "none alike: differs in clock, task.name, workers"


def test_group_comparisons_with_a_baseline_of_several_runs_have_intervals(tmp_path):
    path = tmp_path / "r.db"
    store = Store(str(path))
    # two seeds each of allreduce and of allreduce+qsgd, set up alike otherwise
    for name, compressor, seed, speed, accuracy in (
            ("base", "none", 0, 100.0, 0.80), ("base", "none", 1, 120.0, 0.84),
            ("q", "qsgd", 0, 150.0, 0.78), ("q", "qsgd", 1, 140.0, 0.60)):
        run_id = store.create_run(name, config("allreduce", compressor, seed, 0.05), None, [])
        store.add_metrics(run_id, [MetricRow("samples_per_second", speed),
                                   MetricRow("test_accuracy", accuracy, step=1)])
        store.finish_run(run_id, "completed")
    _, quantized = compare(path, "--by", "compressor", "--baseline", "base")
    # samples/s 150, 140 against 100, 120: the ratio of the means 145/110 and its
    # delta-method interval with Welch's degrees of freedom
    a, b = [150.0, 140.0], [100.0, 120.0]
    v_a = statistics.variance(a) / (2 * statistics.fmean(a) ** 2)
    v_b = statistics.variance(b) / (2 * statistics.fmean(b) ** 2)
    dof = (v_a + v_b) ** 2 / (v_a ** 2 + v_b ** 2)
    from scipy.stats import t

    half = t.ppf(0.975, dof) * (145 / 110) * (v_a + v_b) ** 0.5
    assert quantized["speedup"] == pytest.approx(145 / 110)
    assert (quantized["speedup_ci_low"], quantized["speedup_ci_high"]) == pytest.approx(
        (145 / 110 - half, 145 / 110 + half))
    # accuracy 0.78, 0.60 against 0.80, 0.84: Welch's interval of the difference
    v_a, v_b = statistics.variance([0.78, 0.6]) / 2, statistics.variance([0.8, 0.84]) / 2
    diff_half = t.ppf(0.975, (v_a + v_b) ** 2 / (v_a ** 2 + v_b ** 2)) * (v_a + v_b) ** 0.5
    assert quantized["accuracy_diff"] == pytest.approx(0.69 - 0.82)
    assert quantized["accuracy_diff_ci_high"] - quantized["accuracy_diff"] == pytest.approx(
        diff_half, rel=1e-3)
    table = dsgd("compare", "--db", str(path), "--by", "compressor", "--baseline", "base",
                 "--columns", "compressor,speedup")
    low, high = quantized["speedup_ci_low"], quantized["speedup_ci_high"]
    assert table.stdout.splitlines()[3].split() == ["qsgd", "1.3182", f"[{low:.4f},", f"{high:.4f}]"]


def test_targets_from_the_recorded_history(db):
    rows = {r["id"]: r for r in compare(db, "--target", "test_accuracy=0.85")}
    # Run 1 first reaches 0.85 at step 20 (2.0 s): both ranks sent 5 bytes a step for 20 steps.
    assert (rows[1]["time_to_target"], rows[1]["steps_to_target"], rows[1]["bytes_to_target"]) == (
        2.0, 20, 200.0)
    assert (rows[2]["time_to_target"], rows[2]["steps_to_target"], rows[2]["bytes_to_target"]) == (
        1.5, 10, 100.0)
    assert (rows[5]["time_to_target"], rows[5]["steps_to_target"], rows[5]["bytes_to_target"]) == (
        0.5, 10, 50.0)
    for never in (3, 4):
        assert [rows[never][c] for c in ("time_to_target", "steps_to_target", "bytes_to_target")] == [
            None, None, None]
    grouped = compare(db, "--by", "compressor", "-e", "base", "--target", "test_accuracy=0.85")
    assert grouped[0]["reached"] == "2/2"
    assert grouped[0]["time_to_target"] == pytest.approx((2.0 + 1.5) / 2)


def test_a_lower_is_better_target_is_reached_from_above(db, tmp_path):
    path = tmp_path / "loss.db"
    store = Store(str(path))
    run_id = store.create_run("x", config("allreduce", "none", 0, 0.1), None, [])
    # train_loss per rank: the mean over the ranks reaches 0.5 at step 20 (0.6 and 0.4)
    store.add_metrics(run_id, [
        MetricRow("train_loss", 0.9, step=10, rank=0, seconds=1.0),
        MetricRow("train_loss", 0.3, step=10, rank=1, seconds=1.2),
        MetricRow("train_loss", 0.6, step=20, rank=0, seconds=2.0),
        MetricRow("train_loss", 0.4, step=20, rank=1, seconds=2.2),
    ])
    store.finish_run(run_id, "completed")
    (row,) = compare(path, "--target", "train_loss=0.5")
    assert (row["time_to_target"], row["steps_to_target"]) == (2.2, 20)


def test_sort_ascending_and_descending_with_blanks_last(db):
    assert [r["id"] for r in compare(db, "--sort", "-samples_per_second")] == [5, 3, 4, 2, 1]
    assert [r["id"] for r in compare(db, "--sort", "wall_seconds")] == [5, 3, 4, 2, 1]
    ordered = compare(db, "--target", "test_accuracy=0.85", "--sort", "time_to_target")
    assert [r["id"] for r in ordered] == [5, 2, 1, 3, 4]


def test_csv_keeps_the_spread_in_its_own_columns(db):
    result = dsgd("compare", "--db", str(db), "--by", "seed", "-e", "base", "--format", "csv")
    header = result.stdout.splitlines()[0].split(",")
    assert header[:7] == ["seed", "runs", "test_accuracy", "test_accuracy_std",
                          "test_accuracy_ci_low", "test_accuracy_ci_high", "test_accuracy_n"]


def record_histories(url: str, runs: int = 12, seed: int = 0) -> Store:
    """Runs with untidy histories: per-rank and per-run metrics, steps some ranks skip, two
    records of one step, steps without an epoch or a time, bytes_sent of several ranks (some
    without a step, some only late, a run-wide one), recorded in shuffled order. Every value
    is a multiple of 1/8, so that sums are exact in any order and answers compare exactly."""
    import random

    rng = random.Random(seed)
    store = Store(url)
    for index in range(runs):
        workers = rng.choice([1, 2, 3, 9])
        run_id = store.create_run("h", config("allreduce", "none", index, 0.1), None, [])
        rows = []
        for step in sorted(rng.sample(range(1, 60), rng.randint(0, 20))):
            epoch, seconds = rng.choice([None, step // 10]), rng.choice([None, step / 8])
            for _ in range(rng.choice([0, 1, 1, 1, 2])):
                rows.append(MetricRow("test_accuracy", rng.randint(0, 8) / 8, step, epoch, None, seconds))
            for rank in range(workers):
                if rng.random() < 0.7:
                    rows.append(MetricRow("train_loss", rng.randint(0, 16) / 8, step, epoch, rank,
                                          rng.choice([None, step / 8 + rank / 64])))
                if index % 5 and rng.random() < 0.7:
                    rows.append(MetricRow("bytes_sent", rng.randint(1, 4000) / 8,
                                          rng.choice([step, step, step - 1 if step > 1 else step, None]),
                                          epoch, rank, 1.0))
        if index % 4 == 0:
            rows.append(MetricRow("bytes_sent", 3.25, 100, None, None, None))
        rng.shuffle(rows)
        store.add_metrics(run_id, rows)
        store.finish_run(run_id, "completed")
    return store


def reached_in_python(store: Store, run_ids: list[int], target) -> dict:
    """What `reach_times` answers, worked out from every record in Python: the first step whose
    mean over its records reaches the target, when its last record came, and BytesSent."""
    from dsgd_cli.results.analysis import Reached
    from dsgd_cli.results.history import BytesSent, load_history

    history = load_history(store, run_ids, [target.metric, "bytes_sent"])
    answers = {}
    for run_id in run_ids:
        steps: dict = {}
        for record in history.get((run_id, target.metric), []):
            if record.step is not None:
                steps.setdefault(record.step, []).append(record)
        for step in sorted(steps):
            values = [record.value for record in steps[step]]
            if target.reached_by(sum(values) / len(values)):
                times = [r.seconds for r in steps[step] if r.seconds is not None]
                sent = history.get((run_id, "bytes_sent"))
                answers[run_id] = Reached(max(times) if times else 0.0, step,
                                          BytesSent(sent).by_step(step) if sent else None)
                break
    return answers


@pytest.mark.parametrize("target", ["test_accuracy=0.5", "test_accuracy=0.875", "train_loss=0.75",
                                    "train_loss=1.25", "bytes_sent=250", "test_accuracy=2"])
def test_targets_from_the_database_are_the_history_worked_out_in_python(tmp_path, target):
    from dsgd_cli.results.analysis import parse_target
    from dsgd_cli.results.history import reach_times

    store = record_histories(str(tmp_path / "h.db"), runs=16)
    run_ids = [run.id for run in store.runs(details=False)]
    goal = parse_target(target)
    assert reach_times(store, run_ids, goal) == reached_in_python(store, run_ids, goal)


def test_the_simple_format_is_what_tabulate_draws():
    import random
    import string

    from tabulate import tabulate

    from dsgd_cli.commands.output import simple_table

    rng = random.Random(0)
    words = ["", " ", "True", "False", "1", "-1.5e3", "nan", "None", "  x  ", "1,000", "a b"]

    def text() -> str:
        if rng.random() < 0.5:
            return rng.choice(words)
        return "".join(rng.choice(string.ascii_letters + string.digits + " .-+[]=,")
                       for _ in range(rng.randint(0, 12)))

    for _ in range(500):
        columns = rng.randint(1, 6)
        headers = [text() for _ in range(columns)]
        table = [[text() for _ in range(columns)] for _ in range(rng.randint(1, 6))]
        assert simple_table(table, headers) == tabulate(table, headers=headers, tablefmt="simple",
                                                        disable_numparse=True)
    # Text tabulate measures itself (wide characters, line breaks) and empty tables: tabulate.
    assert simple_table([["日本"]], ["x"]) is None
    assert simple_table([["a\nb"]], ["x"]) is None
    assert simple_table([], ["x"]) is None


@pytest.mark.parametrize("command", [("runs",), ("advise", "--target", "test_accuracy=0.8")])
def test_an_experiment_name_that_selects_nothing_is_an_error_everywhere(db, command):
    result = dsgd(*command, "--db", str(db), "-e", "nosuch")
    assert result.returncode == 2, result.stderr
    assert "--experiment 'nosuch': no recorded run" in result.stderr, result.stderr


def test_short_options_mean_one_thing_across_commands():
    """`-w` is --where wherever runs are selected; `run` names its worker override `-n`."""
    from typer.main import get_command
    from dsgd_cli.cli import app

    meaning: dict[str, set[str]] = {}
    def visit(command):
        for param in getattr(command, "params", []):
            for opt in param.opts:
                if not opt.startswith("--"):
                    meaning.setdefault(opt, set()).add(param.name)
        for sub in getattr(command, "commands", {}).values():
            visit(sub)
    visit(get_command(app))
    assert {name: names for name, names in meaning.items() if len(names) > 1} == {}


def test_terminal_tables_fit_their_width_and_say_what_they_left_out(db, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    wide = dsgd("compare", "--db", str(db), "--baseline", "base", "--target", "test_accuracy=0.8")
    assert wide.returncode == 0, wide.stderr
    lines = wide.stdout.splitlines()
    assert max(len(line) for line in lines) <= 100, wide.stdout
    # columns equal in every row are said once, above the table
    assert lines[0] == "all runs: optimizer sgd, task logreg, workers 2, clock measured, timing ok"
    # labels go first, then the default metrics the options' columns push out
    assert lines[1].split()[:4] == ["id", "experiment", "test_accuracy", "wall_seconds"]
    assert "(10 more columns: status, aggregator, total_bytes_sent, samples_per_second" in wide.stdout
    monkeypatch.setenv("COLUMNS", "300")
    assert "more columns" not in dsgd("compare", "--db", str(db), "--baseline", "base").stdout


def test_a_narrow_table_keeps_the_metrics_and_every_column_asked_for(db, monkeypatch):
    """A one-run table at 60 columns: its labels go to the line above, its metrics stay; and
    no column named in --columns is left out, whatever the width."""
    monkeypatch.setenv("COLUMNS", "60")
    one = dsgd("compare", "--db", str(db), "--last", "1")
    assert "more columns" not in one.stdout, one.stdout
    shown = " ".join(one.stdout.split())
    assert "test_accuracy" in shown and "wall_seconds 5" in shown and "gossip" in shown
    picked = dsgd("compare", "--db", str(db), "--baseline", "base", "--columns",
                  "id,experiment,aggregator,test_accuracy,samples_per_second,speedup,accuracy_diff")
    header = picked.stdout.splitlines()[0].split()
    assert header[-2:] == ["speedup", "accuracy_diff"] and "more columns" not in picked.stdout


def test_columns_picks_the_table_and_csv_keeps_everything(db):
    picked = dsgd("compare", "--db", str(db), "--columns", "experiment,id")
    assert picked.stdout.splitlines()[0].split() == ["experiment", "id"]
    assert picked.stdout.splitlines()[2].split() == ["base", "1"]
    everything = dsgd("compare", "--db", str(db), "-f", "csv", "--columns", "id")
    assert everything.stdout.splitlines()[0].startswith("id,experiment,aggregator,optimizer,task")
    bad = dsgd("compare", "--db", str(db), "--columns", "id,nosuch")
    assert bad.returncode == 2 and "--columns: no column 'nosuch'" in bad.stderr


def test_a_comparison_across_clocks_says_so(tmp_path):
    store = Store(str(tmp_path / "r.db"))
    for name, compute in (("real", None), ("emulated", {"step_seconds": 0.1, "time_scale": 2})):
        cfg = config("allreduce", "none", 0, 0.1) | ({"compute": compute} if compute else {})
        store.finish_run(store.create_run(name, cfg, None, []), "completed")
    rows = compare(tmp_path / "r.db")
    assert [(r["experiment"], r["clock"]) for r in rows] == [("real", "measured"), ("emulated", "modeled")]
    result = dsgd("compare", "--db", str(tmp_path / "r.db"))
    assert "note: 1 of these 2 runs have modeled times" in result.stderr
    assert compare(tmp_path / "r.db", "--where", "clock=modeled")[0]["experiment"] == "emulated"


def test_the_table_dsgd_run_prints_is_compares_plain_table(db):
    """`dsgd run` ends with `compare_rows`, from the results package (no command imports
    another command's module for it): the rows of `compare -f json`, metrics added too."""
    import ast
    import inspect

    from dsgd_cli.commands import run as run_command
    from dsgd_cli.results.analysis import compare_rows
    from dsgd_cli.results.reader import Results

    imported = {node.module for node in ast.walk(ast.parse(inspect.getsource(run_command)))
                if isinstance(node, ast.ImportFrom)}
    assert "dsgd_cli.results.analysis" in imported and "dsgd_cli.commands.compare" not in imported
    store = Results(str(db))
    assert compare_rows(store, store.runs(details=False)) == compare(db)
    assert compare_rows(store, store.runs(ids=[5]), ["lr"]) == compare(db, "--metric", "lr", "--last", "1")


def test_a_run_whose_timing_overran_is_marked_wherever_its_seconds_are(tmp_path):
    """`dsgd run` warns once when 48% of a modeled run's steps overran; the mark stays with
    the run (its `overrun_steps` summary) in compare, runs, export, plot, and --where."""
    path = tmp_path / "r.db"
    store = Store(str(path))
    emulated = config("allreduce", "none", 0, 0.1) | {"compute": {"step_seconds": 0.1}}
    for name, overran in (("clean", 0.0), ("slow", 0.48)):
        run_id = store.create_run(name, emulated, None, [])
        store.add_metrics(run_id, [MetricRow("overrun_steps", overran), MetricRow("wall_seconds", 2.0),
                                   MetricRow("test_accuracy", 0.5, step=1, seconds=1.0)])
        store.finish_run(run_id, "completed")
    assert [(r["experiment"], r["clock"], r["timing"]) for r in compare(path)] == [
        ("clean", "modeled", "ok"), ("slow", "modeled", "overran")]
    assert [r["experiment"] for r in compare(path, "--where", "timing=overran")] == ["slow"]
    table = dsgd("compare", "--db", str(path))
    assert "note: run 2: timing overran" in table.stderr
    assert [line.split()[1:3] for line in table.stdout.splitlines()[-3:-1]] == [
        ["clean", "ok"], ["slow", "overran"]], table.stdout
    listed = json.loads(dsgd("runs", "--db", str(path), "-f", "json").stdout)
    assert [r["timing"] for r in listed] == ["ok", "overran"]
    exported = json.loads(dsgd("export", "--db", str(path), "-f", "json", "-m", "wall_seconds").stdout)
    assert [r["timing"] for r in exported] == ["ok", "overran"]
    from dsgd_cli.results.plotting import run_lines
    from dsgd_cli.results.reader import Results

    reader = Results(str(path))
    assert [line.label for line in run_lines(reader, reader.runs(), "test_accuracy", "step")] == [
        "clean", "slow (timing overran)"]


def test_interrupted_runs_are_hidden_unless_asked_for(db, tmp_path):
    path = tmp_path / "r.db"
    store = Store(str(path))
    for name, status in (("done", "completed"), ("stopped", "interrupted")):
        store.finish_run(store.create_run(name, config("allreduce", "none", 0, 0.1), None, []), status)
    assert [r["experiment"] for r in compare(path)] == ["done"]
    assert [r["experiment"] for r in compare(path, "--where", "status=interrupted")] == ["stopped"]
    assert "(1 interrupted run not shown: --where status=interrupted" in dsgd(
        "compare", "--db", str(path)).stdout
