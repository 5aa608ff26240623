"""Sparsifiers (Stich et al., 2018): keep k = ⌈ratio · d⌉ entries. Use with error feedback."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

import numba_kernels as nk
from dsgd_cli.api import Guarantee, Payload, option
from plugins.compressors._common import (KernelCompressor, bucket_seeds, decoded_average,
                                        segments, warm_up_sparsification)


@dataclass
class SparsityOptions:
    ratio: float = option(0.01, min=0.0, max=1.0, help="share of entries kept")

    def __post_init__(self):
        if self.ratio <= 0:
            raise ValueError("ratio: expected a share in (0, 1]")


def kept(ratio: float, d: int) -> int:
    return min(d, max(1, math.ceil(ratio * d)))


class TopK(KernelCompressor):
    """`topk`: the k entries of largest magnitude, as (int32 index, value) pairs. Each worker
    picks its own indices, so payloads are all-gathered. Contractive with δ = k/d: the d − k
    entries left out are the smallest, so they hold at most (d − k)/d of ‖v‖²."""

    Options = SparsityOptions
    summable = False

    def warm_up(self, device=None) -> None:
        warm_up_sparsification(device)

    def guarantee(self, numel):
        d = max(numel, 1)
        return Guarantee(delta=kept(self.options.ratio, d) / d)

    def compress_bucket(self, flat, layout, step):
        """k = ⌈ratio · d⌉ of each tensor's own d entries; indices into the bucket (int32)."""
        ks = [kept(self.options.ratio, n) if n else 0 for n in layout.sizes]
        indices, values = nk.topk_segments(flat, segments(layout), ks)
        return Payload([indices.int(), values])

    def decompress_bucket(self, payload, layout):
        indices, values = payload.tensors
        return nk.scatter(indices.long(), values, layout.numel)

    def combine_bucket(self, payloads, layout):
        def add(payload, total):
            indices, values = payload.tensors
            nk.scatter(indices.long(), values, layout.numel, out=total, accumulate=True)

        return decoded_average(payloads, layout, add)


@dataclass
class RandomKOptions(SparsityOptions):
    unbiased: bool = option(True, help="scale kept entries by d/k (turn off with error feedback)")


class RandomK(KernelCompressor):
    """`randomk`: k entries drawn uniformly from a seed all workers share. Same indices
    everywhere: only values travel, and they sum. With `unbiased` the values are scaled by
    d/k so E[decompress(compress(v))] = v; with error feedback send them unscaled, as Stich et
    al.'s sparsified SGD with memory does (the scaled version is not a contraction).

    Each entry is kept with probability k/d. Unbiased: E‖Q(v) − v‖² = Σ_k v_k² (d/k − 1), so
    ω = d/k − 1. Unscaled (`unbiased: false`, the biased random-k of CHOCO-SGD): E‖Q(v) − v‖²
    = (1 − k/d)‖v‖², contractive with δ = k/d; it is the unbiased one rescaled by 1/(1 + ω)."""

    Options = RandomKOptions
    summable = True

    def warm_up(self, device=None) -> None:
        warm_up_sparsification(device)

    def guarantee(self, numel):
        d = max(numel, 1)
        k = kept(self.options.ratio, d)
        return Guarantee(omega=d / k - 1) if self.options.unbiased else Guarantee(delta=k / d)

    def compress_bucket(self, flat, layout, step):
        """k = ⌈ratio · d⌉ of each tensor's d entries, from each tensor's own seed (the same on
        every worker); the indices stay here as the payload's context, into the bucket."""
        ks = [kept(self.options.ratio, n) if n else 0 for n in layout.sizes]
        indices, values = nk.randomk_segments(flat, segments(layout), ks,
                                              bucket_seeds(self.ctx, layout, step, per_worker=False))
        if self.options.unbiased:
            values = values * layout.cached(("randomk-scale", tuple(ks)),
                                            lambda: _scales(layout, ks))
        return Payload([values], context=indices)

    def decompress_bucket(self, payload, layout):
        return nk.scatter(payload.context, payload.tensors[0], layout.numel)


def _scales(layout, ks) -> torch.Tensor | float:
    """d/k of each tensor, repeated for its k kept entries (one number when all agree)."""
    per_segment = [n / k for n, k in zip(layout.sizes, ks) if k]
    if len(set(per_segment)) == 1:
        return per_segment[0]
    return torch.tensor(per_segment, dtype=torch.float32, device=layout.device).repeat_interleave(
        torch.tensor([k for k in ks if k], device=layout.device))
