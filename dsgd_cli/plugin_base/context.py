"""What a plugin sees of the worker it runs in: the context, the run's length, the metrics."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Protocol

import torch
from torch import nn

from dsgd_cli.comm.communicator import Comm, SharedCounter
from dsgd_cli.emulation.clock import Clock
from dsgd_cli.emulation.compute import modeled_compute_seconds
from dsgd_cli.emulation.stragglers import Straggling
from dsgd_cli.plugin_base.compressors import Compressor
from dsgd_cli.spec.run_plan import NO_RUN, RunPlan

if TYPE_CHECKING:
    from dsgd_cli.spec.resolved import ResolvedExperiment


class MetricsLogger(Protocol):
    def log(self, name: str, value: float) -> None:
        """Record a value for the current step; the runtime writes it at the next log point."""


@dataclass
class RunLength:
    """How long the run trains. Without a budget: `steps` per worker (epochs × steps per
    epoch). With one: `samples` over all workers or training `seconds`, and `steps` is None.

    `spent()` says whether the budget is used up, as any worker can see it: the samples
    counter is shared by all workers (the runtime adds each step's batch when workers may run
    different numbers of steps), the seconds count from the common start of training.
    """

    steps: int | None = None
    samples: int | None = None
    seconds: float | None = None
    samples_counter: SharedCounter | None = None
    started_at: float | None = None  # time.perf_counter() when training started
    time_scale: float = 1.0  # real seconds per modeled second (the spec's compute.time_scale)
    clock: Clock | None = None  # the worker's clock (ctx.clock), which `elapsed()` reads

    def spent(self) -> bool:
        if self.samples is not None and self.samples_counter is not None:
            return self.samples_counter.value() >= self.samples
        if self.seconds is not None and self.started_at is not None:
            return self.elapsed() >= self.seconds
        return False

    def elapsed(self) -> float:
        """Modeled seconds since training started: the worker's clock, or without one real
        seconds since `started_at` over `time_scale`."""
        if self.clock is not None:
            return self.clock.elapsed()
        return Clock(self.time_scale, started_at=self.started_at).elapsed()


@dataclass
class WorkerContext:
    """What a plugin sees of the worker it runs in.

    `loss` is this step's training loss (detached), set by the runtime after backward;
    `length` is how long the run trains; `clock` is the worker's emulated time: every time a
    plugin records or waits for is modeled seconds, converted from real ones by the clock
    (`clock.to_modeled(real_seconds)`, `clock.real_deadline(modeled_seconds)`); `run` is
    this launch of the run (`run.resuming`: the plugin's state comes from a checkpoint,
    `load_state_dict` after `setup`); `experiment` is the run's resolved experiment, typed
    (`ctx.experiment.workers`, `ctx.experiment.aggregator.options`; None outside a run).
    `config` is the same configuration as a read-only mapping: deprecated, kept for plugins
    written against it (the built-in ones read `experiment`).
    """

    rank: int
    world_size: int
    device: torch.device
    model: nn.Module
    optimizer: torch.optim.Optimizer
    comm: Comm
    metrics: MetricsLogger
    seed: int
    compressor: Compressor
    config: Mapping[str, Any] = field(default_factory=dict)
    loss: torch.Tensor | None = None
    length: RunLength = field(default_factory=RunLength)
    run: RunPlan = NO_RUN
    clock: Clock = field(default_factory=Clock)
    experiment: ResolvedExperiment | None = None
    up: bool = True  # False during a down step under `failures` with failure_mode "continue"

    @property
    def under_failures(self) -> bool:
        """Whether the run has a `failures:` section (its emulation rolls models back)."""
        if self.experiment is not None:
            return self.experiment.failures is not None
        return self.config.get("failures") is not None

    @property
    def experiment_name(self) -> str:
        """The experiment's name ("" outside a run)."""
        if self.experiment is not None:
            return self.experiment.name
        return str(self.config.get("name", ""))

    def modeled_step_seconds(self, rank: int, step: int) -> float:
        """The modeled compute of `rank`'s `step` (from 0), as the runtime pads it:
        `compute.step_seconds` × the straggler factor × the compute model's variation ÷ the
        worker's speed, the same draws of the run's seed; without a compute model, the
        straggler factor alone (a step counts one second). For plugins that order events on
        the modeled clock without waiting for them (async_local_sgd, halos)."""
        experiment = self.experiment
        stragglers = experiment.stragglers if experiment is not None else None
        slow = Straggling(stragglers, rank, self.seed).factor(step)
        compute = experiment.compute if experiment is not None else None
        if compute is None:
            return slow
        cluster = self.comm.cluster
        speed = cluster.speed(rank) if cluster is not None else 1.0
        return modeled_compute_seconds(compute.step_seconds, compute.variation, self.seed, rank,
                                       step, slow, speed)

    def parameters(self) -> list[nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def buffers(self) -> list[torch.Tensor]:
        return [b for b in self.model.buffers() if b.dtype.is_floating_point]
