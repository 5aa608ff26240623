"""One torchrun of a launch: its command, its environment, its directory and its processes
(torchrun, the launch's fork server, the relays torchrun starts and the workers the server
forks: forkserver.py).

Nothing here imports torch. `dsgd run` starts the torchrun of the spec's first launch as soon
as the spec is read this far (`early_start`), before the launcher imports torch and the plugins
to validate it: torchrun's start and the fork server's imports then overlap the validation,
and the workers wait for the launch's plan, which the launcher writes once everything is
valid. When validation fails, or the validated first launch differs from the guess, that
torchrun is stopped unused.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from dsgd_cli.launch import agent, forkserver
from dsgd_cli.launch.launch_dirs import RUN_MARKER, make_launch_dir
from dsgd_cli.launch.agent import LocalAgent
from dsgd_cli.launch.outcome import WorkerExit, listed_ranks, torchrun_failures
from dsgd_cli.spec import specfile
from dsgd_cli.errors import SpecError
from dsgd_cli.comm.events import LAUNCHER_PID
from dsgd_cli.spec.nodes import NodePlan, check_split, local_workers

TERMINATE_WAIT_S = 5.0  # after SIGTERM, before SIGKILL
# glibc: allocations under 64 MiB come from the heap, which keeps up to 256 MiB free.
MALLOC_SETTINGS = {"MALLOC_MMAP_THRESHOLD_": str(64 * 2**20),
                   "MALLOC_TRIM_THRESHOLD_": str(256 * 2**20)}
# Workers of a launch with more workers than the machine has cores run this much nicer than
# the launcher and the fork server, which would otherwise get one share of the cores among
# hundreds: the rendezvous store (in the launcher), the forking and the storing of metrics
# would wait on the workers they serve.
CROWDED_WORKER_NICENESS = 19
# Beyond this many workers an early start is not tried: for a spec that then fails
# validation, starting them costs more than the overlap saves.
EARLY_START_MAX_WORKERS = 16
# torchrun.log keeps at most this much of the launch's output (torchrun's, the fork server's
# and the workers'): its newest part. A chatty plugin would otherwise fill $TMPDIR.
LOG_LIMIT_BYTES = 4 * 2**20
LOG_DRAIN_WAIT_S = 5.0  # for the output of a stopped launch to reach the log
LOG_MEMORY_BYTES = 64 * 2**10  # the newest output, also kept in memory: the log may be unwritable


@dataclass(frozen=True)
class Shape:
    """What a torchrun is started for: the launch's worker count and, for a run over several
    machines, this machine's part and the rendezvous id."""

    workers: int
    nodes: NodePlan | None = None
    rendezvous: str | None = None

    @classmethod
    def of(cls, workers: int, nodes: NodePlan | None, spec_text: str, name: str) -> Shape:
        if nodes is None:
            return cls(workers)
        return cls(workers, nodes, nodes.rendezvous_id(spec_text, name))

    @property
    def local_workers(self) -> int:
        return local_workers(self.nodes, self.workers)


def command(shape: Shape, plan_path: str | Path, run_dir: str | Path) -> list[str]:
    """Standalone on one machine, or this machine's part of a c10d rendezvous."""
    if shape.nodes is None:
        where = ["--standalone", f"--nproc-per-node={shape.workers}"]
    else:
        where = [f"--nnodes={shape.nodes.nnodes}", f"--nproc-per-node={shape.local_workers}",
                 "--rdzv-backend=c10d", f"--rdzv-endpoint={shape.nodes.endpoint}",
                 f"--rdzv-id={shape.rendezvous}",
                 f"--rdzv-conf=join_timeout={shape.nodes.timeout:g}"]
    # torchrun's own log directory (else a `torchelastic_*` in $TMPDIR that nobody removes)
    # lies in the launch's directory, which goes with the launch.
    log_dir = Path(run_dir) / "torchelastic"
    # Each rank's process is a relay to the launch's fork server, which forks the worker.
    return [sys.executable, "-m", "torch.distributed.run", *where, "--max-restarts=0",
            f"--log-dir={log_dir}", "-m", "dsgd_cli.launch.relay", forkserver.WORKER_MODULE,
            str(plan_path), str(run_dir)]


def environment(run_dir: str | Path) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # workers share the machine's cores
    env.setdefault("NUMBA_NUM_THREADS", env["OMP_NUM_THREADS"])
    # torch's CPU allocator passes large tensors to malloc, and glibc maps each one afresh
    # and unmaps it when freed, so every gradient-sized temporary costs page faults, every
    # step. Kept in the heap between steps instead, compressed averaging measured 25-40%
    # faster (benchmarks/RESULTS.md). Other C libraries ignore these variables.
    for name, value in MALLOC_SETTINGS.items():
        env.setdefault(name, value)
    # gloo connects a pair of ranks when they first communicate, not every pair at start-up:
    # at n workers a full mesh is n(n-1)/2 connections (523,776 at 1,024), most never used.
    env.setdefault("TORCH_GLOO_LAZY_INIT", "1")
    env["PYTHONUNBUFFERED"] = "1"
    env["LOGLEVEL"] = "WARNING"  # torchrun's warnings name the workers it stopped itself
    env[RUN_MARKER] = str(run_dir)  # inherited by the workers: how `stop` finds them
    env[LAUNCHER_PID] = str(os.getpid())
    return env


class CappedLog:
    """The launch's output, read from a pipe by a thread of the launcher and written to
    `path`, which keeps at most `limit` bytes: when it grows past them, all but its newest
    `limit // 2` bytes are dropped. Its processes write to `write_end`. Should the file
    become unwritable (a full disk), the output is still read, so that no process blocks,
    and its newest part is kept in memory; `write_error` says why."""

    DROPPED = b"[dsgd: earlier output dropped: this log keeps its newest part]\n"

    def __init__(self, path: Path, limit: int = LOG_LIMIT_BYTES):
        self.path, self.limit = path, limit
        self.write_error: OSError | None = None
        self._newest = bytearray()
        read_end, self.write_end = os.pipe()
        self._thread = threading.Thread(target=self._copy, args=(read_end,), daemon=True,
                                        name="dsgd-torchrun-log")
        self._thread.start()

    def _copy(self, read_end: int) -> None:
        with open(read_end, "rb", buffering=0) as pipe:
            log = self._open()
            while chunk := pipe.read(2**16):
                self._newest += chunk
                del self._newest[:-LOG_MEMORY_BYTES]
                if log is not None:
                    log = self._write(log, chunk)
            if log is not None:
                log.close()

    def _open(self):
        try:
            return open(self.path, "w+b")
        except OSError as error:
            self.write_error = error
            return None

    def _write(self, log, chunk: bytes):
        """`log`, or None once it cannot be written."""
        try:
            log.write(chunk)
            log.flush()
            if log.tell() > self.limit:
                self._keep_tail(log)
            return log
        except OSError as error:
            self.write_error = error
            try:
                log.close()
            except OSError:  # what is left in its buffer cannot be written either
                pass
            return None

    def _keep_tail(self, log) -> None:
        log.seek(-(self.limit // 2), os.SEEK_END)
        tail = log.read()
        log.seek(0)
        log.truncate()
        log.write(self.DROPPED + tail)
        log.flush()

    @property
    def out_of_space(self) -> bool:
        """Whether the log could not be written for lack of space."""
        return self.write_error is not None and self.write_error.errno in (errno.ENOSPC,
                                                                           errno.EDQUOT)

    def close_write_end(self) -> None:
        """Once the processes have it: the log ends when the last of them closes it."""
        if self.write_end is not None:
            os.close(self.write_end)
            self.write_end = None

    def text(self, wait_s: float = LOG_DRAIN_WAIT_S) -> str:
        """The log, once every process of the launch has closed its output (or after `wait_s`)."""
        self.close_write_end()
        self._thread.join(wait_s)
        if self.write_error is not None:
            return bytes(self._newest).decode(errors="replace")
        try:
            return self.path.read_text(errors="replace")
        except FileNotFoundError:
            return ""


class Torchrun:
    """A launch's processes and its temporary directory, which holds the plan (the experiments
    to run, read by every worker), the workers' event files and the launch's log. On one
    machine dsgd's own agent (agent.py) starts the workers through the fork server; across
    machines, or with DSGD_LAUNCHER=torchrun, torchrun does, through relays."""

    def __init__(self, shape: Shape):
        self.shape = shape
        self.dir = make_launch_dir()
        self.plan_path = self.dir / "experiments.json"
        self.log_path = self.dir / "torchrun.log"
        # torchrun's process, or the agent that stands in its place (agent.LocalAgent)
        self.process: subprocess.Popen | LocalAgent | None = None
        self.fork_server: subprocess.Popen | None = None
        self.log: CappedLog | None = None
        self._env: dict[str, str] | None = None

    @property
    def uses_agent(self) -> bool:
        return self.shape.nodes is None and agent.wanted()

    @property
    def starter(self) -> str:
        """What starts the workers, in words."""
        return "the workers" if isinstance(self.process, LocalAgent) else "torchrun"

    def start_server(self) -> None:
        """Start the launch's log and fork server, once; the server imports torch while the
        launcher validates the spec."""
        if self.log is not None:
            return
        agent.raise_descriptor_limit(self.shape.local_workers)
        self._env = environment(self.dir)
        if self.shape.local_workers > (os.cpu_count() or 1):
            self._env.setdefault(forkserver.NICENESS_VARIABLE, str(CROWDED_WORKER_NICENESS))
        self.log = CappedLog(self.log_path)
        self.fork_server = self._start_fork_server(self._env, self.log.write_end)
        if self.fork_server is not None:
            self._env[forkserver.SOCKET_VARIABLE] = str(forkserver.socket_path(self.dir))

    def start(self) -> None:
        """Start the workers (OSError if they cannot be); they wait for the plan. Without a
        fork server (its socket cannot be made) torchrun starts each worker as a process of
        its own."""
        self.start_server()
        try:
            if self.uses_agent and self.fork_server is not None:
                self.process = LocalAgent(self.shape.workers, forkserver.WORKER_MODULE,
                                          [str(self.plan_path), str(self.dir)], self._env,
                                          self.log.write_end,
                                          forkserver.socket_path(self.dir))
                self.process.start()
            else:
                self.process = subprocess.Popen(
                    command(self.shape, self.plan_path, self.dir), stdout=self.log.write_end,
                    stderr=subprocess.STDOUT, env=self._env, start_new_session=True)
        finally:
            self.log.close_write_end()

    def failures(self, log: str) -> list[WorkerExit]:
        """The workers that failed by themselves, the first first (see outcome.py)."""
        if isinstance(self.process, LocalAgent):
            return self.process.failures()
        return torchrun_failures(log)

    def exited_zero(self) -> set[int]:
        """The ranks seen to exit with code 0 while the launch runs: known only where dsgd's
        agent started the workers (torchrun tells of its workers when they have all ended)."""
        if isinstance(self.process, LocalAgent):
            return self.process.exited_zero()
        return set()

    def not_zero(self, log: str) -> set[int]:
        """The ranks that did not exit with 0, failed or stopped."""
        if isinstance(self.process, LocalAgent):
            return self.process.not_zero()
        return listed_ranks(log)

    def out_of_space(self) -> bool:
        """Whether the launch's directory ran out of space: its log could not be written for
        it, or its filesystem has no free block left."""
        if self.log is not None and self.log.out_of_space:
            return True
        try:
            usage = os.statvfs(self.dir)
        except OSError:
            return False
        # root may write into the blocks a filesystem keeps for it; other users may not
        return (usage.f_bfree if os.geteuid() == 0 else usage.f_bavail) == 0

    def log_text(self) -> str:
        """What the launch's processes wrote (its newest part: see CappedLog); call it once
        they have stopped."""
        return self.log.text() if self.log is not None else ""

    def _start_fork_server(self, env: dict[str, str], log) -> subprocess.Popen | None:
        """The server, listening on a socket made here, before torchrun starts: a relay then
        always finds it, and waits in its backlog while the server imports torch."""
        try:
            listener = forkserver.listen(forkserver.socket_path(self.dir))
        except OSError:
            return None
        with listener:
            return subprocess.Popen(
                [sys.executable, "-m", "dsgd_cli.launch.forkserver", str(listener.fileno()),
                 str(self.dir)],
                pass_fds=[listener.fileno()], stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def write_plan(self, plan: dict[str, Any]) -> None:
        """Written whole or not at all: workers may be polling for it already."""
        partial = self.dir / "experiments.json.partial"
        partial.write_text(json.dumps(plan))
        os.replace(partial, self.plan_path)

    def stop(self, hurry: Callable[[], bool] = lambda: False) -> None:
        """Stop every process of the launch: SIGTERM, then SIGKILL to those left after
        TERMINATE_WAIT_S, or as soon as `hurry()` says so."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            pids = self.processes()
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + TERMINATE_WAIT_S
            while self.processes() and time.monotonic() < deadline and not hurry():
                time.sleep(0.1)

    def processes(self) -> set[int]:
        """The live processes of the launch: torchrun and whatever carries the launch's marker
        in its environment: the relays torchrun started, the fork server and the workers it
        forked (whose /proc environment is the server's). Each relay and each worker has a
        session of its own, so a signal to torchrun's process group misses them, and they
        outlive a torchrun that was killed."""
        if self.process is None and self.fork_server is None:
            return set()
        pids = set()
        if (self.process is not None and not isinstance(self.process, LocalAgent)
                and self.process.poll() is None):
            pids.add(self.process.pid)
        marker = f"{RUN_MARKER}={self.dir}".encode()
        for entry in Path("/proc").glob("[0-9]*"):
            try:
                if marker in (entry / "environ").read_bytes().split(b"\0"):
                    pids.add(int(entry.name))
            except OSError:  # gone, or another user's
                continue
        return pids

    def close(self) -> None:
        """Stop what is left of the launch and delete its directory."""
        self.stop()
        if isinstance(self.process, LocalAgent):
            self.process.close()
        if self.fork_server is not None:
            self.fork_server.kill()  # nothing happens if stop() ended it
            self.fork_server.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def early_start(spec: str | Path, only: list[str] | None, workers: int | None,
                launch: dict[str, Any] | None,
                overrides: list[tuple[str, Any]] = ()) -> Torchrun | None:
    """The torchrun of the first experiment `dsgd run` will launch, started now from the spec
    as `specfile` reads it; None when the spec is not readable that far (validation then says
    why) or torchrun cannot start (the launch then says why)."""
    try:
        text, document = specfile.read_document(Path(spec))
        defaults, entries, nodes = specfile.sections(document, launch)
        first = next(point for point in specfile.points(defaults, entries, workers, overrides)
                     if specfile.selected(point.name, only))
        count = first.raw.get("workers")
        if type(count) is not int or count < 1:
            return None  # validation refuses it
        check_split(nodes, count, first.path)
    except (SpecError, RecursionError, StopIteration):
        return None
    shape = Shape.of(count, nodes, text, first.name)
    if shape.local_workers > EARLY_START_MAX_WORKERS:
        return None
    torchrun = Torchrun(shape)
    try:
        if torchrun.uses_agent:
            torchrun.start_server()  # the agent starts the workers once the spec is valid
        else:
            torchrun.start()
    except OSError:
        torchrun.close()
        return None
    return torchrun
