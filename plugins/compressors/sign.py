"""One bit per element: signSGD with majority vote, error-feedback sign, 1-bit SGD.

Signs travel packed, eight per byte (bit set for v_k ≥ 0).
"""

from __future__ import annotations

import torch

import numba_kernels as nk
from dsgd_cli.api import Guarantee, Payload
from plugins.compressors._common import KernelCompressor, segments, warm_up_signs


_on_gpu = nk.runs_on_gpu


class Sign(KernelCompressor):
    """`sign` (signSGD, Bernstein et al., 2018): each worker sends sign(v); the update is the
    majority vote, sign(Σ_i sign(v_i)), with magnitude 1 per element (use a small lr).

    It declares no bound (`guarantee` is None): sign(v) has no scale, so ‖Q(v) − v‖ is not
    bounded by ‖v‖ (v = 0.001·1 gives ‖Q(v) − v‖² ≈ d). `ef_sign` is its scaled version."""

    summable = False

    def warm_up(self, device=None) -> None:
        warm_up_signs(device)

    def compress_bucket(self, flat, layout, step):
        return Payload([nk.sign_pack_segments(flat, segments(layout))])

    def decompress_bucket(self, payload, layout):
        high, low = layout.cached("±1", lambda: (
            torch.ones(len(layout.sizes), device=layout.device),
            torch.full((len(layout.sizes),), -1.0, device=layout.device)))
        return nk.sign_unpack_segments(payload.tensors[0], segments(layout), high, low)

    def combine_bucket(self, payloads, layout):
        stacked = torch.stack([p.tensors[0] for p in payloads])
        return nk.sign_vote_segments(stacked, segments(layout))


class EFSign(KernelCompressor):
    """`ef_sign` (Karimireddy et al., 2019): (‖v‖₁/d) · sign(v), always with error feedback.

    Contractive with δ = 1/d: with a = ‖v‖₁/d, ⟨Q(v), v⟩ = a‖v‖₁ and ‖Q(v)‖² = d a², so
    ‖Q(v) − v‖² = ‖v‖² − ‖v‖₁²/d ≤ (1 − 1/d)‖v‖² since ‖v‖₁ ≥ ‖v‖₂ (zeros count as +, which
    changes neither product)."""

    summable = False
    requires_error_feedback = True

    def warm_up(self, device=None) -> None:
        warm_up_signs(device)

    def guarantee(self, numel):
        return Guarantee(delta=1.0 / max(numel, 1))

    def compress_bucket(self, flat, layout, step):
        """One scale per tensor, ‖v‖₁/d of that tensor."""
        views = layout.views(flat)
        if _on_gpu(flat):  # one multi-tensor kernel
            sizes = layout.cached("sizes", lambda: torch.tensor([max(n, 1) for n in layout.sizes],
                                                            device=flat.device))
            scales = torch.stack(torch._foreach_norm(views, 1)) / sizes
        else:  # tensor by tensor: torch's mean, bit for bit what it was per tensor
            scales = torch.stack([v.abs().mean() if v.numel() else v.new_zeros(()) for v in views])
        return Payload([scales.float(), nk.sign_pack_segments(flat, segments(layout))])

    def decompress_bucket(self, payload, layout):
        scales, packed = payload.tensors
        return nk.sign_unpack_segments(packed, segments(layout), scales, -scales)


class OneBit(KernelCompressor):
    """`onebit` (1-bit SGD, Seide et al., 2014): each element becomes the mean of the
    non-negative entries or the mean of the negative ones, by its sign; error feedback.

    Contractive with δ = 1/d: replacing a class g of n_g same-signed entries by their mean m_g
    leaves ‖v_g‖² − n_g m_g² of error, and n_g m_g² = (Σ_g v_k)²/n_g ≥ ‖v_g‖²/n_g ≥ ‖v_g‖²/d
    (entries of one sign: (Σ|v_k|)² ≥ Σ v_k²)."""

    summable = False
    requires_error_feedback = True

    def warm_up(self, device=None) -> None:
        warm_up_signs(device)

    def guarantee(self, numel):
        return Guarantee(delta=1.0 / max(numel, 1))

    def compress_bucket(self, flat, layout, step):
        """Per tensor, the mean of its entries >= 0 and of its negative ones: (high, low)
        pairs end to end."""
        means = [_class_means(v.reshape(-1)) for v in layout.views(flat)]
        levels = torch.stack([m for pair in means for m in pair]).float()
        return Payload([levels, nk.sign_pack_segments(flat, segments(layout))])

    def decompress_bucket(self, payload, layout):
        levels, packed = payload.tensors
        return nk.sign_unpack_segments(packed, segments(layout), levels[0::2].contiguous(),
                                       levels[1::2].contiguous())


def _class_means(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean of the entries >= 0, mean of the negative ones), 0 for an empty class."""
    positive = flat >= 0
    if _on_gpu(flat):  # masked sums: no synchronisation for the classes' sizes
        count = positive.sum()
        total = flat.sum()
        high_sum = torch.where(positive, flat, 0).sum()
        high = torch.where(count > 0, high_sum / count.clamp(min=1), 0.0)
        others = flat.numel() - count
        low = torch.where(others > 0, (total - high_sum) / others.clamp(min=1), 0.0)
        return high, low
    # on the CPU, torch's mean of the selected entries, as it always was
    high = flat[positive].mean() if positive.any() else flat.new_zeros(())
    low = flat[~positive].mean() if (~positive).any() else flat.new_zeros(())
    return high, low
