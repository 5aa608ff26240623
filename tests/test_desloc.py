"""`desloc` (issue 50): DES-LOC, local Adam whose parameters, first moments and second moments
are averaged over the workers each on its own period, against a reference written from that
definition: two gloo workers run the plugin, the reference simulates both in one process with
torch's AdamW."""

from __future__ import annotations

import pytest
import torch

import frontier_helpers as h
from conftest import write_spec
from distributed import run_workers
from dsgd_cli.spec.experiments import load_spec

WORKERS = 2
STEPS = 13
CASES = [(2, 3, 4), (2, None, None)]  # (K_x, K_u, K_v); None: the default 3·K_x, 6·K_x
# checkpoints after steps 4, 8 and 12; node 1 fails at 6.5 s, seen after step 7: back to 4
FAILURES = {"restart": 1, "checkpoint_every": 4, "at": [{"node": 1, "time": 6.5}]}


def _adamw(params):
    return torch.optim.AdamW(params, lr=0.05, weight_decay=0.1)


def _desloc(case):
    from plugins.aggregators.desloc import DESLOC

    period, first, second = case
    return DESLOC(DESLOC.Options(period=period, first_moment_period=first,
                                 second_moment_period=second))


def _scenarios(rank, n):
    torch.set_num_threads(1)
    results = {}
    for case in CASES:
        ctx = h.context(rank, n, _adamw)
        aggregator = _desloc(case)
        aggregator.setup(ctx)
        results[case] = h.run(aggregator, ctx, STEPS)
        results[case]["moments"] = [(s["exp_avg"].clone(), s["exp_avg_sq"].clone())
                                    for s in ctx.optimizer.state.values()]
    results["resumed"] = h.resumed(rank, n, lambda: _desloc(CASES[0]), _adamw, stop=5, steps=STEPS)
    results["failed"] = h.failed(rank, n, lambda: _desloc(CASES[0]), _adamw, STEPS, FAILURES)
    return results


@pytest.fixture(scope="module")
def scenarios():
    return run_workers(_scenarios, WORKERS, preloaded=True)


def _reference(periods: tuple[int, int, int], n: int = WORKERS) -> dict:
    """Per worker its model and AdamW; after step s (n = s + 1): n % K_x == 0 averages the
    parameters, n % K_u == 0 every exp_avg, n % K_v == 0 every exp_avg_sq."""
    nets = [h.model() for _ in range(n)]
    optimizers = [_adamw(net.parameters()) for net in nets]
    history = {rank: [] for rank in range(n)}
    for step in range(STEPS):
        h.local_steps(nets, optimizers, step)
        tensors = list(zip(*[list(net.parameters()) for net in nets]))  # per parameter, per worker
        due = []
        if (step + 1) % periods[0] == 0:
            due += [[p.data for p in per_worker] for per_worker in tensors]
        for name, period in zip(("exp_avg", "exp_avg_sq"), periods[1:]):
            if (step + 1) % period == 0:
                due += [[o.state[p][name] for o, p in zip(optimizers, per_worker)]
                        for per_worker in tensors]
        for copies in due:
            mean = sum(copies) / n
            for copy in copies:
                copy.copy_(mean)
        for rank, net in enumerate(nets):
            history[rank].append(h.flat(net))
    moments = {rank: [(o.state[p]["exp_avg"], o.state[p]["exp_avg_sq"]) for p in net.parameters()]
               for rank, (o, net) in enumerate(zip(optimizers, nets))}
    return {"models": history, "moments": moments}


@pytest.mark.parametrize("case", CASES, ids=["Kx2-Ku3-Kv4", "Kx2-defaults"])
def test_desloc_equals_its_definition(scenarios, case):
    period, first, second = case
    reference = _reference((period, first or 3 * period, second or 6 * period))
    for rank, result in enumerate(scenarios):
        for step, (got, expected) in enumerate(zip(result[case]["models"], reference["models"][rank])):
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-6, msg=f"rank {rank} step {step}")
        for got, expected in zip(result[case]["moments"], reference["moments"][rank]):
            torch.testing.assert_close(got[0], expected[0], rtol=0, atol=1e-6)
            torch.testing.assert_close(got[1], expected[1], rtol=0, atol=1e-6)
    first_worker, second_worker = (r[case]["models"] for r in scenarios)
    assert torch.equal(first_worker[1], second_worker[1]) and not torch.equal(first_worker[2], second_worker[2])


def test_desloc_sends_what_is_due_in_one_all_reduce(scenarios):
    """K = (2, 3, 4) over a model of 101 float64 numbers: at step n, one all-reduce of 101 per
    due item (ring: each worker sends 2(N − 1)/N of it)."""
    numel = sum(p.numel() for p in h.model().parameters())
    one = 2 * (WORKERS - 1) * numel * 8 // WORKERS
    expected = [one * sum(n % k == 0 for k in (2, 3, 4)) for n in range(1, STEPS + 1)]
    for result in scenarios:
        assert result[2, 3, 4]["traffic"] == expected
    assert expected[:6] == [0, one, one, 2 * one, 0, 2 * one]


def test_a_resumed_desloc_goes_on_as_if_never_stopped(scenarios):
    for result in scenarios:
        torch.testing.assert_close(result["resumed"], result[CASES[0]]["models"][-1], rtol=0, atol=1e-12)


def test_a_failure_rolls_desloc_back_to_the_checkpoint_with_its_moments(scenarios):
    """Under `restart`: after the failure every worker's Adam moments are the checkpoint's
    (step 4), not those of step 7, and the redone steps end on the model of the run without
    a failure (each worker's own: they differ between parameter averages)."""
    h.assert_rolled_back(scenarios, [1, 2, 3, 4, 5, 6, 7, 4] + list(range(5, STEPS + 1)),
                         failure_at=7, back_to=4)
    for result in scenarios:
        assert torch.equal(result["failed"]["model"], result[CASES[0]]["models"][-1])


@pytest.mark.parametrize("make, name", [
    (lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9), "SGD"),
    (lambda params: _muon(params), "MuonWithAdamW")])
def test_desloc_refuses_an_optimizer_without_adams_moments_in_one_line(make, name):
    from plugins.aggregators.desloc import DESLOC

    ctx = h.context(0, 1, make)
    with pytest.raises(ValueError) as error:
        DESLOC(DESLOC.Options()).setup(ctx)
    message = str(error.value)
    assert "\n" not in message and name in message and "exp_avg_sq" in message


def _muon(params):
    from plugins.optimizers import Muon

    return Muon(Muon.Options(adamw_first=0, adamw_last=0)).build(params)  # both matrices on Muon


def test_desloc_records_the_default_moment_periods(tmp_path):
    spec = write_spec(tmp_path, """
        defaults:
          task: {name: logreg, features: 4}
          workers: 2
          optimizer: adamw
        experiments:
          - name: a
            aggregator: {name: desloc, period: 5}
          - name: b
            aggregator: {name: desloc, period: 5, second_moment_period: 7}
    """)
    configs = [experiment.config["aggregator"] for experiment in load_spec(spec)]
    assert [(c["period"], c["first_moment_period"], c["second_moment_period"]) for c in configs] == [
        (5, 15, 30), (5, 15, 7)]

