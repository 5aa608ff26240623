"""Compressor plugins: outputs, PowerSGD, collectives on awkward sizes, real runs (error
feedback in `allreduce`: test_allreduce.py)."""

from __future__ import annotations

import traceback
from types import SimpleNamespace

import pytest
import torch

from conftest import compare_json, dsgd_in_process, write_spec
from distributed import run_workers
from dsgd_cli.spec import registry
from dsgd_cli.api import ErrorFeedback
from dsgd_cli.comm.communicator import Comm
from dsgd_cli.spec.experiments import build_plugin

COMPRESSORS = ["fp16", "bf16", "qsgd", "dqsgd", "terngrad", "sign", "ef_sign", "onebit",
               "topk", "randomk", "powersgd"]


class Recorder:
    def __init__(self):
        self.logged = []

    def log(self, name, value):
        self.logged.append((name, value))


def make(name: str, rank: int = 0, **options):
    compressor = build_plugin("compressor", {"name": name, **options})
    compressor.setup(SimpleNamespace(seed=3, rank=rank, world_size=1, metrics=Recorder()))
    return compressor


# Zeros count as positive (the packed bit is set for v_k >= 0); 7 entries, not a whole byte.
SIGNED = torch.tensor([3.0, -1.0, 0.0, -2.0, 0.5, -4.0, 1.5])


def _roundtrip(compressor, v: torch.Tensor) -> torch.Tensor:
    return compressor.decompress(compressor.compress(v, "w", 0), v)


def test_ef_sign_sends_the_mean_magnitude_times_the_sign():
    """(‖v‖₁/d) · sign(v) (Karimireddy et al., 2019): here ‖v‖₁/d = 12/7."""
    compressor = make("ef_sign")
    expected = 12 / 7 * torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0, -1.0, 1.0])
    torch.testing.assert_close(_roundtrip(compressor, SIGNED), expected, rtol=1e-6, atol=0)
    v = torch.randn(5, 11, generator=torch.Generator().manual_seed(4))
    signs = torch.where(v >= 0, 1.0, -1.0)
    torch.testing.assert_close(_roundtrip(compressor, v), v.abs().mean() * signs,
                               rtol=1e-6, atol=0)
    # what travels: the float32 scale and one bit per entry
    payload = compressor.compress(SIGNED, "w", 0)
    assert [t.numel() * t.element_size() for t in payload.tensors] == [4, 1]


def test_onebit_sends_the_mean_of_each_sign_class():
    """1-bit SGD (Seide et al., 2014): entries >= 0 become the mean of the entries >= 0
    (3, 0, 0.5, 1.5: 1.25), negative entries the mean of the negative ones (-1, -2, -4: -7/3),
    so each class keeps its sum."""
    compressor = make("onebit")
    high, low = 1.25, -7 / 3
    expected = torch.tensor([high, low, high, low, high, low, high])
    out = _roundtrip(compressor, SIGNED)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=0)
    torch.testing.assert_close(out.sum(), SIGNED.sum(), rtol=1e-6, atol=1e-6)
    v = torch.randn(5, 11, generator=torch.Generator().manual_seed(4))
    positive = v >= 0
    expected = torch.where(positive, v[positive].mean(), v[~positive].mean())
    torch.testing.assert_close(_roundtrip(compressor, v), expected, rtol=1e-6, atol=0)
    # one sign class empty: its level is never used
    torch.testing.assert_close(_roundtrip(compressor, SIGNED.abs()),
                               torch.full((7,), float(SIGNED.abs().mean())), rtol=1e-6, atol=0)
    payload = compressor.compress(SIGNED, "w", 0)
    assert [t.numel() * t.element_size() for t in payload.tensors] == [8, 1]


def test_dqsgd_picks_fewest_levels_within_budget():
    compressor = make("dqsgd", variance_budget=0.1)
    v = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    from plugins.compressors.quantization import quantization_variance
    chosen = compressor.choose_levels(v)
    assert quantization_variance(v, chosen, 512) <= 0.1 * float(v.pow(2).sum())
    assert chosen == 1 or quantization_variance(v, chosen // 2, 512) > 0.1 * float(v.pow(2).sum())
    # a looser budget never needs more levels
    assert make("dqsgd", variance_budget=10.0).choose_levels(v) <= chosen


def _powersgd_full_rank(rank, world_size):
    comm = Comm(rank, world_size)
    compressor = make("powersgd", rank=rank)
    compressor.options.rank = 8
    m = torch.randn(6, 8, generator=torch.Generator().manual_seed(rank + 10))
    m = m @ torch.randn(8, 20, generator=torch.Generator().manual_seed(rank + 20))  # 6 x 20
    [(average, local)] = compressor.exchange([m], ["w"], 0, comm, with_local=True)
    return m, average, local


def test_powersgd_full_rank_reconstructs_the_average(collectives):
    (m0, avg0, local0), (m1, avg1, _) = collectives("powersgd_full_rank")
    torch.testing.assert_close(avg0, (m0 + m1) / 2, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(avg0, avg1)
    torch.testing.assert_close(local0, m0, rtol=1e-4, atol=1e-4)  # full rank: nothing left over


def test_powersgd_low_rank_is_rank_r_and_warm_started():
    compressor = make("powersgd", rank=2)
    comm = SimpleNamespace(world_size=1, all_reduce=lambda t, op: t)
    # A matrix with a clear gap after the second singular value, so a few power iterations
    # reach its best rank-2 fit whatever the random start.
    generator = torch.Generator().manual_seed(5)
    u, _ = torch.linalg.qr(torch.randn(30, 30, generator=generator))
    v, _ = torch.linalg.qr(torch.randn(40, 30, generator=generator))
    singular_values = torch.cat([torch.tensor([10.0, 7.0]), torch.linspace(2.0, 0.1, 28)])
    m = u @ torch.diag(singular_values) @ v.T
    [first] = compressor.average_many([m], ["w"], 0, comm)
    assert torch.linalg.matrix_rank(first) == 2
    errors = []
    for step in range(1, 6):  # repeated power iterations on the same M converge to its best rank-2 fit
        [approx] = compressor.average_many([m], ["w"], step, comm)
        errors.append(float((m - approx).norm()))
    u, s, vh = torch.linalg.svd(m)
    best = float((m - u[:, :2] @ torch.diag(s[:2]) @ vh[:2]).norm())
    assert errors[-1] <= errors[0] + 1e-5 and errors[-1] < best * 1.01


def test_powersgd_error_feedback_keeps_what_the_rank_r_fit_left_out():
    """Over steps with error feedback the residual is exactly (g + e) − P Qᵀ of this worker's
    own fit (kept in a reused buffer, which is no part of the saved state)."""
    compressor = make("powersgd")  # rank 2
    comm = SimpleNamespace(world_size=1, all_reduce=lambda t, op: t)
    memory = ErrorFeedback()
    generator = torch.Generator().manual_seed(9)
    residual = torch.zeros(12, 16)
    for step in range(3):
        g = torch.randn(12, 16, generator=generator)
        compensated = g + residual
        [average] = compressor.average_many([g], ["w"], step, comm, memory)
        # One worker: the average is its own fit, so the residual is what the fit missed.
        torch.testing.assert_close(memory.residuals["w"], compensated - average)
        assert torch.linalg.matrix_rank(average) == 2
        residual = compensated - average
    assert set(compressor.state_dict()) == {"q_memory"}


def _average_awkward_sizes(rank, world_size, names):
    comm = Comm(rank, world_size)
    results = {}
    for name in names:
        compressor = make(name, rank=rank)
        for size in (0, 1, 7, 13):
            x = torch.full((size,), float(rank + 1))
            [average] = compressor.average_many([x], [f"t{size}"], 0, comm)
            results[(name, size)] = average
    # uneven all-gather: each rank contributes a different length, one of them empty
    results["uneven"] = comm.all_gather_uneven(torch.arange(float(rank * 3)))
    return results


AWKWARD = ["none", "fp16", "qsgd", "dqsgd", "terngrad", "sign", "ef_sign", "topk", "randomk",
           "powersgd"]


def test_empty_and_awkward_sizes_never_hang(collectives):
    names = AWKWARD
    first, second = collectives("awkward_sizes")
    for name in names:
        for size in (0, 1, 7, 13):
            assert first[(name, size)].shape == (size,)
            torch.testing.assert_close(first[(name, size)], second[(name, size)])
    for name in ("none", "fp16", "powersgd"):  # exact for these: the mean of 1 and 2
        torch.testing.assert_close(first[(name, 13)], torch.full((13,), 1.5))
    assert [t.tolist() for t in first["uneven"]] == [[], [0.0, 1.0, 2.0]]


SHAPES = [(0,), (1,), (7,), (13, 5), (3, 4, 2), (64, 32)]


def _average_many_against_one_by_one(rank, world_size, names):
    comm = Comm(rank, world_size)
    generator = torch.Generator().manual_seed(rank)
    tensors = [torch.randn(shape, generator=generator) for shape in SHAPES]
    keys = [f"t{i}" for i in range(len(SHAPES))]
    results = {}
    for name in names:
        batched_memory, single_memory = ErrorFeedback(), ErrorFeedback()
        comm.take_traffic()
        batched = make(name, rank=rank).average_many(tensors, keys, 5, comm, batched_memory)
        calls = comm.take_traffic().calls
        single = make(name, rank=rank)
        one_by_one = [single.average_many([t], [key], 5, comm, single_memory)[0]
                      for t, key in zip(tensors, keys)]
        # one flat residual for the bucket of all the tensors, one per tensor one by one
        [bucket] = batched_memory.residuals.values()
        parts = bucket.split([t.numel() for t in tensors])
        residuals = [(part.view(t.shape), single_memory.residuals[key])
                     for part, t, key in zip(parts, tensors, keys)]
        results[name] = (batched, one_by_one, residuals, calls)
    return results


def test_average_many_equals_one_tensor_at_a_time_in_one_or_two_collectives(collectives):
    """Batching the payloads of many tensors changes the number of messages, not the result."""
    names = ["none"] + COMPRESSORS
    for results in collectives("average_many"):
        for name in names:
            batched, one_by_one, residuals, calls = results[name]
            for average, expected, (residual, expected_residual), shape in zip(
                    batched, one_by_one, residuals, SHAPES):
                assert average.shape == residual.shape == shape, name
                torch.testing.assert_close(average, expected, rtol=1e-5, atol=1e-6)
                torch.testing.assert_close(residual, expected_residual, rtol=1e-5, atol=1e-6)
            # PowerSGD: P then Q; dqsgd: the payload lengths, then the payloads.
            assert calls == (2 if name in ("powersgd", "dqsgd") else 1), name


def _dqsgd_with_different_levels(rank, world_size):
    comm = Comm(rank, world_size)
    # A single spike needs 1 level for a small variance; Gaussian noise needs many.
    x = torch.zeros(300)
    if rank == 0:
        x[7] = 5.0
    else:
        x = torch.randn(300, generator=torch.Generator().manual_seed(1))
    compressor = make("dqsgd", rank=rank)
    [(average, local)] = compressor.exchange([x], ["t"], 0, comm, with_local=True)
    levels = [value for name, value in compressor.ctx.metrics.logged if name == "dqsgd_levels"]
    return average, local, levels


def test_dqsgd_payloads_of_different_lengths_average_exactly(collectives):
    (average0, local0, levels0), (average1, local1, levels1) = collectives("dqsgd_levels")
    assert levels0 == [1] and levels1[0] > 4  # 2-bit codes on one worker, wider on the other
    torch.testing.assert_close(average0, (local0 + local1) / 2, rtol=0, atol=1e-7)
    torch.testing.assert_close(average0, average1, rtol=0, atol=0)


def _collective_checks(rank, world_size):
    """The checks above that need a real group, one after another in the same two workers.
    A check that raises records its traceback and the next one still runs."""
    checks = {
        "powersgd_full_rank": lambda: _powersgd_full_rank(rank, world_size),
        "awkward_sizes": lambda: _average_awkward_sizes(rank, world_size, AWKWARD),
        "average_many": lambda: _average_many_against_one_by_one(
            rank, world_size, ["none"] + COMPRESSORS),
        "dqsgd_levels": lambda: _dqsgd_with_different_levels(rank, world_size),
    }
    results = {}
    for name, check in checks.items():
        try:
            results[name] = ("ok", check())
        except Exception:
            results[name] = ("error", traceback.format_exc())
    return results


@pytest.fixture(scope="module")
def collectives():
    """`collectives(check)`: each worker's result of that check of `_collective_checks`."""
    ranks = run_workers(_collective_checks, 2, preloaded=True)

    def results(check: str) -> list:
        errors = [f"rank {rank}:\n{r[check][1]}" for rank, r in enumerate(ranks)
                  if r[check][0] == "error"]
        assert not errors, "\n".join(errors)
        return [r[check][1] for r in ranks]

    return results


def test_every_compressor_registered():
    assert set(COMPRESSORS) | {"none"} <= set(registry.discover("compressor"))


def test_each_compressor_converges_on_logreg_and_counts_compressed_bytes(tmp_path):
    experiments = "\n".join(
        f"  - {{name: {name}, aggregator: {{name: allreduce, compressor: {{name: {name}}}}}}}"
        for name in COMPRESSORS if name not in ("sign", "topk", "randomk"))
    spec = write_spec(tmp_path, f"""
defaults:
  task: {{name: logreg}}
  workers: 2
  epochs: 2
  optimizer: {{name: sgd, lr: 0.5}}
experiments:
  - {{name: none, aggregator: {{name: allreduce}}}}
{experiments}
  - {{name: sign, optimizer: {{name: sgd, lr: 0.02}}, aggregator: {{name: allreduce, compressor: {{name: sign}}}}}}
  - {{name: topk, aggregator: {{name: allreduce, error_feedback: true, compressor: {{name: topk, ratio: 0.3}}}}}}
  - {{name: randomk, aggregator: {{name: allreduce, error_feedback: true, compressor: {{name: randomk, ratio: 0.3, unbiased: false}}}}}}
""")
    db = tmp_path / "r.db"
    result = dsgd_in_process("run", str(spec), "--db", str(db))
    assert result.returncode == 0, result.stdout + result.stderr
    rows = {r["experiment"]: r for r in compare_json(db)}
    for name, row in rows.items():
        assert row["status"] == "completed"
        assert row["test_accuracy"] > 0.75, name
        assert row["train_loss"] < 0.45, name  # log 2 = 0.69 at the start
    steps_bytes = rows["none"]["total_bytes_sent"]  # 10 float32 per worker per step, n = 2
    assert rows["fp16"]["total_bytes_sent"] == steps_bytes / 2
    assert rows["bf16"]["total_bytes_sent"] == steps_bytes / 2
    # all-gather over n = 2 sends the payload once: 2 sign bytes for 10 entries
    assert rows["sign"]["total_bytes_sent"] == steps_bytes * 2 / 40
    assert rows["ef_sign"]["total_bytes_sent"] == steps_bytes * (4 + 2) / 40
    assert rows["topk"]["total_bytes_sent"] == steps_bytes * 3 * (4 + 4) / 40  # k = 3 pairs
    # random-k: only the k values travel, in a ring all-reduce like 'none'
    assert rows["randomk"]["total_bytes_sent"] == steps_bytes * 3 * 4 / 40
    # bit-packed codes: 16 levels need 6 bits, so 10 codes take 8 bytes, plus one float32 norm
    assert rows["qsgd"]["total_bytes_sent"] == steps_bytes * (4 + 8) / 40
    # ternary codes take 2 bits: 3 bytes, plus the float32 scale
    assert rows["terngrad"]["total_bytes_sent"] == steps_bytes * (4 + 3) / 40
    # dqsgd: its levels (1 byte), a norm and 2 to 8 bits per code, each of the three tensors
    # all-gathered after its int64 length since workers' code widths may differ
    lengths = 3 * 8
    assert (steps_bytes * (1 + 4 + 3 + lengths) / 40 <= rows["dqsgd"]["total_bytes_sent"]
            <= steps_bytes * (1 + 4 + 10 + lengths) / 40)


@pytest.mark.parametrize("name, options", [("qsgd", {"levels": 2, "bucket_size": 8}),
                                           ("terngrad", {}), ("randomk", {"ratio": 0.25})])
def test_stochastic_compressors_are_unbiased(name, options):
    """The mean of many independent compressions (fresh seed per step) converges to v."""
    compressor = make(name, **options)
    v = torch.randn(50, generator=torch.Generator().manual_seed(2))
    trials = 4000
    total = torch.zeros(50, dtype=torch.float64)
    for step in range(trials):
        total += compressor.decompress(compressor.compress(v, "w", step), v).double()
    mean = total / trials
    # each coordinate's estimator has variance at most (scale·|v|)²-ish; 6 standard errors
    bound = 6 * (v.abs().max() * (50 / 12.5 if name == "randomk" else 2)) / trials**0.5
    assert float((mean - v.double()).abs().max()) < float(bound)


@pytest.mark.parametrize("name", ["qsgd", "dqsgd", "terngrad", "topk"])
def test_decoding_into_the_sum_is_the_sum_of_the_decompressions(name):
    """These compressors add each gathered payload into the average where it is decoded
    (packed codes, sparse entries) instead of decompressing it to a dense tensor first: the
    result is bit for bit the generic `Compressor.combine`."""
    from dsgd_cli.api import Compressor

    for shape in [(300, 70), (7,), (1,)]:
        like = torch.zeros(shape)
        payloads = [make(name, rank=rank).compress(
            torch.randn(shape, generator=torch.Generator().manual_seed(rank)), "w", 1)
            for rank in range(4)]
        combined = make(name).combine(payloads, like)
        assert torch.equal(combined, Compressor.combine(make(name), payloads, like))
        assert combined.shape == like.shape and combined.dtype == like.dtype


# -- what each compressor declares (Compressor.guarantee) -----------------------------------------

def _vectors(d: int) -> dict[str, torch.Tensor]:
    """Random vectors, and the shapes on which each bound is tight: all magnitudes equal (top-k
    and random-k lose exactly 1 − k/d), one large entry among small ones (the sign compressors
    keep only about 1/d), entries at half a QSGD level (its worst rounding)."""
    g = torch.Generator().manual_seed(d)
    signs = torch.where(torch.rand(d, generator=g) < 0.5, -1.0, 1.0)
    spike = torch.full((d,), 1e-3)
    spike[d // 3] = 1.0
    sparse = torch.randn(d, generator=g) * (torch.rand(d, generator=g) < 0.05)
    sparse[0] = 2.0
    return {"gaussian": torch.randn(d, generator=g),
            "heavy_tailed": torch.randn(d, generator=g) ** 3,
            "equal_magnitudes": signs,
            "spike": spike * signs,
            "sparse": sparse}


DECLARED = [  # (name, options, "unbiased" or "contractive" or both)
    ("none", {}, "both"), ("fp16", {}, "contractive"), ("bf16", {}, "contractive"),
    ("qsgd", {"levels": 2, "bucket_size": 16}, "unbiased"),
    ("qsgd", {"levels": 16}, "unbiased"),
    ("qsgd", {"levels": 2, "bucket_size": 16, "rescale": True}, "contractive"),
    ("qsgd", {"levels": 7, "bucket_size": 0, "rescale": True}, "contractive"),
    ("dqsgd", {"variance_budget": 0.1, "max_levels": 4, "bucket_size": 64}, "unbiased"),
    ("terngrad", {}, "unbiased"), ("ef_sign", {}, "contractive"),
    ("onebit", {}, "contractive"), ("topk", {"ratio": 0.1}, "contractive"),
    ("randomk", {"ratio": 0.1}, "unbiased"),
    ("randomk", {"ratio": 0.1, "unbiased": False}, "contractive"),
]


@pytest.mark.parametrize("name, options, kind", DECLARED,
                         ids=[f"{n}-{'-'.join(f'{k}={v}' for k, v in o.items())}"
                              for n, o, _ in DECLARED])
@pytest.mark.parametrize("d", [16, 1000])
def test_declared_omega_and_delta_hold_on_random_vectors(name, options, kind, d):
    """E‖Q(v) − v‖² / ‖v‖², the mean over 300 independent draws (a fresh seed per step),
    is within its declared bound: ω for unbiased compressors, 1 − δ for contractive ones. The
    mean may exceed a tight bound (random-k's is an equality) by sampling noise only: five
    standard errors of the mean."""
    compressor = make(name, **options)
    guarantee = compressor.guarantee(d)
    assert guarantee is not None
    assert guarantee.unbiased == (kind in ("unbiased", "both"))
    assert guarantee.contractive == (kind in ("contractive", "both"))
    bounds = [b for b in (guarantee.omega, None if guarantee.delta is None else 1 - guarantee.delta)
              if b is not None]
    draws = 300
    for shape, v in _vectors(d).items():
        errors = torch.tensor([float((_roundtrip_at(compressor, v, step).double() - v.double())
                                     .square().sum() / v.double().square().sum())
                               for step in range(draws)], dtype=torch.float64)
        mean, noise = float(errors.mean()), 5 * float(errors.std()) / draws**0.5
        for bound in bounds:
            assert mean <= bound + noise + 1e-6, (shape, mean, bound)


def _roundtrip_at(compressor, v, step):
    return compressor.decompress(compressor.compress(v, "w", step), v)


@pytest.mark.parametrize("name, options", [("sign", {}), ("powersgd", {})])
def test_compressors_without_a_bound_declare_none(name, options):
    assert make(name, **options).guarantee(1000) is None


def test_declared_bounds_are_the_papers_formulas():
    d = 1000
    assert make("topk", ratio=0.01).guarantee(d).delta == 10 / d
    assert make("randomk", ratio=0.01).guarantee(d).omega == d / 10 - 1
    assert make("randomk", ratio=0.01, unbiased=False).guarantee(d).delta == 10 / d
    assert make("ef_sign").guarantee(d).delta == 1 / d
    # QSGD: min(b/s², √b/s) with b the bucket; rescaled: δ = 1/(1 + ω)
    assert make("qsgd", levels=16, bucket_size=512).guarantee(d).omega == pytest.approx(512**0.5 / 16)
    assert make("qsgd", levels=16, bucket_size=0).guarantee(100).omega == pytest.approx(100 / 256)
    assert make("qsgd", levels=7, bucket_size=0, rescale=True).guarantee(d).delta == pytest.approx(
        1 / (1 + d**0.5 / 7))
    assert make("terngrad").guarantee(d).omega == pytest.approx(d**0.5 - 1)


def test_rescaled_qsgd_is_qsgd_with_its_norms_scaled():
    """Same codes, same bytes; only the float32 norms differ, by 1/(1 + ω)."""
    v = torch.randn(300, generator=torch.Generator().manual_seed(4))
    plain = make("qsgd", levels=7, bucket_size=128).compress(v, "w", 5)
    scaled = make("qsgd", levels=7, bucket_size=128, rescale=True).compress(v, "w", 5)
    omega = min(128 / 49, 128**0.5 / 7)
    assert torch.equal(plain.tensors[1], scaled.tensors[1])
    torch.testing.assert_close(scaled.tensors[0], plain.tensors[0] * (1 / (1 + omega)))


def _fraction_rounded_differently(first: torch.Tensor, second: torch.Tensor) -> float:
    return float((first != second).double().mean())


@pytest.mark.parametrize("name, options", [("qsgd", {}), ("dqsgd", {}), ("terngrad", {})])
def test_stochastic_rounding_is_drawn_independently_on_each_rank(name, options):
    """Workers quantizing the same vector at the same step round it independently: two ranks
    disagree on as many entries as two independent draws (two steps of one rank) do, and a
    rank repeats its own draw (the seed is the rank's, not fresh randomness)."""
    v = torch.randn(20000, generator=torch.Generator().manual_seed(8))
    step = 7
    draws = [_roundtrip_at(make(name, rank=rank, **options), v, step) for rank in range(4)]
    again = make(name, rank=0, **options)
    independent = _fraction_rounded_differently(_roundtrip_at(again, v, step),
                                                _roundtrip_at(again, v, step + 1))
    assert torch.equal(_roundtrip_at(again, v, step), draws[0])
    assert independent > 0.05
    tolerance = 5 * (independent / v.numel()) ** 0.5  # about five standard deviations
    for a in range(4):
        for b in range(a + 1, 4):
            across = _fraction_rounded_differently(draws[a], draws[b])
            assert abs(across - independent) < tolerance, (a, b, across, independent)


def test_randomk_draws_the_same_indices_on_every_rank():
    """Random-k payloads are summed, so every rank keeps the same entries of its own vector:
    the same indices on every rank at a step, new ones at the next step."""
    vectors = [torch.randn(5000, generator=torch.Generator().manual_seed(rank))
               for rank in range(4)]
    payloads = [make("randomk", rank=rank, ratio=0.01).compress(v, "w", 3)
                for rank, v in enumerate(vectors)]
    for rank, payload in enumerate(payloads):
        assert torch.equal(payload.context, payloads[0].context)
        assert torch.equal(payload.tensors[0], vectors[rank][payload.context] * 100)  # d/k
    next_step = make("randomk", rank=0, ratio=0.01).compress(vectors[0], "w", 4)
    assert not torch.equal(next_step.context, payloads[0].context)


# -- the collective is chosen on the communication side (dsgd_cli/comm/compressed.py) -----------

class _OneWorker:
    """A communicator of one worker that counts its collectives."""

    world_size = 1

    def __init__(self):
        self.calls = []

    def all_reduce(self, tensor, op="sum"):
        self.calls.append("all_reduce")

    def all_gather(self, tensor):
        self.calls.append("all_gather")
        return [tensor.clone()]


def test_compressed_average_chooses_the_collective_from_what_the_compressor_declares():
    from dsgd_cli.api import compressed_average

    x = torch.arange(6.0).reshape(2, 3)
    for name, collective in (("fp16", "all_reduce"), ("sign", "all_gather"),
                             ("dqsgd", "all_gather")):
        comm, memory = _OneWorker(), ErrorFeedback()
        compressor = make(name)
        [average] = compressed_average(compressor, comm, [x], ["w"], 0, memory)
        assert set(comm.calls) == {collective}, name
        # one worker: the average is its own payload, the residual what that left out
        torch.testing.assert_close(average, _roundtrip(compressor, x))
        torch.testing.assert_close(memory.residuals["w"], x - average)


def test_third_party_overrides_of_average_many_and_exchange_are_still_used():
    """Compressors written against the collective-choosing `Compressor` of earlier versions
    (and PowerSGD, which needs two rounds) keep their own `average_many` or `exchange`."""
    from dsgd_cli.api import Compressor, Payload, compressed_average

    class Plain(Compressor):
        def compress(self, tensor, key, step):
            return Payload([tensor.clone()])

        def decompress(self, payload, like):
            return payload.tensors[0].view_as(like)

    class OwnAverage(Plain):
        def average_many(self, tensors, keys, step, comm, memory=None):
            return [t * 0 + 7 for t in tensors]

    class OwnExchange(Plain):
        def exchange(self, tensors, keys, step, comm, with_local=False):
            return [(t * 0 + 5, t * 0 + 1 if with_local else None) for t in tensors]

    class Halving(Plain):
        def average_many(self, tensors, keys, step, comm, memory=None):  # calls the base's
            return [t / 2 for t in super().average_many(tensors, keys, step, comm, memory)]

    x = torch.ones(3)
    assert compressed_average(OwnAverage(), _OneWorker(), [x], ["w"], 0)[0].tolist() == [7] * 3
    memory = ErrorFeedback()
    assert compressed_average(OwnExchange(), _OneWorker(), [x], ["w"], 0, memory)[0].tolist() == [5] * 3
    assert memory.residuals["w"].tolist() == [0] * 3  # x − own payload (1)
    assert compressed_average(Halving(), _OneWorker(), [x], ["w"], 0)[0].tolist() == [0.5] * 3
    assert compressed_average(Plain(), _OneWorker(), [x], ["w"], 0)[0].tolist() == [1] * 3
    powersgd, comm = make("powersgd", rank=1), _OneWorker()
    compressed_average(powersgd, comm, [torch.randn(4, 6)], ["w"], 0)
    assert comm.calls == ["all_reduce", "all_reduce"]  # P, then Q: its own two rounds
