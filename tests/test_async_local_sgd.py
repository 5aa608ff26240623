"""`async_local_sgd` (issue 51): asynchronous local SGD with a parameter server on rank 0, the
order of its updates fixed by the modeled clock. The workers run the plugin over gloo with a
fake compute model (each rank's own step time); the reference replays the same workers in
one process, in the order of their modeled arrivals, with HALoS's server rule (the
pseudo-gradient as the gradient of the server's optimizer)."""

from __future__ import annotations

import math

import pytest
import torch

import frontier_helpers as h
from conftest import write_spec
from distributed import run_workers
from dsgd_cli.api import RunLength
from dsgd_cli.spec.experiments import load_spec

WORKERS = 3
PERIOD = 2
STEPS = 9  # 4 rounds each, one step left local
SPEED = [1.0, 0.45, 0.7]  # relative speeds: rank 1 slowest
SERVER = {"name": "sgd", "lr": 0.8, "momentum": 0.5, "nesterov": True}


def fake_step_seconds(ctx, rank, step):
    """A fake clock: rank r's steps last 1/SPEED[r], with a small per-step wobble."""
    return (1.0 + 0.1 * ((step * 7 + rank) % 3)) / SPEED[rank]


def _sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _scenario(rank, n):
    from plugins.aggregators import parameter_servers as ps
    from plugins.aggregators.async_local_sgd import AsyncLocalSGD

    torch.set_num_threads(1)
    ps.modeled_step_seconds = fake_step_seconds
    ctx = h.context(rank, n, _sgd)
    ctx.length = RunLength(steps=STEPS)
    aggregator = AsyncLocalSGD(AsyncLocalSGD.Options(period=PERIOD, outer_optimizer=SERVER))
    aggregator.setup(ctx)
    result = h.run(aggregator, ctx, STEPS)
    aggregator.finish()
    result["final"] = h.flat(ctx.model)
    result["events"] = [(e.kind, e.who, e.round) for e in aggregator.events]
    return result


@pytest.fixture(scope="module")
def scenarios():
    return run_workers(_scenario, WORKERS, preloaded=True)


def reference_order(n: int = WORKERS) -> list[tuple[int, int]]:
    """(worker, round) sorted by modeled arrival: round k of w arrives after the sum of its
    rounds' compute (transfers cost nothing here: no network), ties by round then rank."""
    arrivals = []
    for w in range(n):
        now = 0.0
        for k in range(STEPS // PERIOD):
            now += sum(fake_step_seconds(None, w, k * PERIOD + s) for s in range(PERIOD))
            arrivals.append((now, k, w))
    return [(w, k) for _, k, w in sorted(arrivals)]


def reference(n: int = WORKERS) -> dict:
    nets = [h.model() for _ in range(n)]
    optimizers = [_sgd(net.parameters()) for net in nets]
    server = h.flat(nets[0]).clone()
    server_optimizer = torch.optim.SGD([server], lr=0.8, momentum=0.5, nesterov=True)
    start = [h.flat(net) for net in nets]
    models = {}
    for w, k in reference_order(n):
        net, optimizer = nets[w], optimizers[w]
        for s in range(PERIOD):
            optimizer.zero_grad()
            for p, g in zip(net.parameters(), h.gradients(net, w, k * PERIOD + s)):
                p.grad = g
            optimizer.step()
        server.grad = start[w] - h.flat(net)  # HALoS: the pseudo-gradient is the gradient
        server_optimizer.step()
        start[w] = server.detach().clone()
        torch.nn.utils.vector_to_parameters(start[w].clone(), net.parameters())
        models[(w, k)] = start[w]
    return {"after_round": models, "final": server.detach().clone()}


def test_events_follow_the_modeled_clock(scenarios):
    order = reference_order()
    assert order[:4] == [(0, 0), (2, 0), (0, 1), (1, 0)]  # the fast worker goes ahead
    for result in scenarios:  # every rank computed the same order
        assert [(w, k) for _, w, k in result["events"]] == order


def test_async_local_sgd_equals_the_servers_rule(scenarios):
    want = reference()
    for rank, result in enumerate(scenarios):
        for k in range(STEPS // PERIOD):
            got = result["models"][(k + 1) * PERIOD - 1]  # the model right after round k
            assert torch.allclose(got, want["after_round"][(rank, k)], atol=1e-6, rtol=0), (rank, k)
        assert torch.allclose(result["final"], want["final"], atol=1e-6, rtol=0)


def test_workers_send_one_model_per_round_to_the_server(scenarios):
    numel = h.flat(h.model()).numel()
    for rank, result in enumerate(scenarios):
        rounds = [step for step, sent in enumerate(result["traffic"]) if sent]
        if rank == 0:  # in-process; rank 0's server answers the others in the background
            continue
        assert rounds == [PERIOD * (k + 1) - 1 for k in range(STEPS // PERIOD)]
        assert {result["traffic"][s] for s in rounds} == {numel * 4 if False else numel * 8}


def test_the_event_order_takes_the_runtimes_step_times():
    """The servers order their events by `ctx.modeled_step_seconds`, which is what the
    runtime pads each step to (`PaddedCompute.modeled_seconds` with the straggler factor and
    the worker's speed): one source, no copy of the draws."""
    from types import SimpleNamespace

    from dsgd_cli.emulation.compute import Compute, PaddedCompute
    from dsgd_cli.emulation.stragglers import Straggling
    from dsgd_cli.plugin_base import WorkerContext
    from dsgd_cli.spec.experiment_options import RandomStragglers, Stragglers
    from plugins.aggregators import parameter_servers as ps

    compute = Compute(step_seconds=0.02, variation={"distribution": "lognormal", "sigma": 0.3},
                      time_scale=1.0, ring_max=64)
    stragglers = Stragglers(ranks=[1], slowdown=3.0,
                            random=RandomStragglers(probability=0.5, slowdown=2.0))
    speeds = {0: 1.0, 1: 0.5, 2: 0.25}
    ctx = WorkerContext(rank=0, world_size=3, device=torch.device("cpu"), model=None,
                        optimizer=None, comm=SimpleNamespace(cluster=SimpleNamespace(
                            speed=speeds.__getitem__)), metrics=None, seed=7, compressor=None,
                        experiment=SimpleNamespace(compute=compute, stragglers=stragglers))
    for rank, step in [(0, 0), (1, 17), (2, 5), (1, 3)]:
        padded = PaddedCompute(compute, 7, rank, lambda: 0.0, speed=speeds[rank])
        expected = padded.modeled_seconds(step, Straggling(stragglers, rank, 7).factor(step))
        assert ps.modeled_step_seconds(ctx, rank, step) == expected


def test_refuses_failures_and_budgets_at_validation(tmp_path):
    from dsgd_cli.errors import SpecError

    spec = write_spec(tmp_path, """
defaults: {task: {name: logreg, samples: 256, features: 8}, workers: 2, epochs: 1}
experiments:
  - {name: a, aggregator: {name: async_local_sgd, period: 4},
     failures: {schedule: [{at_step: 3, ranks: [1], down_steps: 2}]}}
""")
    with pytest.raises(SpecError, match="async_local_sgd|failures"):
        load_spec(spec)


# -- the default server optimizer: HALoS's delayed Nesterov, per update ---------------------------

def _delayed_nesterov(grads, lr, beta, buffer_size):
    """utnslab/halos `opt.py`'s DelayedNesterovOptimizer (c = 0), on one scalar parameter:
    the positions after each update."""
    theta, m, delta, out = 0.0, 0.0, 0.0, []
    for t, g in enumerate(grads):
        delta += g
        if (t + 1) % buffer_size == 0:
            m = beta * m + delta / buffer_size
            theta -= lr * (beta * m + g / buffer_size)
            delta = 0.0
        else:
            theta -= lr * (g / buffer_size)
        out.append(theta)
    return out


def _server_positions(section, grads):
    from dsgd_cli.api import build_optimizer
    from plugins.aggregators import parameter_servers as ps

    server = ps.Server(torch.zeros(1, dtype=torch.float64), section, build_optimizer)
    out = []
    for g in grads:
        server.update(torch.tensor([g], dtype=torch.float64))
        out.append(float(server.model[0]))
    return out


def test_default_server_optimizer_is_halos_plain_step():
    """HALoS's script: delayed Nesterov with GLR 0.05, GBETA 0.9, buffer 32, passed as
    lr = GLR × 32. Its updates between momentum steps are SGD with lr GLR: the default's,
    update for update, on any pseudo-gradients, until DN's first momentum step (the 32nd)."""
    from plugins.aggregators.async_local_sgd import AsyncLocalSGD

    section = AsyncLocalSGD.Options().outer_optimizer
    assert section["name"] == "sgd" and section["lr"] == 0.05
    assert section.get("momentum", 0.0) == 0.0
    grads = [math.sin(1.7 * t) + 0.3 for t in range(40)]
    dn = _delayed_nesterov(grads, lr=0.05 * 32, beta=0.9, buffer_size=32)
    ours = _server_positions(section, grads)
    assert ours[:31] == pytest.approx(dn[:31], abs=1e-12)
    # The 32nd: DN adds its momentum step, lr · beta · mean of the 32 pseudo-gradients.
    momentum_step = 0.05 * 32 * 0.9 * sum(grads[:32]) / 32
    assert dn[31] == pytest.approx(ours[31] - momentum_step, abs=1e-12)
