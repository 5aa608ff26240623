"""`noloco` (issue 51): NoLoCo, DiLoCo's rounds where each outer step averages with one random
peer, against a reference written from the paper's update: the workers run the plugin over
gloo, the reference simulates them in one process, a plain loop over workers."""

from __future__ import annotations

import random

import pytest
import torch

import frontier_helpers as h
from conftest import write_spec
from distributed import run_workers
from dsgd_cli.spec.experiments import load_spec

WORKERS = 3  # an odd number: a lone worker in each round, too
STEPS = 11
PERIOD = 3
OPTIONS = {"period": PERIOD, "outer_lr": 0.6, "outer_momentum": 0.5, "consensus_lr": 0.3}


def _sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _scenarios(rank, n):
    from plugins.aggregators.noloco import NoLoCo

    torch.set_num_threads(1)
    results = {}
    for name, options in [("set", OPTIONS), ("default_gamma", {"period": PERIOD})]:
        ctx = h.context(rank, n, _sgd)
        aggregator = NoLoCo(NoLoCo.Options(**options))
        aggregator.setup(ctx)
        results[name] = h.run(aggregator, ctx, STEPS)
        results[name]["peers"] = ctx.metrics.values.get("noloco_peer")
    return results


@pytest.fixture(scope="module")
def scenarios():
    return run_workers(_scenarios, WORKERS, preloaded=True)


def _reference_pairs(n: int, seed: int, round_: int) -> list[list[int]]:
    """Written from the definition: a seeded permutation, consecutive ranks paired."""
    order = list(range(n))
    random.Random(f"noloco:{seed}:{round_}").shuffle(order)
    return [order[k: k + 2] for k in range(0, n, 2)]


def _reference(n: int, alpha: float, beta: float, gamma: float) -> dict:
    """Per worker a model, its SGD, outer weights φ_i and momentum m_i. After step s with
    (s + 1) % H == 0, for each pair G (NoLoCo's update, Kolehmainen et al. 2025):
    m_i ← α m_i − β mean_G(φ_k − θ_k) − γ (φ_i − mean_G φ_k); φ_i ← φ_i + m_i; θ_i ← φ_i."""
    nets = [h.model() for _ in range(n)]
    optimizers = [_sgd(net.parameters()) for net in nets]
    phi = [h.flat(net) for net in nets]
    momentum = [torch.zeros_like(p) for p in phi]
    history = {rank: [] for rank in range(n)}
    rounds = 0
    for step in range(STEPS):
        h.local_steps(nets, optimizers, step)
        if (step + 1) % PERIOD == 0:
            theta = [h.flat(net) for net in nets]
            new_phi = list(phi)
            for group in _reference_pairs(n, 0, rounds):
                mean_delta = sum(phi[k] - theta[k] for k in group) / len(group)
                mean_phi = sum(phi[k] for k in group) / len(group)
                for i in group:
                    momentum[i] = alpha * momentum[i] - beta * mean_delta - gamma * (phi[i] - mean_phi)
                    new_phi[i] = phi[i] + momentum[i]
            phi = new_phi
            for net, value in zip(nets, phi):
                torch.nn.utils.vector_to_parameters(value.clone(), net.parameters())
            rounds += 1
        for rank, net in enumerate(nets):
            history[rank].append(h.flat(net))
    return history


@pytest.mark.parametrize("name, gamma", [("set", 0.3), ("default_gamma", 0.7)])
def test_noloco_equals_the_papers_update(scenarios, name, gamma):
    alpha = OPTIONS["outer_momentum"] if name == "set" else 0.5
    beta = OPTIONS["outer_lr"] if name == "set" else 0.7
    reference = _reference(WORKERS, alpha, beta, gamma)
    for rank, result in enumerate(scenarios):
        for step, (got, want) in enumerate(zip(result[name]["models"], reference[rank])):
            assert torch.allclose(got, want, atol=1e-6, rtol=0), (name, rank, step)


def test_noloco_pairs_are_drawn_from_the_seed_and_round_and_agree(scenarios):
    from plugins.aggregators.noloco import pairs, peer_of

    rounds = STEPS // PERIOD
    for r in range(rounds):
        assert sorted(map(sorted, pairs(WORKERS, 0, r))) == sorted(map(sorted, _reference_pairs(WORKERS, 0, r)))
        for rank, result in enumerate(scenarios):
            peer = result["set"]["peers"][r]
            assert peer == (-1 if peer_of(rank, WORKERS, 0, r) is None else peer_of(rank, WORKERS, 0, r))
            if peer >= 0:  # pairing is mutual
                assert scenarios[int(peer)]["set"]["peers"][r] == rank
    assert len({tuple(map(tuple, pairs(8, 0, r))) for r in range(6)}) > 1  # it changes
    assert pairs(8, 0, 3) == pairs(8, 0, 3) and pairs(8, 0, 3) != pairs(8, 1, 3)


def test_noloco_sends_two_models_to_one_peer_per_round_and_nothing_between(scenarios):
    numel = h.flat(h.model()).numel()
    for result in scenarios:
        traffic = result["set"]["traffic"]
        for step, sent in enumerate(traffic):
            peer = None
            if (step + 1) % PERIOD == 0:
                peer = result["set"]["peers"][(step + 1) // PERIOD - 1]
            expected = 0 if peer is None or peer < 0 else (2 * numel + 1) * 8
            assert sent == expected, step


def test_noloco_options_are_declared_and_validated(tmp_path):
    spec = write_spec(tmp_path, """
defaults: {task: {name: logreg, samples: 256, features: 8}, workers: 2, epochs: 1}
experiments:
  - {name: a, aggregator: {name: noloco, period: 4}}
""")
    [experiment] = load_spec(spec)
    options = experiment.config["aggregator"]
    assert options["period"] == 4 and options["outer_momentum"] == 0.5
    assert options["consensus_lr"] is None
