"""Shared by the numba-backed compressors: per-step seeds, a kernel warm-up, and the
per-tensor API served by the bucket methods (a tensor is a bucket of one segment)."""

import zlib
from functools import cache

import torch

import numba_kernels as nk
from dsgd_cli.api import BucketLayout, Compressor, bucket_layout
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
# numba's cache is empty), so that its first training step's time is not numba's start-up:
# the segmented kernels, on a bucket of two tensors. The test helpers call them before
# starting workers, so that workers never compile, nor write numba's cache, at the same time.
# Given a GPU (`device`), each runs there too, so that the CUDA kernels compile (or load from
# numba's cache) at setup, not inside the first timed step.

def _bucket(device) -> tuple[torch.Tensor, nk.Segments]:
    return torch.linspace(-1, 1, 24, device=device), nk.Segments([16, 8], device)


@cache
def warm_up_quantization(device=None) -> None:
    x, table = _bucket(device)
    norms, q = nk.qsgd_quantize_segments(x, table, 4, 8, [0, 1])
    nk.dequantize_segments(norms, nk.pack_codes_segments(q, table, 4), table, 4, 4, 8)


@cache
def warm_up_terngrad(device=None) -> None:
    x, table = _bucket(device)
    nk.terngrad_quantize_segments(x, table, [0, 1])


@cache
def warm_up_signs(device=None) -> None:
    x, table = _bucket(device)
    packed = nk.sign_pack_segments(x, table)
    ones = torch.ones(2, device=x.device)
    nk.sign_unpack_segments(packed, table, ones, -ones)
    nk.sign_vote_segments(torch.stack([packed, packed]), table)


@cache
def warm_up_sparsification(device=None) -> None:
    x, table = _bucket(device)
    indices, values = nk.topk_segments(x, table, [3, 2])
    nk.scatter(indices, values, 24)
    nk.randomk_segments(x, table, [3, 2], [0, 1])


@cache
def warm_up_codes(bits: int, device=None) -> None:
    """Load the packing kernels of one code width (on the CPU each width is compiled on its
    own)."""
    x, table = _bucket(device)
    packed = nk.pack_codes_segments(torch.zeros(24, dtype=torch.int8, device=x.device), table, bits)
    nk.dequantize_segments(torch.ones(3, device=x.device), packed, table, bits, 1, 8,
                           out=torch.zeros(24, device=x.device), add=True)


def bucket_seeds(ctx, layout: BucketLayout, step: int, per_worker: bool) -> list[int]:
    """`tensor_seed` of each segment of the bucket: the seeds its tensors had on their own."""
    return [tensor_seed(ctx, key, step, per_worker) for key in layout.keys]


def segments(layout: BucketLayout) -> nk.Segments:
    """The kernels' segment tables of a bucket, made once per bucket."""
    return layout.cached("segments", lambda: nk.Segments(layout.sizes, layout.device))


def decoded_average(payloads, layout: BucketLayout, add) -> torch.Tensor:
    """The average of gathered payloads, each added into a flat float32 `total` by
    `add(payload, total)` where it is decoded (packed codes, sparse entries), never first
    decompressed to a dense tensor of its own."""
    total = torch.zeros(layout.numel, dtype=torch.float32, device=layout.device)
    for payload in payloads:
        add(payload, total)
    return total.div_(len(payloads)).to(layout.dtype)


class BucketCompressor(Compressor):
    """A compressor written for buckets (`compress_bucket`, `decompress_bucket`,
    `combine_bucket`): a single tensor is compressed as a bucket of one segment, so the
    per-tensor methods and the bucket ones compute the same."""

    def compress(self, tensor, key, step):
        return self.compress_bucket(tensor.reshape(-1), bucket_layout([key], [tensor]), step)

    def decompress(self, payload, like):
        return self.decompress_bucket(payload, bucket_layout([""], [like])).view(like.shape)

    def combine(self, payloads, like):
        return self.combine_bucket(payloads, bucket_layout([""], [like])).view(like.shape)

    def combine_bucket(self, payloads, layout):
        """The mean of the workers' decompressed buckets."""
        total = torch.zeros(layout.numel, dtype=layout.dtype, device=layout.device)
        for payload in payloads:
            total += self.decompress_bucket(payload, layout)
        return total.div_(len(payloads))


class KernelCompressor(BucketCompressor):
    """Base of the compressors whose work is done by numba_kernels."""

    uses_numba_kernels = True

    def setup(self, ctx) -> None:
        super().setup(ctx)
        self.warm_up()
        device = getattr(ctx, "device", None)
        if device is not None and torch.device(device).type == "cuda":
            self.warm_up(torch.device(device))

    def warm_up(self, device=None) -> None:
        """Load the kernels this compressor uses (the `warm_up_*` functions above): the CPU's
        when `device` is None, else those it runs on that GPU."""
