"""The public plugin API: the bases and services every plugin, built-in or third-party, is
written against (docs/writing-plugins.md lists the few other modules a plugin may import).

Five kinds of plugin, each found through an entry-point group:

=================  =====================  =============================================
group              base class             what it does
=================  =====================  =============================================
dsgd.aggregators   `Aggregator`           the distributed algorithm (hooks in the loop)
dsgd.compressors   `Compressor`           turns a tensor into a payload and back
dsgd.optimizers    `OptimizerPlugin`      builds the local torch optimizer
dsgd.tasks         `Task`                 data and model
dsgd.schedules     `LRSchedule`           the learning rate of each step
=================  =====================  =============================================

Each plugin class may declare `Options`, a dataclass whose fields use `option(...)`; the spec
loader validates a spec section against it before anything launches and the plugin receives
the instance as `self.options`.

The worker loop (dsgd_cli/worker/training.py) owns the order; the aggregator owns the algorithm::

    aggregator.setup(ctx)
    for each step, until the run's length is reached (or `aggregator.finished()`):
        aggregator.before_forward(step)
        loss = task.loss(model(x), y); loss.backward()   # ctx.loss = loss.detach()
        aggregator.after_backward(step)     # e.g. average the gradients
        optimizer.step()
        aggregator.after_step(step)         # e.g. average or gossip the models
    aggregator.finish()
    aggregator.run_totals()                 # whole-run values for the summary (rank 0's)

The classes are defined in `dsgd_cli.plugin_base`, below the spec and the registry (which
name them too); this module is the door plugins go through, and re-exports them.
"""

from __future__ import annotations

from typing import Any

import torch

from dsgd_cli.comm.batching import all_gather_flat, all_reduce_flat
from dsgd_cli.comm.compressed import BucketLayout, bucket_layout, compressed_average
from dsgd_cli.comm.communicator import Comm, Group, Handle, NetworkModel, SharedCounter, Traffic
from dsgd_cli.emulation.clock import Clock
from dsgd_cli.options import option
from dsgd_cli.plugin_base import (
    Aggregator, AggregatorOptions, Compressor, ErrorFeedback, Guarantee, LRSchedule,
    MetricsLogger, NoOptions, OptimizerPlugin, Payload, Plugin, RunLength, ScheduleOptions, Task,
    TaskData, WorkerContext, flatten, unflatten_into)
from dsgd_cli.spec import registry
# Reachable from here before the bases moved to plugin_base; kept for code that imports them.
from dsgd_cli.comm.compressed import (average_with_memory, delegated,  # noqa: F401
                                      exchange_in_one_collective)
from dsgd_cli.plugin_base.state import default_state, load_default_state  # noqa: F401
from dsgd_cli.spec.resolved import ResolvedExperiment  # noqa: F401
from dsgd_cli.spec.run_plan import NO_RUN, RunPlan  # noqa: F401

__all__ = [
    "Aggregator", "AggregatorOptions", "Clock", "Comm", "Compressor", "ErrorFeedback", "Group",
    "Guarantee", "Handle", "LRSchedule", "MetricsLogger", "NetworkModel", "NoOptions",
    "OptimizerPlugin", "Payload", "Plugin", "RunLength", "ScheduleOptions", "SharedCounter", "Task",
    "TaskData", "Traffic", "WorkerContext",
    "all_gather_flat", "compressed_average", "BucketLayout", "bucket_layout",
    "all_reduce_flat", "build_optimizer", "build_plugin", "flatten", "option", "unflatten_into",
]


def build_plugin(kind: str, section: dict[str, Any]) -> Plugin:
    """The plugin a validated section names (`{name: sgd, lr: 0.7, ...}`, as an option
    declared with `option(plugin=kind)` holds it), with its options, found through the same
    registry as the experiment's own plugins, a third party's included."""
    return registry.build(kind, section)


def build_optimizer(section: dict[str, Any], params) -> torch.optim.Optimizer:
    """The torch optimizer an optimizer section names, over `params`."""
    return build_plugin("optimizer", section).build(params)
