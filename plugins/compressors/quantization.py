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
from plugins.compressors._common import (KernelCompressor, bucket_seeds, decoded_average,
                                        segments, warm_up_codes, warm_up_quantization,
                                        warm_up_terngrad)


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

    def warm_up(self, device=None) -> None:
        warm_up_quantization(device)
        warm_up_codes(nk.code_bits(self.options.levels), device)

    def guarantee(self, numel):
        omega = qsgd_omega(self.options.levels, self.options.bucket_size, numel)
        return Guarantee(delta=1.0 / (1.0 + omega)) if self.options.rescale else Guarantee(omega=omega)

    def compress_bucket(self, flat, layout, step):
        """Per tensor, as QSGD defines it: its own buckets of `bucket_size` (none straddles two
        tensors) and its own seed; the norms and the packed codes of all tensors end to end."""
        levels, bucket_size = self.options.levels, self.options.bucket_size
        norms, packed = nk.qsgd_packed_segments(
            flat, segments(layout), levels, bucket_size,
            bucket_seeds(self.ctx, layout, step, per_worker=True))
        if self.options.rescale:
            norms = self._rescale(norms, layout)
        return Payload([norms, packed])

    def _rescale(self, norms, layout):
        """Each norm times 1/(1 + ω), ω of its own tensor's size."""
        def factors():
            per_segment = [1.0 / (1.0 + qsgd_omega(self.options.levels, self.options.bucket_size, n))
                           for n in layout.sizes]
            if len(set(per_segment)) == 1:
                return per_segment[0]
            counts = [_bucket_count(n, self.options.bucket_size) for n in layout.sizes]
            return torch.tensor(per_segment, dtype=torch.float32, device=layout.device
                                ).repeat_interleave(torch.tensor(counts, device=layout.device))

        scale = layout.cached(("qsgd-rescale", self.options.levels, self.options.bucket_size),
                              factors)
        return norms * scale

    def decompress_bucket(self, payload, layout):
        norms, packed = payload.tensors
        levels = self.options.levels
        return nk.dequantize_segments(norms, packed, segments(layout), nk.code_bits(levels),
                                      levels, self.options.bucket_size, scratch=_codes(layout))

    def combine_bucket(self, payloads, layout):
        levels, bucket_size = self.options.levels, self.options.bucket_size
        table, scratch = segments(layout), _codes(layout)

        def decode(payload, total):
            norms, packed = payload.tensors
            nk.dequantize_segments(norms, packed, table, nk.code_bits(levels), levels,
                                   bucket_size, out=total, add=True, scratch=scratch)

        return decoded_average(payloads, layout, decode)


def _bucket_count(n: int, bucket_size: int) -> int:
    """QSGD buckets (norms) of a tensor of n elements."""
    if n == 0:
        return 0
    size = n if bucket_size <= 0 or bucket_size > n else bucket_size
    return -(-n // size)


def _codes(layout) -> torch.Tensor:
    """int8 scratch of one code per element of the bucket (unpacked codes), kept per bucket."""
    return layout.cached("int8 codes", lambda: torch.empty(layout.numel, dtype=torch.int8,
                                                           device=layout.device))


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

    def warm_up(self, device=None) -> None:
        warm_up_quantization(device)  # on the CPU the packing kernels load per width, at a
        # width's first use

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

    def compress_bucket(self, flat, layout, step):
        """Levels chosen per tensor; the payload: the levels (int8, one per tensor), the norms
        and the packed codes, each tensor's codes at its own width."""
        levels = [self.choose_levels(view) if view.numel() else 1 for view in layout.views(flat)]
        for view, chosen in zip(layout.views(flat), levels):
            if view.numel():
                self.ctx.metrics.log("dqsgd_levels", chosen)
        norms, packed = nk.qsgd_packed_segments(
            flat, segments(layout), levels, self.options.bucket_size,
            bucket_seeds(self.ctx, layout, step, per_worker=True))
        levels_tensor = torch.tensor(levels, dtype=torch.int8, device=flat.device)
        return Payload([levels_tensor, norms, packed])

    def _decode(self, payload, layout, out=None, add=False):
        levels_tensor, norms, packed = payload.tensors
        levels = levels_tensor.tolist()  # each worker's own: read on the host to find the bytes
        return nk.dequantize_segments(norms, packed, segments(layout),
                                      [nk.code_bits(v) for v in levels], levels,
                                      self.options.bucket_size, out=out, add=add,
                                      scratch=_codes(layout))

    def decompress_bucket(self, payload, layout):
        return self._decode(payload, layout)

    def combine_bucket(self, payloads, layout):
        return decoded_average(payloads, layout,
                               lambda payload, total: self._decode(payload, layout, total, True))


TERNARY_BITS = nk.TERNARY_BITS  # {-1, 0, 1} as 2-bit two's complement


class TernGrad(KernelCompressor):
    """`terngrad` (Wen et al., 2017): values in {−1, 0, 1} · max|v|, stochastic, unbiased.

    With m = max|v|, entry k is m·sign(v_k) with probability |v_k|/m, else 0, so
    E‖Q(v) − v‖² = Σ_k (m|v_k| − v_k²) = m‖v‖₁ − ‖v‖² ≤ (√d − 1)‖v‖² (m ≤ ‖v‖₂ and
    ‖v‖₁ ≤ √d‖v‖₂): unbiased with ω = √d − 1."""

    summable = False

    def warm_up(self, device=None) -> None:
        warm_up_terngrad(device)
        warm_up_codes(TERNARY_BITS, device)

    def guarantee(self, numel):
        return Guarantee(omega=math.sqrt(max(numel, 1)) - 1.0)

    def compress_bucket(self, flat, layout, step):
        """One scale (max |v|) per tensor, each tensor with its own seed."""
        scales, packed = nk.terngrad_packed_segments(
            flat, segments(layout), bucket_seeds(self.ctx, layout, step, per_worker=True))
        if 0 in layout.sizes:  # an empty tensor has no scale (nor a QSGD bucket) to send
            scales = scales[[s for s, n in enumerate(layout.sizes) if n]]
        return Payload([scales, packed])

    def decompress_bucket(self, payload, layout):
        # scale · t is QSGD's decoding with one level and one bucket per tensor
        scales, packed = payload.tensors
        return nk.dequantize_segments(scales, packed, segments(layout), TERNARY_BITS, 1, 0,
                                      scratch=_codes(layout))

    def combine_bucket(self, payloads, layout):
        table, scratch = segments(layout), _codes(layout)

        def decode(payload, total):
            scales, packed = payload.tensors
            nk.dequantize_segments(scales, packed, table, TERNARY_BITS, 1, 0, out=total,
                                   add=True, scratch=scratch)

        return decoded_average(payloads, layout, decode)
