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


def local_steps(nets: list[nn.Module], optimizers: list, step: int) -> None:
    """The references' inner step: each worker applies its own `gradients` at `step`."""
    for rank, (net, optimizer) in enumerate(zip(nets, optimizers)):
        optimizer.zero_grad()
        for p, g in zip(net.parameters(), gradients(net, rank, step)):
            p.grad = g
        optimizer.step()


def context(rank: int, n: int, make_optimizer, dtype=torch.float64) -> WorkerContext:
    net = model(dtype)
    return WorkerContext(rank=rank, world_size=n, device=torch.device("cpu"), model=net,
                         optimizer=make_optimizer(net.parameters()), comm=Comm(rank, n),
                         metrics=Metrics(), seed=0, compressor=None, config={})


def step(aggregator, ctx, index: int, lr=None) -> None:
    """One step in the runtime's order, with the test's gradient; `lr(index)`, when given,
    is every param group's learning rate at this step, as a schedule sets it."""
    ctx.optimizer.zero_grad(set_to_none=True)
    if lr is not None:
        for group in ctx.optimizer.param_groups:
            group["lr"] = lr(index)
    aggregator.before_forward(index)
    for p, g in zip(ctx.model.parameters(), gradients(ctx.model, ctx.rank, index)):
        p.grad = g
    aggregator.after_backward(index)
    ctx.optimizer.step()
    aggregator.after_step(index)


def flat(net: nn.Module) -> torch.Tensor:
    return flatten([p.detach() for p in net.parameters()]).clone()


def run(aggregator, ctx, steps: int, start: int = 0, lr=None) -> dict:
    """`steps` steps; each step's model and bytes sent."""
    models, traffic = [], []
    for index in range(start, start + steps):
        step(aggregator, ctx, index, lr)
        models.append(flat(ctx.model))
        traffic.append(ctx.comm.take_traffic().bytes_sent)
    return {"models": models, "traffic": traffic}


def resumed(rank: int, n: int, make_aggregator, make_optimizer, stop: int, steps: int, lr=None):
    """Train `stop` steps, save model, optimizer and aggregator through torch.save as a
    checkpoint does, rebuild everything, load, and train on to `steps`: the final model."""
    import io

    ctx = context(rank, n, make_optimizer)
    aggregator = make_aggregator()
    aggregator.setup(ctx)
    run(aggregator, ctx, stop, lr=lr)
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
    return run(aggregator, ctx, steps - stop, start=stop, lr=lr)["models"][-1]


def private_state(aggregator, optimizer) -> torch.Tensor:
    """Every tensor the worker keeps besides its model, flat: the aggregator's state (δ, error
    buffers, θ_global) and the optimizer's (Adam's moments), as a checkpoint saves them."""
    def tensors(value):
        if isinstance(value, torch.Tensor):
            return [value.detach().reshape(-1).double()]
        if isinstance(value, dict):
            return [t for key in sorted(value, key=str) for t in tensors(value[key])]
        if isinstance(value, (list, tuple)):
            return [t for item in value for t in tensors(item)]
        return []

    found = tensors(aggregator.state_dict()) + tensors(optimizer.state_dict()["state"])
    return torch.cat(found) if found else torch.zeros(0, dtype=torch.float64)


def failed(rank: int, n: int, make_aggregator, make_optimizer, steps: int, failures: dict,
           lr=None) -> dict:
    """`steps` steps under the runtime's `restart` emulation (dsgd_cli/emulation/failures.py,
    driven as training.py drives it), each step 1 modeled second: the final model, and the
    private state (`private_state`) at every boundary, in the order they were reached (a
    rollback goes back to an earlier step and reaches its boundaries again)."""
    import types

    from dsgd_cli.emulation.clock import Clock
    from dsgd_cli.emulation.failures import FailureEmulation
    from dsgd_cli.spec.failures_spec import parse_failures

    ctx = context(rank, n, make_optimizer)
    aggregator = make_aggregator()
    aggregator.setup(ctx)
    real = [0.0]
    clock = Clock(1.0, now=lambda: real[0], sleep=lambda seconds: None)
    stateless = types.SimpleNamespace(state_dict=dict, load_state_dict=lambda state: None)
    worker = types.SimpleNamespace(
        experiment=types.SimpleNamespace(workers=n, cluster=None,
                                         failures=parse_failures(failures, "failures")),
        model=ctx.model, optimizer=ctx.optimizer, aggregator=aggregator, device=ctx.device,
        comm=ctx.comm, interval=Metrics(), ctx=types.SimpleNamespace(clock=clock, compressor=stateless),
        evaluation=types.SimpleNamespace(reached_at=None))
    emulation = FailureEmulation(worker, start=0.0)
    done, boundaries = 0, []
    while done < steps:
        step(aggregator, ctx, done, lr)
        real[0] += 1.0
        done += 1
        boundaries.append((done, private_state(aggregator, ctx.optimizer)))  # as the failure found it
        back = emulation.after_step(done, samples=0)
        if back is not None:
            done = back[0]
            boundaries.append((done, private_state(aggregator, ctx.optimizer)))  # as restored
    return {"model": flat(ctx.model), "boundaries": boundaries, "totals": emulation.totals()}


def assert_rolled_back(results: list[dict], boundaries: list[int], failure_at: int,
                       back_to: int) -> None:
    """Every worker's `failed` run reached `boundaries` in that order (one failure, seen after
    step `failure_at`, rolled back to the checkpoint of step `back_to`), and its private state
    after the rollback is the one it had at that checkpoint, not the one at the failure."""
    for rank, result in enumerate(results):
        run = result["failed"]
        assert [done for done, _ in run["boundaries"]] == boundaries, f"rank {rank}"
        assert (run["totals"]["failures"], run["totals"]["lost_steps"]) == (1, failure_at - back_to)
        states = dict(run["boundaries"][:failure_at])  # the first pass, up to the failure
        restored = run["boundaries"][failure_at][1]
        assert states[back_to].numel() > 0
        assert torch.equal(restored, states[back_to]), f"rank {rank}: not the checkpoint's state"
        assert not torch.equal(restored, states[failure_at]), f"rank {rank}: left as at the failure"
