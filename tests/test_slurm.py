"""`dsgd submit --slurm`: a spec's points as a SLURM job array into one PostgreSQL database.

The script and the refusals are checked as text, without SLURM. The sweeps themselves run on a
real one-machine SLURM (tests/slurm_cluster.py: munged, slurmctld and slurmd of Debian's
`slurm-wlm` and `munge`, on loopback) writing to the PostgreSQL server of tests/test_postgres.py;
without SLURM they are skipped with the reason, unless DSGD_REQUIRE_SLURM=1 (.ci/run) makes that
a failure. They take about a minute, so they are marked `slow` and CI runs them in a step of
their own.
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
import time
from datetime import datetime
from pathlib import Path

import pytest

import slurm_cluster
from conftest import dsgd, dsgd_in_process, write_spec
from dsgd_cli.results.reader import Results
from dsgd_cli.results.slurm_ids import SlurmJob, slurm_job_of_this_process
from dsgd_cli.results.store import Store
from test_postgres import postgres_server  # noqa: F401 (a fixture)

PG_URL = "postgresql+psycopg://dsgd@/sweeps?host=/tmp/pg"

# 6 points: 3 seeds x 2 worker counts, a few steps each.
GRID_SPEC = """
    defaults: {task: logreg, epochs: 1, steps_per_epoch: 4, log_interval: 2}
    experiments:
      - name: sweep
        grid: {seed: [1, 2, 3], workers: [1, 2]}
"""

# Point 0 is quick; point 1 takes 320 steps (5 epochs of logreg's 64) of 50 ms of modeled
# compute at time scale 1 (16 s of real time) and checkpoints every 10 steps: long enough to be
# cancelled in the middle.
LONG_SPEC = """
    defaults: {task: logreg, workers: 1, epochs: 1, log_interval: 10}
    experiments:
      - {name: quick, steps_per_epoch: 4}
      - name: long
        epochs: 5
        checkpoint_every: 10
        compute: {step_seconds: 0.05, time_scale: 1}
"""

MULTI_NODE_SPEC = """
    defaults: {task: logreg, workers: 4, epochs: 1, steps_per_epoch: 4}
    launch: {nnodes: 2}
    experiments:
      - name: two_nodes
        grid: {seed: [1, 2]}
"""


# -- the script, without SLURM ------------------------------------------------------------------

def test_a_grid_is_one_array_task_per_point_with_the_resources_asked(tmp_path):
    spec = write_spec(tmp_path, GRID_SPEC)
    result = dsgd_in_process("submit", str(spec), "--slurm", "--dry-run", "--db",
                             "postgresql+psycopg://me:secret@db.example.org/lab", "-j", "2",
                             "--partition", "gpu", "--time", "1:00:00", "--cpus-per-task", "3",
                             "--gpus-per-task", "1", "--mem", "4G",
                             "--sbatch-option=--account=lab", "--set", "epochs=2")
    assert result.returncode == 0, result.stderr
    script = result.stdout
    assert script.startswith("#!/bin/bash\n")
    for line in ("#SBATCH --job-name=dsgd-spec", "#SBATCH --array=0-5%2", "#SBATCH --nodes=1",
                 "#SBATCH --cpus-per-task=3", "#SBATCH --gpus-per-task=1",
                 "#SBATCH --time=1:00:00", "#SBATCH --partition=gpu", "#SBATCH --mem=4G",
                 "#SBATCH --account=lab", f"#SBATCH --chdir={Path.cwd()}",
                 f"SPEC={spec.resolve()}", "DB='postgresql+psycopg://me:***@db.example.org/lab'",
                 'exec "${DSGD[@]}" run "$SPEC" --point "$POINT" --db "$DB" --set epochs=2'):
        assert line in script.splitlines(), line
    assert "secret" not in script  # --dry-run shows no password


def test_each_task_runs_the_point_of_its_index(tmp_path):
    spec = write_spec(tmp_path, GRID_SPEC)
    shown = dsgd_in_process("run", str(spec), "--point", "3", "--dry-run")
    assert shown.returncode == 0, shown.stderr
    assert "launch 1: 1 experiment on 2 workers" in shown.stdout
    assert "sweep[seed=2,workers=2]:" in shown.stdout
    beyond = dsgd_in_process("run", str(spec), "--point", "6", "--dry-run")
    assert (beyond.returncode, beyond.stderr) == (
        2, f"dsgd: error: --point 6: {spec} has 6 experiments (points 0 to 5)\n")
    both = dsgd_in_process("run", "--point", "1", "--resume", "3")
    assert both.returncode == 2 and both.stderr.count("\n") == 1


def test_cpus_per_task_default_to_the_most_workers_of_a_point(tmp_path):
    spec = write_spec(tmp_path, GRID_SPEC)
    script = dsgd_in_process("submit", str(spec), "--slurm", "--dry-run", "--db",
                             PG_URL).stdout
    assert "#SBATCH --cpus-per-task=2" in script.splitlines()
    assert "#SBATCH --array=0-5" in script.splitlines()  # no limit unless asked


def test_sqlite_is_refused_for_an_array_with_the_reason(tmp_path):
    spec = write_spec(tmp_path, GRID_SPEC)
    for db in (str(tmp_path / "r.db"), f"sqlite:///{tmp_path}/r.db"):
        result = dsgd_in_process("submit", str(spec), "--slurm", "--dry-run", "--db", db)
        assert result.returncode == 2 and result.stdout == ""
        assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
        assert "SQLite on a shared filesystem (NFS)" in result.stderr
        assert "use PostgreSQL" in result.stderr
    assert not (tmp_path / "r.db").exists()


def test_submit_names_its_scheduler(tmp_path):
    spec = write_spec(tmp_path, GRID_SPEC)
    result = dsgd_in_process("submit", str(spec), "--db", PG_URL)
    assert (result.returncode, result.stderr) == (
        2, "dsgd: error: dsgd submit needs a scheduler: --slurm (the only one so far)\n")
    result = dsgd_in_process("submit", str(spec), "--slurm", "--only", "done", "--db", PG_URL)
    assert (result.returncode, result.stderr) == (
        2, "dsgd: error: --only done: expected --only failed\n")


def test_a_point_over_several_machines_runs_under_srun_meeting_on_its_first_node(tmp_path):
    spec = write_spec(tmp_path, MULTI_NODE_SPEC)
    result = dsgd_in_process("submit", str(spec), "--slurm", "--dry-run", "--db", PG_URL)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "#SBATCH --nodes=2" in lines and "#SBATCH --cpus-per-task=2" in lines
    assert 'HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)' in lines
    assert lines[-1] == ('exec srun --kill-on-bad-exit=1 bash -c \'exec "$@" --node-rank '
                         '"$SLURM_NODEID"\' dsgd "${DSGD[@]}" run "$SPEC" --point "$POINT" '
                         '--db "$DB" "${NODES[@]}"')


def interrupted_two_node_run(tmp_path) -> tuple[Path, str, int]:
    """The spec of MULTI_NODE_SPEC, and a database where its point 0 has an interrupted run
    over its 2 machines, with a sound checkpoint: all that a resume of one machine needs."""
    from dsgd_cli.spec.experiments import load_spec
    from dsgd_cli.worker import checkpoint

    spec = write_spec(tmp_path, MULTI_NODE_SPEC)
    first = load_spec(spec, launch={"node_rank": 0, "rdzv_endpoint": "node0:1"})[0]
    assert first.config["nnodes"] == 2  # how the run records that it spans 2 machines
    db = str(tmp_path / "r.db")
    store = Store(db)
    directory = tmp_path / "checkpoints" / "two_nodes"
    run_id = store.create_run(first.name, first.config, str(spec), [],
                              checkpoint_dir=str(directory))
    for rank in range(4):
        checkpoint.save(directory, 2, rank, {"step": 2, "rank": rank}, workers=4)
    store.finish_run(run_id, "interrupted")
    return spec, db, run_id


def test_a_run_over_several_machines_is_refused_by_resume(tmp_path):
    _, db, run_id = interrupted_two_node_run(tmp_path)
    result = dsgd_in_process("run", "--resume", str(run_id), "--db", db)
    assert (result.returncode, result.stdout, result.stderr) == (
        2, "", f"dsgd: error: run {run_id} ran over 2 machines, and --resume continues a run on "
               "one machine only: run its experiment again (a new run)\n")
    result = dsgd_in_process("run", "--resume", str(run_id), "--db", db, "--nnodes", "2",
                             "--node-rank", "1", "--rdzv-endpoint", "node0:1")
    assert (result.returncode, result.stderr) == (
        2, "dsgd: error: --resume continues a run on this machine alone: without --nnodes, "
           "--node-rank, --rdzv-endpoint or --rdzv-timeout\n")


def test_resubmitting_a_run_over_several_machines_starts_it_again_as_a_new_run(
        tmp_path, monkeypatch, capsys):
    from dsgd_cli.commands import submit as submit_command
    from dsgd_cli.launch import slurm as slurm_jobs

    spec, db, run_id = interrupted_two_node_run(tmp_path)
    monkeypatch.setattr(slurm_jobs, "queued_points", lambda job_name: {})  # SLURM holds none
    experiments = submit_command._validated(spec, None, None, [], None)
    job = slurm_jobs.ArrayJob(
        spec=spec.resolve(), point_count=2, indices=[0, 1], db_url=db, run_args=[],
        resources=slurm_jobs.Resources(nodes=2), concurrency=None, job_name="dsgd-spec",
        log_dir=tmp_path / "logs", workdir=tmp_path)
    submit_command._keep_points_to_run(job, experiments, db, dry_run=True)
    assert capsys.readouterr().err.splitlines() == [
        f"dsgd: point 0 (two_nodes[seed=1]): run {run_id} interrupted over 2 machines, which "
        f"--resume does not continue: from the start as a new run (run {run_id} stays as it is)",
        "dsgd: point 1 (two_nodes[seed=2]): no run yet",
        "dsgd: 0 of 2 points done; would submit 2"]
    assert (job.indices, job.resumes) == ([0, 1], {})
    lines = slurm_jobs.array_script(job).splitlines()
    assert "#SBATCH --array=0-1" in lines
    assert not [line for line in lines if "--resume" in line]
    assert lines[-1].endswith('run "$SPEC" --point "$POINT" --db "$DB" "${NODES[@]}"')


def most_at_once(intervals) -> int:
    """The most of the half-open intervals [start, end) that overlap at any instant: one
    ending when another starts does not overlap it (SLURM's times are whole seconds)."""
    events = sorted([(end, -1) for _, end in intervals] + [(start, 1) for start, _ in intervals])
    running = most = 0
    for _, change in events:  # at the same instant, ends (-1) before starts
        running += change
        most = max(most, running)
    return most


def test_most_at_once_counts_overlapping_intervals_only():
    assert most_at_once([]) == 0
    assert most_at_once([(0, 5)]) == 1
    assert most_at_once([(0, 2), (2, 4), (4, 6)]) == 1  # each starting as the previous ends
    assert most_at_once([(0, 4), (1, 5), (4, 8), (5, 9)]) == 2  # two at a time, as %2 runs
    assert most_at_once([(0, 4), (1, 5), (3, 8), (5, 9)]) == 3  # a third before one ended
    assert most_at_once([(3, 8), (0, 10), (1, 2), (4, 5)]) == 3  # in any order
    assert most_at_once([(0, 3)] * 3) == 3


def task_intervals(slurm, array_id: str) -> dict[int, tuple[datetime, datetime]]:
    """Each task of the array by its index, with SLURM's own start and end times of it (kept
    by slurmctld for MinJobAge seconds after it ended; there is no accounting database)."""
    shown = slurm.command("scontrol", "--oneliner", "show", "job", array_id).stdout
    intervals = {}
    for line in shown.splitlines():
        fields = dict(re.findall(r"(ArrayTaskId|StartTime|EndTime)=(\S+)", line))
        intervals[int(fields["ArrayTaskId"])] = (datetime.fromisoformat(fields["StartTime"]),
                                                 datetime.fromisoformat(fields["EndTime"]))
    return intervals


# -- SLURM's ids on a run, without SLURM ---------------------------------------------------------

def test_the_slurm_job_of_a_process_comes_from_its_environment():
    assert slurm_job_of_this_process({}) is None
    task = slurm_job_of_this_process({"SLURM_JOB_ID": "15", "SLURM_ARRAY_JOB_ID": "12",
                                      "SLURM_ARRAY_TASK_ID": "3"})
    assert task == SlurmJob(15, 12, 3) and str(task) == "12_3"
    assert str(slurm_job_of_this_process({"SLURM_JOB_ID": "7"})) == "7"


def test_runs_carry_their_slurm_jobs_and_list_them(tmp_path, monkeypatch):
    db = str(tmp_path / "r.db")
    store = Store(db)
    config = {"task": {"name": "logreg"}, "aggregator": {"name": "allreduce"},
              "compressor": {"name": "none"}, "optimizer": {"name": "sgd"}, "workers": 2}
    outside = store.create_run("outside", config, None, [])
    monkeypatch.setenv("SLURM_JOB_ID", "15")
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "12")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "3")
    inside = store.create_run("inside", config, None, [], checkpoint_dir=str(tmp_path / "c"))
    store.finish_run(inside, "interrupted")
    monkeypatch.setenv("SLURM_JOB_ID", "21")
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "20")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "3")
    store.resume_run(inside, 0)  # a resubmitted task goes on with it
    rows = json.loads(dsgd_in_process("runs", "--db", db, "-f", "json").stdout)
    assert [(row["id"], row["slurm"]) for row in rows] == [(outside, []),
                                                           (inside, ["12_3", "20_3"])]
    assert "12_3,20_3" in dsgd_in_process("runs", "--db", db).stdout
    assert "slurm jobs: 12_3, 20_3" in dsgd_in_process("show", str(inside), "--db", db).stdout
    assert dsgd_in_process("runs", "delete", str(inside), "--force", "--db", db).returncode == 0
    with sqlite3.connect(tmp_path / "r.db") as connection:  # deleted with its run
        assert connection.execute("SELECT COUNT(*) FROM slurm_jobs").fetchone() == (0,)


# -- on a real SLURM -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def slurm():
    try:
        # At least 4 CPUs, even where the machine has fewer: SLURM itself would run 4 of the
        # grid's 1-CPU tasks at once, so only the array's `%2` holds it to 2.
        cluster = slurm_cluster.start(cpus=max(4, os.cpu_count() or 1))
    except slurm_cluster.SlurmUnavailable as why:
        if os.environ.get("DSGD_REQUIRE_SLURM") == "1":
            pytest.fail(f"DSGD_REQUIRE_SLURM=1 but {why}", pytrace=False)
        pytest.skip(str(why))
    yield cluster
    cluster.stop()


@pytest.fixture
def sweep_db(postgres_server):  # noqa: F811 (the fixture imported above)
    name = postgres_server.new_database()
    return postgres_server.url(name)


def submit(slurm, spec: Path, url: str, *args: str):
    result = dsgd("submit", str(spec), "--slurm", "--db", url, "--cpus-per-task", "1",
                  "--log-dir", str(spec.parent / "logs"), *args, env=slurm.env(),
                  cwd=spec.parent)
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def task_outputs(spec: Path) -> str:
    return "\n".join(f"{path.name}: {path.read_text()[-1500:]}"
                     for path in sorted((spec.parent / "logs").glob("*.out")))


def wait_for_the_array(slurm, spec: Path, timeout: float = 240) -> None:
    try:
        slurm.wait_until_idle(timeout)
    except TimeoutError as error:
        pytest.fail(f"{error}\n{task_outputs(spec)}", pytrace=False)


@pytest.mark.slow
def test_a_grid_lands_in_one_postgres_as_an_array_two_at_a_time(slurm, sweep_db, tmp_path):
    spec = write_spec(tmp_path, GRID_SPEC)
    submitted = submit(slurm, spec, sweep_db, "--concurrency", "2")
    array_id = submitted.stdout.split()[3].rstrip(":")
    assert submitted.stdout.startswith(f"submitted array job {array_id}: 6 tasks (points 0-5 of ")
    wait_for_the_array(slurm, spec)

    rows = json.loads(dsgd_in_process("compare", "--db", sweep_db, "-f", "json").stdout)
    assert sorted((row["experiment"], row["status"]) for row in rows) == sorted(
        (f"sweep[seed={seed},workers={workers}]", "completed")
        for seed in (1, 2, 3) for workers in (1, 2)), task_outputs(spec)
    runs = {run.experiment: run for run in Results(sweep_db).runs()}
    # At most 2 at once (--concurrency 2), by SLURM's own record of its tasks and by the runs'.
    tasks = task_intervals(slurm, array_id)
    assert sorted(tasks) == list(range(6)) and most_at_once(tasks.values()) <= 2, tasks
    assert most_at_once((run.started_at, run.ended_at) for run in runs.values()) <= 2
    for index, name in enumerate(f"sweep[seed={s},workers={w}]" for s in (1, 2, 3) for w in (1, 2)):
        assert [str(job) for job in runs[name].slurm_jobs] == [f"{array_id}_{index}"]
    listing = dsgd_in_process("runs", "--db", sweep_db).stdout
    assert f"{array_id}_5" in listing

    again = submit(slurm, spec, sweep_db, "--only", "failed")
    assert again.stdout == ""
    assert "nothing to submit: 6 of 6 points done" in again.stderr


@pytest.mark.slow
def test_a_cancelled_task_is_interrupted_then_resumed_alone(slurm, sweep_db, tmp_path):
    spec = write_spec(tmp_path, LONG_SPEC)
    checkpoints = tmp_path / "checkpoints"
    submitted = submit(slurm, spec, sweep_db, "--checkpoint-dir", str(checkpoints))
    array_id = submitted.stdout.split()[3].rstrip(":")
    long_run = wait_for_checkpoint(sweep_db, "long", checkpoints, spec)
    slurm.command("scancel", f"{array_id}_1")  # SIGTERM to the task, SIGKILL 30 s later
    wait_for_the_array(slurm, spec)
    runs = {run.experiment: run for run in Results(sweep_db).runs()}
    assert runs["quick"].status == "completed"
    assert (runs["long"].id, runs["long"].status) == (long_run, "interrupted"), task_outputs(spec)

    again = submit(slurm, spec, sweep_db, "--only", "failed", "--checkpoint-dir", str(checkpoints))
    assert f"point 1 (long): resumes run {long_run}" in again.stderr
    assert "1 of 2 points done; submitting 1" in again.stderr
    assert "(points 1 of " in again.stdout
    resumed_id = again.stdout.split()[3].rstrip(":")
    wait_for_the_array(slurm, spec)
    runs = Results(sweep_db).runs()
    assert sorted((run.experiment, run.status) for run in runs) == [
        ("long", "completed"), ("quick", "completed")], task_outputs(spec)  # nothing run twice
    long = next(run for run in runs if run.experiment == "long")
    assert [str(job) for job in long.slurm_jobs] == [f"{array_id}_1", f"{resumed_id}_1"]
    steps = [m.step for m in Results(sweep_db).metric_history(long.id, "train_loss")]
    assert steps == sorted(set(steps)) and steps[-1] == 320, steps  # each step once, to the end


def wait_for_checkpoint(url: str, experiment: str, checkpoints: Path, spec: Path,
                        timeout: float = 120) -> int:
    """The id of the experiment's run once it is running with a complete checkpoint."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            runs = [run for run in Results(url).runs() if run.experiment == experiment]
        except Exception:  # noqa: BLE001 (the tables may not be there yet)
            runs = []
        if runs and runs[0].status == "running" and list(checkpoints.glob("*/step-*")):
            return runs[0].id
        time.sleep(0.5)
    pytest.fail(f"no checkpoint of {experiment} within {timeout} s\n{task_outputs(spec)}",
                pytrace=False)
