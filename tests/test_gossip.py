"""The gossip aggregators (dpsgd, sgp, osgp, adpsgd), each checked against its definition.

Two kinds of test:

* the plugins driven by a hand-written training loop in worker processes on a real gloo
  group, with a different model on every worker (one start of the workers runs every
  scenario): with zero learning rate, so the mixing alone can be compared with the matrices
  of `dsgd_cli.topology`, and with a quadratic loss and lr > 0 against a trajectory computed
  here step by step. Slow workers are made slow by events (a rank waits until the others have
  finished), never by sleeping, so the assertions hold on a loaded machine;
* real `dsgd run` launches under torchrun, with 2 and 4 workers, and with a straggler (one
  `dsgd run` runs them all).
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

from conftest import compare_json, dsgd_in_process, write_spec
from distributed import run_scenarios
from dsgd_cli.api import Comm, WorkerContext, flatten
from dsgd_cli.errors import SpecError
from dsgd_cli.spec.experiments import load_spec
from dsgd_cli.results.store import Store
from dsgd_cli.topology import (CustomTopology, make_topology, mixing_matrix, push_matrix,
                               push_weights, spectral_gap)
from plugins.aggregators.gossip import ADPSGD, DPSGD, OSGP, SGP
from plugins.aggregators.gossip.adpsgd import HEADER as ADPSGD_HEADER
from plugins.aggregators.gossip.graph import bipartite_split, messages_through
from plugins.aggregators.gossip.pushsum import HEADER as PUSH_SUM_HEADER
from plugins.aggregators.gossip.pushsum import PushSum
from plugins.tasks.logreg import LogisticRegression

WORKERS = 4
STEPS = 30

# A strongly connected directed graph that is not regular: out-degrees 2, 1, 1, 2 and
# in-degrees 1, 2, 2, 1, so push-sum weights settle away from 1.
NON_REGULAR = np.zeros((4, 4), dtype=bool)
for src, dst in [(0, 1), (0, 2), (1, 2), (2, 3), (3, 0), (3, 1)]:
    NON_REGULAR[src, dst] = True


class NonRegularSGP(SGP):
    @classmethod
    def make_topology(cls, options, world_size, seed=0):
        return CustomTopology(NON_REGULAR)


# The one-way ring i -> i+1: uniform weights W = (I + S)/2 are doubly stochastic, and unlike
# the undirected 4-ring its non-unit eigenvalues (1 + i^k)/2 differ in modulus (√½, 0, √½).
DIRECTED_RING = np.roll(np.eye(4, dtype=bool), 1, axis=1)


class DirectedRingDPSGD(DPSGD):
    @classmethod
    def make_topology(cls, options, world_size, seed=0):
        return CustomTopology(DIRECTED_RING)


# -- the in-process harness -------------------------------------------------------------------

class _Metrics:
    def __init__(self):
        self.values: dict[str, list[float]] = {}
        self.steps: dict[str, list[int]] = {}  # the loop's step at which each value was logged
        self.step = 0

    def log(self, name, value):
        self.values.setdefault(name, []).append(float(value))
        self.steps.setdefault(name, []).append(self.step)


def _context(rank: int, world_size: int, lr: float = 0.0) -> WorkerContext:
    torch.manual_seed(100 + rank)  # a different model on every worker
    model = nn.Linear(5, 3, dtype=torch.float64)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    return WorkerContext(rank=rank, world_size=world_size, device=torch.device("cpu"),
                         model=model, optimizer=optimizer, comm=Comm(rank, world_size),
                         metrics=_Metrics(), seed=0, compressor=None, config={})


def _flat(model: nn.Module) -> torch.Tensor:
    return flatten([p.detach() for p in model.parameters()]).clone()


def _train(aggregator, ctx, steps: int, record=None, straggle=None) -> None:
    """The runtime's loop order, on a fixed batch. `straggle` (from `_Straggler`) holds the
    slow rank back until every other rank has finished its loop."""
    x = torch.randn(8, 5, dtype=torch.float64)
    if straggle:
        straggle.before_first_step()
    for step in range(steps):
        ctx.metrics.step = step
        ctx.optimizer.zero_grad(set_to_none=True)
        aggregator.before_forward(step)
        ctx.model(x).square().mean().backward()
        aggregator.after_backward(step)
        ctx.optimizer.step()
        aggregator.after_step(step)
        if record is not None:
            record(step)
    if straggle:
        straggle.after_last_step()
    aggregator.finish()


class _Straggler:
    """Rank `slow` takes its first step only once every other rank has taken its last one: the
    most a worker can lag, with no clock involved. The ranks meet through the rendezvous store,
    not a collective, so an algorithm that waits for the slow rank's computation hangs (the
    fixture reports a hang)."""

    def __init__(self, ctx, slow: int, name: str):
        self.counter = ctx.comm.counter(name)
        self.slow, self.rank, self.others = slow, ctx.rank, ctx.world_size - 1

    def before_first_step(self):
        if self.rank == self.slow:
            while self.counter.value() < self.others:
                time.sleep(0.005)  # polling, from Python: the plugin's threads keep running

    def after_last_step(self):
        if self.rank != self.slow:
            self.counter.add(1)


def _centre(rank: int, d: int) -> torch.Tensor:
    """The minimum of worker `rank`'s quadratic loss."""
    return torch.linspace(-1.0, 1.0, d, dtype=torch.float64) * (rank + 1)


def _params(ctx) -> torch.Tensor:
    return torch.cat([p.reshape(-1) for p in ctx.model.parameters()])


def _forward_backward(ctx) -> None:
    """f_i(x) = ½‖x - c_i‖²: the gradient is x - c_i at the model forward sees."""
    x = _params(ctx)
    (0.5 * (x - _centre(ctx.rank, x.numel())).square().sum()).backward()


def _quadratic_step(aggregator, ctx, step: int) -> None:
    ctx.optimizer.zero_grad(set_to_none=True)
    aggregator.before_forward(step)
    _forward_backward(ctx)
    aggregator.after_backward(step)
    ctx.optimizer.step()
    aggregator.after_step(step)


LR = 0.1
LR_STEPS = 3


def _trajectory(aggregator, rank, n):
    """The model before and after each of LR_STEPS steps on the quadratic, with lr > 0."""
    ctx = _context(rank, n, lr=LR)
    aggregator.setup(ctx)
    models = [_flat(ctx.model)]
    for step in range(LR_STEPS):
        _quadratic_step(aggregator, ctx, step)
        models.append(_flat(ctx.model))
    aggregator.finish()
    return {"models": torch.stack(models)}


def _scenario_dpsgd_lr(rank, n):
    return _trajectory(DPSGD(DPSGD.Options(topology="ring", mixing="uniform")), rank, n)


def _scenario_sgp_lr(rank, n):
    return _trajectory(NonRegularSGP(NonRegularSGP.Options()), rank, n)


def _scenario_adpsgd_lr(rank, n):
    """Asynchronous, so the test fixes the order of events with barriers: in each step the
    passive workers take their snapshot and gradient, then active 0 does its whole step, then
    active 2, then the passive workers apply their gradient (so both averages land between a
    passive worker's snapshot and its update)."""
    ctx = _context(rank, n, lr=LR)
    aggregator = ADPSGD(ADPSGD.Options(topology="ring"))
    aggregator.setup(ctx)
    models, peers = [_flat(ctx.model)], []
    for step in range(LR_STEPS):
        if not aggregator.active:
            ctx.optimizer.zero_grad(set_to_none=True)
            aggregator.before_forward(step)
            _forward_backward(ctx)
        for active in (None, 0, 2):
            if rank == active:
                _quadratic_step(aggregator, ctx, step)
                peers.append(aggregator.peer)
            dist.barrier()
        if not aggregator.active:
            aggregator.after_backward(step)
            ctx.optimizer.step()
            aggregator.after_step(step)
        dist.barrier()
        models.append(_flat(ctx.model))
    aggregator.finish()
    return {"models": torch.stack(models), "peers": peers}


def _scenario_consensus(rank, n, aggregator):
    ctx = _context(rank, n)
    aggregator.setup(ctx)
    models = [_flat(ctx.model)]
    _train(aggregator, ctx, 4, record=lambda step: models.append(_flat(ctx.model)))
    return {"models": torch.stack(models)}


def _scenario_sgp(rank, n):
    ctx = _context(rank, n)
    aggregator = NonRegularSGP(NonRegularSGP.Options())
    aggregator.setup(ctx)
    initial = _flat(ctx.model)
    numerators, weights, models = [], [], []

    def record(step):
        numerators.append(aggregator.state.numerator.clone())
        weights.append(aggregator.state.weight)
        models.append(_flat(ctx.model))

    _train(aggregator, ctx, STEPS, record=record)
    return {"initial": initial, "numerators": torch.stack(numerators),
            "weights": torch.tensor(weights, dtype=torch.float64), "models": torch.stack(models)}


def _scenario_dpsgd(rank, n):
    ctx = _context(rank, n)
    aggregator = DPSGD(DPSGD.Options(topology="ring", mixing="metropolis"))
    aggregator.setup(ctx)
    initial = _flat(ctx.model)
    models = []
    _train(aggregator, ctx, 8, record=lambda step: models.append(_flat(ctx.model)))
    return {"initial": initial, "models": torch.stack(models)}


def _scenario_osgp(rank, n):
    ctx = _context(rank, n)
    aggregator = OSGP(OSGP.Options(tau=2))
    aggregator.setup(ctx)
    initial = _flat(ctx.model)
    # Ranks stop after different numbers of steps, and rank 1 starts when the others are done.
    _train(aggregator, ctx, STEPS + 5 * rank, straggle=_Straggler(ctx, 1, "osgp-done"))
    return {"initial": initial, "numerator": aggregator.state.numerator.clone(),
            "weight": aggregator.state.weight, "model": _flat(ctx.model),
            "metrics": ctx.metrics.values, "metric_steps": ctx.metrics.steps,
            "rounds": aggregator.gossip.next_round, "traffic": vars(ctx.comm.take_traffic())}


def _scenario_adpsgd(rank, n):
    ctx = _context(rank, n)
    aggregator = ADPSGD(ADPSGD.Options(topology="ring"))
    aggregator.setup(ctx)
    initial = _flat(ctx.model)
    peers = []
    # Ranks stop after different numbers of steps, and the passive rank 1 starts when the
    # others are done.
    _train(aggregator, ctx, STEPS + 5 * rank, straggle=_Straggler(ctx, 1, "adpsgd-done"),
           record=lambda step: peers.append(aggregator.peer if aggregator.active else None))
    return {"initial": initial, "model": _flat(ctx.model), "active": aggregator.active,
            "metrics": ctx.metrics.values, "metric_steps": ctx.metrics.steps, "peers": peers,
            "neighbours": aggregator.neighbours, "unlogged_averages": aggregator.averages,
            "traffic": vars(ctx.comm.take_traffic())}


SCENARIOS = {
    "sgp": _scenario_sgp, "dpsgd": _scenario_dpsgd, "osgp": _scenario_osgp,
    "adpsgd": _scenario_adpsgd, "dpsgd_lr": _scenario_dpsgd_lr, "sgp_lr": _scenario_sgp_lr,
    "adpsgd_lr": _scenario_adpsgd_lr,
    "directed_ring": lambda rank, n: _scenario_consensus(
        rank, n, DirectedRingDPSGD(DirectedRingDPSGD.Options(mixing="uniform"))),
    "time_varying": lambda rank, n: _scenario_consensus(
        rank, n, DPSGD(DPSGD.Options(topology="time_varying_exponential", mixing="uniform"))),
}


@pytest.fixture(scope="module")
def spawned(tmp_path_factory) -> list[dict]:
    """Every scenario on WORKERS processes; one result dict per rank."""
    return run_scenarios(__name__, WORKERS, tmp_path_factory.mktemp("spawned"), timeout=180)


# -- push-sum (sgp) on a non-regular directed graph ---------------------------------------------

def test_sgp_preserves_the_numerator_average_and_debiases_to_it(spawned):
    runs = [r["sgp"] for r in spawned]
    initial = torch.stack([r["initial"] for r in runs])          # workers x d
    numerators = torch.stack([r["numerators"] for r in runs], 1)  # steps x workers x d
    weights = torch.stack([r["weights"] for r in runs], 1)        # steps x workers
    models = torch.stack([r["models"] for r in runs], 1)
    target = initial.mean(0)
    assert (initial - target).abs().max() > 0.1  # the workers really start apart

    for step in range(STEPS):
        # The average of the numerators never changes, and the weights sum to n ...
        torch.testing.assert_close(numerators[step].mean(0), target, rtol=0, atol=1e-14)
        assert abs(float(weights[step].sum()) - WORKERS) < 1e-12
        # ... every worker computes with its de-biased model z_i = x_i / w_i ...
        torch.testing.assert_close(models[step], numerators[step] / weights[step][:, None],
                                   rtol=1e-14, atol=1e-14)
    # ... one round is exactly x <- P x with the column-stochastic push matrix of the graph,
    topology = CustomTopology(NON_REGULAR)
    previous_x, previous_w = initial, torch.ones(WORKERS, dtype=torch.float64)
    for step in range(STEPS):
        p = torch.from_numpy(push_matrix(topology, step))
        torch.testing.assert_close(numerators[step], p @ previous_x, rtol=1e-13, atol=1e-14)
        torch.testing.assert_close(weights[step], p @ previous_w, rtol=1e-13, atol=1e-14)
        previous_x, previous_w = numerators[step], weights[step]
    # ... the weights are not all 1 (the graph is not regular, de-biasing matters) ...
    assert (weights[-1] - 1).abs().max() > 0.1
    # ... and every z_i converges to the average of the numerators.
    errors = [float((models[step] - target).norm()) for step in range(STEPS)]
    assert errors[-1] < 1e-6 * errors[0]
    assert errors[-1] < errors[STEPS // 2] < errors[0]


def _push_sum_rounds(dtype: torch.dtype, rounds: int) -> tuple[list[PushSum], torch.Tensor]:
    """Synchronous push-sum rounds on NON_REGULAR in one process, with the messages `sgp` sends
    (`PushSum.emit` and `absorb`), from the same float64 start cast to `dtype`. Returns the
    final states and every round's weights (rounds x workers)."""
    topology = CustomTopology(NON_REGULAR)
    start = torch.randn(WORKERS, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    states = [PushSum(start[rank].to(dtype)) for rank in range(WORKERS)]
    weights = []
    for step in range(rounds):
        inboxes = [[] for _ in range(WORKERS)]
        for rank, state in enumerate(states):
            shares = push_weights(topology, rank, step)
            for peer, message in state.emit(shares, rank, step, step).items():
                inboxes[peer].append(message)
        for state, inbox in zip(states, inboxes):
            for message in inbox:
                state.absorb(message)
        weights.append([state.weight for state in states])
    return states, torch.tensor(weights, dtype=torch.float64)


def test_push_sum_weights_of_float32_models_are_those_of_float64_models():
    """A float32 message carries the push-sum weight as a high and a low float32 part, so on a
    non-regular graph, where the weights are not round numbers, they stay float64-exact: the
    same as with a float64 model, and summing to n."""
    rounds = 60
    float32_states, float32_weights = _push_sum_rounds(torch.float32, rounds)
    float64_states, float64_weights = _push_sum_rounds(torch.float64, rounds)
    assert (float64_weights[-1] - 1).abs().max() > 0.1  # not regular: w_i settle away from 1
    torch.testing.assert_close(float32_weights, float64_weights, rtol=0, atol=1e-14)
    torch.testing.assert_close(float32_weights.sum(1), torch.full((rounds,), float(WORKERS),
                                                                  dtype=torch.float64),
                               rtol=0, atol=1e-13)
    # The de-biased float32 models reach the float64 models' consensus to float32 precision.
    average = torch.stack([state.debiased() for state in float64_states]).mean(0)
    for state in float32_states:
        assert state.numerator.dtype == torch.float32
        torch.testing.assert_close(state.debiased().double(), average, rtol=0, atol=1e-6)


# -- dpsgd: geometric consensus at the rate of the mixing matrix --------------------------------

def test_dpsgd_consensus_shrinks_at_the_rate_of_the_mixing_matrix(spawned):
    runs = [r["dpsgd"] for r in spawned]
    x = torch.stack([r["initial"] for r in runs])
    models = torch.stack([r["models"] for r in runs], 1)  # steps x workers x d
    w_np = mixing_matrix(make_topology("ring", WORKERS, directed=False), 0, "metropolis")
    w = torch.from_numpy(w_np)
    rate = 1 - spectral_gap(w_np)  # the second-largest eigenvalue modulus
    assert 0 < rate < 1

    def distance(m):
        return float((m - m.mean(0)).norm())

    previous = x
    for step in range(models.shape[0]):
        # x <- W x exactly (zero learning rate) ...
        torch.testing.assert_close(models[step], w @ previous, rtol=1e-13, atol=1e-14)
        # ... so the consensus distance shrinks by the predicted factor at every step.
        assert distance(models[step]) == pytest.approx(rate * distance(previous), rel=1e-9)
        previous = models[step]
    torch.testing.assert_close(models[-1].mean(0), x.mean(0), rtol=0, atol=1e-14)


@pytest.mark.parametrize("name, topology", [
    ("directed_ring", CustomTopology(DIRECTED_RING)),
    ("time_varying", make_topology("time_varying_exponential", WORKERS)),
], ids=["directed_ring", "time_varying"])
def test_dpsgd_consensus_follows_the_product_of_the_mixing_matrices(spawned, name, topology):
    """Uniform weights where the contraction is not one factor per step: on the one-way ring
    the deviation's components shrink by √½ or vanish at once; on the time-varying exponential
    graph W_1 W_0 = J/n, exact consensus after two steps."""
    runs = [r[name] for r in spawned]
    models = torch.stack([r["models"] for r in runs], 1)  # steps x workers x d
    x = models[0]

    def distance(m):
        return float((m - m.mean(0)).norm())

    product = torch.eye(WORKERS, dtype=torch.float64)
    for step in range(models.shape[0] - 1):
        product = torch.from_numpy(mixing_matrix(topology, step, "uniform")) @ product
        expected = product @ x
        torch.testing.assert_close(models[step + 1], expected, rtol=1e-13, atol=1e-14)
        assert distance(models[step + 1]) == pytest.approx(distance(expected), rel=1e-9,
                                                           abs=1e-13)
    distances = [distance(m) for m in models]
    if name == "time_varying":
        assert distances[1] > 0.1 * distances[0] and distances[2] < 1e-13 * distances[0]
    else:  # the first step removes the components of eigenvalue 0, then √½ per step
        assert distances[1] / distances[0] < 0.99 * 2 ** -0.5
        assert distances[3] / distances[2] == pytest.approx(2 ** -0.5, rel=1e-9)


# -- osgp: asynchronous push-sum, drained at shutdown -------------------------------------------

def test_osgp_conserves_mass_and_reaches_consensus_after_shutdown(spawned):
    runs = [r["osgp"] for r in spawned]
    initial = torch.stack([r["initial"] for r in runs])
    numerators = torch.stack([r["numerator"] for r in runs])
    weights = torch.tensor([r["weight"] for r in runs], dtype=torch.float64)
    models = torch.stack([r["model"] for r in runs])
    target = initial.mean(0)
    # After finish() nothing is in flight: the numerators still sum to the initial sum,
    torch.testing.assert_close(numerators.mean(0), target, rtol=0, atol=1e-13)
    assert abs(float(weights.sum()) - WORKERS) < 1e-12
    # every reported model is de-biased, and all of them agree with the average.
    torch.testing.assert_close(models, numerators / weights[:, None], rtol=1e-14, atol=1e-14)
    assert float((models - target).abs().max()) < 1e-6 * float((initial - target).abs().max())
    # The slow worker (rank 1) started when its peers had finished: it is behind the peers
    # whose messages it receives (they could finish without it, or the fixture reports a hang).
    slow_lag = runs[1]["metrics"]["peer_step_lag"]
    assert min(slow_lag) < -5
    # No worker ever ran ahead of the bound: the model of step s went through a complete round
    # by step s + tau (tau = 2 here), waiting when it had to.
    for run in runs:
        assert max(run["metrics"]["gossip_staleness"]) <= 2
        assert sum(run["metrics"]["gossip_rounds"]) >= 1


# -- adpsgd: atomic pairwise averages, shut down with ranks ending at different steps ------------

def test_adpsgd_pairwise_averages_keep_the_sum_and_mix(spawned):
    runs = [r["adpsgd"] for r in spawned]
    assert [r["active"] for r in runs] == [True, False, True, False]  # ring: even ranks start
    initial = torch.stack([r["initial"] for r in runs])
    models = torch.stack([r["model"] for r in runs])
    # x_i, x_j <- (x_i + x_j) / 2 for a pair at once keeps the sum (zero learning rate) ...
    torch.testing.assert_close(models.mean(0), initial.mean(0), rtol=0, atol=1e-13)

    def distance(m):
        return float((m - m.mean(0)).norm())

    # ... and the many averages drive the models together.
    assert distance(models) < 1e-3 * distance(initial)
    averages = sum(sum(run["metrics"]["gossip_averages"]) for run in runs if run["active"])
    assert averages == STEPS + (STEPS + 10)  # every step of an active worker averages once
    # The active workers did not wait for the passive rank 1 to compute: it took its first step
    # after their last one, so each time they averaged with it, it had taken none.
    with_rank_1 = 0
    for rank in (0, 2):
        lags = runs[rank]["metrics"]["peer_step_lag"]  # one per step: one average per step
        assert runs[rank]["metric_steps"]["peer_step_lag"] == list(range(STEPS + 5 * rank))
        for step, peer in enumerate(runs[rank]["peers"]):
            if peer == 1:
                assert lags[step] == step
                with_rank_1 += 1
    assert with_rank_1 > 5


# -- bytes: the messages each algorithm sends --------------------------------------------------

MODEL_NUMBERS = 5 * 3 + 3  # nn.Linear(5, 3)
FLOAT64 = 8


def test_osgp_sends_one_share_per_out_peer_and_round_and_a_small_end_message(spawned):
    runs = [r["osgp"] for r in spawned]
    rounds = runs[0]["rounds"]
    assert [r["rounds"] for r in runs] == [rounds] * WORKERS  # every worker ran rounds 0..M
    assert rounds >= sum(runs[0]["metrics"]["gossip_rounds"]) > 0
    topology = make_topology("time_varying_exponential", WORKERS)
    share = (PUSH_SUM_HEADER + MODEL_NUMBERS) * FLOAT64
    end = PUSH_SUM_HEADER * FLOAT64
    agree_on_last_round = 2 * (WORKERS - 1) * FLOAT64 // WORKERS  # ring all-reduce of 1 number
    for rank, run in enumerate(runs):
        sent = sum(len(topology.out_peers(rank, r)) for r in range(rounds))
        received = sum(len(topology.in_peers(rank, r)) for r in range(rounds))
        # The end message goes to rank + 1, into a buffer the size of a share.
        assert run["traffic"]["bytes_sent"] == sent * share + end + agree_on_last_round
        assert run["traffic"]["bytes_received"] == received * share + end + agree_on_last_round


def test_adpsgd_sends_a_model_per_request_and_reply_and_small_stop_messages(spawned):
    runs = [r["adpsgd"] for r in spawned]
    model = (ADPSGD_HEADER + MODEL_NUMBERS) * FLOAT64
    stop = ADPSGD_HEADER * FLOAT64
    requests = 0
    for rank in (0, 2):  # active: one request per step, then a stop to each neighbour
        run = runs[rank]
        steps = STEPS + 5 * rank
        assert sum(run["metrics"]["gossip_averages"]) == steps
        assert run["traffic"]["bytes_sent"] == steps * model + len(run["neighbours"]) * stop
        assert run["traffic"]["bytes_received"] == steps * model  # the replies
        requests += steps
    replies = 0
    for rank in (1, 3):  # passive: one reply per request served, including after its last step
        run = runs[rank]
        served = sum(run["metrics"]["gossip_averages"]) + run["unlogged_averages"]
        assert run["traffic"]["bytes_sent"] == served * model
        # the requests, and a stop from each neighbour into a request-sized buffer
        assert run["traffic"]["bytes_received"] == served * model + len(run["neighbours"]) * stop
        replies += served
    assert replies == requests


# -- lr > 0: one gradient step and one mixing per step, in the algorithm's order --------------

def _initial_and_centres(runs) -> tuple[torch.Tensor, torch.Tensor]:
    initial = torch.stack([r["models"][0] for r in runs])
    return initial, torch.stack([_centre(rank, initial.shape[1]) for rank in range(WORKERS)])


def test_dpsgd_with_lr_mixes_the_step_start_models_and_subtracts_the_gradient_there(spawned):
    """x_i <- Σ_j W_ij x_j - η ∇f_i(x_i) (Lian et al., 2017, Algorithm 1): the gradient is
    taken at the model of the start of the step, the one the neighbours receive."""
    runs = [r["dpsgd_lr"] for r in spawned]
    x, centres = _initial_and_centres(runs)
    w = torch.from_numpy(mixing_matrix(make_topology("ring", WORKERS, directed=False), 0,
                                       "uniform"))
    for step in range(LR_STEPS):
        x = w @ x - LR * (x - centres)
        torch.testing.assert_close(torch.stack([r["models"][step + 1] for r in runs]), x,
                                   rtol=1e-13, atol=1e-14)


def test_sgp_with_lr_steps_the_numerator_with_the_gradient_at_the_debiased_model(spawned):
    """Assran et al., 2019, Algorithm 1: z_i = x_i / w_i; x_i <- x_i - η ∇f_i(z_i); then the
    push-sum round (x, w) <- (P x, P w). After the first round the weights are not all 1 on
    this graph, so steps 2 and 3 tell z from x, and an update on x from one on z."""
    runs = [r["sgp_lr"] for r in spawned]
    x, centres = _initial_and_centres(runs)
    w = torch.ones(WORKERS, dtype=torch.float64)
    topology = CustomTopology(NON_REGULAR)
    for step in range(LR_STEPS):
        z = x / w[:, None]
        x = x - LR * (z - centres)
        p = torch.from_numpy(push_matrix(topology, step))
        x, w = p @ x, p @ w
        torch.testing.assert_close(torch.stack([r["models"][step + 1] for r in runs]),
                                   x / w[:, None], rtol=1e-13, atol=1e-14)
    assert (w - 1).abs().max() > 0.1


def test_adpsgd_with_lr_averages_pairs_and_applies_the_gradient_of_the_model_before(spawned):
    """Lian et al., 2018: active i averages with passive j, x_i, x_j <- (x_i + x_j)/2, and
    applies the gradient of the model it read before, x_i -= η ∇f_i(x̂_i); a passive worker's
    gradient, taken at its snapshot, is added to its model after the averages made meanwhile.
    Pairings as the plugin drew them (seeded); the order of events as the scenario fixed it."""
    runs = [r["adpsgd_lr"] for r in spawned]
    x, centres = _initial_and_centres(runs)
    peers = {rank: spawned[rank]["adpsgd_lr"]["peers"] for rank in (0, 2)}
    for step in range(LR_STEPS):
        passive_gradients = {j: x[j] - centres[j] for j in (1, 3)}
        for i in (0, 2):
            j = peers[i][step]
            average = (x[i] + x[j]) / 2
            x[i], x[j] = average - LR * (x[i] - centres[i]), average
        for j, gradient in passive_gradients.items():
            x[j] = x[j] - LR * gradient
        torch.testing.assert_close(torch.stack([r["models"][step + 1] for r in runs]), x,
                                   rtol=1e-13, atol=1e-14)
    assert len({peer for rank in (0, 2) for peer in peers[rank]}) == 2  # both pairings happen


# -- topology checks reach the spec loader --------------------------------------------------------

@pytest.mark.parametrize("aggregator, workers, message", [
    ("{name: dpsgd, topology: hypercube}", 6,
     "topology 'hypercube' cannot connect 6 workers: hypercube topology needs world_size to be a power of 2, got 6"),
    ("{name: sgp, topology: ring, peers_per_step: 2}", 4,
     "peers_per_step applies to topologies 'time_varying_exponential', "
     "'dynamic_directed_exponential'"),
    ("{name: sgp, topology: dynamic_bipartite_exponential}", 5,
     "dynamic_bipartite_exponential needs an even number of workers"),
    ("{name: dpsgd, topology: npeer_dynamic_directed_exponential, peers_per_step: 4}", 4,
     "takes peers_per_step at most 3, got 4"),
    ("{name: osgp, topology: dynamic_directed_linear, peers_per_step: 5}", 4,
     "peers_per_step must be at most 4, got 5"),
    ("{name: dpsgd, topology: time_varying_exponential, mixing: metropolis}", 4,
     "metropolis weights need an undirected graph"),
    ("{name: adpsgd, topology: hypercube}", 6, "cannot connect 6 workers"),
    ("{name: osgp, topology: random_regular}", 5, "world_size * degree to be even"),
    ("{name: sgp, topology: rign}", 4, "expected one of ring, torus, complete"),
])
def test_impossible_topologies_are_spec_errors(tmp_path, aggregator, workers, message):
    spec = write_spec(tmp_path, f"""
        experiments:
          - name: bad
            task: {{name: logreg}}
            workers: {workers}
            aggregator: {aggregator}
    """)
    with pytest.raises(SpecError) as error:
        load_spec(spec)
    assert message in str(error.value)
    assert "experiments[0].aggregator" in str(error.value)


@pytest.mark.parametrize("aggregator", ["sgp", "osgp", "dpsgd"])
def test_the_sgp_reference_graphs_are_accepted_by_the_gossip_plugins(tmp_path, aggregator):
    graphs = ["dynamic_directed_exponential", "npeer_dynamic_directed_exponential",
              "dynamic_bipartite_exponential", "dynamic_directed_linear", "dynamic_bipartite_linear"]
    experiments = "".join(f"""
          - name: {graph}-{peers}
            task: {{name: logreg}}
            workers: 4
            aggregator: {{name: {aggregator}, topology: {graph}, peers_per_step: {peers}}}"""
                          for graph in graphs for peers in (1, 2))
    loaded = load_spec(write_spec(tmp_path, "experiments:" + experiments))
    assert len(loaded) == 2 * len(graphs)


def test_spec_error_exits_2_before_launching(tmp_path):
    spec = write_spec(tmp_path, """
        experiments:
          - name: bad
            task: {name: logreg}
            workers: 6
            aggregator: {name: osgp, topology: hypercube}
    """)
    result = dsgd_in_process("run", str(spec), "--db", str(tmp_path / "r.db"))
    assert result.returncode == 2
    assert "hypercube topology needs world_size to be a power of 2, got 6" in result.stderr
    assert not (tmp_path / "r.db").exists()


def test_active_passive_split():
    # Bipartite graphs use their two colour classes; others the edges between even and odd ranks.
    active, neighbours = bipartite_split(make_topology("hypercube", 8))
    assert active == [bin(r).count("1") % 2 == 0 for r in range(8)]
    assert all(len(peers) == 3 for peers in neighbours)
    active, neighbours = bipartite_split(make_topology("complete", 5))
    assert active == [True, False, True, False, True]
    assert neighbours[1] == [0, 2, 4] and neighbours[0] == [1, 3]
    assert all(active[i] != active[j] for i in range(5) for j in neighbours[i])


def test_messages_through_counts_rounds_of_a_period():
    assert messages_through([1, 2, 0], -1) == 0
    assert messages_through([1, 2, 0], 0) == 1
    assert messages_through([1, 2, 0], 4) == 1 + 2 + 0 + 1 + 2


# -- real runs under torchrun -------------------------------------------------------------------

@pytest.fixture(scope="module")
def gossip_runs(tmp_path_factory):
    """One `dsgd run` of every real run below, models saved. Consecutive experiments with the
    same worker count share a torchrun, so the 2-worker runs come first, then the 4-worker
    ones: two launches.

    * each gossip plugin on logreg with 2 workers, dpsgd and sgp also with 4;
    * osgp and adpsgd on 4 workers, rank 0 computing 60 times slower, 2 epochs of 64 steps.
    """
    tmp = tmp_path_factory.mktemp("gossip")
    spec = write_spec(tmp, f"""
        defaults:
          task: {{name: logreg}}
          epochs: 6
          batch_size: 32
          log_interval: 4
          optimizer: {{name: sgd, lr: 0.5}}
          save_dir: {tmp / "models"}
        experiments:
          - name: dpsgd[workers=2]
            workers: 2
            aggregator: {{name: dpsgd}}
          - name: sgp[workers=2]
            workers: 2
            aggregator: {{name: sgp}}
          - name: osgp[workers=2]
            workers: 2
            aggregator: {{name: osgp, tau: 2}}
          - name: adpsgd[workers=2]
            workers: 2
            aggregator: {{name: adpsgd}}
          - name: dpsgd[workers=4]
            workers: 4
            aggregator: {{name: dpsgd}}
          - name: sgp[workers=4]
            workers: 4
            aggregator: {{name: sgp}}
          - name: straggler-osgp
            workers: 4
            task: {{name: logreg, samples: 16384}}
            epochs: 2
            steps_per_epoch: 64
            stragglers: {{ranks: [0], slowdown: 60}}
            aggregator: {{name: osgp}}
          - name: straggler-adpsgd
            workers: 4
            task: {{name: logreg, samples: 16384}}
            epochs: 2
            steps_per_epoch: 64
            stragglers: {{ranks: [0], slowdown: 60}}
            aggregator: {{name: adpsgd}}
    """)
    db = tmp / "results.db"
    result = dsgd_in_process("run", str(spec), "--db", str(db))
    assert result.returncode == 0, result.stdout + result.stderr
    rows = {r["experiment"]: r for r in compare_json(db)}
    return db, tmp / "models", rows


@pytest.mark.parametrize("plugin, workers", [("dpsgd", 2), ("dpsgd", 4), ("sgp", 2), ("sgp", 4),
                                             ("osgp", 2), ("adpsgd", 2)])
def test_torchrun_runs_converge(gossip_runs, plugin, workers):
    db, models, rows = gossip_runs
    name = f"{plugin}[workers={workers}]"
    row = rows[name]
    assert row["status"] == "completed"
    assert row["test_accuracy"] > 0.75 and row["total_bytes_sent"] > 0
    optimum = LogisticRegression().optimum().float()
    finals = [torch.load(models / name / f"rank{r}.pt")["weight"][0] for r in range(workers)]
    for final in finals:
        assert (final - optimum).norm() < 0.25 * optimum.norm()
    # Models differ between workers, so the runtime reports consensus and the mean over workers.
    store = Store(str(db))
    run = [r for r in store.runs() if r.experiment == name][0]
    names = {s.name for s in run.summaries}
    assert {"consensus_distance", "test_accuracy_workers"} <= names
    distances = [m.value for m in store.metric_history(run.id, "consensus_distance")]
    # once per epoch, or once at the end for the asynchronous ones (they never meet before)
    assert len(distances) == (1 if plugin in ("osgp", "adpsgd") else 6)
    assert all(0 <= d < 0.3 * float(optimum.norm()) for d in distances)


def test_torchrun_bytes_match_the_graph(gossip_runs):
    _, _, rows = gossip_runs
    model_bytes = 10 * 4
    steps = 6 * (2048 // 4 // 32)
    # dpsgd on a ring of 4: each worker sends its model to its 2 neighbours every step.
    assert rows["dpsgd[workers=4]"]["total_bytes_sent"] == 4 * steps * 2 * model_bytes
    # sgp with one peer per step: one message (model share plus a 5-number header) per step.
    assert rows["sgp[workers=4]"]["total_bytes_sent"] == 4 * steps * (model_bytes + 5 * 4)


@pytest.mark.parametrize("plugin", ["osgp", "adpsgd"])
def test_fast_workers_do_not_wait_for_a_straggler(gossip_runs, plugin):
    db, models, rows = gossip_runs
    name = f"straggler-{plugin}"
    store = Store(str(db))
    run = [r for r in store.runs() if r.experiment == name][0]
    steps = 2 * 64
    lag = store.metric_history(run.id, "peer_step_lag")
    # Every message or average the slow rank 0 takes part in carries its peer's step count (a
    # synchronous algorithm keeps the lag at 0). Step counts, not clocks: in some log interval
    # of its first epoch (steps <= 64), rank 0 averaged with peers more than 64 steps ahead on
    # average, so at least one peer had passed the end of the first epoch while rank 0 had not
    # reached it: the fast ranks did not wait for it there either (evaluation is local). The
    # 60-fold slowdown leaves a wide margin: the fast ranks would have to be more than 30
    # times slower than usual relative to it.
    first_epoch = [m.value for m in lag if m.rank == 0 and m.step <= 64]
    assert first_epoch and min(first_epoch) < -64
    # Each worker evaluated its own model every epoch, and once more after the last exchange;
    # the average model only then.
    own = store.metric_history(run.id, "test_accuracy_workers")
    assert sorted(m.epoch for m in own if m.rank == 0) == [0, 1, 1]
    assert len(store.metric_history(run.id, "test_accuracy")) == 1
    # Training still converges, every worker's model and their average.
    row = rows[name]
    assert row["status"] == "completed" and row["test_accuracy"] > 0.8
    if plugin == "adpsgd":
        # The active ranks 0 and 2 each send a request per step and get a reply (13 float32:
        # header and model), then a stop (the 3-number header) to each of their 2 neighbours.
        assert row["total_bytes_sent"] == 2 * steps * 2 * (3 + 10) * 4 + 2 * 2 * 3 * 4
    else:  # the number of rounds is not logged (exact count: the in-process test); with
        # tau = 1 a round starts at least every second step: one model-sized share per round
        assert row["total_bytes_sent"] >= 4 * (steps // 2) * (5 + 10) * 4
    optimum = LogisticRegression(LogisticRegression.Options(samples=16384)).optimum().float()
    for rank in range(4):  # from about optimum.norm() away at the start
        final = torch.load(models / name / f"rank{rank}.pt")["weight"][0]
        assert (final - optimum).norm() < 0.35 * optimum.norm()
    assert {"consensus_distance", "test_accuracy_workers"} <= {s.name for s in run.summaries}
