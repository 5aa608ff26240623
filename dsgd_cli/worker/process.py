"""The worker process, one per rank: forked by the launch's fork server for the relay torchrun
started (dsgd_cli/launch/forkserver.py), which calls `main`; or `python -m dsgd_cli.worker.process`.

A worker runs its launch's experiments one after another; for each it builds its parts
(worker.py), trains (training.py, which owns the order of the loop; the aggregator plugin owns
the algorithm through its hooks), then reports the run's totals. Every metric goes to this
rank's event file (see events.py).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import traceback
import uuid
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from dsgd_cli.comm.cluster import LEVELS
from dsgd_cli.emulation.clock import Clock
from dsgd_cli.emulation.compute import experiment_time_scale
from dsgd_cli.spec.directories import UntrustedDirectory, make_experiment_directory
from dsgd_cli.comm.events import EventWriter, events_path, experiment_dir, launcher_gone, stop_path
from dsgd_cli.launch.local_store import STORE_VARIABLE
from dsgd_cli.worker.store_client import LocalStore
from dsgd_cli.worker.training import Diverged, Stopped, StopRequest, Totals, TrainingLoop
from dsgd_cli.worker.parts import Worker, build_worker
from dsgd_cli.spec.resolved import ResolvedExperiment, read_key
from dsgd_cli.spec.run_plan import NO_RUN, RunPlan, read_plan_entry
from dsgd_cli.worker.evaluation import all_sum


def main(argv: list[str] | None = None) -> None:
    """A worker of one launch: runs the launch's experiments (a JSON list) one after another
    in one process group, each from a fresh start. The first that fails ends the process: the
    launcher records it and launches the rest anew."""
    plan_path, events_dir = (argv or sys.argv[1:])[:2]
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    plan = wait_for_plan(Path(plan_path))
    exit_code = 0
    for index, entry in enumerate(plan["experiments"]):
        config, run = read_plan_entry(entry)
        directory = experiment_dir(events_dir, index)
        directory.mkdir(parents=True, exist_ok=True)
        # The worker's clock: the events' seconds, and the plugins' `ctx.clock`.
        clock = Clock(experiment_time_scale(read_key(config, "compute")))
        events = EventWriter(events_path(directory, rank), rank, clock)
        exit_code = run_experiment(config, events, rank, world_size, local_rank,
                                   namespace=str(index), stop_file=stop_path(events_dir),
                                   device_kind=plan.get("device"), run=run)
        events.close()
        if exit_code:
            break
    sys.stdout.flush()
    sys.stderr.flush()
    # Leave without tearing down the process group: after a failure the peers may be gone and
    # a clean shutdown could block on them, and gloo's teardown can abort the process
    # ("terminate called without an active exception") after a run that succeeded.
    os._exit(max(exit_code, 0))


def wait_for_plan(path: Path) -> dict:
    """The launch's plan. torchrun may start before the launcher has validated the spec (so
    that starting and importing overlap the validation): the plan then appears, whole, once
    the spec is valid. A launcher that is gone will not write it."""
    while not path.exists():
        if launcher_gone():
            sys.exit("dsgd: the launcher is gone")
        time.sleep(0.01)
    return json.loads(path.read_text())


def run_experiment(config: dict, events: EventWriter, rank: int, world_size: int,
                   local_rank: int, namespace: str = "", stop_file: Path | None = None,
                   device_kind: str | None = None, run: RunPlan = NO_RUN) -> int:
    """Train one experiment, reporting to `events`; returns the process exit code, or -1 when
    it stopped as the launcher asked (the process then leaves, with code 0)."""
    try:
        experiment = ResolvedExperiment.from_config(config)  # typed: what the worker reads
        device, backend = device_and_backend(local_rank, device_kind)
        if not dist.is_initialized():
            torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
            timeout = timedelta(seconds=experiment.timeout)
            dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout,
                                    store=launch_store(timeout))
        if (experiment.nnodes or 1) > 1:
            events.write("run", run_id=_shared_run_id(run, namespace))
        worker = build_worker(config, events, rank, world_size, device, namespace, run,
                              experiment)
        totals = TrainingLoop(worker, events, StopRequest(stop_file, namespace)).run()
        report_run(worker, events, totals)
        if experiment.save_dir:
            save_model(worker, Path(experiment.save_dir) / experiment.name.replace("/", "_"))
        with worker.comm.untracked():  # nobody tears down its links while a peer needs them
            worker.comm.barrier()
        worker.comm.close()
        events.write("done")
        return 0
    except Stopped as stopped:
        events.write("stopped", step=stopped.step)
        return -1
    except Diverged as diverged:
        events.write("diverged", step=diverged.step, name="train_loss",
                     value=str(diverged.value), at=time.time())
    except Exception as error:
        # `behind`: the ranks that never entered the collective that timed out (CommTimeout)
        events.write("error", reason=f"{type(error).__name__}: {error}",
                     traceback=traceback.format_exc(), at=time.time(),
                     behind=getattr(error, "behind", []))
    return 1


def report_run(worker: Worker, events: EventWriter, totals: Totals) -> None:
    """The run's totals, written by rank 0 (every rank takes part in the all-reduces)."""
    wall = worker.ctx.clock.elapsed()  # modeled, since the common start (before a resume too)
    # Run totals: samples and bytes over all workers; the emulation's overrun steps.
    padding = worker.padding
    comm = worker.comm
    samples, total_sent, steps, overran, modeled_ops, overran_ops, overrun_s, train_s = all_sum(
        comm, [totals.samples, totals.bytes_sent, padding.steps if padding else 0,
               padding.overran_steps if padding else 0, comm.modeled_operations,
               comm.overran_operations, worker.ctx.clock.to_modeled(comm.overrun_seconds),
               totals.train_seconds])
    # The slowest worker's training time; the time by which every worker had seen the
    # target accuracy (workers of asynchronous algorithms each judge their own model;
    # under a budget rank 0 judged the average model and the others pass 0).
    reached_at = totals.reached_at
    latest = torch.tensor([totals.train_seconds, math.inf if reached_at is None else reached_at],
                          dtype=torch.float64, device=worker.device)
    with worker.comm.untracked():
        worker.comm.all_reduce(latest, "max")
    slowest_train_seconds, reached_by_all = latest.tolist()
    if worker.rank == 0:
        events.metric("wall_seconds", wall, per_rank=False)
        events.metric("samples_per_second", samples / slowest_train_seconds, per_rank=False)
        events.metric("total_bytes_sent", total_sent, per_rank=False)
        if padding is not None and steps:
            events.metric("overrun_steps", overran / steps, per_rank=False)
        if modeled_ops:
            events.metric("comm_overrun", overran_ops / modeled_ops, per_rank=False)
            if train_s > 0:  # the share of the workers' training time those overruns added
                events.metric("comm_overrun_time", min(1.0, overrun_s / train_s), per_rank=False)
        if reached_by_all != math.inf:
            events.metric("time_to_accuracy", reached_by_all, per_rank=False)
        for name, value in worker.aggregator.run_totals().items():
            events.metric(name, value, per_rank=False)
    if totals.sent_by_level is not None:
        report_levels(worker, events, totals.sent_by_level)
    if totals.failures is not None:
        report_failures(worker, events, totals.failures, wall)


def report_levels(worker: Worker, events: EventWriter, sent_by_level: dict[str, int]) -> None:
    """On a cluster: the run's bytes over all workers per link level they crossed,
    `total_bytes_sent_{level}`, which sum to `total_bytes_sent`."""
    # Every rank sums all the levels, in one order (a rank that sent nothing has none).
    totals = all_sum(worker.comm, [sent_by_level.get(level, 0) for level in LEVELS])
    if worker.rank == 0:
        for level, total in zip(LEVELS, totals):
            events.metric(f"total_bytes_sent_{level}", total, per_rank=False)


def report_failures(worker: Worker, events: EventWriter, failures: dict, wall: float) -> None:
    """Under the spec's `failures`: how many struck (the same on every worker), the
    worker-seconds they cost over all workers, and the goodput, the fraction of modeled
    worker-time spent on work that counted."""
    # Under `continue` each node's outages are counted by its first rank (node_failures).
    lost, worker_time, node_failures = all_sum(
        worker.comm, [failures["lost_seconds"], wall, failures.get("node_failures", 0)])
    if worker.rank == 0:
        events.metric("failures", failures.get("failures", node_failures), per_rank=False)
        events.metric("lost_seconds", lost, per_rank=False)
        if "lost_steps" in failures:  # restart: steps rolled back and redone, per worker
            events.metric("lost_steps", failures["lost_steps"], per_rank=False)
        events.metric("goodput", 1.0 - lost / worker_time if worker_time > 0 else 1.0,
                      per_rank=False)


def save_model(worker: Worker, directory: Path) -> None:
    """The model this worker reports, on the CPU: `DIRECTORY/rank{RANK}.pt`."""
    state = worker.aggregator.evaluation_model().state_dict()
    write_model({k: v.detach().cpu() for k, v in state.items()}, directory, worker.rank)


def write_model(state: dict, directory: Path, rank: int) -> Path:
    """Write `state` to `DIRECTORY/rank{RANK}.pt` through a new temporary file in the same
    directory, renamed over it: the final path is never opened, so a link planted there is
    replaced, not written through. A `save_dir` (its parent) where other users could swap
    the directory, and a directory that is a link or another user's, are refused
    (UntrustedDirectory). The directory is opened once, and the files made and renamed
    relative to it: what was checked is where the model goes, whatever is renamed since."""
    make_experiment_directory(directory)
    target = directory / f"rank{rank}.pt"
    temporary = f".{target.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        folder = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as error:  # swapped for a link since it was checked, or gone
        raise UntrustedDirectory(f"save_dir: the experiment's directory {directory} cannot be "
                                 f"opened ({error.strerror or error}): refused") from None
    try:
        if os.fstat(folder).st_uid != os.getuid():  # swapped since it was checked
            raise UntrustedDirectory(f"save_dir: the experiment's directory {directory} is "
                                     "not your own: refused")
        # O_EXCL: a new file, never one (or a link) already there; 0o666 less the umask, as
        # any file the user writes.
        descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW,
                             0o666, dir_fd=folder)
        try:
            with os.fdopen(descriptor, "wb") as file:
                torch.save(state, file)
                file.flush()
                os.fsync(file.fileno())
            os.replace(temporary, target.name, src_dir_fd=folder, dst_dir_fd=folder)
        except BaseException:
            try:
                os.unlink(temporary, dir_fd=folder)
            except FileNotFoundError:
                pass
            raise
    finally:
        os.close(folder)
    return target


def launch_store(timeout: timedelta) -> dist.Store | None:
    """The store of the launch on one machine (dsgd's agent: a Unix socket only this user
    reaches); None under torchrun, whose environment names its TCP store (env://)."""
    global _STORE
    path = os.environ.get(STORE_VARIABLE)
    if path is not None and _STORE is None:
        _STORE = LocalStore(path, timeout)
    return _STORE


# torch keeps only the C++ half of a store written in Python: the Python object must stay
# alive for as long as the process group uses it, or its methods are lost ("pure virtual").
_STORE: LocalStore | None = None


def device_and_backend(local_rank: int, kind: str | None = None) -> tuple[torch.device, str]:
    """The launcher's choice (`launcher.choose_device`, in the plan); for a worker started
    by hand, CUDA when it is there."""
    kind = kind or ("cuda" if torch.cuda.is_available() else "cpu")
    if kind == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        return device, "nccl"
    if kind == "cuda_shared":  # fewer GPUs than workers: taken in turn, gloo between them
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        return device, "gloo"
    return torch.device("cpu"), "gloo"


def _shared_run_id(run: RunPlan, namespace: str) -> int:
    """The id of the run, which only node rank 0's launcher knows (it created the run): its
    workers put it in the rendezvous store, the other machines' read it from there."""
    store = dist.distributed_c10d._get_default_store()
    key = f"dsgd/run_id/{namespace}"
    if run.run_id is not None and int(os.environ.get("LOCAL_RANK", "0")) == 0:
        store.set(key, str(run.run_id))
    return int(store.get(key))


if __name__ == "__main__":
    main()
