"""Aggregators: distributed training algorithms as hooks around the local optimizer step, their common options, and the flatten helpers they use."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from dsgd_cli.options import option
from dsgd_cli.plugin_base.base import Plugin
from dsgd_cli.plugin_base.compressors import Compressor
from dsgd_cli.plugin_base.context import WorkerContext
from dsgd_cli.plugin_base.state import default_state, load_default_state

if TYPE_CHECKING:
    from dsgd_cli.plugin_base.tasks import Task


@dataclass
class AggregatorOptions:
    """Options every aggregator accepts. Subclass it for an aggregator's own options.

    The spec's `compressor` section is resolved by the spec loader and reaches the
    aggregator as `ctx.compressor`.
    """

    error_feedback: bool = option(False, help="keep compression residuals and add them back")
    sync_buffers: bool = option(True, help="average buffers (batch-norm statistics) with models")


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
