"""Compressors that only change the number format: none, fp16, bf16."""

import torch

from dsgd_cli.api import Compressor, Payload


class NoCompression(Compressor):
    """`none`: the tensor travels as it is."""

    summable = True
    identity = True

    def compress(self, tensor, key, step):
        return Payload([tensor])

    def decompress(self, payload, like):
        return payload.tensors[0]


class _Cast(Compressor):
    """Sends the tensor in a narrower float format; sums are taken in that format."""

    summable = True
    wire_dtype: torch.dtype

    def compress(self, tensor, key, step):
        return Payload([tensor.to(self.wire_dtype)])

    def decompress(self, payload, like):
        return payload.tensors[0].to(like.dtype)


class Float16(_Cast):
    """`fp16`: IEEE half precision (range ±65504)."""

    wire_dtype = torch.float16


class BFloat16(_Cast):
    """`bf16`: bfloat16, float32's range with 8 bits of mantissa."""

    wire_dtype = torch.bfloat16
