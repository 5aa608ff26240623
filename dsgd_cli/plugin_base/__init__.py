"""The plugin base classes, the worker context and the helpers they use: one module per plugin
kind. Plugins import these names from `dsgd_cli.api`, which re-exports every one of them
(docs/writing-plugins.md); the names are also importable from this package.

They live here, below the spec and the registry, because both name them (the registry
checks that a loaded plugin derives from its kind's base; validation asks an aggregator's
class methods) while `dsgd_cli.api` builds plugins through the registry: with the classes
in api.py, api and the spec would import each other.

- `base`: `Plugin`, `NoOptions`
- `tasks`: `Task`, `TaskData`
- `optimizers`: `OptimizerPlugin`
- `schedules`: `LRSchedule`, `ScheduleOptions`
- `compressors`: `Compressor`, `Payload`, `Guarantee`, `ErrorFeedback`
- `context`: `WorkerContext`, `RunLength`, `MetricsLogger`
- `aggregators`: `Aggregator`, `AggregatorOptions`, `flatten`, `unflatten_into`
- `state`: the default `state_dict()` / `load_state_dict()` of aggregators and compressors
"""

from dsgd_cli.plugin_base.aggregators import (Aggregator, AggregatorOptions, flatten,
                                              unflatten_into)
from dsgd_cli.plugin_base.base import NoOptions, Plugin
from dsgd_cli.plugin_base.compressors import Compressor, ErrorFeedback, Guarantee, Payload
from dsgd_cli.plugin_base.context import MetricsLogger, RunLength, WorkerContext
from dsgd_cli.plugin_base.optimizers import OptimizerPlugin
from dsgd_cli.plugin_base.schedules import LRSchedule, ScheduleOptions
from dsgd_cli.plugin_base.tasks import Task, TaskData

__all__ = ["Aggregator", "AggregatorOptions", "Compressor", "ErrorFeedback", "Guarantee",
           "LRSchedule", "MetricsLogger", "NoOptions", "OptimizerPlugin", "Payload", "Plugin",
           "RunLength", "ScheduleOptions", "Task", "TaskData", "WorkerContext", "flatten",
           "unflatten_into"]
