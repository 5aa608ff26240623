"""One worker's parts for one experiment, and how they are built: data, model, optimizer,
communication, plugins, evaluations, and the state a resumed run continues from."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dsgd_cli.worker import checkpoint
from dsgd_cli.api import Aggregator, Task, WorkerContext
from dsgd_cli.emulation.network import GLOO_RING_MAX
from dsgd_cli.comm.communicator import Comm
from dsgd_cli.emulation.compute import PaddedCompute
from dsgd_cli.emulation.network import real_cluster, real_network
from dsgd_cli.comm.events import EventWriter
from dsgd_cli.worker.interval_metrics import IntervalMetrics
from dsgd_cli.spec.learning_rate import LearningRate, last_step
from dsgd_cli.emulation.stragglers import Straggling
from dsgd_cli.worker.schedule import StopRule, run_length
from dsgd_cli.spec.cluster_spec import cluster_of, network_of
from dsgd_cli.spec.resolved import ResolvedExperiment
from dsgd_cli.spec.run_plan import NO_RUN, RunPlan, read_only
from dsgd_cli.spec.sharding import Shard, steps_per_epoch
from dsgd_cli.worker.data import load_data
from dsgd_cli.worker.warmup import warm_up
from dsgd_cli.worker.evaluation import WorkerEvaluation


@dataclass
class Worker:
    """What the training loop, the evaluations and the end-of-run report work with."""

    experiment: ResolvedExperiment  # the run's resolved experiment, typed (`ctx.experiment`)
    config: dict  # the same as stored (current version): `ctx.config`, for plugins of before
    rank: int
    world_size: int
    device: torch.device
    task: Task
    train_x: torch.Tensor
    train_y: torch.Tensor
    shard: Shard
    steps_per_epoch: int
    model: nn.Module
    optimizer: torch.optim.Optimizer
    comm: Comm
    aggregator: Aggregator
    ctx: WorkerContext  # what the plugins see; its compressor is the run's
    interval: IntervalMetrics  # the plugins' MetricsLogger (ctx.metrics)
    stop_rule: StopRule
    evaluation: WorkerEvaluation
    straggling: Straggling
    padding: PaddedCompute | None  # the spec's compute model: steps padded to modeled time
    checkpoint_dir: str | None  # set by the launcher when the spec asks for checkpoints
    checkpoint_every: int | None  # None without a checkpoint directory
    resumed: dict | None  # the checkpoint's progress, where a resumed run goes on from
    learning_rate: LearningRate  # sets the optimizer's lr before each step


def build_worker(config: dict, events: EventWriter, rank: int, world_size: int,
                 device: torch.device, namespace: str = "", run: RunPlan = NO_RUN,
                 experiment: ResolvedExperiment | None = None) -> Worker:
    """The worker's parts, built in the same order on every rank: the order of process group
    creation and of random number use is part of what makes runs reproducible. The worker's
    clock (`ctx.clock`) is the one `events` stamps its metrics with, of the run's time scale
    (process.py makes both). `config` is the run's configuration (current version: the
    launcher upgrades stored ones); `experiment` the same, typed, when the caller read it
    already. Everything here reads the typed experiment; `config` is only `ctx.config`."""
    if experiment is None:
        experiment = ResolvedExperiment.from_config(config)  # typed: what plugins see too
    seed, batch_size = experiment.seed, experiment.batch_size
    task = experiment.task.build("task")
    data = load_data(task, experiment.task, seed)
    train_x, train_y = data.train_x.to(device), data.train_y.to(device)
    test_x, test_y = data.test_x.to(device), data.test_y.to(device)
    torch.manual_seed(seed)  # the same initial model on every worker
    model = task.build_model().to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = experiment.optimizer.build("optimizer").build(params)
    base_lrs = [group["lr"] for group in optimizer.param_groups]  # a checkpoint's are scheduled
    resumed = None
    if run.resuming:
        resumed = checkpoint.load(run.checkpoint_dir, run.resume_step, rank)
        model.load_state_dict(resumed["model"])
        optimizer.load_state_dict(resumed["optimizer"])
    # Before the plugins hook into the model; outside every clock (see warmup.py).
    warm_up(task, model, experiment.optimizer, train_x[:batch_size], train_y[:batch_size])
    clock = events.clock  # the worker's emulated time: the events' seconds are its
    network = real_network(network_of(experiment.network), clock)  # links in real time
    cluster = cluster_of(experiment.cluster, experiment.workers)
    comm = Comm(rank, world_size, network, device,
                timeout_s=experiment.timeout, namespace=namespace,
                cluster=real_cluster(cluster, clock),
                ring_max=(GLOO_RING_MAX if experiment.compute is None
                          else experiment.compute.ring_max))
    interval = IntervalMetrics()
    shard = Shard(len(train_y), rank, world_size, seed, experiment.data_split, data.train_y)
    per_epoch = steps_per_epoch(shard, batch_size, experiment.steps_per_epoch)
    planned = last_step(experiment, shard.size, per_epoch)  # None under a seconds budget
    learning_rate = LearningRate(
        experiment.lr_schedule.build("lr_schedule"), optimizer,
        base_lrs, experiment.lr_scaling, world_size, planned, per_epoch)
    aggregator = experiment.aggregator.build("aggregator")
    ctx = WorkerContext(
        rank=rank, world_size=world_size, device=device, model=model, optimizer=optimizer,
        comm=comm, metrics=interval, seed=seed,
        compressor=experiment.compressor.build("compressor"), config=read_only(config),
        experiment=experiment, run=run, clock=clock)
    ctx.length = run_length(experiment, per_epoch, comm, aggregator, clock)
    # Every rank creates the same process groups in the same order: the runtime's first.
    stop_rule = StopRule(ctx.length, aggregator, comm, planned)
    ctx.compressor.setup(ctx)
    aggregator.setup(ctx)
    if resumed is not None:  # the plugins set up from the restored model, then their state
        ctx.compressor.load_state_dict(resumed["compressor"])
        aggregator.load_state_dict(resumed["aggregator"])
    evaluation = WorkerEvaluation(experiment, task, aggregator, comm, test_x, test_y, events,
                                  stop_rule, ctx.length)
    torch.manual_seed(seed * 7919 + rank)  # per-worker randomness (dropout, compressors)
    straggling = Straggling(experiment.stragglers, rank, seed)
    padding = None
    if experiment.compute is not None:
        speed = 1.0 if cluster is None else cluster.speed(rank)
        padding = PaddedCompute(experiment.compute, seed, rank, comm.blocked_seconds,
                                speed=speed, clock=clock)
    if resumed is not None:
        checkpoint.set_rng_state(resumed["rng"], device)
    return Worker(
        experiment=experiment, config=config, rank=rank, world_size=world_size, device=device, task=task,
        train_x=train_x, train_y=train_y, shard=shard, steps_per_epoch=per_epoch, model=model,
        optimizer=optimizer, comm=comm, aggregator=aggregator, ctx=ctx, interval=interval,
        stop_rule=stop_rule, evaluation=evaluation, straggling=straggling, padding=padding,
        checkpoint_dir=run.checkpoint_dir,
        checkpoint_every=experiment.checkpoint_every if run.checkpoint_dir else None,
        resumed=None if resumed is None else resumed["progress"], learning_rate=learning_rate)
