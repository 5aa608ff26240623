"""The results store on a real PostgreSQL server, set against SQLite: the same commands give the
same answers, many processes write at once, old schemas are upgraded, read-only users and
reading commands change nothing.

The server: `postgres_server` initdb's a cluster in a fresh directory under /tmp and starts it
listening only on a unix socket in that directory (no TCP port to clash with anything). As root
(CI), whom PostgreSQL refuses to run as, initdb, pg_ctl and the server run as `nobody`, owner
of that directory; as any other user, as that user. It finds initdb in PATH or in
/usr/lib/postgresql/*/bin (Debian's `postgresql` package; .ci/run installs it). Without it, or
without psycopg (`pip install 'dsgd[postgres]'`), the PostgreSQL tests are skipped with the
reason, unless DSGD_REQUIRE_POSTGRES=1 (set by .ci/run) makes that a failure.
"""

from __future__ import annotations

import glob
import importlib.util
import itertools
import json
import os
import pwd
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from conftest import dsgd_in_process
from dsgd_cli.results.reader import Results
from results_helpers import count_metrics
from test_store import fill

WRITERS = 8
RUNS_PER_WRITER = 4
METRIC_BATCHES = 6


# -- the server --------------------------------------------------------------------------------

@dataclass
class PostgresServer:
    directory: Path  # holds the cluster, the log and the socket
    user: str = "dsgd"  # the cluster's superuser
    counter: itertools.count = field(default_factory=lambda: itertools.count(1))

    def url(self, database: str, user: str | None = None) -> str:
        return f"postgresql+psycopg://{user or self.user}@/{database}?host={self.directory}"

    def sql(self, statement: str, database: str = "postgres") -> None:
        import psycopg

        with psycopg.connect(host=str(self.directory), user=self.user, dbname=database,
                             autocommit=True) as connection:
            connection.execute(statement)

    def new_database(self) -> str:
        name = f"dsgd_test_{next(self.counter)}"
        self.sql(f"CREATE DATABASE {name}")
        return name


def _unavailable(reason: str):
    if os.environ.get("DSGD_REQUIRE_POSTGRES") == "1":
        pytest.fail(f"DSGD_REQUIRE_POSTGRES=1 but {reason}", pytrace=False)
    pytest.skip(reason)


def _postgres_bindir() -> Path | None:
    found = shutil.which("initdb")
    if found:
        return Path(found).resolve().parent
    candidates = glob.glob("/usr/lib/postgresql/*/bin/initdb")
    newest = sorted(candidates, key=lambda p: [int(n) for n in re.findall(r"\d+", p)])
    return Path(newest[-1]).parent if newest else None


@pytest.fixture(scope="session")
def postgres_server():
    if importlib.util.find_spec("psycopg") is None:
        _unavailable("psycopg is not installed (pip install 'dsgd[postgres]')")
    bindir = _postgres_bindir()
    if bindir is None:
        _unavailable("PostgreSQL is not installed: no initdb in PATH or /usr/lib/postgresql/*/bin "
                     "(apt-get install postgresql)")
    # Under /tmp, not pytest's tmp_path: a unix socket's path must be short, and the
    # unprivileged server user must be able to reach the directory.
    directory = Path(tempfile.mkdtemp(prefix="dsgd-pg-", dir="/tmp" if os.path.isdir("/tmp") else None))
    as_user: dict = {}
    if os.geteuid() == 0:
        nobody = pwd.getpwnam("nobody")
        os.chown(directory, nobody.pw_uid, nobody.pw_gid)
        as_user = {"user": nobody.pw_uid, "group": nobody.pw_gid, "extra_groups": []}

    def run(*command: str) -> None:
        result = subprocess.run([str(bindir / command[0]), *command[1:]], cwd=directory,
                                capture_output=True, text=True, timeout=120, **as_user)
        if result.returncode != 0:
            log = directory / "server.log"
            tail = log.read_text()[-2000:] if log.exists() else ""
            pytest.fail(f"{' '.join(command)} failed ({result.returncode}): "
                        f"{result.stdout}{result.stderr}{tail}", pytrace=False)

    data = directory / "data"
    server = PostgresServer(directory)
    started = False
    try:
        run("initdb", "-D", str(data), "-U", server.user, "--auth=trust", "--encoding=UTF8",
            "--locale=C", "--no-sync")
        options = (f"-k {directory} -c listen_addresses='' -c fsync=off -c synchronous_commit=off "
                   "-c full_page_writes=off -c shared_buffers=32MB -c max_connections=100")
        run("pg_ctl", "-D", str(data), "-l", str(directory / "server.log"), "-o", options,
            "-w", "-t", "60", "start")
        started = True
        yield server
    finally:
        if started:
            run("pg_ctl", "-D", str(data), "-m", "immediate", "-w", "stop")  # thrown away anyway
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def pg_url(postgres_server) -> str:
    """A new, empty database of the session's server."""
    return postgres_server.url(postgres_server.new_database())


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request, tmp_path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'r.db'}"
    return request.getfixturevalue("pg_url")


def database(url: str) -> str:
    from sqlalchemy.engine import make_url

    return make_url(url).database


def cli(*args: str) -> str:
    result = dsgd_in_process(*args)
    assert result.returncode == 0, (args, result.stderr)
    return result.stdout


# -- the same answers ----------------------------------------------------------------------------

def record(url: str):
    """The same runs, metrics and tags in any database."""
    store = fill(url)
    store.tag_run(1, ["baseline", "paper"])
    store.tag_run(3, ["paper"])
    run_id = store.create_run("broken", {"task": {"name": "logreg"}, "optimizer": {"name": "adam"},
                                         "aggregator": {"name": "sgp"}, "compressor": {"name": "qsgd"},
                                         "workers": 4}, None, [])
    store.add_metrics(run_id, [])
    store.finish_run(run_id, "failed", "rank 3: RuntimeError: boom", failed_rank=3)
    return store


def test_sqlite_and_postgresql_give_the_same_answers(tmp_path, pg_url):
    sqlite_url = f"sqlite:///{tmp_path / 'r.db'}"
    for url in (sqlite_url, pg_url):
        record(url)

    def answers(url: str) -> dict:
        runs = json.loads(cli("runs", "--db", url, "--format", "json"))
        for row in runs:  # when each run started and how long it took differ, nothing else
            assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", row.pop("started"))
            assert row.pop("real_seconds") >= 0
        show = cli("show", "1", "--db", url).splitlines()
        assert show[3].startswith("started: ")
        return {
            "runs": runs,
            "compare": json.loads(cli("compare", "--db", url, "--format", "json", "--metric", "lr")),
            "tagged": json.loads(cli("compare", "--db", url, "-f", "json", "--where", "tag=paper")),
            "grouped": json.loads(cli("compare", "--db", url, "-f", "json", "--by", "aggregator")),
            "export": json.loads(cli("export", "--db", url, "--format", "json", "-c", "optimizer.lr")),
            "show": [show[:3], show[4:]],
        }

    on_sqlite, on_postgres = answers(sqlite_url), answers(pg_url)
    assert on_postgres == on_sqlite
    assert [(r["id"], r["tags"]) for r in on_postgres["runs"]] == [
        (1, ["baseline", "paper"]), (2, []), (3, ["paper"]), (4, [])]
    assert [r["id"] for r in on_postgres["tagged"]] == [1, 3]
    assert on_postgres["runs"][3]["reason"] == "rank 3: RuntimeError: boom"


def test_times_are_utc_whatever_the_server_time_zone(tmp_path, pg_url, postgres_server):

    postgres_server.sql(f"ALTER DATABASE {database(pg_url)} SET timezone TO 'Asia/Kolkata'")
    for url in (f"sqlite:///{tmp_path / 'r.db'}", pg_url):
        before = datetime.now(timezone.utc).replace(microsecond=0)
        record(url)
        after = datetime.now(timezone.utc)
        run = Results(url).get_run(1)
        assert run.started_at.utcoffset() == timedelta(0) == run.ended_at.utcoffset()
        assert before <= run.started_at <= run.ended_at <= after
        listed = json.loads(cli("runs", "--db", url, "-f", "json"))[0]["started"]
        assert listed == run.started_at.strftime("%Y-%m-%d %H:%M:%S")


def test_delete_and_tag_on_postgresql(pg_url):

    record(pg_url)
    assert cli("runs", "tag", "2", "new", "--db", pg_url) == "run 2: tags new\n"
    assert cli("runs", "tag", "1", "paper", "--remove", "--db", pg_url) == "run 1: tags baseline\n"
    assert cli("runs", "delete", "1", "2", "--db", pg_url) == "deleted runs 1, 2\n"
    result = dsgd_in_process("runs", "delete", "3", "17", "--db", pg_url)
    assert (result.returncode, result.stderr) == (2, "dsgd: error: no run with id 17; nothing deleted\n")
    store = Results(pg_url)
    assert [(r.id, r.tag_names) for r in store.runs()] == [(3, ["paper"]), (4, [])]
    with store.engine.connect() as connection:
        for table in ("metrics", "summaries", "params", "plugin_versions", "tags"):
            left = connection.exec_driver_sql(f"SELECT DISTINCT run_id FROM {table} ORDER BY 1").scalars().all()
            assert set(left) <= {3, 4}, table


def test_reading_commands_change_nothing_on_postgresql(pg_url):
    result = dsgd_in_process("runs", "--db", pg_url)  # an empty database is not created into
    assert result.returncode == 2
    assert result.stderr == f"dsgd: error: {pg_url} holds no dsgd results (no table 'runs')\n"
    record(pg_url)

    store = Results(pg_url)
    with store.engine.connect() as connection:  # its sessions are read-only transactions
        with pytest.raises(Exception, match="read-only transaction"):
            connection.exec_driver_sql("UPDATE meta SET value = value")


def test_a_postgresql_user_who_may_only_read(pg_url, postgres_server):
    from dsgd_cli.errors import StoreError
    from dsgd_cli.results.store import Store

    record(pg_url)
    name = database(pg_url)
    postgres_server.sql("DO $$ BEGIN IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'reader') "
                        "THEN CREATE ROLE reader LOGIN; END IF; END $$")
    postgres_server.sql("GRANT SELECT ON ALL TABLES IN SCHEMA public TO reader", name)
    url = postgres_server.url(name, user="reader")
    with pytest.raises(StoreError, match=r"^cannot write to results database .*permission denied "
                                         r"for table meta$"):
        Store(url)
    assert [run.id for run in Results(url).runs()] == [1, 2, 3, 4]


# -- migrations ----------------------------------------------------------------------------------

def test_a_schema_1_database_on_postgresql_is_upgraded(pg_url):
    from dsgd_cli.results.store import SCHEMA_VERSION, Store

    record(pg_url)
    store = Store(pg_url)
    with store.engine.begin() as connection:  # back to schema 1: without the later tables
        connection.exec_driver_sql("DROP TABLE slurm_jobs")
        connection.exec_driver_sql("DROP TABLE tags")
        connection.exec_driver_sql("DROP TABLE checkpoints")
        connection.exec_driver_sql("UPDATE meta SET value = '1'")
    reader = Results(pg_url)  # reads it as it is: no tags, nothing written
    assert [run.tag_names for run in reader.runs()] == [[], [], [], []]
    assert _version(pg_url) == "1"

    upgraded = Store(pg_url)
    assert _version(pg_url) == str(SCHEMA_VERSION) == "5"
    assert [r.experiment for r in upgraded.runs()] == ["base", "local", "sweep[optimizer.lr=0.1]", "broken"]
    assert count_metrics(upgraded, 1) == 7
    assert upgraded.tag_run(2, ["again"]) == ["again"]
    assert cli("runs", "delete", "2", "--db", pg_url) == "deleted run 2\n"  # the cascade is there


def test_a_deleted_runs_id_is_never_given_again_on_postgresql(pg_url):
    """A serial id comes from a sequence, which only goes up: schema 4 changes nothing here."""
    from dsgd_cli.results.store import Store

    store = record(pg_url)  # runs 1 to 4
    store.delete_runs([4])
    assert store.create_run("next", store.get_run(1).config, None, []) == 5
    store.delete_runs([5], force=True)
    assert Store(pg_url).create_run("again", store.get_run(1).config, None, []) == 6


def _version(url: str) -> str:
    from sqlalchemy import create_engine

    engine = create_engine(url)
    try:
        with engine.connect() as connection:
            return connection.exec_driver_sql("SELECT value FROM meta WHERE key = 'schema_version'").scalar()
    finally:
        engine.dispose()


# -- many writers at once ------------------------------------------------------------------------

WRITER = """
import sys, time
from pathlib import Path
from dsgd_cli.results.store import MetricRow, Store

url, worker, runs, batches, ready, go = sys.argv[1:]
import dsgd_cli.results.store, sqlalchemy.dialects.sqlite  # everything loaded before the start
if url.startswith("postgresql"):
    import psycopg, sqlalchemy.dialects.postgresql
Path(ready).touch()
while not Path(go).exists():
    time.sleep(0.005)
store = Store(url)  # all at once: the first creates (or upgrades) the schema
config = {"task": {"name": "logreg"}, "optimizer": {"name": "sgd", "lr": 0.1},
          "aggregator": {"name": "allreduce"}, "compressor": {"name": "none"}, "workers": 2}
for number in range(int(runs)):
    run_id = store.create_run(f"w{worker}-{number}", config, None, [("aggregator", "allreduce", "dsgd", "0")])
    for batch in range(int(batches)):
        store.add_metrics(run_id, [MetricRow("train_loss", 1.0 / (batch + 1), step=batch, rank=rank)
                                   for rank in range(2)])
    store.add_metrics(run_id, [MetricRow("test_accuracy", 0.5 + int(worker) / 100)])
    store.tag_run(run_id, [f"writer{worker}", "concurrent"])
    store.finish_run(run_id, "completed")
print("done")
"""


def run_writers(url: str, directory: Path) -> None:
    """WRITERS processes, released together once all have started, each writing its runs."""
    go = directory / "go"
    processes = []
    for worker in range(WRITERS):
        ready = directory / f"ready{worker}"
        processes.append(subprocess.Popen(
            [sys.executable, "-c", WRITER, url, str(worker), str(RUNS_PER_WRITER),
             str(METRIC_BATCHES), str(ready), str(go)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=directory))
    deadline = time.monotonic() + 240  # a guard against a hang, not a measurement
    while not all((directory / f"ready{w}").exists() for w in range(WRITERS)):
        assert time.monotonic() < deadline and all(p.poll() is None for p in processes), \
            [p.communicate() for p in processes if p.poll() is not None]
        time.sleep(0.01)
    go.touch()
    outcomes = [process.communicate(timeout=300) for process in processes]
    for process, (out, err) in zip(processes, outcomes):
        assert "locked" not in err, err
        assert (process.returncode, out) == (0, "done\n"), err


def check_everything_written(url: str) -> None:

    store = Results(url)
    runs = store.runs()
    assert sorted(run.experiment for run in runs) == sorted(
        f"w{w}-{n}" for w in range(WRITERS) for n in range(RUNS_PER_WRITER))
    assert len({run.id for run in runs}) == WRITERS * RUNS_PER_WRITER
    finals = store.finals([run.id for run in runs])
    for run in runs:
        worker = int(run.experiment[1:].split("-")[0])
        assert run.status == "completed"
        assert run.tag_names == sorted(["concurrent", f"writer{worker}"])
        assert count_metrics(store, run.id) == 2 * METRIC_BATCHES + 1
        assert finals[run.id]["test_accuracy"] == pytest.approx(0.5 + worker / 100)
        assert finals[run.id]["train_loss"] == pytest.approx(1.0 / METRIC_BATCHES)
        assert [p.name for p in run.plugins] == ["allreduce"]


# [sqlite] slow: test_many_processes_open_a_schema_1_database_at_once[sqlite] (default) runs the
# same writers at once on SQLite; test_store's test_processes_creating_one_database_at_once
# (default) creates one SQLite database from 8 processes at once, 20 times
@pytest.mark.parametrize("db_url", [pytest.param("sqlite", marks=pytest.mark.slow), "postgresql"],
                         indirect=True)
def test_many_processes_write_at_once(db_url, tmp_path):
    run_writers(db_url, tmp_path)
    check_everything_written(db_url)


def test_many_processes_open_a_schema_1_database_at_once(db_url, tmp_path):
    """The first to open it upgrades it; the others wait for it, then write."""
    from dsgd_cli.results.store import SCHEMA_VERSION, Store

    store = Store(db_url)
    with store.engine.begin() as connection:  # back to schema 1: without the later tables
        connection.exec_driver_sql("DROP TABLE slurm_jobs")
        connection.exec_driver_sql("DROP TABLE tags")
        connection.exec_driver_sql("DROP TABLE checkpoints")
        connection.exec_driver_sql("UPDATE meta SET value = '1'")
    store.engine.dispose()
    run_writers(db_url, tmp_path)
    check_everything_written(db_url)
    assert _version(db_url) == str(SCHEMA_VERSION)


def test_targets_and_curves_are_the_same_from_sqlite_and_postgresql(tmp_path, pg_url):
    """Time, steps and bytes to a target and the points of plotted curves are worked out by the
    database: both give the same answers (untidy histories, several ranks, run-wide records)."""
    from test_compare import record_histories

    from dsgd_cli.results.plotting import _series

    sqlite_url = f"sqlite:///{tmp_path / 'h.db'}"

    def answers(url: str) -> dict:
        store = record_histories(url, runs=10)
        runs = store.runs(details=False)
        result = {target: json.loads(cli("compare", "--db", url, "-f", "json", "--target", target))
                  for target in ("test_accuracy=0.5", "train_loss=0.75", "bytes_sent=250")}
        for metric in ("test_accuracy", "train_loss"):
            for x in ("step", "epoch", "seconds", "bytes"):
                result[metric, x] = {run_id: (xs.tolist(), ys.tolist())
                                     for run_id, (xs, ys) in _series(store, runs, metric, x).items()}
        return result

    on_sqlite, on_postgres = answers(sqlite_url), answers(pg_url)
    assert on_postgres == on_sqlite
    assert any(row["bytes_to_target"] for row in on_sqlite["test_accuracy=0.5"])


# -- what PostgreSQL refuses -----------------------------------------------------------------------

def test_a_network_without_bandwidth_runs_on_postgresql(tmp_path, pg_url):
    """PostgreSQL's json refuses `Infinity`: a network with a latency and no bandwidth (no
    limit) is recorded with null for its bandwidth, and the next experiment runs too."""
    from conftest import dsgd, write_spec
    from test_strict_json import LATENCY_ONLY, strict_loads

    spec = write_spec(tmp_path, LATENCY_ONLY + "  - name: b\n")
    result = dsgd("run", str(spec), "--db", pg_url, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    runs = Results(pg_url).runs()
    assert [(run.experiment, run.status) for run in runs] == [("a", "completed"), ("b", "completed")]
    assert runs[0].config["network"] == {"bytes_per_second": None, "latency_s": 0.001}
    exported = cli("export", "1", "--db", pg_url, "-f", "json", "-c", "network.bytes_per_second",
                   "-m", "test_accuracy")
    assert [row["network.bytes_per_second"] for row in strict_loads(exported)] == [None]


def test_commands_that_look_up_a_run_create_no_tables_on_postgresql(pg_url):
    """An empty database is not made a dsgd one by a command that only looks a run up."""
    import psycopg

    for args in (["runs", "tag", "1", "x"], ["runs", "delete", "1"], ["run", "--resume", "1"]):
        result = dsgd_in_process(*args, "--db", pg_url)
        assert (result.returncode, result.stderr) == (
            2, f"dsgd: error: {pg_url} holds no dsgd results (no table 'runs')\n"), args
    with psycopg.connect(host=pg_url.split("host=")[1], user="dsgd",
                         dbname=database(pg_url)) as connection:
        tables = connection.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
        assert tables.fetchall() == []


def test_advice_is_the_same_from_sqlite_and_postgresql(tmp_path, pg_url):
    """`dsgd advise` reads step times and target curves in plain SQL on SQLite and through
    SQLAlchemy on PostgreSQL: the same predictions and the same advice."""
    from test_advise import TARGET, record, steps_law, system_law

    from dsgd_cli.results.store import Store

    def answers(url: str) -> list[dict]:
        store = Store(url)
        for n in (2, 4, 8):
            for seed in (0, 1):
                record(store, "allreduce", n, system_law(n) * (1 + seed / 10), steps_law(n),
                       seed=seed, tags=["paper"])
        record(store, "sgp", 4, 0.02, 500, tags=["paper"])
        rows = json.loads(cli("advise", "--db", url, "--target", TARGET, "-f", "json",
                              "--where", "tag=paper"))
        # The databases' sums may differ in the last bits.
        return [{k: round(v, 9) if isinstance(v, float) else v for k, v in row.items()}
                for row in rows]

    on_sqlite, on_postgres = answers(f"sqlite:///{tmp_path / 'a.db'}"), answers(pg_url)
    assert on_postgres == on_sqlite
    counts = [2, 4, 8, 16, 32, 64]  # allreduce's predictions, then sgp's advice at each n
    assert [row["workers"] for row in on_postgres] == counts + counts
    assert {row["advice"] for row in on_postgres[6:]} == {"runs at n = 4 only: run at n = 2 and 8"}


def test_a_sql_ascii_database_keeps_text_that_is_not_ascii(postgres_server):
    """A database created with ENCODING 'SQL_ASCII' (the default of clusters initialised
    without a locale) stores bytes as given, and psycopg returned them undecoded: the first
    read of the schema's version failed with a traceback. dsgd's connections ask for UTF-8, so
    non-ASCII text (an experiment's name, its spec file's path) goes in and comes back."""
    name = f"dsgd_ascii_{next(postgres_server.counter)}"
    postgres_server.sql(f"CREATE DATABASE {name} ENCODING 'SQL_ASCII' TEMPLATE template0")
    url = postgres_server.url(name)
    from dsgd_cli.results.store import MetricRow, Store

    store = Store(url)
    config = {"task": {"name": "logreg"}, "optimizer": {"name": "sgd"},
              "aggregator": {"name": "allreduce"}, "compressor": {"name": "none"}, "workers": 2}
    run_id = store.create_run("λ-sweep/lr×2", config, "/data/η-runs/spec.yaml", [])
    store.add_metrics(run_id, [MetricRow("train_loss", 0.5, step=1, rank=0)])
    store.finish_run(run_id, "completed")
    runs = json.loads(cli("runs", "--db", url, "--format", "json"))
    assert [row["experiment"] for row in runs] == ["λ-sweep/lr×2"], runs
    shown = cli("show", str(run_id), "--db", url)
    assert "λ-sweep/lr×2" in shown and "/data/η-runs/spec.yaml" in shown
