"""The gossip aggregators (dpsgd, sgp, osgp, adpsgd), each checked against its definition.

Two kinds of test:

* the plugins driven by a hand-written training loop in worker processes on a real gloo
  group, with zero learning rate and a different model on every worker, so the mixing alone
  can be compared with the matrices of `dsgd_cli.topology` (one start of the workers runs
  every scenario);
* real `dsgd run` launches under torchrun, with 2 and 4 workers, and with a straggler (one
  `dsgd run` runs them all).
"""

from __future__ import annotations

import os
import time
import traceback

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

from conftest import compare_json, dsgd, dsgd_in_process, write_spec
from distributed import preloaded_context
from dsgd_cli.api import Comm, WorkerContext, flatten
from dsgd_cli.errors import SpecError
from dsgd_cli.spec import load_spec
from dsgd_cli.store import Store
from dsgd_cli.topology import (CustomTopology, make_topology, mixing_matrix, push_matrix,
                               spectral_gap)
from plugins.aggregators.gossip import ADPSGD, DPSGD, OSGP, SGP
from plugins.aggregators.gossip.graph import bipartite_split, messages_through
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


# -- the in-process harness -------------------------------------------------------------------

class _Metrics:
    def __init__(self):
        self.values: dict[str, list[float]] = {}

    def log(self, name, value):
        self.values.setdefault(name, []).append(float(value))


def _context(rank: int, world_size: int) -> WorkerContext:
    torch.manual_seed(100 + rank)  # a different model on every worker
    model = nn.Linear(5, 3, dtype=torch.float64)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    return WorkerContext(rank=rank, world_size=world_size, device=torch.device("cpu"),
                         model=model, optimizer=optimizer, comm=Comm(rank, world_size),
                         metrics=_Metrics(), seed=0, compressor=None, config={})


def _flat(model: nn.Module) -> torch.Tensor:
    return flatten([p.detach() for p in model.parameters()]).clone()


def _train(aggregator, ctx, steps: int, delay: float = 0.0, record=None) -> None:
    """The runtime's loop order, on a fixed batch."""
    x = torch.randn(8, 5, dtype=torch.float64)
    for step in range(steps):
        if delay:
            time.sleep(delay)
        ctx.optimizer.zero_grad(set_to_none=True)
        aggregator.before_forward(step)
        ctx.model(x).square().mean().backward()
        aggregator.after_backward(step)
        ctx.optimizer.step()
        aggregator.after_step(step)
        if record is not None:
            record(step)
    aggregator.finish()


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
    # Ranks stop after different numbers of steps, and rank 1 is slow.
    _train(aggregator, ctx, STEPS + 5 * rank, delay=0.01 if rank == 1 else 0.0)
    return {"initial": initial, "numerator": aggregator.state.numerator.clone(),
            "weight": aggregator.state.weight, "model": _flat(ctx.model),
            "metrics": ctx.metrics.values}


def _scenario_adpsgd(rank, n):
    ctx = _context(rank, n)
    aggregator = ADPSGD(ADPSGD.Options(topology="ring"))
    aggregator.setup(ctx)
    initial = _flat(ctx.model)
    # Ranks stop after different numbers of steps, and the passive rank 1 is slow.
    _train(aggregator, ctx, STEPS + 5 * rank, delay=0.01 if rank == 1 else 0.0)
    return {"initial": initial, "model": _flat(ctx.model), "active": aggregator.active,
            "metrics": ctx.metrics.values}


SCENARIOS = {"sgp": _scenario_sgp, "dpsgd": _scenario_dpsgd, "osgp": _scenario_osgp,
             "adpsgd": _scenario_adpsgd}


def _worker(rank: int, world_size: int, directory: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{directory}/store", rank=rank,
                            world_size=world_size)
    results = {}
    try:
        for name, scenario in SCENARIOS.items():
            results[name] = scenario(rank, world_size)
            dist.barrier()
    except BaseException:
        results["error"] = traceback.format_exc()
        torch.save(results, os.path.join(directory, f"rank{rank}.pt"))
        os._exit(1)
    torch.save(results, os.path.join(directory, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def spawned(tmp_path_factory) -> list[dict]:
    """Every scenario on WORKERS processes; one result dict per rank."""
    directory = tmp_path_factory.mktemp("spawned")
    context = preloaded_context()
    processes = [context.Process(target=_worker, args=(rank, WORKERS, str(directory)))
                 for rank in range(WORKERS)]
    for process in processes:
        process.start()
    deadline = time.monotonic() + 180
    for process in processes:
        process.join(timeout=max(1.0, deadline - time.monotonic()))
    hung = [rank for rank, process in enumerate(processes) if process.is_alive()]
    for process in processes:
        if process.is_alive():
            process.kill()
    assert not hung, f"ranks {hung} hung (deadlock?)"
    results = [torch.load(directory / f"rank{rank}.pt") for rank in range(WORKERS)]
    errors = [r["error"] for r in results if "error" in r]
    assert not errors, errors[0]
    return results


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
    # The slow worker (rank 1) is behind the peers whose messages it receives.
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
    # The active workers did not wait for the slow passive rank 1 to compute: when they
    # averaged with it, it was many steps behind them.
    assert max(runs[0]["metrics"]["peer_step_lag"] + runs[2]["metrics"]["peer_step_lag"]) > 5


# -- topology checks reach the spec loader --------------------------------------------------------

@pytest.mark.parametrize("aggregator, workers, message", [
    ("{name: dpsgd, topology: hypercube}", 6,
     "topology 'hypercube' cannot connect 6 workers: hypercube topology needs world_size to be a power of 2, got 6"),
    ("{name: sgp, topology: ring, peers_per_step: 2}", 4,
     "peers_per_step applies to topology 'time_varying_exponential' only"),
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
    result = dsgd("run", str(spec), "--db", str(db), timeout=600)
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
    # Every message or average the slow rank 0 takes part in carries its peer's step count:
    # its peers were far ahead, i.e. they completed many more steps than it in the same time
    # (a synchronous algorithm keeps this at 0).
    slow = [m.value for m in lag if m.rank == 0]
    assert min(slow) < -steps / 4
    # The fast ranks reached their last step while rank 0 was still in its first epoch: they
    # did not wait for it at the end of the epoch either (evaluation there is local).
    loss = store.metric_history(run.id, "train_loss")
    fast_done = max(m.seconds for m in loss if m.rank != 0 and m.step == steps)
    slow_done = max(m.seconds for m in loss if m.rank == 0 and m.step == steps)
    slow_then = max((m.step for m in loss if m.rank == 0 and m.seconds <= fast_done), default=0)
    assert slow_then < 64 and slow_done > fast_done
    # Each worker evaluated its own model every epoch, and once more after the last exchange;
    # the average model only then.
    own = store.metric_history(run.id, "test_accuracy_workers")
    assert sorted(m.epoch for m in own if m.rank == 0) == [0, 1, 1]
    assert len(store.metric_history(run.id, "test_accuracy")) == 1
    # Training still converges, every worker's model and their average.
    row = rows[name]
    assert row["status"] == "completed" and row["test_accuracy"] > 0.8
    assert row["total_bytes_sent"] > 0
    optimum = LogisticRegression(LogisticRegression.Options(samples=16384)).optimum().float()
    for rank in range(4):  # from about optimum.norm() away at the start
        final = torch.load(models / name / f"rank{rank}.pt")["weight"][0]
        assert (final - optimum).norm() < 0.35 * optimum.norm()
    assert {"consensus_distance", "test_accuracy_workers"} <= {s.name for s in run.summaries}
