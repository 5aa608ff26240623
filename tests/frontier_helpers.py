"""A small in-process harness for the issue-50 aggregators (demo, desloc, sparseloco): a
worker context over the gloo group that `distributed.run_workers` sets up, a hand-driven step
in the runtime's order with gradients under the test's control, and flat views of models.
The references simulate the same workers in one process with the same model and gradients."""

from __future__ import annotations

import torch
from torch import nn

from dsgd_cli.api import Comm, WorkerContext, flatten


class Metrics:
    def __init__(self):
        self.values: dict[str, list[float]] = {}

    def log(self, name, value):
        self.values.setdefault(name, []).append(float(value))


def model(dtype=torch.float64) -> nn.Module:
    """Weights of 8×6 and 5×8 and biases of 8 and 5: chunks of several shapes (with a chunk
    target of 4: blocks of 4×3, runs of 4, blocks of 1×4, runs of 1). The same on every worker."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Linear(8, 5)).to(dtype)


def gradients(net: nn.Module, rank: int, step: int) -> list[torch.Tensor]:
    """A known gradient per rank and step, which depends on the parameters too:
    g = p · (1 + rank) / 4 + sin(3·step + index + rank)."""
    return [p.detach() * (1 + rank) / 4
            + torch.sin(torch.arange(p.numel(), dtype=p.dtype) + 3 * step + rank).view_as(p)
            for p in net.parameters()]


def context(rank: int, n: int, make_optimizer, dtype=torch.float64) -> WorkerContext:
    net = model(dtype)
    return WorkerContext(rank=rank, world_size=n, device=torch.device("cpu"), model=net,
                         optimizer=make_optimizer(net.parameters()), comm=Comm(rank, n),
                         metrics=Metrics(), seed=0, compressor=None, config={})


def step(aggregator, ctx, index: int) -> None:
    """One step in the runtime's order, with the test's gradient."""
    ctx.optimizer.zero_grad(set_to_none=True)
    aggregator.before_forward(index)
    for p, g in zip(ctx.model.parameters(), gradients(ctx.model, ctx.rank, index)):
        p.grad = g
    aggregator.after_backward(index)
    ctx.optimizer.step()
    aggregator.after_step(index)


def flat(net: nn.Module) -> torch.Tensor:
    return flatten([p.detach() for p in net.parameters()]).clone()


def run(aggregator, ctx, steps: int, start: int = 0) -> dict:
    """`steps` steps; each step's model and bytes sent."""
    models, traffic = [], []
    for index in range(start, start + steps):
        step(aggregator, ctx, index)
        models.append(flat(ctx.model))
        traffic.append(ctx.comm.take_traffic().bytes_sent)
    return {"models": models, "traffic": traffic}


def resumed(rank: int, n: int, make_aggregator, make_optimizer, stop: int, steps: int):
    """Train `stop` steps, save model, optimizer and aggregator through torch.save as a
    checkpoint does, rebuild everything, load, and train on to `steps`: the final model."""
    import io

    ctx = context(rank, n, make_optimizer)
    aggregator = make_aggregator()
    aggregator.setup(ctx)
    run(aggregator, ctx, stop)
    buffer = io.BytesIO()
    torch.save({"model": ctx.model.state_dict(), "optimizer": ctx.optimizer.state_dict(),
                "aggregator": aggregator.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    ctx = context(rank, n, make_optimizer)
    ctx.model.load_state_dict(saved["model"])
    ctx.optimizer.load_state_dict(saved["optimizer"])
    aggregator = make_aggregator()
    aggregator.setup(ctx)
    aggregator.load_state_dict(saved["aggregator"])
    return run(aggregator, ctx, steps - stop, start=stop)["models"][-1]
