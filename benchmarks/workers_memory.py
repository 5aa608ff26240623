"""Start-up time and memory per worker of `dsgd run` with many workers on one machine.

For each worker count, runs one short experiment (a few steps of the task, a compute model so
the workers sit in their padded steps while they are measured) and samples, every 0.2 s, the
unique set size (USS: Private_Clean + Private_Dirty of /proc/PID/smaps_rollup) of every worker
process, and the launch's whole memory: the proportional set size (PSS) of `dsgd run` and
every process below it, summed per sampling round, which counts each shared page once.
torch's libraries are shared between the workers, so RSS would count them once per worker;
USS is what each worker adds.

Printed per worker count: start-up (from `dsgd run` starting to every worker's first training
step: the first `step_seconds` record), the median and the largest peak USS per worker, the
workers' total peak USS, the total peak USS of the launch's other processes (the fork server;
with --torchrun also torchrun and its per-rank relays), the launcher's (`dsgd run`, which
hosts the rendezvous store), the largest whole-launch PSS, the run's `overrun_steps`, and the
whole `dsgd run`'s time.

    python benchmarks/workers_memory.py [--workers 16 32 64] [--task mnist1d_mlp] [--steps 6]
        [--aggregator allreduce] [--torchrun]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

from results_row import print_rows

WORKER_MODULE = "dsgd_cli.worker.process"


def memory_bytes(pid: int) -> tuple[int, int] | None:
    """A process's USS (Private_Clean + Private_Dirty) and PSS (its private pages, and each
    shared page divided by the number of processes sharing it), in bytes; None once it is
    gone. The PSS of every process of a launch add up to its memory with each shared page
    counted once."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return None
    uss = pss = 0
    for line in text.splitlines():
        if line.startswith(("Private_Clean:", "Private_Dirty:")):
            uss += int(line.split()[1])
        elif line.startswith("Pss:"):
            pss += int(line.split()[1])
    return uss * 1024, pss * 1024


def launch_processes(root: int) -> dict[int, str]:
    """The processes below process `root` (`dsgd run`), each named by what it is: "worker"
    (forked by the fork server, which names it dsgd-rank-N; or, without one, started as
    `python -m dsgd_cli.worker.process`) or "other" (torchrun, the relays, the fork server)."""
    children: dict[int, list[int]] = {}
    commands: dict[int, str] = {}
    names: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            commands[int(entry)] = Path(f"/proc/{entry}/cmdline").read_bytes().decode(
                errors="replace").replace("\0", " ")
        except OSError:
            continue
        names[int(entry)] = stat[stat.index("(") + 1:stat.rindex(")")]
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(parent, []).append(int(entry))
    found, stack = {}, [root]
    while stack:
        pid = stack.pop()
        for child in children.get(pid, []):
            stack.append(child)
            command = commands.get(child, "")
            started_as_worker = (WORKER_MODULE in command and "torch.distributed.run" not in command
                                 and "dsgd_cli.launch.relay" not in command)
            is_worker = names.get(child, "").startswith("dsgd-rank-") or started_as_worker
            found[child] = "worker" if is_worker else "other"
    return found


class Sampler(threading.Thread):
    """Peak USS per process of the launch, and the peak over sampling rounds of the launch's
    whole memory (the PSS of `dsgd run` and every process below it), sampled until `stop`."""

    def __init__(self, root: int):
        super().__init__(daemon=True)
        self.root, self.peak, self.kind = root, {}, {}
        self.peak_all_in = 0
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.is_set():
            processes = {self.root: "launcher", **launch_processes(self.root)}
            all_in = 0
            for pid, kind in processes.items():
                sizes = memory_bytes(pid)
                if sizes is not None:
                    self.peak[pid] = max(self.peak.get(pid, 0), sizes[0])
                    self.kind[pid] = kind
                    all_in += sizes[1]
            self.peak_all_in = max(self.peak_all_in, all_in)
            self.stopping.wait(0.2)

    def peaks(self, kind: str) -> list[int]:
        return sorted(size for pid, size in self.peak.items() if self.kind[pid] == kind)


def first_step_at(db: Path) -> float | None:
    """When the first training metric was stored (seconds since the epoch), from SQLite."""
    import sqlite3

    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as connection:
            row = connection.execute("SELECT count(*) FROM metrics WHERE name = 'step_seconds'"
                                     ).fetchone()
    except sqlite3.Error:
        return None
    return time.time() if row and row[0] else None


# The task option that sizes its training set, and the training set's share of it.
DATA_SIZE = {"logreg": ("samples", 1.0), "mnist1d_mlp": ("num_samples", 0.8)}


def task_section(task: str, workers: int, steps: int) -> str:
    """The task, with a training set large enough for `steps` steps of batch 16 on every
    worker (a task's default data set gives each of 1,024 workers a few examples: one step)."""
    if task not in DATA_SIZE:
        return f"{{name: {task}}}"
    key, train_share = DATA_SIZE[task]
    return f"{{name: {task}, {key}: {int(workers * 16 * steps / train_share) + 1}}}"


def measure(workers: int, task: str, directory: Path, steps: int = 6,
            aggregator: str = "allreduce", env: dict[str, str] | None = None,
            time_scale: float = 20, timeout: float = 600) -> dict:
    spec = directory / f"workers{workers}.yaml"
    spec.write_text(textwrap.dedent(f"""
        experiments:
          - name: workers-{workers}
            task: {task_section(task, workers, steps)}
            workers: {workers}
            epochs: 1
            steps_per_epoch: {steps}
            aggregator: {aggregator}
            batch_size: 16
            log_interval: 1
            compute: {{step_seconds: 0.05, time_scale: {time_scale:g}}}
            timeout: {timeout:g}
    """))
    db = directory / f"workers{workers}.db"
    started = time.time()
    process = subprocess.Popen([sys.executable, "-m", "dsgd_cli", "run", str(spec), "--db",
                                str(db)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, env={**os.environ, **(env or {})})
    sampler = Sampler(process.pid)
    sampler.start()
    first_step = None
    while process.poll() is None:
        if first_step is None:
            first_step = first_step_at(db)
        time.sleep(0.2)
    total = time.time() - started
    sampler.stopping.set()
    sampler.join()
    output = process.stdout.read()
    if process.returncode != 0:
        raise SystemExit(f"{workers} workers: dsgd run failed:\n{output}")
    peaks = sampler.peaks("worker")
    return {"workers": workers, "startup_s": (first_step or time.time()) - started,
            "run_s": total, "uss_median_mib": statistics.median(peaks) / 2**20,
            "uss_max_mib": peaks[-1] / 2**20, "uss_total_gib": sum(peaks) / 2**30,
            "others_gib": sum(sampler.peaks("other")) / 2**30, "sampled": len(peaks),
            "launcher_gib": sum(sampler.peaks("launcher")) / 2**30,
            "all_in_gib": sampler.peak_all_in / 2**30, "overrun": overrun_steps(db)}


def overrun_steps(db: Path) -> float | None:
    """The run's `overrun_steps` (the fraction of steps whose real time exceeded the
    modeled one), from SQLite."""
    import sqlite3

    with sqlite3.connect(db) as connection:
        row = connection.execute("select value from metrics where name = 'overrun_steps'"
                                 ).fetchone()
    return row[0] if row else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--task", default="mnist1d_mlp")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--aggregator", default="allreduce")
    parser.add_argument("--time-scale", type=float, default=20,
                        help="compute.time_scale: steps of 0.05 modeled seconds last 0.05 × this "
                             "in real time (a larger one leaves longer to sample every worker)")
    parser.add_argument("--timeout", type=float, default=600,
                        help="the spec's timeout: seconds a worker waits in one collective, "
                             "the start's barrier included")
    parser.add_argument("--torchrun", action="store_true",
                        help="torchrun with a relay per rank (DSGD_LAUNCHER=torchrun), as before "
                             "dsgd's own agent")
    args = parser.parse_args()
    env = {"DSGD_LAUNCHER": "torchrun"} if args.torchrun else {}
    print(f"{'workers':>7} {'start-up s':>10} {'USS median MiB':>14} {'USS max MiB':>11} "
          f"{'USS total GiB':>13} {'others GiB':>10} {'launcher GiB':>12} {'all in GiB':>10} "
          f"{'overrun':>7} {'run s':>6}")
    headline = []
    with tempfile.TemporaryDirectory() as tmp:
        for workers in args.workers:
            row = measure(workers, args.task, Path(tmp), args.steps, args.aggregator, env,
                          args.time_scale, args.timeout)
            overrun = "-" if row["overrun"] is None else f"{row['overrun']:.3f}"
            print(f"{row['workers']:>7} {row['startup_s']:>10.1f} {row['uss_median_mib']:>14.1f} "
                  f"{row['uss_max_mib']:>11.1f} {row['uss_total_gib']:>13.2f} {row['others_gib']:>10.2f} "
                  f"{row['launcher_gib']:>12.2f} {row['all_in_gib']:>10.2f} {overrun:>7} "
                  f"{row['run_s']:>6.1f}"
                  + ("" if row["sampled"] == workers else f"  ({row['sampled']} sampled)"),
                  flush=True)
            headline.append(f"{workers:,} workers: start-up {row['startup_s']:.1f} s, USS "
                            f"{row['uss_median_mib']:.1f} MiB per worker (median"
                            + ("" if row["sampled"] == workers else f", {row['sampled']} sampled")
                            + f"), {row['all_in_gib']:.2f} GiB all in, `overrun_steps` {overrun}, "
                            f"whole run {row['run_s']:.1f} s")
    print_rows((f"Start-up and memory of a launch ({args.task}, {args.steps} steps, "
                f"{args.aggregator}, time scale {args.time_scale:g})", "; ".join(headline)))


if __name__ == "__main__":
    main()
