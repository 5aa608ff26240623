"""The plugin base classes, the worker context and the helpers they use. Plugins import
these names from `dsgd_cli.api`, which re-exports every one of them (docs/writing-plugins.md).

They live here, below the spec and the registry, because both name them (the registry
checks that a loaded plugin derives from its kind's base; validation asks an aggregator's
class methods) while `dsgd_cli.api` builds plugins through the registry: with the classes
in api.py, api and the spec would import each other."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Mapping, Protocol

import torch
from torch import nn

from dsgd_cli.comm.compressed import (average_with_memory, combine_segments,
                                      compress_segments, decompress_segments, delegated,
                                      exchange_in_one_collective)
from dsgd_cli.comm.communicator import Comm, SharedCounter
from dsgd_cli.emulation.clock import Clock
from dsgd_cli.options import option
from dsgd_cli.spec.run_plan import NO_RUN, RunPlan
from dsgd_cli.plugin_state import default_state, load_default_state

if TYPE_CHECKING:
    from dsgd_cli.comm.compressed import BucketLayout
    from dsgd_cli.spec.resolved import ResolvedExperiment


@dataclass
class NoOptions:
    """For plugins that take no options."""


class Plugin(ABC):
    """Common base: typed options, and the name the registry found the plugin under."""

    Options: ClassVar[type] = NoOptions
    plugin_name: ClassVar[str] = ""

    def __init__(self, options: Any = None):
        self.options = options if options is not None else self.Options()


# -- tasks ------------------------------------------------------------------------------------

@dataclass
class TaskData:
    """A whole dataset in memory; the runtime shards the training part across workers."""

    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor


class Task(Plugin):
    """Data and model. Models are built after `torch.manual_seed(run seed)` on every worker,
    so all workers start from the same parameters.

    `reports_perplexity`: `test_loss` is a mean cross-entropy per token (language models), and
    its exponential is recorded with it as `test_perplexity`.

    `one_label_per_example`: `train_y` holds one integer class per example, so the spec's
    `data_split: by_label` can sort by it; a task whose targets are sequences says False."""

    reports_perplexity: ClassVar[bool] = False
    one_label_per_example: ClassVar[bool] = True

    @abstractmethod
    def load_data(self, seed: int) -> TaskData:
        """The whole dataset, made or loaded locally (no downloads)."""

    @abstractmethod
    def build_model(self) -> nn.Module:
        """A freshly initialised model (the runtime seeds torch first)."""

    def train_examples(self) -> int | None:
        """How many training examples `load_data` returns, computed from the options without
        loading anything; None (the default) when unknown until loaded. The spec loader
        refuses, before launching, more workers than this (each worker needs one example)."""
        return None

    def augment(self, x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """A training batch as the model sees it (random crops, flips); the default leaves it
        as it is. `generator` (on the CPU) is the only source of randomness to use: the
        runtime seeds it from the run's seed, the worker's rank and the step, so the same run
        makes the same batches, workers make different ones, and a resumed run goes on
        with the batches of one never stopped. Test batches are not augmented."""
        return x

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(output, target)

    def count_correct(self, output: torch.Tensor, target: torch.Tensor) -> float:
        """How many of the batch's examples are right (`test_accuracy` is this over the
        number of examples); a language model counts each example's share of right tokens."""
        return int((output.argmax(dim=1) == target).sum())


# -- optimizers -------------------------------------------------------------------------------

class OptimizerPlugin(Plugin):
    """Builds the worker's local optimizer, applied to whatever the aggregator left in .grad."""

    @abstractmethod
    def build(self, params) -> torch.optim.Optimizer:
        """The torch optimizer over `params`."""


# -- learning-rate schedules -----------------------------------------------------------------

@dataclass
class ScheduleOptions:
    """Options every schedule accepts: a linear warm-up. Subclass it for a schedule's own."""

    warmup_steps: int = option(0, min=0, help="steps of linear warm-up up to the peak lr")
    warmup_epochs: float = option(0.0, min=0.0, help="warm-up in epochs (instead of steps)")

    def __post_init__(self):
        if self.warmup_steps and self.warmup_epochs:
            raise ValueError("set warmup_steps or warmup_epochs, not both")


class LRSchedule(Plugin):
    """The learning rate of every step, from the peak lr (the optimizer's `lr`, times the
    spec's `lr_scaling`).

    Steps count from 1: `lr(s)` is what the s-th step of a worker applies, and what the `lr`
    metric recorded at step s shows. The base class does the warm-up: for s <= W (the warm-up
    steps) `lr(s) = peak × s / W`, so the first step trains at peak / W and the W-th at the
    peak; after it, `decay(s)` (the subclass's) gives the lr.

    `needs_total_steps`: the schedule's shape depends on the run's last step (cosine), so it
    cannot run under a `seconds` budget, whose last step is not known in advance.
    """

    Options: ClassVar[type] = ScheduleOptions
    needs_total_steps: ClassVar[bool] = False

    @staticmethod
    def warmup_length(options: ScheduleOptions, steps_per_epoch: int) -> int:
        """The warm-up in steps: `warmup_steps`, or `warmup_epochs` × steps per epoch,
        rounded to the nearest step."""
        if options.warmup_epochs:
            return round(options.warmup_epochs * steps_per_epoch)
        return options.warmup_steps

    @classmethod
    def check_run(cls, options: Any, total_steps: int | None, steps_per_epoch: int) -> None:
        """Raise ValueError if the schedule does not fit a run of `total_steps` steps per
        worker (None: not known in advance). Subclasses with options of their own that
        depend on the run's length extend it."""
        warmup = cls.warmup_length(options, steps_per_epoch)
        if total_steps is None:
            if cls.needs_total_steps:
                raise ValueError(f"schedule {cls.plugin_name!r} needs the run's length in "
                                 f"steps, which a seconds budget does not give")
            return
        if warmup > total_steps:
            given = (f"warmup_epochs: {options.warmup_epochs} ({warmup} steps)"
                     if options.warmup_epochs else f"warmup_steps: {warmup}")
            raise ValueError(f"the warm-up is longer than the run ({given}, the run has "
                             f"{total_steps} steps per worker)")

    def setup(self, peak: float, total_steps: int | None, steps_per_epoch: int) -> None:
        """Called once per worker before training: the peak lr, the run's steps per worker
        (None under a seconds budget) and the steps of an epoch."""
        self.peak, self.total_steps, self.steps_per_epoch = peak, total_steps, steps_per_epoch
        self.warmup_steps = self.warmup_length(self.options, steps_per_epoch)

    def lr(self, step: int) -> float:
        """The learning rate of the `step`-th step (from 1)."""
        if step <= self.warmup_steps:
            return self.peak * step / self.warmup_steps
        return self.decay(step)

    @abstractmethod
    def decay(self, step: int) -> float:
        """The learning rate of a step after the warm-up (`step` > `self.warmup_steps`)."""


# -- compressors ------------------------------------------------------------------------------

@dataclass
class Payload:
    """A compressed tensor: `tensors` travel over the network, `context` stays local."""

    tensors: list[torch.Tensor]
    context: Any = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)


@dataclass(frozen=True)
class Guarantee:
    """What a compressor Q promises about E‖Q(x) − x‖² for a tensor x of d elements, the
    expectation taken over Q's random draws (a deterministic Q's bound holds for every x):

    * `omega` (unbiased compressors): E[Q(x)] = x and E‖Q(x) − x‖² ≤ ω‖x‖²;
    * `delta` (contractive compressors, 0 < δ ≤ 1): E‖Q(x) − x‖² ≤ (1 − δ)‖x‖².

    A compressor may be both (`none`: ω = 0, δ = 1). An unbiased Q rescaled by 1/(1 + ω) is
    contractive with δ = 1/(1 + ω) (Koloskova, Stich, Jaggi, 2019, Remark 2): `qsgd` with
    `rescale: true` and `randomk` with `unbiased: false` are such rescaled compressors.
    """

    omega: float | None = None
    delta: float | None = None

    def __post_init__(self):
        if self.omega is None and self.delta is None:
            raise ValueError("a Guarantee needs omega (unbiased) or delta (contractive)")
        if self.omega is not None and self.omega < 0:
            raise ValueError(f"omega must be >= 0, got {self.omega}")
        if self.delta is not None and not 0 < self.delta <= 1:
            raise ValueError(f"delta must be in (0, 1], got {self.delta}")

    @property
    def unbiased(self) -> bool:
        return self.omega is not None

    @property
    def contractive(self) -> bool:
        return self.delta is not None


class Compressor(Plugin):
    """Turns a tensor into a `Payload` and back. Aggregators average through
    `compressed_average(compressor, comm, tensors, keys, step, memory)`, which lays the
    tensors end to end in buckets (`BucketLayout`: one segment per tensor), compresses each
    bucket into one payload (`compress_bucket`: by default `compress` on each tensor) and
    chooses the collective from what the compressor declares:
    `summable = True`: the payload tensors of all workers may be summed elementwise (an
    all-reduce) and the sum decompressed once, giving the sum of the workers' values.
    Otherwise the payloads are all-gathered and `combine` turns them into the average.
    `uniform_payload = False` (only with `summable = False`): the payload tensors' lengths may
    differ between workers (dqsgd picks its bits per worker), so they must be 1-D and their
    lengths are all-gathered first.
    A compressor that needs several rounds of communication (PowerSGD) overrides `exchange`.
    A payload's `context` must not depend on the worker's data: it is used to decompress
    every worker's payload.
    `requires_error_feedback = True`: the method is defined with error feedback (ef_sign,
    onebit, powersgd); the aggregator then keeps residuals whatever its `error_feedback` says.
    `guarantee(d)` declares what the compressor is (unbiased with ω, contractive with δ, see
    `Guarantee`); algorithms that rely on a bound (CHOCO-SGD needs δ) refuse a compressor
    that declares none, which is the default.
    """

    summable: ClassVar[bool] = True
    requires_error_feedback: ClassVar[bool] = False
    uniform_payload: ClassVar[bool] = True
    identity: ClassVar[bool] = False  # only `none`: aggregators may skip compression entirely
    # Whether it calls numba_kernels (numba.cuda on a GPU): checked before a CUDA launch.
    uses_numba_kernels: ClassVar[bool] = False

    def setup(self, ctx: "WorkerContext") -> None:
        """Called once per worker before the aggregator's setup."""
        self.ctx = ctx

    def guarantee(self, numel: int) -> Guarantee | None:
        """The bound the compressor keeps for a tensor of `numel` elements with its options,
        or None when it promises none (`sign`: sign(x) has no scale, so ‖Q(x) − x‖ is not
        bounded by ‖x‖). Whether it is unbiased or contractive must not depend on `numel`
        (validation asks with one size); only ω and δ may. Called before `setup`."""
        return None

    def state_dict(self) -> dict[str, Any]:
        """What the compressor keeps between steps (warm starts, generators), for checkpoints.
        The default saves its plain-data attributes (docs/writing-plugins.md, "State and resume")."""
        return default_state(self, getattr(self, "ctx", None))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()`'s output; called after `setup`."""
        load_default_state(self, state, getattr(getattr(self, "ctx", None), "device", None))

    @abstractmethod
    def compress(self, tensor: torch.Tensor, key: str, step: int) -> Payload:
        """`tensor`'s payload; `key` names the tensor, `step` the training step (for seeds)."""

    @abstractmethod
    def decompress(self, payload: Payload, like: torch.Tensor) -> torch.Tensor:
        """The tensor a payload stands for, shaped like `like`."""

    def combine(self, payloads: list[Payload], like: torch.Tensor) -> torch.Tensor:
        """The average of the workers' values, from their gathered payloads."""
        total = torch.zeros_like(like)
        for payload in payloads:
            total += self.decompress(payload, like)
        return total.div_(len(payloads))

    # A bucket: `flat` holds the tensors `layout` describes end to end (`layout.keys`,
    # `layout.shapes`, `layout.views(flat)`). These defaults call the per-tensor methods on
    # each segment; a compressor that does a whole bucket at once overrides all three.

    def compress_bucket(self, flat: torch.Tensor, layout: BucketLayout, step: int) -> Payload:
        """One payload for the whole bucket."""
        parts = compress_segments(self, flat, layout, step)
        return Payload(parts.tensors(), context=parts)

    def decompress_bucket(self, payload: Payload, layout: BucketLayout) -> torch.Tensor:
        """The flat bucket a bucket's payload stands for."""
        return decompress_segments(self, payload, layout)

    def combine_bucket(self, payloads: list[Payload], layout: BucketLayout) -> torch.Tensor:
        """The flat average of the workers' buckets, from their gathered payloads."""
        return combine_segments(self, payloads, layout)

    @delegated
    def average_many(self, tensors: list[torch.Tensor], keys: list[str], step: int, comm: Comm,
                     memory: ErrorFeedback | None = None) -> list[torch.Tensor]:
        """Kept for compatibility (aggregators call `compressed_average`, which uses an
        override of this method): each tensor averaged over all workers, compressed, with
        error feedback when `memory` is given."""
        return average_with_memory(self, comm, tensors, keys, step, memory)

    @delegated
    def exchange(self, tensors: list[torch.Tensor], keys: list[str], step: int, comm: Comm,
                 with_local: bool = False) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Per tensor: its average over all workers and, when `with_local`, what this worker's
        own payload decompresses to. By default all payloads travel in one collective;
        compressors that need several rounds (PowerSGD) override this."""
        return exchange_in_one_collective(self, comm, tensors, keys, step, with_local)


class ErrorFeedback:
    """Keeps per-key residuals: e <- (g + e) - decompress(compress(g + e))."""

    def __init__(self):
        self.residuals: dict[str, torch.Tensor] = {}

    def compensate(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        """g + e, in the residual's own buffer (`update` turns it back into the residual):
        no allocation per step, which for large tensors costs more than the addition."""
        residual = self.residuals.get(key)
        if residual is None:
            return tensor
        if residual.device != tensor.device:
            residual = self.residuals[key] = residual.to(tensor.device)
        return residual.add_(tensor)

    def update(self, key: str, compensated: torch.Tensor, transmitted: torch.Tensor) -> None:
        if self.residuals.get(key) is compensated:
            compensated.sub_(transmitted)
        else:
            self.residuals[key] = compensated - transmitted

    def state_dict(self) -> dict[str, Any]:
        return {"residuals": {key: r.clone() for key, r in self.residuals.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.residuals = {key: r.clone() for key, r in state["residuals"].items()}


# -- aggregators ------------------------------------------------------------------------------

@dataclass
class AggregatorOptions:
    """Options every aggregator accepts. Subclass it for an aggregator's own options.

    The spec's `compressor` section is resolved by the spec loader and reaches the
    aggregator as `ctx.compressor`.
    """

    error_feedback: bool = option(False, help="keep compression residuals and add them back")
    sync_buffers: bool = option(True, help="average buffers (batch-norm statistics) with models")


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
    `config` is the same configuration as a read-only mapping, kept for plugins written
    against it.
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

    def parameters(self) -> list[nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def buffers(self) -> list[torch.Tensor]:
        return [b for b in self.model.buffers() if b.dtype.is_floating_point]


class Aggregator(Plugin):
    """A distributed training algorithm, expressed as hooks around the local optimizer step.

    Class attributes tell the runtime how to treat it:
    `models_identical`: the workers' models are always equal (evaluate one, skip consensus);
    `supports_compression`: the spec may give it a compressor other than `none`;
    `asynchronous`: workers never wait for each other while training (osgp, adpsgd, wagma,
    backup). The runtime then evaluates each worker's own model per epoch without
    communicating, and the average model once, after `finish()`.
    `steps_may_differ`: workers may run different numbers of steps (adpsgd, wagma, backup), so
    under a budget each worker stops on its own when the budget is spent; otherwise all
    workers stop after the same step.
    `decides_stop`: the algorithm itself ends the run (backup's coordinator counts the run's
    steps); the runtime then stops a worker when `finished()` says so, and not before.
    `failure_mode`: how the algorithm lives with the spec's `failures` (docs/failures.md):
    "restart" (the default: every worker rolls back to the last emulated checkpoint, restored
    through `state_dict`/`load_state_dict`; only for workers that run in step), "continue"
    (the others go on without the failed workers, told by `worker_left` and
    `worker_rejoined`; a down worker still runs the hooks, with `ctx.up` False and no
    gradients, and the aggregator makes it contribute nothing), or None: it cannot run
    under failures, and `failure_refusal` says why.
    """

    Options: ClassVar[type] = AggregatorOptions
    models_identical: ClassVar[bool] = True
    uses_numba_kernels: ClassVar[bool] = False  # as a compressor's (see Compressor)
    supports_compression: ClassVar[bool] = False
    asynchronous: ClassVar[bool] = False
    steps_may_differ: ClassVar[bool] = False
    decides_stop: ClassVar[bool] = False
    failure_mode: ClassVar[str | None] = "restart"
    failure_refusal: ClassVar[str] = ""

    @classmethod
    def check_world(cls, options: Any, world_size: int, seed: int = 0) -> None:
        """Raise ValueError if the algorithm cannot run with `world_size` workers. `seed` is
        the run's, which a graph drawn at random is drawn with (`random_regular`): check the
        graph the workers will build. An override without `seed` (written before it was
        passed) is still called, without it."""

    @classmethod
    def check_compressor(cls, options: Any, compressor: "Compressor") -> None:
        """Raise ValueError if the algorithm cannot use `compressor` (built from the spec's
        options, not set up: its `guarantee()` may be asked). Called at validation, for
        aggregators that support compression (choco refuses a compressor that is not
        contractive)."""

    @classmethod
    def resolve_options(cls, options: Any, compressor: "Compressor", task: Task,
                        world_size: int, seed: int) -> Any:
        """The options with whatever the spec left to the algorithm chosen (choco's
        `gamma: auto`): called at validation, after the checks, with the run's compressor
        and task (neither set up) and the worker count and seed; what it returns is the run's
        recorded configuration. The default returns `options` as they are."""
        return options

    def setup(self, ctx: WorkerContext) -> None:
        self.ctx = ctx

    def before_forward(self, step: int) -> None:
        pass

    def after_backward(self, step: int) -> None:
        pass

    def after_step(self, step: int) -> None:
        pass

    def finished(self) -> bool:
        """With `decides_stop`: whether this worker has done its last step."""
        return False

    def updates_done(self) -> int | None:
        """With `decides_stop`, when the run's length counts updates rather than this
        worker's steps (backup): the updates made so far as this worker knows them, for the
        progress bar. None: the bar counts steps."""
        return None

    def finish(self) -> None:
        """Complete outstanding communication; called once after the last step."""

    def worker_left(self, rank: int, step: int) -> None:
        """With `failure_mode = "continue"`: worker `rank` failed after `step` steps; what it
        sends counts for nothing until `worker_rejoined` (its `ctx.up` is False meanwhile).
        Called on every worker, the failed one included, before step `step`."""

    def worker_rejoined(self, rank: int, step: int, source: int) -> None:
        """With `failure_mode = "continue"`: worker `rank` is back after `step` steps and
        takes its model, and the state the algorithm needs, from live worker `source` (the
        lowest rank that stayed up). Called on every worker before step `step`."""

    def run_totals(self) -> dict[str, float]:
        """Whole-run values for the run's summary (name -> value), asked for after `finish()`;
        rank 0's are recorded."""
        return {}

    def evaluation_model(self) -> nn.Module:
        """The model this worker would report (push-sum reports its de-biased copy)."""
        return self.ctx.model

    def state_dict(self) -> dict[str, Any]:
        """What the algorithm keeps between steps (residuals, counters, push-sum weights,
        generators), for checkpoints. The default saves its plain-data attributes; override
        both methods when that is not enough (docs/writing-plugins.md, "State and resume")."""
        return default_state(self, self.ctx)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()`'s output; called after `setup`, with the model and optimizer
        already restored."""
        load_default_state(self, state, self.ctx.device)


# -- helpers for plugins ----------------------------------------------------------------------

def flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One contiguous 1-D copy of `tensors`."""
    if not tensors:
        return torch.empty(0)
    return torch.cat([t.reshape(-1) for t in tensors])


def unflatten_into(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Copy consecutive slices of `flat` back into `tensors`."""
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset: offset + n].view_as(t))
        offset += n
