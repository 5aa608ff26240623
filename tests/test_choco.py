"""Compressed decentralized SGD: `choco` (CHOCO-SGD) and `dcd` (DCD-PSGD), each checked against
its definition.

The plugins run in 4 gloo worker processes on a ring (one start of the workers runs every
scenario), each worker with its own model, driven by a hand-written loop in the runtime's
order on the quadratic f_i(x) = ½‖x − c_i‖², so trajectories can be computed here step by
step; `gamma: auto` runs in this process; bad specs go through the spec loader and the CLI;
real runs go through `dsgd run` under torchrun.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

from conftest import compare_json, dsgd_in_process, write_spec
from distributed import run_scenarios
from dsgd_cli.api import Comm, WorkerContext, flatten
from dsgd_cli.errors import SpecError
from dsgd_cli.spec.experiments import build_plugin, load_spec
from dsgd_cli.results.store import Store
from dsgd_cli.topology import CustomTopology, make_topology, mixing_matrix
from plugins.aggregators.gossip import DCD, DPSGD, Choco
from plugins.aggregators.gossip import choco as choco_module
from plugins.aggregators.gossip.choco import GAMMA_GRID, consensus_error, tune_gamma

WORKERS = 4
LR = 0.1
RING = mixing_matrix(make_topology("ring", WORKERS, directed=False), 0, "uniform")


# -- the in-process harness -------------------------------------------------------------------

class _Metrics:
    def __init__(self):
        self.values: dict[str, list[float]] = {}

    def log(self, name, value):
        self.values.setdefault(name, []).append(float(value))


def _context(rank: int, n: int, compressor: dict, lr: float = LR,
             same_start: bool = False) -> WorkerContext:
    """A different model on every worker, or with `same_start` the same on all (as in a
    `dsgd run`, where the run's seed builds every worker's model)."""
    torch.manual_seed(100 if same_start else 100 + rank)
    model = nn.Linear(5, 3, dtype=torch.float64)  # 18 parameters
    ctx = WorkerContext(rank=rank, world_size=n, device=torch.device("cpu"), model=model,
                        optimizer=torch.optim.SGD(model.parameters(), lr=lr),
                        comm=Comm(rank, n), metrics=_Metrics(), seed=5,
                        compressor=build_plugin("compressor", compressor), config={})
    ctx.compressor.setup(ctx)
    return ctx


def _flat(ctx) -> torch.Tensor:
    return flatten([p.detach() for p in ctx.model.parameters()]).clone()


def _centre(rank: int, d: int) -> torch.Tensor:
    """The minimum of worker `rank`'s quadratic loss."""
    return torch.linspace(-1.0, 1.0, d, dtype=torch.float64) * (rank + 1)


def _step(aggregator, ctx, step: int) -> None:
    """One step in the runtime's order; f_i(x) = ½‖x − c_i‖², so ∇f_i(x) = x − c_i."""
    ctx.optimizer.zero_grad(set_to_none=True)
    aggregator.before_forward(step)
    x = torch.cat([p.reshape(-1) for p in ctx.model.parameters()])
    (0.5 * (x - _centre(ctx.rank, x.numel())).square().sum()).backward()
    aggregator.after_backward(step)
    ctx.optimizer.step()
    aggregator.after_step(step)


def _run(aggregator, rank, n, compressor, steps, lr=LR, same_start=False):
    """The models before and after each step, and what the aggregator and its comm kept."""
    ctx = _context(rank, n, compressor, lr, same_start)
    aggregator.setup(ctx)
    setup_traffic = vars(ctx.comm.take_traffic())
    models = [_flat(ctx)]
    for step in range(steps):
        _step(aggregator, ctx, step)
        models.append(_flat(ctx))
    aggregator.finish()  # as the runtime does after the last step
    return {"models": torch.stack(models), "traffic": vars(ctx.comm.take_traffic()),
            "setup_traffic": setup_traffic, "metrics": ctx.metrics.values}


class CopyingChoco(Choco):
    """choco that also keeps, from what it receives, a copy of each neighbour's x̂_j (the
    plugin itself keeps only s_i = Σ_j w_ij x̂_j)."""

    def setup(self, ctx):
        super().setup(ctx)
        self.copies = {peer: torch.zeros_like(self.public) for peer in self.exchange.neighbours}

    def received(self, peer, q):
        self.copies[peer] += q


class CopyingDCD(DCD):
    """dcd that also keeps a replica of each neighbour's model, from the initial models and
    every q_j received."""

    def _exchange_models(self, x):
        self.initial = x.clone()
        return super()._exchange_models(x)

    def received(self, peer, q):
        self.copies[peer] += q


COMPRESSORS = {"topk": {"name": "topk", "ratio": 0.3},
               "qsgd": {"name": "qsgd", "levels": 7, "bucket_size": 8, "rescale": True},
               "randomk": {"name": "randomk", "ratio": 0.3, "unbiased": False}}
REPLICA_STEPS = 6


def _scenario_replicas(rank, n):
    results = {}
    for name, compressor in COMPRESSORS.items():
        choco = CopyingChoco(Choco.Options(gamma=0.4))
        run = _run(choco, rank, n, compressor, REPLICA_STEPS)
        results[f"choco-{name}"] = {"public": choco.public, "mixed": choco.mixed,
                                    "copies": choco.copies, **run}
        dcd = CopyingDCD(DCD.Options())
        ctx = _context(rank, n, compressor)
        dcd.setup(ctx)
        # the replicas start from the neighbours' models, which rank r's test gets from r
        initial = [torch.zeros_like(dcd.initial) for _ in range(n)]
        dist.all_gather(initial, dcd.initial)
        dcd.copies = {peer: initial[peer].clone() for peer in dcd.exchange.neighbours}
        for step in range(REPLICA_STEPS):
            _step(dcd, ctx, step)
        results[f"dcd-{name}"] = {"model": _flat(ctx), "mixed": dcd.mixed, "copies": dcd.copies}
    return results


EXACT_STEPS = 5


def _scenario_exact(rank, n):
    return {name: _run(aggregator, rank, n, {"name": "none"}, EXACT_STEPS, same_start=True)
            for name, aggregator in [
                ("choco", Choco(Choco.Options(gamma=1.0))),
                ("dpsgd", DPSGD(DPSGD.Options(topology="ring", mixing="uniform")))]}


def _scenario_exact_step_first(rank, n):
    return _run(Choco(Choco.Options(gamma=1.0, order="step_first")), rank, n, {"name": "none"},
                EXACT_STEPS)


def _scenario_consensus(rank, n):
    return _run(Choco(Choco.Options(gamma=0.3)), rank, n, {"name": "topk", "ratio": 0.2}, 40,
                lr=0.0)


def _scenario_dcd_none(rank, n):
    return _run(DCD(DCD.Options()), rank, n, {"name": "none"}, 5)


def _scenario_dpsgd(rank, n):
    return _run(DPSGD(DPSGD.Options(topology="ring", mixing="uniform")), rank, n,
                {"name": "none"}, EXACT_STEPS)


BYTES_STEPS = 4


def _scenario_bytes(rank, n):
    return {name: _run(Choco(Choco.Options(gamma=0.5)), rank, n, compressor, BYTES_STEPS)
            for name, compressor in [("topk", {"name": "topk", "ratio": 0.25}),
                                     ("qsgd", {"name": "qsgd", "levels": 7, "bucket_size": 0,
                                               "rescale": True}),
                                     ("dqsgd", {"name": "dqsgd", "max_levels": 8}),
                                     ("dcd", {"name": "topk", "ratio": 0.25})]
            if name != "dcd"} | {"dcd": _run(DCD(DCD.Options()), rank, n,
                                             {"name": "topk", "ratio": 0.25}, BYTES_STEPS)}


def _scenario_auto(rank, n):
    return _run(Choco(Choco.Options()), rank, n, {"name": "topk", "ratio": 0.2}, 2)


class _LoggingComm(Comm):
    """A Comm that logs each compressed message it posts ("send") and each wait that returns
    a received one ("received"), in order."""

    def __init__(self, rank, n, log: list[str]):
        super().__init__(rank, n)
        self.log = log

    def isend_tensors(self, *args, **kwargs):
        self.log.append("send")
        return super().isend_tensors(*args, **kwargs)

    def irecv_tensors(self, *args, **kwargs):
        return _LoggedReceive(super().irecv_tensors(*args, **kwargs), self.log)


class _LoggedReceive:
    def __init__(self, handle, log):
        self.handle, self.log = handle, log

    def wait(self):
        tensors = self.handle.wait()
        self.log.append("received")
        return tensors


class LoggingChoco(Choco):
    """choco that logs where the runtime's step is: the forward pass and `after_step`."""

    def before_forward(self, step):
        self.ctx.comm.log.append(f"forward {step}")
        super().before_forward(step)

    def after_step(self, step):
        self.ctx.comm.log.append(f"after_step {step}")
        super().after_step(step)

    def finish(self):
        self.ctx.comm.log.append("finish")
        super().finish()


OVERLAP_STEPS = 3


def _scenario_overlap(rank, n):
    """The order of each step's hooks and messages, in both orders (ring: 2 neighbours)."""
    logs = {}
    for order in ("mix_first", "step_first"):
        log: list[str] = []
        ctx = dataclasses.replace(_context(rank, n, {"name": "topk", "ratio": 0.3}),
                                  comm=_LoggingComm(rank, n, log))
        _run_in(LoggingChoco(Choco.Options(gamma=0.4, order=order)), ctx, OVERLAP_STEPS)
        logs[order] = log
    return logs


def _run_in(aggregator, ctx, steps):
    aggregator.setup(ctx)
    for step in range(steps):
        _step(aggregator, ctx, step)
    aggregator.finish()


def _scenario_checkpoint(rank, n):
    """What a checkpoint after step 3 holds, and the state once the run finishes."""
    choco = Choco(Choco.Options(gamma=0.4))
    ctx = _context(rank, n, {"name": "topk", "ratio": 0.3})
    choco.setup(ctx)
    for step in range(3):
        _step(choco, ctx, step)
    saved = choco.state_dict()
    choco.finish()
    return {"saved": saved, "public": choco.public, "mixed": choco.mixed}


SCENARIOS = {"auto": _scenario_auto, "replicas": _scenario_replicas, "exact": _scenario_exact,
             "exact_step_first": _scenario_exact_step_first, "consensus": _scenario_consensus, "dcd_none": _scenario_dcd_none,
             "dpsgd": _scenario_dpsgd, "bytes": _scenario_bytes, "overlap": _scenario_overlap,
             "checkpoint": _scenario_checkpoint}


@pytest.fixture(scope="module")
def spawned(tmp_path_factory) -> list[dict]:
    """Every scenario on WORKERS processes; one result dict per rank."""
    return run_scenarios(__name__, WORKERS, tmp_path_factory.mktemp("spawned"), timeout=240)


def _neighbours(rank):
    return [j for j in range(WORKERS) if j != rank and RING[rank, j] > 0]


# -- choco ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("compressor", list(COMPRESSORS))
def test_choco_every_copy_of_a_public_model_equals_its_owners(spawned, compressor):
    """After the steps, each neighbour's copy of x̂_j (the sum of the q_j it decoded) is bit
    for bit the x̂_j that j holds (the sum of the q_j it sent): the sender adds the same draw
    it sent. And s_i is Σ_j w_ij x̂_j."""
    runs = [r["replicas"][f"choco-{compressor}"] for r in spawned]
    for i, run in enumerate(runs):
        assert sorted(run["copies"]) == _neighbours(i)
        for j, copy in run["copies"].items():
            assert torch.equal(copy, runs[j]["public"]), (i, j)
        expected = sum(RING[i, j] * runs[j]["public"] for j in range(WORKERS))
        torch.testing.assert_close(run["mixed"], expected, rtol=0, atol=1e-12)
        assert float(runs[i]["public"].abs().sum()) > 0  # something was sent


@pytest.mark.parametrize("compressor", list(COMPRESSORS))
def test_dcd_replicas_stay_exact_copies_of_the_neighbours_models(spawned, compressor):
    runs = [r["replicas"][f"dcd-{compressor}"] for r in spawned]
    for i, run in enumerate(runs):
        for j, copy in run["copies"].items():
            assert torch.equal(copy, runs[j]["model"]), (i, j)
        expected = sum(RING[i, j] * runs[j]["model"] for j in range(WORKERS))
        torch.testing.assert_close(run["mixed"], expected, rtol=0, atol=1e-12)


def test_choco_without_compression_and_gamma_1_is_dpsgd(spawned):
    """In the authors' order (the default), exact messages and γ = 1 give D-PSGD,
    x ← Wx − η∇F(x) (Lian et al., 2017): from the same starting model on every worker, as in
    a `dsgd run`, `choco` equals `dpsgd` step for step. (x̂ starts at 0, so from models that
    differ the first step would not mix them.)"""
    for r in spawned:
        models = r["exact"]["choco"]["models"]
        torch.testing.assert_close(models, r["exact"]["dpsgd"]["models"],
                                   rtol=1e-12, atol=1e-12)
        assert not torch.equal(models[-1], spawned[0]["exact"]["choco"]["models"][-1]) \
            or r is spawned[0]  # the models drift apart: the mixing is exercised
    assert spawned[0]["exact"]["choco"]["metrics"]["choco_gamma"] == [1.0] * EXACT_STEPS


def test_choco_step_first_without_compression_and_gamma_1_is_gossip_after_the_step(spawned):
    """`order: step_first` (the ICML 2019 paper's Algorithm 2): x ← W(x − η∇F(x)), computed
    here; D-PSGD's x ← Wx − η∇F(x) is not it."""
    runs = [r["exact_step_first"]["models"] for r in spawned]
    x = torch.stack([run[0] for run in runs])
    w = torch.tensor(RING)
    centres = torch.stack([_centre(i, x.shape[1]) for i in range(WORKERS)])
    for step in range(1, runs[0].shape[0]):
        dpsgd_order = w @ x - LR * (x - centres)
        x = w @ (x - LR * (x - centres))
        got = torch.stack([run[step] for run in runs])
        torch.testing.assert_close(got, x, rtol=1e-12, atol=1e-12)
        assert not torch.allclose(got, dpsgd_order, rtol=1e-6, atol=1e-6)


def test_choco_mix_first_sends_during_the_next_steps_computation(spawned):
    """In the authors' order q_i does not depend on the next gradient: the messages posted at
    the end of step t are waited for in step t + 1's `after_step`, after its forward and
    backward, so the emulated network time of the round runs while the step computes; the
    last step's are received in `finish`. In `step_first` each round completes in its own
    `after_step`, nothing computing meanwhile."""
    exchange = ["send", "send"]  # two neighbours on the ring
    received = ["received", "received"]
    overlapping = []
    for step in range(OVERLAP_STEPS):
        overlapping += [f"forward {step}", f"after_step {step}"]
        overlapping += (received if step else []) + exchange
    overlapping += ["finish"] + received
    blocking = [entry for step in range(OVERLAP_STEPS)
                for entry in [f"forward {step}", f"after_step {step}"] + exchange + received]
    blocking += ["finish"]
    for r in spawned:
        assert r["overlap"]["mix_first"] == overlapping
        assert r["overlap"]["step_first"] == blocking


def test_choco_checkpoint_holds_the_estimates_with_the_last_steps_messages(spawned):
    """A checkpoint taken while the last step's round is in flight completes it first: it
    holds x̂_i and s_i as the run has them once the round is in (a resumed run mixes with
    what the uninterrupted one does)."""
    for r in spawned:
        saved = r["checkpoint"]["saved"]
        assert saved.get("in_flight") is None
        assert torch.equal(saved["public"], r["checkpoint"]["public"])
        assert torch.equal(saved["mixed"], r["checkpoint"]["mixed"])


def test_choco_consensus_keeps_the_average_and_contracts(spawned):
    """Zero gradients: the mean of the models never changes (W is doubly stochastic and
    everyone adds the same q's), and with top-k at γ = 0.3 the distance to it shrinks."""
    models = torch.stack([r["consensus"]["models"] for r in spawned])  # rank, step, d
    mean = models.mean(0)
    torch.testing.assert_close(mean, mean[0].expand_as(mean), rtol=0, atol=1e-12)
    distance = (models - mean).square().sum((0, 2))
    assert float(distance[-1]) < 0.05 * float(distance[0])
    assert float(distance[20]) < float(distance[0])


def test_dcd_without_compression_is_dpsgd(spawned):
    for r in spawned:
        torch.testing.assert_close(r["dcd_none"]["models"], r["dpsgd"]["models"],
                                   rtol=1e-12, atol=1e-12)


def test_bytes_are_the_compressors_payload_per_neighbour(spawned):
    """18 parameters, ring of 4: two neighbours, one message each per step."""
    messages = BYTES_STEPS * 2
    for r in spawned:
        runs = r["bytes"]
        # top-k of 18 at 25%: k = 5 pairs of int32 index and float32 value
        assert runs["topk"]["traffic"]["bytes_sent"] == messages * 5 * 8
        assert runs["topk"]["traffic"]["bytes_received"] == messages * 5 * 8
        assert runs["topk"]["setup_traffic"]["bytes_sent"] == 0
        # 4-bit QSGD (7 levels), one bucket: one float32 norm and 18 codes of 4 bits
        assert runs["qsgd"]["traffic"]["bytes_sent"] == messages * (4 + 9)
        # dqsgd's payloads differ in length between workers: the byte length of each of its
        # 3 tensors goes first (int64), then its levels (int8), a norm and ≤ 4-bit codes
        sent = runs["dqsgd"]["traffic"]["bytes_sent"]
        assert messages * (3 * 8 + 1 + 4 + 3) <= sent <= messages * (3 * 8 + 1 + 4 + 9)
        # dcd: the models once, uncompressed (float64), then the same payloads as choco's
        assert runs["dcd"]["setup_traffic"]["bytes_sent"] == 2 * 18 * 8
        assert runs["dcd"]["traffic"]["bytes_sent"] == messages * 5 * 8


# -- gamma: auto ----------------------------------------------------------------------------------

def _solo_context(compressor: dict, n: int = 8) -> WorkerContext:
    model = nn.Linear(10, 100)  # 1100 parameters
    ctx = WorkerContext(rank=0, world_size=n, device=torch.device("cpu"), model=model,
                        optimizer=torch.optim.SGD(model.parameters(), lr=0.1), comm=None,
                        metrics=_Metrics(), seed=3,
                        compressor=build_plugin("compressor", compressor), config={})
    ctx.compressor.setup(ctx)
    return ctx


def test_gamma_auto_picks_the_step_size_whose_consensus_gets_closest():
    """On a ring of 8 with top-1%, γ = 1 blows up or stalls: the tuned γ is smaller, its
    consensus converges, and no γ of the grid does better; it is the same on every call (every
    worker computes it alone)."""
    ctx = _solo_context({"name": "topk", "ratio": 0.01})
    w = mixing_matrix(make_topology("ring", 8, directed=False), 0, "uniform")
    gamma = tune_gamma(ctx, w, 1100, steps=60)
    assert gamma in GAMMA_GRID and gamma < 1
    choco_module._TUNED.clear()  # computed again, not remembered
    assert tune_gamma(ctx, w, 1100, steps=60) == gamma
    from plugins.aggregators.gossip.choco import _simulated_compressor
    compressors = [_simulated_compressor(ctx, rank) for rank in range(8)]
    start = torch.randn(8, 1100, generator=torch.Generator().manual_seed(ctx.seed))
    mixing = torch.tensor(w, dtype=torch.float32)
    errors = {g: consensus_error(compressors, mixing, start, g, 60) for g in GAMMA_GRID}
    assert errors[gamma] == min(errors.values()) < 1
    assert errors[1.0] > errors[gamma]


def _disagreement_after(compressors, mixing, start, gamma, steps, order) -> float:
    """‖X − X̄‖² + ‖X − X̂‖² after `steps` of CHOCO's consensus in `order`, over its value at
    the start (X̂ = 0): the authors' tuner mixes with the old estimates first and measures
    this; `step_first` mixes with the new ones last."""
    x, public = start.clone(), torch.zeros_like(start)

    def disagreement():
        return float((x - x.mean(0)).square().sum() + (x - public).square().sum())

    initial = disagreement()
    for step in range(steps):
        if order == "mix_first":
            x = x + gamma * (mixing @ public - public)
        public = public + torch.stack([
            c.decompress(c.compress(x[i] - public[i], "gamma-auto", step), x[i])
            for i, c in enumerate(compressors)])
        if order == "step_first":
            x = x + gamma * (mixing @ public - public)
    return disagreement() / initial


@pytest.mark.parametrize("order, other", [("mix_first", "step_first"),
                                          ("step_first", "mix_first")])
def test_gamma_auto_tunes_for_the_order_that_runs(order, other):
    """The γ picked minimises ‖X − X̄‖² + ‖X − X̂‖² after the consensus steps in the order
    the run uses. On a ring of 8 with top-1% and 10 steps the two orders pick different γ, so
    tuning for the other order, or measuring something else, is caught."""
    ctx = _solo_context({"name": "topk", "ratio": 0.01})
    w = mixing_matrix(make_topology("ring", 8, directed=False), 0, "uniform")
    compressors = [choco_module._simulated_compressor(ctx, rank) for rank in range(8)]
    start = torch.randn(8, 1100, generator=torch.Generator().manual_seed(ctx.seed))
    mixing = torch.tensor(w, dtype=torch.float32)
    errors = {g: _disagreement_after(compressors, mixing, start, g, 10, order)
              for g in GAMMA_GRID}
    for g, error in errors.items():
        assert consensus_error(compressors, mixing, start, g, 10, order) == \
            pytest.approx(error, rel=1e-4)
    best = min(sorted(GAMMA_GRID, reverse=True), key=errors.get)  # ties: the larger γ
    choco_module._TUNED.clear()
    assert tune_gamma(ctx, w, 1100, order, steps=10) == best
    assert tune_gamma(ctx, w, 1100, other, steps=10) != best


def test_gamma_auto_is_tuned_for_the_configured_order(monkeypatch, tmp_path):
    """Both places that tune (validation, and `setup` outside `dsgd run`) pass the order."""
    orders = []

    def tuned(ctx, w, numel, order):
        orders.append(order)
        return 0.5

    monkeypatch.setattr(choco_module, "tune_gamma", tuned)
    spec = write_spec(tmp_path, """
        experiments:
          - {name: a, task: logreg, workers: 4,
             aggregator: {name: choco, order: step_first, compressor: {name: topk}}}
    """)
    experiment, = load_spec(spec)
    assert experiment.config["aggregator"]["gamma"] == 0.5 and orders == ["step_first"]
    choco = Choco(Choco.Options(order="step_first"))
    choco.setup(_context(0, 1, {"name": "topk", "ratio": 0.3}))
    assert choco.gamma == 0.5 and orders == ["step_first"] * 2


def test_gamma_auto_is_tuned_on_rank_0_and_broadcast(spawned):
    """Every worker steps with the γ that `tune_gamma` picks for the run (the default is
    auto); rank 0 computes it and sends it to the 3 others: 8 bytes each."""
    ctx = _context(0, WORKERS, {"name": "topk", "ratio": 0.2})
    choco_module._TUNED.clear()
    expected = tune_gamma(ctx, RING, 18)
    assert expected < 1
    for rank, r in enumerate(spawned):
        assert r["auto"]["metrics"]["choco_gamma"] == [expected] * 2
        assert r["auto"]["setup_traffic"]["bytes_sent"] == (3 * 8 if rank == 0 else 0)


def test_gamma_auto_without_compression_is_1():
    ctx = _solo_context({"name": "none"})
    w = mixing_matrix(make_topology("ring", 8, directed=False), 0, "uniform")
    assert tune_gamma(ctx, w, 1100, steps=30) == 1.0


# -- bad input -------------------------------------------------------------------------------------

def _bad_spec(tmp_path, aggregator: str):
    return write_spec(tmp_path, f"""
        experiments:
          - name: bad
            task: {{name: logreg}}
            workers: 4
            aggregator: {aggregator}
    """)


@pytest.mark.parametrize("aggregator, path, message", [
    ("{name: choco, topology: time_varying_exponential}", "aggregator",
     "topology 'time_varying_exponential' is directed; choco needs an undirected graph with "
     "symmetric mixing weights"),
    ("{name: dcd, topology: time_varying_exponential}", "aggregator", "is directed; dcd needs"),
    ("{name: choco, compressor: sign}", "aggregator.compressor",
     "compressor 'sign' sends sign(x) without a scale"),
    ("{name: choco, gamma: 0}", "aggregator",
     "gamma: expected a consensus step size in (0, 1] or 'auto', got 0.0"),
    ("{name: choco, gamma: 1.5}", "aggregator", "gamma: expected a consensus step size in (0, 1]"),
    ("{name: choco, gamma: -0.1}", "aggregator", "gamma: expected a consensus step size in (0, 1]"),
    ("{name: choco, gamma: fast}", "aggregator.gamma", "expected a number or one of auto"),
    ("{name: choco, compressor: qsgd}", "aggregator.compressor",
     "compressor 'qsgd' is unbiased, not contractive"),
    ("{name: choco, compressor: randomk}", "aggregator.compressor", "set unbiased: false"),
    ("{name: choco, compressor: terngrad}", "aggregator.compressor", "use a contractive one"),
    ("{name: choco, compressor: powersgd}", "aggregator.compressor",
     "compressor 'powersgd' declares no bound"),
    ("{name: dcd, compressor: sign}", "aggregator.compressor", "compressor 'sign' declares no bound"),
    ("{name: choco, error_feedback: true, compressor: topk}", "aggregator",
     "error_feedback: choco compresses x_i − x̂_i"),
])
def test_bad_choco_and_dcd_specs_are_refused(tmp_path, aggregator, path, message):
    spec = _bad_spec(tmp_path, aggregator)
    with pytest.raises(SpecError) as error:
        load_spec(spec)
    assert message in str(error.value)
    assert error.value.path == f"experiments[0].{path}"


@pytest.mark.parametrize("aggregator, message", [
    ("{name: choco, topology: time_varying_exponential}", "is directed"),
    ("{name: choco, gamma: 0}", "gamma: expected a consensus step size in (0, 1]"),
    ("{name: choco, compressor: sign}", "without a scale"),
])
def test_bad_choco_spec_exits_2_naming_file_and_key(tmp_path, aggregator, message):
    spec = _bad_spec(tmp_path, aggregator)
    result = dsgd_in_process("run", str(spec), "--db", str(tmp_path / "r.db"))
    assert result.returncode == 2
    line, = result.stderr.strip().splitlines()
    assert line.startswith(f"dsgd: error: {spec}: experiments[0].aggregator") and message in line
    assert not (tmp_path / "r.db").exists()


# -- real runs under torchrun ----------------------------------------------------------------------

@pytest.mark.slow  # about a minute on 2 cores
def test_torchrun_choco_and_dcd_converge_resume_bit_for_bit_and_count_payload_bytes(tmp_path):
    """Logistic regression on a ring of 4. Every run completes near D-PSGD's loss with the
    bytes of its payloads; then each is recorded failed and resumed from its checkpoint at
    step 40 of 48: the models end bit for bit where the uninterrupted runs ended."""
    spec = write_spec(tmp_path, f"""
        defaults: {{task: logreg, workers: 4, epochs: 3, checkpoint_every: 20,
                   optimizer: {{name: sgd, lr: 0.5}}, save_dir: {tmp_path / "models"}}}
        experiments:
          - {{name: dpsgd, aggregator: {{name: dpsgd}}}}
          - {{name: choco-topk, aggregator: {{name: choco, gamma: 0.5,
                                               compressor: {{name: topk, ratio: 0.3}}}}}}
          - {{name: choco-qsgd, aggregator: {{name: choco, compressor: {{name: qsgd, levels: 7,
                                                                          rescale: true}}}}}}
          - {{name: dcd-randomk, aggregator: {{name: dcd, compressor: {{name: randomk, ratio: 0.5,
                                                                           unbiased: false}}}}}}
    """)
    db = tmp_path / "r.db"
    result = dsgd_in_process("run", str(spec), "--db", str(db), "--checkpoint-dir",
                             str(tmp_path / "ck"))
    assert result.returncode == 0, result.stdout + result.stderr
    rows = {row["experiment"]: row for row in compare_json(db)}
    steps = rows["dpsgd"]["total_bytes_sent"] / (4 * 2 * 10 * 4)  # 10 float32 per model
    assert steps == 48  # 3 epochs of 512 examples per worker, 32 per batch
    for name, row in rows.items():
        assert row["status"] == "completed"
        assert row["train_loss"] < rows["dpsgd"]["train_loss"] + 0.05, name
    assert rows["choco-topk"]["total_bytes_sent"] == steps * 4 * 2 * 3 * 8  # k = 3 pairs
    assert rows["choco-qsgd"]["total_bytes_sent"] == steps * 4 * 2 * (4 + 5)  # norm, 10 codes
    # dcd: the models once, then k = 5 values (random-k's indices come from a shared seed)
    assert rows["dcd-randomk"]["total_bytes_sent"] == 4 * 2 * 40 + steps * 4 * 2 * 5 * 4
    (tmp_path / "models").rename(tmp_path / "uninterrupted")
    sent = {name: row["total_bytes_sent"] for name, row in rows.items()}
    store = Store(str(db))
    # gamma: auto was chosen at validation: the configuration records the γ every step used
    auto, = [run for run in store.runs() if run.experiment == "choco-qsgd"]
    gamma = auto.config["aggregator"]["gamma"]
    assert isinstance(gamma, float) and 0 < gamma <= 1
    assert {m.value for m in store.metric_history(auto.id, "choco_gamma")} == {gamma}
    for run in store.runs():
        if run.experiment == "dpsgd":
            continue
        store.finish_run(run.id, "failed", "recorded as failed by the test")
        result = dsgd_in_process("run", "--resume", str(run.id), "--db", str(db))
        assert result.returncode == 0, result.stdout + result.stderr
        assert [entry["step"] for entry in store.resumes(run.id)] == [40]
        for rank in range(4):
            resumed = torch.load(tmp_path / "models" / run.experiment / f"rank{rank}.pt")
            uninterrupted = torch.load(tmp_path / "uninterrupted" / run.experiment / f"rank{rank}.pt")
            assert all(torch.equal(resumed[key], uninterrupted[key]) for key in resumed), run.experiment
    # The resumed runs sent what the uninterrupted ones did: dcd's set-up exchange of the
    # models is not repeated (its memory comes from the checkpoint).
    assert {row["experiment"]: row["total_bytes_sent"] for row in compare_json(db)} == sent


def test_gamma_auto_is_chosen_at_validation_and_recorded_in_the_configuration(tmp_path):
    """The spec loader replaces `auto` by the γ that rank 0 would tune: the same function on
    the run's graph, compressor, seed and model length; an explicit γ stays as written."""
    spec = write_spec(tmp_path, """
        defaults: {task: {name: logreg, features: 200}, workers: 8, seed: 4}
        experiments:
          - {name: auto, aggregator: {name: choco, compressor: {name: topk, ratio: 0.01}}}
          - {name: fixed, aggregator: {name: choco, gamma: 0.25,
                                        compressor: {name: topk, ratio: 0.01}}}
    """)
    auto, fixed = (e.config for e in load_spec(spec))
    model = nn.Linear(200, 1, bias=False)
    ctx = WorkerContext(rank=0, world_size=8, device=torch.device("cpu"), model=model,
                        optimizer=None, comm=None, metrics=_Metrics(), seed=4,
                        compressor=build_plugin("compressor", auto["compressor"]), config={})
    w = mixing_matrix(make_topology("ring", 8, directed=False), 0, "uniform")
    choco_module._TUNED.clear()  # computed here, not remembered from the validation
    assert auto["aggregator"]["gamma"] == tune_gamma(ctx, w, 200) < 1
    assert fixed["aggregator"]["gamma"] == 0.25


def _graph(edges, n=4, directed=False):
    adjacency = np.zeros((n, n), dtype=bool)
    for i, j in edges:
        adjacency[i, j] = True
        if not directed:
            adjacency[j, i] = True
    return CustomTopology(adjacency)


@pytest.mark.parametrize("topology, mixing, message", [
    (_graph([(0, 1), (1, 2), (2, 3), (3, 0)], directed=True), "uniform",
     "topology 'custom' is directed; choco needs an undirected graph"),
    # a path 0-1-2-3: degrees 1, 2, 2, 1, so uniform 1/(deg+1) weights are not doubly stochastic
    (_graph([(0, 1), (1, 2), (2, 3)]), "uniform", "is not doubly stochastic"),
    ([_graph([(0, 1), (2, 3)]).adjacency(0), _graph([(1, 2), (3, 0)]).adjacency(0)], "uniform",
     "changes every step"),
])
def test_choco_refuses_what_its_memory_cannot_follow(topology, mixing, message):
    """s_i = Σ_j w_ij x̂_j needs one symmetric doubly stochastic W for every step."""
    graph = topology if isinstance(topology, CustomTopology) else CustomTopology(np.stack(topology))

    class OnGraph(Choco):
        @classmethod
        def make_topology(cls, options, world_size, seed=0):
            return graph

    with pytest.raises(ValueError, match=message):
        OnGraph.check_world(Choco.Options(mixing=mixing), 4)
    # the path with Metropolis weights is symmetric and doubly stochastic: accepted
    if message == "is not doubly stochastic":
        OnGraph.check_world(Choco.Options(mixing="metropolis"), 4)
