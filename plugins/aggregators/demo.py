"""`demo`: Decoupled Momentum optimization (Peng, Kingma et al., "DeMo: Decoupled Momentum
Optimization", 2024, arXiv 2411.19870), as the authors' `demo.py` (bloc97/DeMo) computes it.

There is no gradient all-reduce. Every worker keeps its own momentum δ per parameter, and at
every step, with lr the parameter's current learning rate:

    x ← x · (1 − lr · weight_decay)                decoupled weight decay
    δ ← β · δ + lr · g                              β = `decay`
    C = DCT(chunks of δ)                            orthonormal DCT-II per chunk
    q = the `topk` largest |C| of every chunk       (index, value) pairs
    δ ← δ − IDCT(q)                                 what is sent leaves δ
    all workers' q are all-gathered
    Q = per position, the mean of the values the workers sent there (0 where none did)
    x ← x − lr · sign(IDCT(Q))                      the experiment's optimizer: plain SGD

Chunks: a 2-D weight of shape R×C is cut into blocks of r×c, r the largest divisor of R not
above `chunk` and c that of C (2-D DCT per block); a 1-D weight of length L into runs of l, l
the largest divisor of L not above `chunk`. A tensor of more dimensions (a convolution kernel)
is treated as the 2-D matrix of its first dimension by the rest; a scalar as a run of one.

The sign step is the experiment's own optimizer, which must be `sgd` without momentum or
weight decay (the authors' DeMo is torch's SGD with the gradient replaced by that sign): its
learning rate, under the run's schedule, is the lr above.

Every worker decodes the same gathered pairs in the same order, so the models stay identical.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dsgd_cli.api import Aggregator, AggregatorOptions, all_gather_flat, option
from plugins.aggregators.diloco import average_buffers


@dataclass
class DeMoOptions(AggregatorOptions):
    decay: float = option(0.999, min=0.0, max=1.0, help="β, the momentum's decay: δ ← β·δ + lr·g")
    topk: int = option(32, min=1, help="DCT coefficients sent per chunk (all of a smaller chunk)")
    chunk: int = option(64, min=1, help="the chunk's side: per dimension, its largest divisor "
                                        "not above this")
    weight_decay: float = option(0.0, min=0.0, help="decoupled weight decay: x ← x·(1 − lr·wd) "
                                                    "before each step")
    sync_buffers: bool = option(False, help="average buffers (batch-norm statistics) after every "
                                            "step; false leaves each worker its own, as DeMo does")


def chunk_side(length: int, target: int) -> int:
    """The largest divisor of `length` not above `target` (the authors' `_get_smaller_split`)."""
    return max(d for d in range(1, min(length, target) + 1) if length % d == 0)


def dct_matrix(n: int, dtype=torch.float64) -> torch.Tensor:
    """The orthonormal DCT-II matrix D (n×n): D @ x is the DCT of x, D.T @ y the inverse."""
    k = torch.arange(n, dtype=torch.float64).unsqueeze(1)
    i = torch.arange(n, dtype=torch.float64).unsqueeze(0)
    matrix = torch.cos(math.pi * (2 * i + 1) * k / (2 * n)) * math.sqrt(2 / n)
    matrix[0] /= math.sqrt(2)
    return matrix.to(dtype)


class ChunkCodec:
    """One parameter's chunks: `encode(x)` gives a (chunks, chunk size) matrix, one row per
    chunk in row-major order of the blocks, `decode` takes such a matrix back to x's shape.
    With `dct`, each chunk goes through the orthonormal DCT-II (2-D for blocks)."""

    def __init__(self, shape: torch.Size, target: int, dct: bool, dtype, device):
        if len(shape) == 0:
            self.matrix_shape = (1,)
        elif len(shape) == 1:
            self.matrix_shape = (shape[0],)
        else:
            self.matrix_shape = (shape[0], math.prod(shape[1:]))
        self.shape = shape
        self.sides = [chunk_side(n, target) for n in self.matrix_shape]
        self.bases = ([dct_matrix(side, dtype).to(device) for side in self.sides] if dct else None)

    @property
    def chunk_numel(self) -> int:
        return math.prod(self.sides)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.sides) == 1:
            (side,) = self.sides
            runs = x.reshape(-1, side)                             # (L/l, l)
            return runs @ self.bases[0].T if self.bases else runs.clone()
        (rows, cols), (r, c) = self.matrix_shape, self.sides
        blocks = x.reshape(rows // r, r, cols // c, c).permute(0, 2, 1, 3)  # (R/r, C/c, r, c)
        if self.bases:
            blocks = self.bases[0] @ blocks @ self.bases[1].T
        return blocks.reshape(-1, r * c)

    def decode(self, coefficients: torch.Tensor) -> torch.Tensor:
        if len(self.sides) == 1:
            runs = coefficients @ self.bases[0] if self.bases else coefficients
            return runs.reshape(self.shape)
        (rows, cols), (r, c) = self.matrix_shape, self.sides
        blocks = coefficients.reshape(rows // r, cols // c, r, c)
        if self.bases:
            blocks = self.bases[0].T @ blocks @ self.bases[1]
        return blocks.permute(0, 2, 1, 3).reshape(self.shape)


def index_dtype(chunk_numel: int) -> torch.dtype:
    """The smallest integer type that holds a position inside a chunk: what travels."""
    if chunk_numel <= 256:
        return torch.uint8
    return torch.int16 if chunk_numel <= 2**15 else torch.int32


def top_k(chunks: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the positions and values of the k largest magnitudes."""
    k = min(k, chunks.shape[-1])
    positions = chunks.abs().topk(k, dim=-1, sorted=False).indices
    return positions, chunks.gather(-1, positions)


def scatter_mean(like: torch.Tensor, positions: list[torch.Tensor],
                 values: list[torch.Tensor]) -> torch.Tensor:
    """A (chunks, chunk size) matrix like `like`: per position, the mean of the values sent
    there by the senders that chose it, 0 where none did."""
    dense = torch.zeros_like(like)
    index = torch.cat([p.long() for p in positions], dim=-1)
    dense.scatter_reduce_(-1, index, torch.cat(values, dim=-1), reduce="mean", include_self=False)
    return dense


def check_plain_sgd(optimizer: torch.optim.Optimizer, name: str) -> None:
    plain = isinstance(optimizer, torch.optim.SGD) and all(
        group["momentum"] == 0 and group["weight_decay"] == 0 and not group["nesterov"]
        for group in optimizer.param_groups)
    if not plain:
        raise ValueError(f"{name} steps with sign-SGD through the experiment's optimizer: give it "
                         f"`optimizer: {{name: sgd}}` without momentum or weight_decay (use "
                         f"{name}'s own weight_decay), not {type(optimizer).__name__}")


class DeMo(Aggregator):
    """DeMo: each worker's momentum stays local; only the top-k DCT coefficients of each of
    its chunks travel, all-gathered, and every worker steps with the sign of their mean."""

    Options = DeMoOptions
    models_identical = True  # every worker applies the same decoded update

    def setup(self, ctx):
        super().setup(ctx)
        check_plain_sgd(ctx.optimizer, "demo")
        self.params = ctx.parameters()
        self.codecs = [ChunkCodec(p.shape, self.options.chunk, True, p.dtype, p.device)
                       for p in self.params]
        self.momenta = [torch.zeros_like(p.detach()) for p in self.params]  # δ, one per parameter

    def state_dict(self):
        return {"momenta": [delta.clone() for delta in self.momenta]}

    @torch.no_grad()
    def load_state_dict(self, state):
        for delta, saved in zip(self.momenta, state["momenta"]):
            delta.copy_(saved)

    @torch.no_grad()
    def after_backward(self, step):
        o = self.options
        positions, values = [], []
        for param, lr, codec, delta in zip(self.params, self.rates(), self.codecs, self.momenta):
            if o.weight_decay:
                param.mul_(1 - lr * o.weight_decay)
            gradient = param.grad if param.grad is not None else torch.zeros_like(param)
            delta.mul_(o.decay).add_(gradient, alpha=lr)
            coefficients = codec.encode(delta)
            where, kept = top_k(coefficients, o.topk)
            delta.sub_(codec.decode(scatter_mean(coefficients, [where], [kept])))
            positions.append(where.to(index_dtype(codec.chunk_numel)))
            values.append(kept)
        gathered = all_gather_flat(positions + values, self.ctx.comm)  # per worker, in rank order
        count = len(self.params)
        for index, (param, codec) in enumerate(zip(self.params, self.codecs)):
            like = torch.zeros(param.numel() // codec.chunk_numel, codec.chunk_numel,
                               dtype=param.dtype, device=param.device)
            mean = scatter_mean(like, [worker[index] for worker in gathered],
                                [worker[count + index] for worker in gathered])
            update = codec.decode(mean).sign()
            if param.grad is None:
                param.grad = update
            else:
                param.grad.copy_(update)

    def rates(self) -> list[float]:
        """Each parameter's current learning rate. Looked up at every step: a schedule sets
        it, and a rollback under failures (optimizer.load_state_dict) replaces the groups."""
        lr_of = {id(p): group["lr"] for group in self.ctx.optimizer.param_groups
                 for p in group["params"]}
        return [lr_of[id(p)] for p in self.params]

    def after_step(self, step):
        if self.options.sync_buffers:
            average_buffers(self.ctx)
