"""One throwaway training step before an experiment's clock starts.

The first forward, backward and optimizer step of a process pay one-time costs: lazy imports
(the optimizer's), autograd's worker threads, the allocator's first blocks. Only a launch's
first experiment would pay them inside its measured time, which would make its curve start
late and bias every comparison by the order of the spec. Each experiment therefore runs one
step on a copy of its model first, without communicating and without touching the run's
model, optimizer or random state.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from dsgd_cli.api import Task
from dsgd_cli.spec.resolved import PluginSection


def warm_up(task: Task, model: nn.Module, optimizer: PluginSection, x: torch.Tensor,
            y: torch.Tensor) -> None:
    """A forward, backward and optimizer step of `task` on a copy of `model`, with a batch
    (`x`, `y`) and the experiment's `optimizer` section. Call it before plugins attach hooks
    to the model."""
    section = optimizer
    devices = [x.device] if x.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):  # the run draws the same numbers as without
        copied = copy.deepcopy(model)
        params = [p for p in copied.parameters() if p.requires_grad]
        optimizer = section.build("optimizer").build(params)
        task.loss(copied(x), y).backward()
        optimizer.step()
