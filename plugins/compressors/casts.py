"""Compressors that only change the number format."""

from dsgd_cli.api import Compressor, Payload


class NoCompression(Compressor):
    """`none`: the tensor travels as it is."""

    summable = True

    def compress(self, tensor, key, step):
        return Payload([tensor])

    def decompress(self, payload, like):
        return payload.tensors[0]
