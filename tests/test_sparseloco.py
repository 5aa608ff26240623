"""`sparseloco` (issue 50): DiLoCo's rounds with an error buffer and sparse 2-bit messages,
against a reference written from the definition (plugins/aggregators/sparseloco.py): two gloo
workers run the plugin, the reference simulates both in one process with torch's AdamW."""

from __future__ import annotations

import numpy
import pytest
import torch

import frontier_helpers as h
from conftest import write_spec
from distributed import run_workers
from dsgd_cli.spec.experiments import load_spec

WORKERS = 2
STEPS = 11  # rounds after steps 3, 6 and 9; steps 10 and 11 stay local
PERIOD, CHUNK, DECAY, OUTER_LR = 3, 4, 0.9, 0.8
CASES = [("topk", 3, 2), ("density", 0.5, 4)]  # (how many, its value, bits)
# checkpoints after steps 4 and 8; node 0 fails at 5.5 s, seen after step 6 (a round): back to 4
FAILURES = {"restart": 1, "checkpoint_every": 4, "at": [{"node": 0, "time": 5.5}]}


def _adamw(params):
    return torch.optim.AdamW(params, lr=0.05, weight_decay=0.1)


def _sparseloco(case):
    from plugins.aggregators.sparseloco import SparseLoCo

    kind, amount, bits = case
    return SparseLoCo(SparseLoCo.Options(period=PERIOD, chunk=CHUNK, decay=DECAY,
                                         outer_lr=OUTER_LR, bits=bits, **{kind: amount}))


def _scenarios(rank, n):
    torch.set_num_threads(1)
    results = {}
    for case in CASES:
        ctx = h.context(rank, n, _adamw)
        aggregator = _sparseloco(case)
        aggregator.setup(ctx)
        results[case] = h.run(aggregator, ctx, STEPS)
        results[case]["rounds"] = ctx.metrics.values.get("outer_rounds")
    results["resumed"] = h.resumed(rank, n, lambda: _sparseloco(CASES[0]), _adamw, stop=4, steps=STEPS)
    results["failed"] = h.failed(rank, n, lambda: _sparseloco(CASES[0]), _adamw, STEPS, FAILURES)
    return results


@pytest.fixture(scope="module")
def scenarios():
    return run_workers(_scenarios, WORKERS, preloaded=True)


# -- the reference ------------------------------------------------------------------------------

def _blocks(shape: tuple[int, ...]) -> list[tuple[slice, ...]]:
    """Chunks of a 1-D or 2-D tensor: per dimension the largest divisor not above CHUNK."""
    sides = [[d for d in range(1, n + 1) if n % d == 0 and d <= CHUNK][-1] for n in shape]
    return [tuple(slice(i * side, (i + 1) * side) for i, side in zip(start, sides))
            for start in numpy.ndindex(*[n // side for n, side in zip(shape, sides)])]


def _quantized(values: numpy.ndarray, bits: int) -> numpy.ndarray:
    """Each value replaced by the mean of its bin's values: bins of width 6σ / 2^bits around
    the mean μ, codes round((v − μ)/width + 2^bits/2) clamped to [0, 2^bits − 1]."""
    bins = 2**bits
    mu = values.mean()
    centered = values - mu
    sigma = numpy.sqrt((centered**2).sum() / (centered.size - 1)) if centered.size > 1 else 0.0
    width = 6 * sigma / bins or 1.0
    codes = numpy.clip(numpy.round(centered / width + bins // 2), 0, bins - 1)
    decoded = numpy.empty_like(values)
    for code in range(bins):
        chosen = codes == code
        if chosen.any():
            decoded[chosen] = centered[chosen].mean() + mu
    return decoded


def _compressed(error: numpy.ndarray, case) -> numpy.ndarray:
    """What a worker sends of its error buffer, as the others decode it (dense)."""
    kind, amount, bits = case
    chunks = _blocks(error.shape)
    picks = []
    for block in chunks:
        flat = error[block].ravel()
        k = amount if kind == "topk" else int(numpy.ceil(amount * flat.size))
        top = torch.from_numpy(numpy.abs(flat)).topk(min(k, flat.size)).indices.numpy()
        picks.append(top)
    values = numpy.concatenate([error[block].ravel()[top] for block, top in zip(chunks, picks)])
    decoded = iter(_quantized(values, bits))
    sent = numpy.zeros_like(error)
    for block, top in zip(chunks, picks):
        dense = numpy.zeros(error[block].size)
        for position in top:  # in the order the values were quantized
            dense[position] = next(decoded)
        sent[block] = dense.reshape(error[block].shape)
    return sent


def _reference(case, n: int = WORKERS) -> dict:
    nets = [h.model() for _ in range(n)]
    optimizers = [_adamw(net.parameters()) for net in nets]
    global_ = [p.detach().numpy().copy() for p in nets[0].parameters()]
    errors = [[numpy.zeros_like(x) for x in global_] for _ in range(n)]
    history = {rank: [] for rank in range(n)}
    for step in range(STEPS):
        h.local_steps(nets, optimizers, step)
        if (step + 1) % PERIOD == 0:
            total = [numpy.zeros_like(x) for x in global_]
            for rank, net in enumerate(nets):
                for i, (x, p) in enumerate(zip(global_, net.parameters())):
                    errors[rank][i] = DECAY * errors[rank][i] + (x - p.detach().numpy())
                    sent = _compressed(errors[rank][i], case)
                    errors[rank][i] = errors[rank][i] - sent
                    total[i] = total[i] + sent
            global_ = [x - OUTER_LR * (t / n) for x, t in zip(global_, total)]
            for net in nets:
                for p, x in zip(net.parameters(), global_):
                    p.data.copy_(torch.from_numpy(x))
        for rank, net in enumerate(nets):
            history[rank].append(h.flat(net))
    return history


# -- the tests ----------------------------------------------------------------------------------

@pytest.mark.parametrize("case", CASES, ids=["top3-2bit", "density0.5-4bit"])
def test_sparseloco_equals_its_definition(scenarios, case):
    reference = _reference(case)
    for rank, result in enumerate(scenarios):
        assert result[case]["rounds"] == [1.0, 2.0, 3.0]
        for step, (got, expected) in enumerate(zip(result[case]["models"], reference[rank])):
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-6, msg=f"rank {rank} step {step}")
    first, second = (r[case]["models"] for r in scenarios)
    assert torch.equal(first[2], second[2]) and not torch.equal(first[3], second[3])


def test_sparseloco_sends_its_sparse_message_once_per_round(scenarios):
    """Top 3 of chunks of 4: W1 12 entries, b1 6, W2 30, b2 5 (chunks of 1). Per tensor: a
    1-byte index per entry, the 2-bit codes packed 4 to a byte, a table of 4 float64."""
    per_round = (12 + 3 + 32) + (6 + 2 + 32) + (30 + 8 + 32) + (5 + 2 + 32)
    for result in scenarios:
        traffic = result[CASES[0]]["traffic"]
        assert traffic == [per_round * (WORKERS - 1) if (s + 1) % PERIOD == 0 else 0
                           for s in range(STEPS)]


def test_a_resumed_sparseloco_goes_on_as_if_never_stopped(scenarios):
    """Stopped after step 4, inside the second round: θ_global and the error buffers travel."""
    for result in scenarios:
        torch.testing.assert_close(result["resumed"], result[CASES[0]]["models"][-1], rtol=0, atol=1e-12)


def test_a_failure_rolls_sparseloco_back_to_the_checkpoint_with_its_error_buffers(scenarios):
    """Under `restart`: after the failure (after the round of step 6) every worker's error
    buffers, θ_global and AdamW moments are the checkpoint's (step 4), and the redone steps
    end on the model of the run without a failure."""
    h.assert_rolled_back(scenarios, [1, 2, 3, 4, 5, 6, 4, 5, 6, 7, 8, 9, 10, 11], failure_at=6,
                         back_to=4)
    for result in scenarios:
        assert torch.equal(result["failed"]["model"], result[CASES[0]]["models"][-1])


def test_pack_and_unpack_round_trip():
    from plugins.aggregators.sparseloco import pack, unpack

    for bits in (1, 2, 4, 8):
        codes = torch.randint(0, 2**bits, (13,), generator=torch.Generator().manual_seed(bits))
        packed = pack(codes, bits)
        assert packed.dtype == torch.uint8 and packed.numel() == -(-13 * bits // 8)
        assert torch.equal(unpack(packed, bits, 13), codes)


def test_sparseloco_records_its_topk_and_refuses_both_or_odd_bits(tmp_path):
    spec = """
        defaults:
          task: {{name: logreg, features: 4}}
          workers: 2
        experiments:
          - name: a
            aggregator: {{name: sparseloco, {options}}}
    """
    config = load_spec(write_spec(tmp_path, spec.format(options="period: 5")))[0].config
    assert (config["aggregator"]["topk"], config["aggregator"]["density"]) == (64, None)
    for options, message in [("topk: 3, density: 0.02", "give topk or density, not both"),
                             ("bits: 3", "bits: expected 1, 2, 4 or 8, got 3")]:
        with pytest.raises(Exception, match=message):
            load_spec(write_spec(tmp_path, spec.format(options=options)))
