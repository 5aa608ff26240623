"""`demo` (issue 50): Decoupled Momentum, against a reference written from the authors' update
(bloc97/DeMo `demo.py`): chunk sides by the divisor rule, the orthonormal DCT-II per chunk
(here scipy's, block by block), the top-k per chunk, the mean over the workers that chose a
position, the sign step, decoupled weight decay first. Two gloo workers run the plugin; the
reference simulates both in one process."""

from __future__ import annotations

import numpy
import pytest
import scipy.fft
import torch

import frontier_helpers as h
from distributed import run_workers

WORKERS = 2
STEPS = 8
LR = 0.05
OPTIONS = dict(decay=0.9, topk=3, chunk=4, weight_decay=0.1)
# checkpoints after steps 3 and 6; node 1 fails at 4.5 s, seen after step 5: back to step 3
FAILURES = {"restart": 1, "checkpoint_every": 3, "at": [{"node": 1, "time": 4.5}]}


def _lr(step: int) -> float:
    """A schedule's rate at `step`: 2 steps of warm-up to LR, then a decay by 0.7 a step. It
    varies, so that a δ ← βδ + g (lr left out) or a step by another lr is seen: the sign
    step alone would hide a constant lr's scale."""
    return LR * (step + 1) / 3 if step < 2 else LR * 0.7 ** (step - 2)


def _sgd(params):
    return torch.optim.SGD(params, lr=LR)


def _demo():
    from plugins.aggregators.demo import DeMo

    return DeMo(DeMo.Options(**OPTIONS))


def _scenarios(rank, n):
    torch.set_num_threads(1)
    ctx = h.context(rank, n, _sgd)
    aggregator = _demo()
    aggregator.setup(ctx)
    result = h.run(aggregator, ctx, STEPS, lr=_lr)
    result["resumed"] = h.resumed(rank, n, _demo, _sgd, stop=3, steps=STEPS, lr=_lr)
    result["failed"] = h.failed(rank, n, _demo, _sgd, STEPS, FAILURES, lr=_lr)
    return result


@pytest.fixture(scope="module")
def scenarios():
    return run_workers(_scenarios, WORKERS, preloaded=True)


# -- the reference ------------------------------------------------------------------------------

def _side(length: int, target: int) -> int:
    """The largest divisor of `length` that is not above `target`."""
    return [d for d in range(1, length + 1) if length % d == 0 and d <= target][-1]


def _blocks(shape: tuple[int, ...], target: int) -> list[tuple[slice, ...]]:
    """The chunks of a 1-D or 2-D tensor, as slices: runs of l, or blocks of r×c."""
    sides = [_side(n, target) for n in shape]
    starts = numpy.ndindex(*[n // side for n, side in zip(shape, sides)])
    return [tuple(slice(i * side, (i + 1) * side) for i, side in zip(start, sides))
            for start in starts]


def _compress(delta: numpy.ndarray, target: int, k: int) -> dict:
    """{(chunk, position in the chunk's row-major coefficients): value} of the top-k
    coefficients of every chunk's orthonormal DCT-II."""
    kept = {}
    for chunk, block in enumerate(_blocks(delta.shape, target)):
        coefficients = scipy.fft.dctn(delta[block], norm="ortho").ravel()
        top = torch.from_numpy(numpy.abs(coefficients)).topk(min(k, coefficients.size)).indices
        for position in top.tolist():
            kept[chunk, position] = coefficients[position]
    return kept


def _decompress(values: dict, shape: tuple[int, ...], target: int) -> numpy.ndarray:
    out = numpy.zeros(shape)
    for chunk, block in enumerate(_blocks(shape, target)):
        size = out[block].shape
        coefficients = numpy.zeros(numpy.prod(size))
        for (c, position), value in values.items():
            if c == chunk:
                coefficients[position] = value
        out[block] = scipy.fft.idctn(coefficients.reshape(size), norm="ortho")
    return out


def _reference(n: int = WORKERS) -> dict:
    """DeMo from its definition, every worker simulated: per worker and parameter δ; per
    step x ← x(1 − lr·wd), δ ← βδ + lr·g, q = top-k of DCT(δ) per chunk, δ ← δ − IDCT(q);
    Q = per position the mean of the workers' values there; x ← x − lr·sign(IDCT(Q))."""
    beta, k, target, wd = OPTIONS["decay"], OPTIONS["topk"], OPTIONS["chunk"], OPTIONS["weight_decay"]
    net = h.model()
    params = [p.detach().numpy().copy() for p in net.parameters()]  # identical on all workers
    deltas = [[numpy.zeros_like(x) for x in params] for _ in range(n)]
    history, shared = [], {1: 0, 2: 0}  # positions chosen by one worker, by both
    for step in range(STEPS):
        lr, grads = _lr(step), []
        for rank in range(n):
            for p, x in zip(net.parameters(), params):
                p.data = torch.from_numpy(x.copy())
            grads.append([g.numpy() for g in h.gradients(net, rank, step)])
        params = [x * (1 - lr * wd) for x in params]
        sent = [[] for _ in params]
        for rank in range(n):
            for i, x in enumerate(params):
                delta = deltas[rank][i] = beta * deltas[rank][i] + lr * grads[rank][i]
                kept = _compress(delta, target, k)
                deltas[rank][i] = delta - _decompress(kept, x.shape, target)
                sent[i].append(kept)
        for i, x in enumerate(params):
            chosen = {}
            for kept in sent[i]:
                for key, value in kept.items():
                    chosen.setdefault(key, []).append(value)
            for values in chosen.values():
                shared[len(values)] += 1
            mean = {key: sum(values) / len(values) for key, values in chosen.items()}
            params[i] = x - lr * numpy.sign(_decompress(mean, x.shape, target))
        history.append(torch.from_numpy(numpy.concatenate([x.ravel() for x in params])))
    return {"models": history, "shared": shared}


# -- the tests ----------------------------------------------------------------------------------

def test_demo_equals_the_authors_update(scenarios):
    reference = _reference()
    assert reference["shared"][1] > 0 and reference["shared"][2] > 0  # both cases of the mean
    for rank, result in enumerate(scenarios):
        assert len(result["models"]) == STEPS
        for step, (got, expected) in enumerate(zip(result["models"], reference["models"])):
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-6, msg=f"rank {rank} step {step}")
    assert all(torch.equal(a, b) for a, b in zip(scenarios[0]["models"], scenarios[1]["models"]))


def test_demo_sends_k_indices_and_values_per_chunk(scenarios):
    """Chunk target 4, top 3: W1 8×6 in 4 blocks of 4×3 (12 pairs), b1 in 2 runs of 4 (6),
    W2 5×8 in 10 blocks of 1×4 (30), b2 in 5 runs of 1 (5 pairs: a chunk of 1 sends 1): 53
    pairs of a 1-byte index and a float64 value, to the one other worker, every step."""
    for result in scenarios:
        assert result["traffic"] == [53 * (1 + 8) * (WORKERS - 1)] * STEPS


def test_a_resumed_demo_goes_on_as_if_never_stopped(scenarios):
    for result in scenarios:
        torch.testing.assert_close(result["resumed"], result["models"][-1], rtol=0, atol=1e-12)


def test_a_failure_rolls_demo_back_to_the_checkpoint_with_its_momenta(scenarios):
    """Under `restart`: after the failure every worker's δ is the checkpoint's (step 3), not
    what it was at the failure (step 5), and the redone steps end on the model of the run
    without a failure, the same on both workers."""
    h.assert_rolled_back(scenarios, [1, 2, 3, 4, 5, 3, 4, 5, 6, 7, 8], failure_at=5, back_to=3)
    for result in scenarios:
        assert torch.equal(result["failed"]["model"], result["models"][-1])


def test_chunk_sides_follow_the_divisor_rule():
    from plugins.aggregators.demo import chunk_side

    assert [chunk_side(n, 64) for n in (768, 3072, 50257, 100, 64, 7, 1)] == [64, 64, 29, 50, 64, 7, 1]
    assert chunk_side(12, 5) == 4 and chunk_side(13, 5) == 1


def test_the_dct_is_orthonormal_dct_ii():
    from plugins.aggregators.demo import dct_matrix

    x = numpy.random.default_rng(0).normal(size=6)
    numpy.testing.assert_allclose(dct_matrix(6).numpy() @ x, scipy.fft.dct(x, norm="ortho"), atol=1e-12)
    numpy.testing.assert_allclose(dct_matrix(6).numpy() @ dct_matrix(6).numpy().T, numpy.eye(6), atol=1e-12)


@pytest.mark.parametrize("make, what", [
    (lambda params: torch.optim.AdamW(params), "AdamW"),
    (lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9), "SGD")])
def test_demo_refuses_an_optimizer_other_than_plain_sgd_in_one_line(make, what):
    ctx = h.context(0, 1, make)
    with pytest.raises(ValueError) as error:
        _demo().setup(ctx)
    assert "\n" not in str(error.value) and what in str(error.value)
