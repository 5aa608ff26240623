"""`sparseloco`: SparseLoCo ("Communication Efficient LLM Pre-training with SparseLoCo", 2025,
arXiv 2508.15706): DiLoCo's rounds with the outer momentum replaced by an error buffer, and a
sparse, 2-bit message instead of the dense pseudo-gradient.

Every worker takes `period` (H) steps with the experiment's own (inner) optimizer, then, with
Δ = θ_global − θ_i its pseudo-gradient (as `diloco`):

    e ← β · e + Δ                            the error buffer, β = `decay`
    per chunk, the top-k entries of |e|      (index, value) pairs; k = `topk`, or `density`
    values quantized to `bits` bits          (below)
    e ← e − what was sent (as decoded)
    all workers' messages are all-gathered
    mean = (1/n) Σ_i decoded message_i       0 where no worker sent an entry
    θ_global ← θ_global − α · mean           α = `outer_lr`; every θ_i ← θ_global

Chunks are `demo`'s without the DCT: a 2-D weight in blocks of r×c, r and c the largest
divisors of its dimensions not above `chunk`, a 1-D one in runs.

Quantization, per parameter tensor (all its sent values together): with μ their mean and σ
the standard deviation of v − μ (n − 1 in the denominator), the 2^bits bins are
code = clamp(round((v − μ)/s + 2^bits/2), 0, 2^bits − 1) with s = 6σ / 2^bits, and each bin
decodes to the mean of the values that fell in it (a table of 2^bits numbers that travels with
the codes; μ is folded into it). Codes travel packed, 8/bits per byte; an index inside a chunk
travels in the smallest integer type that holds it (int16 for a 64×64 chunk).

The rounds are `diloco`'s own (the round after hook step s with (s + 1) % H == 0, θ_global,
the reset, the outer step, `outer_rounds`); only the exchange of Δ differs, and the outer
optimizer is plain SGD at `outer_lr`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from dsgd_cli.api import AggregatorOptions, all_gather_flat, option
from plugins.aggregators.demo import ChunkCodec, index_dtype, top_k
from plugins.aggregators.diloco import DiLoCo

DEFAULT_TOPK = 64  # of a 64×64 chunk: 1.6% of the entries
RANGE_IN_SIGMAS = 6.0  # the quantizer's bins span 6 standard deviations of the sent values


@dataclass
class SparseLoCoOptions(AggregatorOptions):
    period: int = option(30, min=1, help="inner steps per round (H)")
    topk: int | None = option(None, min=1, help=f"entries sent per chunk (default {DEFAULT_TOPK}; "
                                                "or give density)")
    density: float | None = option(None, min=0.0, max=1.0,
                                   help="instead of topk: ⌈density · chunk size⌉ entries per chunk")
    chunk: int = option(64, min=1, help="the chunk's side: per dimension, its largest divisor "
                                        "not above this")
    bits: int = option(2, min=1, max=8, help="bits per sent value: 1, 2, 4 or 8")
    decay: float = option(0.95, min=0.0, max=1.0, help="β of the error buffer: e ← β·e + Δ")
    outer_lr: float = option(1.0, min=0.0, help="α of the outer step θ ← θ − α·mean")
    sync_buffers: bool = option(False, help="average buffers (batch-norm statistics) at each "
                                            "round, as diloco's")

    def __post_init__(self):
        if self.topk is not None and self.density is not None:
            raise ValueError("give topk or density, not both")
        if 8 % self.bits:
            raise ValueError(f"bits: expected 1, 2, 4 or 8, got {self.bits}")


def quantize(values: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `bits`-bit codes of `values` and the table that decodes them: table[code]."""
    bins = 2**bits
    shift = values.mean()
    centered = values - shift
    count = centered.numel()
    sigma = centered.norm() / math.sqrt(count - 1) if count > 1 else torch.zeros(())
    scale = RANGE_IN_SIGMAS * float(sigma) / bins
    if scale == 0 or not math.isfinite(scale):
        scale = 1.0
    codes = (centered / scale + bins // 2).round().clamp(0, bins - 1).long()
    flat_codes, flat_centered = codes.reshape(-1), centered.reshape(-1)
    sums = values.new_zeros(bins).index_add_(0, flat_codes, flat_centered)
    counts = values.new_zeros(bins).index_add_(0, flat_codes, torch.ones_like(flat_centered))
    return codes.to(torch.uint8), sums / counts.clamp(min=1) + shift


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """`bits`-bit codes, 8/bits to a byte, the first in the lowest bits."""
    per_byte = 8 // bits
    codes = codes.reshape(-1).long()
    codes = torch.cat([codes, codes.new_zeros(-codes.numel() % per_byte)]).view(-1, per_byte)
    shifts = torch.arange(per_byte, device=codes.device) * bits
    return (codes << shifts).sum(dim=1).to(torch.uint8)


def unpack(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    shifts = torch.arange(8 // bits, device=packed.device) * bits
    return ((packed.long().unsqueeze(1) >> shifts) & (2**bits - 1)).reshape(-1)[:count]


class SparseLoCo(DiLoCo):
    """SparseLoCo: DiLoCo's rounds; an error buffer of pseudo-gradients, whose top-k per
    chunk, quantized, is all-gathered and averaged; plain outer SGD at `outer_lr`."""

    Options = SparseLoCoOptions
    supports_compression = False  # it compresses Δ itself
    failure_mode = "restart"  # the error buffers roll back with the models

    @classmethod
    def resolve_options(cls, options, compressor, task, world_size, seed):
        """Neither topk nor density given: topk 64, recorded as such."""
        if options.topk is None and options.density is None:
            return dataclasses.replace(options, topk=DEFAULT_TOPK)
        return options

    def setup(self, ctx):
        self.options = self.resolve_options(self.options, None, None, ctx.world_size, ctx.seed)
        super().setup(ctx)
        self.codecs = [ChunkCodec(p.shape, self.options.chunk, False, p.dtype, p.device)
                       for p in self.outer.params]
        self.errors = [torch.zeros_like(p.detach()) for p in self.outer.params]  # e

    def outer_optimizer_section(self) -> dict:
        return {"name": "sgd", "lr": self.options.outer_lr}

    def entries_per_chunk(self, codec: ChunkCodec) -> int:
        if self.options.density is None:
            return self.options.topk
        return max(1, math.ceil(self.options.density * codec.chunk_numel))

    @torch.no_grad()
    def average_deltas(self, deltas, step):
        o = self.options
        message = []  # per parameter: positions, packed codes, decoding table
        for delta, error, codec in zip(deltas, self.errors, self.codecs):
            error.mul_(o.decay).add_(delta)
            chunks = codec.encode(error)
            positions, values = top_k(chunks, self.entries_per_chunk(codec))
            codes, table = quantize(values, o.bits)
            sent = torch.zeros_like(chunks).scatter_(-1, positions, table[codes.long()])
            error.sub_(codec.decode(sent))
            message += [positions.to(index_dtype(codec.chunk_numel)), pack(codes, o.bits), table]
        gathered = all_gather_flat(message, self.ctx.comm)  # per worker, in rank order
        averaged = []
        for index, (delta, codec) in enumerate(zip(deltas, self.codecs)):
            total = torch.zeros(delta.numel() // codec.chunk_numel, codec.chunk_numel,
                                dtype=delta.dtype, device=delta.device)
            for worker in gathered:
                positions, packed, table = worker[3 * index: 3 * index + 3]
                codes = unpack(packed, o.bits, positions.numel()).view(positions.shape)
                total.scatter_add_(-1, positions.long(), table[codes])
            averaged.append(codec.decode(total / self.ctx.world_size))
        return averaged
