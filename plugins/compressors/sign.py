"""One bit per element: signSGD with majority vote, error-feedback sign, 1-bit SGD.

Signs travel packed, eight per byte (bit set for v_k ≥ 0).
"""

from __future__ import annotations

import torch

import numba_kernels as nk
from dsgd_cli.api import Guarantee, Payload
from plugins.compressors._common import KernelCompressor, warm_up_signs


class Sign(KernelCompressor):
    """`sign` (signSGD, Bernstein et al., 2018): each worker sends sign(v); the update is the
    majority vote, sign(Σ_i sign(v_i)), with magnitude 1 per element (use a small lr).

    It declares no bound (`guarantee` is None): sign(v) has no scale, so ‖Q(v) − v‖ is not
    bounded by ‖v‖ (v = 0.001·1 gives ‖Q(v) − v‖² ≈ d). `ef_sign` is its scaled version."""

    summable = False

    def warm_up(self) -> None:
        warm_up_signs()

    def compress(self, tensor, key, step):
        return Payload([nk.sign_pack(tensor.reshape(-1))])

    def decompress(self, payload, like):
        return nk.sign_unpack(payload.tensors[0], like.numel()).view(like.shape)

    def combine(self, payloads, like):
        stacked = torch.stack([p.tensors[0] for p in payloads])
        return nk.sign_vote(stacked, like.numel()).view(like.shape)


class EFSign(KernelCompressor):
    """`ef_sign` (Karimireddy et al., 2019): (‖v‖₁/d) · sign(v), always with error feedback.

    Contractive with δ = 1/d: with a = ‖v‖₁/d, ⟨Q(v), v⟩ = a‖v‖₁ and ‖Q(v)‖² = d a², so
    ‖Q(v) − v‖² = ‖v‖² − ‖v‖₁²/d ≤ (1 − 1/d)‖v‖² since ‖v‖₁ ≥ ‖v‖₂ (zeros count as +, which
    changes neither product)."""

    summable = False
    requires_error_feedback = True

    def warm_up(self) -> None:
        warm_up_signs()

    def guarantee(self, numel):
        return Guarantee(delta=1.0 / max(numel, 1))

    def compress(self, tensor, key, step):
        flat = tensor.reshape(-1)
        scale = flat.abs().mean().reshape(1)
        return Payload([scale, nk.sign_pack(flat)])

    def decompress(self, payload, like):
        scale, packed = payload.tensors
        return nk.sign_unpack(packed, like.numel(), scale).view(like.shape)


class OneBit(KernelCompressor):
    """`onebit` (1-bit SGD, Seide et al., 2014): each element becomes the mean of the
    non-negative entries or the mean of the negative ones, by its sign; error feedback.

    Contractive with δ = 1/d: replacing a class g of n_g same-signed entries by their mean m_g
    leaves ‖v_g‖² − n_g m_g² of error, and n_g m_g² = (Σ_g v_k)²/n_g ≥ ‖v_g‖²/n_g ≥ ‖v_g‖²/d
    (entries of one sign: (Σ|v_k|)² ≥ Σ v_k²)."""

    summable = False
    requires_error_feedback = True

    def warm_up(self) -> None:
        warm_up_signs()

    def guarantee(self, numel):
        return Guarantee(delta=1.0 / max(numel, 1))

    def compress(self, tensor, key, step):
        flat = tensor.reshape(-1)
        positive = flat >= 0
        high = flat[positive].mean() if positive.any() else flat.new_zeros(())
        low = flat[~positive].mean() if (~positive).any() else flat.new_zeros(())
        return Payload([torch.stack([high, low]).float(), nk.sign_pack(flat)])

    def decompress(self, payload, like):
        levels, packed = payload.tensors
        is_positive = nk.sign_unpack(packed, like.numel()) > 0
        return torch.where(is_positive, levels[0], levels[1]).view(like.shape)
