"""Compressors that only change the number format: none, fp16, bf16."""

import torch

from dsgd_cli.api import Guarantee, Payload
from plugins.compressors._common import BucketCompressor


class NoCompression(BucketCompressor):
    """`none`: the tensor travels as it is."""

    summable = True
    identity = True

    def guarantee(self, numel):
        return Guarantee(omega=0.0, delta=1.0)  # Q(x) = x

    def compress(self, tensor, key, step):
        return Payload([tensor])

    def decompress(self, payload, like):
        return payload.tensors[0]

    def compress_bucket(self, flat, layout, step):
        return Payload([flat])

    def decompress_bucket(self, payload, layout):
        return payload.tensors[0]


class _Cast(BucketCompressor):
    """Sends the tensor in a narrower float format; sums are taken in that format.

    Rounding to nearest changes each entry by at most u·|x_k|, u the format's unit roundoff
    (2^-11 for fp16, 2^-8 for bf16), so ‖Q(x) − x‖² ≤ u²‖x‖²: contractive with δ = 1 − u².
    That holds for entries in the format's normal range: fp16 overflows beyond 65504 and keeps
    less relative precision below 6.1e-5; bf16 has float32's range."""

    summable = True
    wire_dtype: torch.dtype
    unit_roundoff: float

    def guarantee(self, numel):
        return Guarantee(delta=1.0 - self.unit_roundoff**2)

    def compress(self, tensor, key, step):
        return Payload([tensor.to(self.wire_dtype)])

    def decompress(self, payload, like):
        return payload.tensors[0].to(like.dtype)

    def compress_bucket(self, flat, layout, step):
        return Payload([flat.to(self.wire_dtype)])

    def decompress_bucket(self, payload, layout):
        return payload.tensors[0].to(layout.dtype)


class Float16(_Cast):
    """`fp16`: IEEE half precision (range ±65504)."""

    wire_dtype = torch.float16
    unit_roundoff = 2.0**-11


class BFloat16(_Cast):
    """`bf16`: bfloat16, float32's range with 8 bits of mantissa."""

    wire_dtype = torch.bfloat16
    unit_roundoff = 2.0**-8
