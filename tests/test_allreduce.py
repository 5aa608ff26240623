"""`allreduce` driven by a hand-written training loop in 3 worker processes on a real gloo
group, with gradients the test chooses: the averaged gradient is (1/n) Σ_i g_i, and with a
compressor and error feedback every worker keeps e <- (g + e) - (what it transmitted).

Expected values are computed here from the known per-rank gradients, not by the plugins."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from distributed import run_workers
from dsgd_cli.api import Comm, WorkerContext, flatten
from dsgd_cli.spec.experiments import build_plugin
from plugins.aggregators.allreduce import AllReduce

WORKERS = 3
STEPS = 3
LR = 0.1
SHAPES = [(2, 3), (2,)]  # nn.Linear(3, 2): weight, bias


class _Metrics:
    def log(self, name, value):
        pass


def _gradients(rank: int, step: int) -> list[torch.Tensor]:
    """A different, known gradient of every parameter per rank and step (no ties in |g|)."""
    generator = torch.Generator().manual_seed(1000 * rank + step)
    return [torch.randn(shape, generator=generator) for shape in SHAPES]


def _run(rank: int, n: int, aggregator_options: dict, compressor: dict) -> list[dict]:
    torch.manual_seed(0)  # the same initial model everywhere, as the runtime makes it
    model = nn.Linear(3, 2)
    ctx = WorkerContext(rank=rank, world_size=n, device=torch.device("cpu"), model=model,
                        optimizer=torch.optim.SGD(model.parameters(), lr=LR),
                        comm=Comm(rank, n), metrics=_Metrics(), seed=0,
                        compressor=build_plugin("compressor", compressor))
    aggregator = AllReduce(AllReduce.Options(**aggregator_options))
    ctx.compressor.setup(ctx)
    aggregator.setup(ctx)
    params = list(model.parameters())
    records = [{"model": flatten([p.detach() for p in params]).clone()}]
    for step in range(STEPS):
        ctx.optimizer.zero_grad(set_to_none=True)
        aggregator.before_forward(step)
        # d/dp Σ p·g = g: backward yields exactly the chosen gradients, through the real
        # accumulation hooks of the overlapped path.
        loss = sum((p * g).sum() for p, g in zip(params, _gradients(rank, step)))
        loss.backward()
        aggregator.after_backward(step)
        grads = [p.grad.detach().clone() for p in params]
        ctx.optimizer.step()
        aggregator.after_step(step)
        memory = aggregator.memory
        residuals = None
        if memory is not None:  # one flat residual per bucket; the parameters make one bucket
            [flat] = memory.residuals.values()
            residuals = [part.view_as(p).clone()
                         for part, p in zip(flat.split([p.numel() for p in params]), params)]
        records.append({"grads": grads, "residuals": residuals,
                        "model": flatten([p.detach() for p in params]).clone()})
    aggregator.finish()
    return records


SCENARIOS = {
    # bucket_mb tiny: one bucket per parameter, launched from the backward hooks
    "overlap": ({"bucket_mb": 1e-6}, {"name": "none"}),
    "no-overlap": ({"overlap": False}, {"name": "none"}),
    "topk": ({"error_feedback": True}, {"name": "topk", "ratio": 0.5}),
    "ef_sign": ({}, {"name": "ef_sign"}),  # error feedback because the compressor requires it
}


def _all_scenarios(rank, n):
    torch.set_num_threads(1)
    return {name: _run(rank, n, *options) for name, options in SCENARIOS.items()}


@pytest.fixture(scope="module")
def spawned() -> list[dict]:
    return run_workers(_all_scenarios, WORKERS, timeout=240, preloaded=True)


def _topk(v: torch.Tensor, ratio: float) -> torch.Tensor:
    """v with all but its ⌈ratio·d⌉ entries of largest magnitude set to zero."""
    flat = v.reshape(-1)
    keep = flat.abs().argsort(descending=True)[:math.ceil(ratio * flat.numel())]
    out = torch.zeros_like(flat)
    out[keep] = flat[keep]
    return out.view_as(v)


def _ef_sign(v: torch.Tensor) -> torch.Tensor:
    return v.abs().mean() * torch.where(v >= 0, 1.0, -1.0)


TRANSMIT = {"topk": lambda v: _topk(v, 0.5), "ef_sign": _ef_sign}


@pytest.mark.parametrize("name", ["overlap", "no-overlap"])
def test_allreduce_applies_the_mean_of_the_workers_gradients(spawned, name):
    runs = [r[name] for r in spawned]
    model = runs[0][0]["model"]
    for step in range(STEPS):
        mean = [sum(g) / WORKERS for g in zip(*(_gradients(r, step) for r in range(WORKERS)))]
        for run in runs:
            for got, expected in zip(run[step + 1]["grads"], mean):
                torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
        model = model - LR * flatten(mean)
        for run in runs:
            torch.testing.assert_close(run[step + 1]["model"], model, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", ["topk", "ef_sign"])
def test_error_feedback_keeps_what_this_worker_did_not_transmit(spawned, name):
    """Each step: c_i = g_i + e_i, worker i transmits t_i = C(c_i), keeps e_i <- c_i - t_i,
    and every worker applies (1/n) Σ_i t_i. Over the steps, Σ t_i + e_i = Σ g_i."""
    runs = [r[name] for r in spawned]
    transmit = TRANSMIT[name]
    residuals = [[torch.zeros(shape) for shape in SHAPES] for _ in range(WORKERS)]
    sent_total = [[torch.zeros(shape) for shape in SHAPES] for _ in range(WORKERS)]
    model = runs[0][0]["model"]
    for step in range(STEPS):
        transmitted = []
        for rank in range(WORKERS):
            compensated = [g + e for g, e in zip(_gradients(rank, step), residuals[rank])]
            sent = [transmit(c) for c in compensated]
            assert any(not torch.equal(s, c) for s, c in zip(sent, compensated))  # lossy
            residuals[rank] = [c - s for c, s in zip(compensated, sent)]
            sent_total[rank] = [total + s for total, s in zip(sent_total[rank], sent)]
            transmitted.append(sent)
        mean = [sum(t) / WORKERS for t in zip(*transmitted)]
        model = model - LR * flatten(mean)
        for rank, run in enumerate(runs):
            record = run[step + 1]
            for got, expected in zip(record["residuals"], residuals[rank]):
                torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
            for got, expected in zip(record["grads"], mean):
                torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(record["model"], model, rtol=1e-5, atol=1e-6)
    # nothing lost, only delayed: Σ transmitted + residual = Σ gradients
    for rank, run in enumerate(runs):
        gradients = [sum(g) for g in zip(*(_gradients(rank, s) for s in range(STEPS)))]
        for total, kept, g in zip(sent_total[rank], run[-1]["residuals"], gradients):
            torch.testing.assert_close(total + kept, g, rtol=1e-5, atol=1e-5)


def _alone(rank, n):
    """One worker, uncompressed: counts the collectives its steps issue."""
    torch.set_num_threads(1)
    calls = []
    for name in ("all_reduce", "reduce_scatter", "all_gather", "broadcast"):
        original = getattr(Comm, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            calls.append(_name)
            return _original(self, *args, **kwargs)
        setattr(Comm, name, counted)
    return {name: _run(rank, n, *SCENARIOS[name]) for name in ("overlap", "no-overlap")}, calls


def test_a_world_of_one_applies_its_own_gradient_and_exchanges_nothing():
    """With one worker the gradient is the average: the step applies it as it is (bit for
    bit: the same tensors an SGD step without dsgd would apply) and no collective is issued."""
    ((runs, calls),) = run_workers(_alone, 1, timeout=120)
    assert calls == []
    for run in runs.values():
        model = run[0]["model"]
        for step in range(STEPS):
            gradients = _gradients(0, step)
            assert all(torch.equal(got, expected)
                       for got, expected in zip(run[step + 1]["grads"], gradients))
            model = model - LR * flatten(gradients)
            assert torch.equal(run[step + 1]["model"], model)
