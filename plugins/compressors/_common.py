"""Shared by the numba-backed compressors: per-step seeds and a kernel warm-up."""

import zlib
from functools import cache

import torch

import numba_kernels as nk
from dsgd_cli.api import Compressor
from numba_kernels import derive_seed


def tensor_seed(ctx, key: str, step: int, per_worker: bool) -> int:
    """A seed unique to (run seed, step, tensor), and to the worker when `per_worker`.

    Stochastic rounding must be independent across workers (per_worker=True); random-k must
    draw the same indices on every worker (per_worker=False) so its payloads can be summed.
    """
    parts = [ctx.seed, step, zlib.crc32(key.encode())]
    if per_worker:
        parts.append(ctx.rank + 1)
    return derive_seed(*parts)


# Warm-ups: each compressor loads the kernels it uses once per process (compiling them where
# numba's cache is empty), so that its first training step's time is not numba's start-up.

@cache
def warm_up_quantization() -> None:
    nk.qsgd_dequantize(*nk.qsgd_quantize(torch.linspace(-1, 1, 16), 4, 8, 0), 4, 8)


@cache
def warm_up_terngrad() -> None:
    nk.terngrad_dequantize(*nk.terngrad_quantize(torch.linspace(-1, 1, 16), 0))


@cache
def warm_up_signs() -> None:
    packed = nk.sign_pack(torch.linspace(-1, 1, 16))
    nk.sign_unpack(packed, 16)
    nk.sign_vote(torch.stack([packed, packed]), 16)


@cache
def warm_up_sparsification() -> None:
    x = torch.linspace(-1, 1, 16)
    indices, values = nk.topk(x, 3)
    nk.scatter(indices, values, 16)
    nk.randomk(x, 3, 0)


@cache
def warm_up_codes(bits: int) -> None:
    """Load the packing kernels of one code width (each width is compiled on its own)."""
    packed = nk.pack_codes(torch.zeros(16, dtype=torch.int8), bits)
    nk.unpack_codes(packed, 16, bits)
    nk.dequantize_add(torch.ones(2), packed, bits, 1, 8, torch.zeros(16))


def decoded_average(payloads, like: torch.Tensor, add) -> torch.Tensor:
    """The average of gathered payloads, each added into a flat float32 `total` by
    `add(payload, total)` where it is decoded (packed codes, sparse entries), never first
    decompressed to a dense tensor of its own."""
    total = torch.zeros(like.numel(), dtype=torch.float32, device=like.device)
    for payload in payloads:
        add(payload, total)
    return total.div_(len(payloads)).view(like.shape).to(like.dtype)


class KernelCompressor(Compressor):
    """Base of the compressors whose work is done by numba_kernels."""

    uses_numba_kernels = True

    def setup(self, ctx) -> None:
        super().setup(ctx)
        self.warm_up()

    def warm_up(self) -> None:
        """Load the kernels this compressor uses (the `warm_up_*` functions above)."""
