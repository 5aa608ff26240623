"""`choco` and `dcd` against references written here from the papers' definitions.

The spec of the issue that found CHOCO's order wrong: logistic regression on 20 features, top-5
of 20 (`topk`, ratio 0.25), γ = 0.4, a ring of 2 and of 4 workers, 60 steps (η = 0.1, batches
of 8, the same starting model on every worker, as in a `dsgd run`). The plugins run
in gloo worker processes (one world of 2, one of 4, each running every scenario), driven in
the runtime's hook order; the references compute all workers' models as one matrix X (a row
per worker) in float64:

* CHOCO-SGD in the authors' order (Koloskova, Lin, Stich, Jaggi, ICLR 2020, Algorithm 1; the
  order of the authors' code, epfml/ChocoSGD): the gradient at the mixed model, then mix with
  the old estimates, X ← X − ηG + γ(W X̂ − X̂), then X̂ ← X̂ + Q(X − X̂), X̂ starting at 0;
* CHOCO-SGD as printed in Koloskova, Stich, Jaggi (ICML 2019), Algorithm 2: X ← X − ηG,
  X̂ ← X̂ + Q(X − X̂), then mix with the new estimates, X ← X + γ(W X̂ − X̂);
* DCD-PSGD (Tang, Gan, Zhang, Zhang, Liu, NeurIPS 2018, Algorithm 1):
  X ← X + C(W X − ηG(X) − X), every replica exact.

The plugins' models are float64, but their payloads are float32 (compression runs on float32),
so they differ from the float64 references by rounding: about 2e-7 here, against 0.28 (ring
of 2) and 0.47 (ring of 4) between the two CHOCO orders.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from distributed import run_workers
from dsgd_cli.api import Comm, WorkerContext, flatten
from dsgd_cli.spec.experiments import build_plugin
from dsgd_cli.topology import make_topology, mixing_matrix
from plugins.aggregators.gossip import DCD, Choco

FEATURES = 20
KEPT = 5  # top-5 of 20
TOPK = {"name": "topk", "ratio": KEPT / FEATURES}
GAMMA = 0.4
LR = 0.1
STEPS = 60
SAMPLES = 64  # per worker
BATCH = 8
TOLERANCE = 1e-6


# -- the problem, the same in the workers and in the references ------------------------------

def _data(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Worker `rank`'s examples and ±1 labels; each worker's data leans its own way, so the
    models drift apart between mixing steps."""
    generator = torch.Generator().manual_seed(1000 + rank)
    features = torch.randn(SAMPLES, FEATURES, generator=generator, dtype=torch.float64)
    features += 0.5 * (rank + 1)
    truth = torch.linspace(-2.0, 2.0, FEATURES, dtype=torch.float64).roll(3 * rank)
    labels = torch.sign(features @ truth + torch.randn(SAMPLES, generator=generator,
                                                       dtype=torch.float64))
    return features, labels


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    features, labels = _data(rank)
    start = (step * BATCH) % SAMPLES
    return features[start:start + BATCH], labels[start:start + BATCH]


def _initial_model() -> torch.Tensor:
    """Every worker starts from the same model, as in a `dsgd run` (the run's seed)."""
    return torch.randn(FEATURES, generator=torch.Generator().manual_seed(7),
                       dtype=torch.float64)


def _loss(x: torch.Tensor, features: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Logistic loss, mean over the batch: log(1 + exp(−y aᵀx))."""
    return nn.functional.softplus(-labels * (features @ x)).mean()


def _gradient(x: torch.Tensor, features: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The logistic loss's gradient, written out: −mean(y σ(−y aᵀx) a)."""
    return -((labels * torch.sigmoid(-labels * (features @ x)))[:, None] * features).mean(0)


def _ring(n: int) -> torch.Tensor:
    """The ring's uniform weights 1/(degree + 1): 1/2 on a ring of 2, 1/3 on a ring of 4."""
    return torch.tensor(mixing_matrix(make_topology("ring", n, directed=False), 0, "uniform"))


def _top_k(rows: torch.Tensor) -> torch.Tensor:
    """Each row's KEPT entries of largest magnitude, the rest 0."""
    kept = torch.zeros_like(rows)
    indices = rows.abs().topk(KEPT, dim=1).indices
    return kept.scatter(1, indices, rows.gather(1, indices))


# -- the references -------------------------------------------------------------------------------

def _gradients(x: torch.Tensor, step: int) -> torch.Tensor:
    return torch.stack([_gradient(x[rank], *_batch(rank, step)) for rank in range(x.shape[0])])


def choco_authors_order(n: int, gamma: float = GAMMA, steps: int = STEPS) -> torch.Tensor:
    """CHOCO-SGD in the authors' order; X after each step (steps + 1, n, d)."""
    w = _ring(n)
    x = _initial_model().expand(n, FEATURES).clone()
    public = torch.zeros_like(x)  # X̂
    models = [x.clone()]
    for step in range(steps):
        x = x - LR * _gradients(x, step) + gamma * (w @ public - public)  # old estimates
        public = public + _top_k(x - public)
        models.append(x.clone())
    return torch.stack(models)


def choco_icml_2019(n: int, gamma: float = GAMMA, steps: int = STEPS) -> torch.Tensor:
    """CHOCO-SGD as Algorithm 2 of the ICML 2019 paper prints it: step, compress, update the
    estimates, mix with the new ones."""
    w = _ring(n)
    x = _initial_model().expand(n, FEATURES).clone()
    public = torch.zeros_like(x)
    models = [x.clone()]
    for step in range(steps):
        x = x - LR * _gradients(x, step)
        public = public + _top_k(x - public)
        x = x + gamma * (w @ public - public)  # new estimates
        models.append(x.clone())
    return torch.stack(models)


def dcd_psgd(n: int, steps: int = STEPS) -> torch.Tensor:
    """DCD-PSGD: the D-PSGD step on exact replicas, then each model moves by the compressed
    change, x_i ← x_i + C(Σ_j w_ij x_j − η∇F_i(x_i) − x_i)."""
    w = _ring(n)
    x = _initial_model().expand(n, FEATURES).clone()
    models = [x.clone()]
    for step in range(steps):
        half = w @ x - LR * _gradients(x, step)
        x = x + _top_k(half - x)
        models.append(x.clone())
    return torch.stack(models)


# -- the plugins, in worker processes ---------------------------------------------------------------

class _Metrics:
    def log(self, name, value):
        pass


def _train(aggregator, rank: int, n: int) -> torch.Tensor:
    """The worker's model before and after each step, in the runtime's hook order, then
    `finish()` as the runtime calls it after the last step."""
    model = nn.Linear(FEATURES, 1, bias=False, dtype=torch.float64)
    with torch.no_grad():
        model.weight.copy_(_initial_model()[None])
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    ctx = WorkerContext(rank=rank, world_size=n, device=torch.device("cpu"), model=model,
                        optimizer=optimizer, comm=Comm(rank, n), metrics=_Metrics(), seed=5,
                        compressor=build_plugin("compressor", TOPK), config={})
    ctx.compressor.setup(ctx)
    aggregator.setup(ctx)
    models = [flatten([model.weight.detach()]).clone()]
    for step in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        aggregator.before_forward(step)
        _loss(model.weight[0], *_batch(rank, step)).backward()
        aggregator.after_backward(step)
        optimizer.step()
        aggregator.after_step(step)
        models.append(flatten([model.weight.detach()]).clone())
    aggregator.finish()
    return torch.stack(models)


def _worker(rank: int, n: int) -> dict[str, torch.Tensor]:
    torch.set_num_threads(1)
    return {"choco": _train(Choco(Choco.Options(gamma=GAMMA)), rank, n),
            "choco_step_first": _train(Choco(Choco.Options(gamma=GAMMA, order="step_first")),
                                       rank, n),
            "dcd": _train(DCD(DCD.Options()), rank, n)}


@pytest.fixture(scope="module", params=[2, 4], ids=["ring2", "ring4"])
def trained(request) -> tuple[int, dict[str, torch.Tensor]]:
    """(n, {scenario: models (steps + 1, n, d)}) from n worker processes."""
    n = request.param
    results = run_workers(_worker, n, timeout=180, preloaded=True)
    return n, {name: torch.stack([r[name] for r in results], dim=1) for name in results[0]}


def max_difference(got: torch.Tensor, reference: torch.Tensor) -> float:
    return float((got - reference).abs().max())


# -- tests ------------------------------------------------------------------------------------------

def test_the_references_differ_where_the_orders_differ():
    """The spec tells the orders apart (else the tests below would prove nothing): by far more
    than the tolerance, from the second step on (the first mixes estimates that are still 0)."""
    authors, icml = choco_authors_order(4), choco_icml_2019(4)
    assert max_difference(authors[1], icml[1]) > 1e-3
    assert max_difference(authors, icml) > 0.05
    assert max_difference(authors, dcd_psgd(4)) > 0.05
    assert 0.5 < float(authors[-1].abs().max()) < 10  # parameters of order 1


def test_choco_equals_the_authors_order(trained):
    """The default order: every worker's parameters after every step are the reference's."""
    n, models = trained
    assert max_difference(models["choco"], choco_authors_order(n)) < TOLERANCE


def test_choco_step_first_equals_the_icml_2019_algorithm(trained):
    n, models = trained
    assert max_difference(models["choco_step_first"], choco_icml_2019(n)) < TOLERANCE


def test_dcd_equals_dcd_psgd(trained):
    n, models = trained
    assert max_difference(models["dcd"], dcd_psgd(n)) < TOLERANCE


def test_the_workers_models_differ(trained):
    """Each worker has its own data, so the models are not all the same (the comparisons
    above check more than one model)."""
    n, models = trained
    assert max_difference(models["choco"][-1], models["choco"][-1][0].expand(n, -1)) > 1e-2
