"""Stochastic quantizers: QSGD, its dynamic-level variant, and TernGrad.

All are unbiased (E[decompress(compress(v))] = v). The integer codes travel bit-packed, with
as many bits per element as their range needs (2 for TernGrad, 6 for 16 QSGD levels), plus a
few float32 scales; workers' scales differ, so payloads are all-gathered, not summed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

import numba_kernels as nk
from dsgd_cli.api import Guarantee, Payload, option
from plugins.compressors._common import (KernelCompressor, decoded_average, tensor_seed, warm_up_codes,
                                        warm_up_quantization, warm_up_terngrad)


def qsgd_omega(levels: int, bucket_size: int, numel: int) -> float:
    """QSGD's variance factor ω = min(b/s², √b/s) (Alistarh et al., 2017, Lemma 3.1) for
    buckets of b = min(bucket_size, d) elements: each bucket's error is at most ω times its
    squared norm (ω grows with b, so the shorter last bucket keeps it too), hence the whole
    tensor's is at most ω‖v‖²."""
    b = max(1, numel if bucket_size <= 0 else min(bucket_size, numel))
    return min(b / levels**2, math.sqrt(b) / levels)


@dataclass
class QSGDOptions:
    levels: int = option(16, min=1, max=127, help="quantization levels s")
    bucket_size: int = option(512, min=0, help="elements sharing one norm (0: whole tensor)")
    rescale: bool = option(False, help="scale by 1/(1 + ω): biased but contractive, for choco "
                                       "and dcd")


class QSGD(KernelCompressor):
    """`qsgd` (Alistarh et al., 2017): Q_s(v)_k = ‖v‖₂ · sign(v_k) · ξ_k, ξ_k ∈ {l/s, (l+1)/s}
    by stochastic rounding; unbiased, variance ≤ ω‖v‖² with ω = min(b/s², √b/s) for buckets
    of b elements (`qsgd_omega`).

    `rescale: true` is the scaled QSGD of CHOCO-SGD (Koloskova et al., 2019): Q/(1 + ω). For a
    scale a with a(1 + ω) ≤ 1, E‖aQ(v) − v‖² = a²E‖Q(v)‖² − 2a‖v‖² + ‖v‖² ≤ (1 − a)‖v‖²
    (E‖Q(v)‖² ≤ (1 + ω)‖v‖²): contractive with δ = 1/(1 + ω). The scale multiplies the
    bucket norms before they travel, so the payload and its decoding stay those of QSGD."""

    Options = QSGDOptions
    summable = False

    def warm_up(self) -> None:
        warm_up_quantization()
        warm_up_codes(nk.code_bits(self.options.levels))

    def guarantee(self, numel):
        omega = qsgd_omega(self.options.levels, self.options.bucket_size, numel)
        return Guarantee(delta=1.0 / (1.0 + omega)) if self.options.rescale else Guarantee(omega=omega)

    def compress(self, tensor, key, step):
        seed = tensor_seed(self.ctx, key, step, per_worker=True)
        levels = self.options.levels
        norms, q = nk.qsgd_quantize(tensor.reshape(-1), levels, self.options.bucket_size, seed)
        if self.options.rescale:
            omega = qsgd_omega(levels, self.options.bucket_size, tensor.numel())
            norms = norms * (1.0 / (1.0 + omega))
        return Payload([norms, nk.pack_codes(q, nk.code_bits(levels))])

    def decompress(self, payload, like):
        norms, packed = payload.tensors
        levels = self.options.levels
        q = nk.unpack_codes(packed, like.numel(), nk.code_bits(levels))
        return nk.qsgd_dequantize(norms, q, levels, self.options.bucket_size).view(like.shape)

    def combine(self, payloads, like):
        levels, bucket_size = self.options.levels, self.options.bucket_size

        def decode(payload, total):
            norms, packed = payload.tensors
            nk.dequantize_add(norms, packed, nk.code_bits(levels), levels, bucket_size, total)

        return decoded_average(payloads, like, decode)


@dataclass
class DQSGDOptions:
    variance_budget: float = option(0.25, min=0.0, help="largest allowed E‖Q(v)−v‖² / ‖v‖²")
    max_levels: int = option(127, min=1, max=127, help="most levels ever used")
    bucket_size: int = option(512, min=0, help="elements sharing one norm (0: whole tensor)")


def quantization_variance(v: torch.Tensor, levels: int, bucket_size: int) -> float:
    """Exact E‖Q_s(v) − v‖² of QSGD with `levels`: Σ_k (‖b‖/s)² p_k (1 − p_k), where p_k is the
    fractional part of |v_k|·s/‖b‖ and b the bucket of k."""
    flat = v.reshape(-1).double()
    size = bucket_size if bucket_size > 0 else max(flat.numel(), 1)
    pad = (-flat.numel()) % size
    buckets = torch.nn.functional.pad(flat, (0, pad)).view(-1, size)
    norms = buckets.norm(dim=1, keepdim=True)
    scaled = torch.where(norms > 0, buckets.abs() * levels / norms, torch.zeros_like(buckets))
    p = scaled - scaled.floor()
    return float(((norms / levels) ** 2 * p * (1 - p)).sum())


class DQSGD(KernelCompressor):
    """`dqsgd`: QSGD whose number of levels is chosen per step and per tensor: the fewest
    levels (powers of two, up to `max_levels`) whose exact quantization variance for this
    gradient stays within `variance_budget` of ‖v‖². Fewer levels cost fewer bits on a
    bit-packed wire; the choice is logged as the metric `dqsgd_levels`.

    Unbiased with ω = max(variance_budget, QSGD's ω at `max_levels`): when even `max_levels`
    misses the budget it is used anyway, with QSGD's bound."""

    Options = DQSGDOptions
    summable = False
    uniform_payload = False  # the packed codes' length follows each worker's levels

    def warm_up(self) -> None:
        warm_up_quantization()  # the packing kernels load per width, at a width's first use

    def guarantee(self, numel):
        worst = qsgd_omega(self.options.max_levels, self.options.bucket_size, numel)
        return Guarantee(omega=max(self.options.variance_budget, worst))

    def choose_levels(self, v: torch.Tensor) -> int:
        budget = self.options.variance_budget * float(v.double().pow(2).sum())
        candidates = [2**i for i in range(int(math.log2(self.options.max_levels)) + 1)]
        candidates.append(self.options.max_levels)
        for levels in sorted(set(candidates)):
            if quantization_variance(v, levels, self.options.bucket_size) <= budget:
                return levels
        return self.options.max_levels

    def compress(self, tensor, key, step):
        levels = self.choose_levels(tensor)
        self.ctx.metrics.log("dqsgd_levels", levels)
        seed = tensor_seed(self.ctx, key, step, per_worker=True)
        norms, q = nk.qsgd_quantize(tensor.reshape(-1), levels, self.options.bucket_size, seed)
        levels_tensor = torch.tensor([levels], dtype=torch.int8, device=tensor.device)
        return Payload([levels_tensor, norms, nk.pack_codes(q, nk.code_bits(levels))])

    def decompress(self, payload, like):
        levels_tensor, norms, packed = payload.tensors
        levels = int(levels_tensor[0])
        q = nk.unpack_codes(packed, like.numel(), nk.code_bits(levels))
        return nk.qsgd_dequantize(norms, q, levels, self.options.bucket_size).view(like.shape)

    def combine(self, payloads, like):
        def decode(payload, total):
            levels_tensor, norms, packed = payload.tensors
            levels = int(levels_tensor[0])
            nk.dequantize_add(norms, packed, nk.code_bits(levels), levels,
                              self.options.bucket_size, total)

        return decoded_average(payloads, like, decode)


TERNARY_BITS = 2  # {-1, 0, 1} as 2-bit two's complement


class TernGrad(KernelCompressor):
    """`terngrad` (Wen et al., 2017): values in {−1, 0, 1} · max|v|, stochastic, unbiased.

    With m = max|v|, entry k is m·sign(v_k) with probability |v_k|/m, else 0, so
    E‖Q(v) − v‖² = Σ_k (m|v_k| − v_k²) = m‖v‖₁ − ‖v‖² ≤ (√d − 1)‖v‖² (m ≤ ‖v‖₂ and
    ‖v‖₁ ≤ √d‖v‖₂): unbiased with ω = √d − 1."""

    summable = False

    def warm_up(self) -> None:
        warm_up_terngrad()
        warm_up_codes(TERNARY_BITS)

    def guarantee(self, numel):
        return Guarantee(omega=math.sqrt(max(numel, 1)) - 1.0)

    def compress(self, tensor, key, step):
        seed = tensor_seed(self.ctx, key, step, per_worker=True)
        scale, t = nk.terngrad_quantize(tensor.reshape(-1), seed)
        return Payload([scale, nk.pack_codes(t, TERNARY_BITS)])

    def decompress(self, payload, like):
        scale, packed = payload.tensors
        t = nk.unpack_codes(packed, like.numel(), TERNARY_BITS)
        return nk.terngrad_dequantize(scale, t).view(like.shape)

    def combine(self, payloads, like):
        # scale · t is QSGD's decoding with one level and one bucket
        def decode(payload, total):
            scale, packed = payload.tensors
            nk.dequantize_add(scale, packed, TERNARY_BITS, 1, 0, total)

        return decoded_average(payloads, like, decode)
