"""`powersgd` (Vogels, Karimireddy, Jaggi, NeurIPS 2019): rank-r gradient compression by one
step of power iteration per step, warm-started from the previous step's Q.

For a gradient reshaped to a matrix M (n × m):  P = M Q;  all-reduce P;  P̂ = orth(P);
Q = Mᵀ P̂;  all-reduce Q;  approximation P̂ Qᵀ. Both all-reduces are sums (the method is
linear in M given P̂), so (n + m)·r numbers travel instead of n·m. Vectors and matrices too
small to gain are averaged uncompressed, as in the paper. Error feedback is always on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dsgd_cli.api import Compressor, Payload, all_reduce_flat, option
from plugins.compressors._common import tensor_seed


@dataclass
class PowerSGDOptions:
    rank: int = option(2, min=1, help="rank r of the approximation")
    warm_start: bool = option(True, help="start each power iteration from the last Q")


class PowerSGD(Compressor):
    """Declares no bound (`guarantee` is None): one power iteration from a warm start gives
    no worst-case δ, and the factors are averaged by two collectives, not per worker."""

    Options = PowerSGDOptions
    summable = True
    requires_error_feedback = True

    def setup(self, ctx):
        super().setup(ctx)
        self.q_memory: dict[str, torch.Tensor] = {}

    def _factor_rank(self, tensor: torch.Tensor) -> int:
        """The rank to use for `tensor`, or 0 when it travels uncompressed."""
        if tensor.dim() < 2:
            return 0
        rows, cols = tensor.shape[0], math.prod(tensor.shape[1:])
        rank = min(self.options.rank, rows, cols)
        return rank if (rows + cols) * rank < rows * cols else 0

    def _start(self, matrix: torch.Tensor, key: str, step: int, rank: int) -> torch.Tensor:
        q = self.q_memory.get(key) if self.options.warm_start else None
        if q is None:  # the same random start on every worker
            generator = torch.Generator(device=matrix.device).manual_seed(
                tensor_seed(self.ctx, key, step, per_worker=False) % 2**63)
            q = torch.randn(matrix.shape[1], rank, generator=generator, device=matrix.device)
        return q

    def compress(self, tensor, key, step):
        """This worker's own rank-r approximation, without communication."""
        rank = self._factor_rank(tensor)
        if rank == 0:
            return Payload([tensor])
        matrix = tensor.reshape(tensor.shape[0], -1)
        p = torch.linalg.qr(matrix @ self._start(matrix, key, step, rank)).Q
        return Payload([p, _transposed_product(matrix, p)])

    def decompress(self, payload, like):
        if len(payload.tensors) == 1:
            return payload.tensors[0]
        p, q = payload.tensors
        return (p @ q.T).view_as(like)

    def exchange(self, tensors, keys, step, comm, with_local=False):
        """Two all-reduces per step for all tensors: the P factors together with the tensors
        that travel uncompressed, then the Q factors. Matrices of the same shape (and rank)
        are computed as one batch (as torch's batched PowerSGD hook does): one product, one
        orthogonalization and one more product for the batch, not for each matrix."""
        n = comm.world_size
        ranks = [self._factor_rank(t) for t in tensors]
        plain = [i for i, rank in enumerate(ranks) if rank == 0]
        batches: dict[tuple, list[int]] = {}
        for i, rank in enumerate(ranks):
            if rank > 0:
                shape = (tensors[i].shape[0], math.prod(tensors[i].shape[1:]), rank)
                batches.setdefault(shape, []).append(i)
        matrices = [_batch([tensors[i].reshape(tensors[i].shape[0], -1) for i in batch])
                    for batch in batches.values()]
        starts = [_batch([self._start(m, keys[i], step, ranks[i]) for m, i in zip(stack, batch)])
                  for stack, batch in zip(matrices, batches.values())]
        ps = [torch.bmm(m, q) for m, q in zip(matrices, starts)]
        summed = all_reduce_flat([tensors[i] for i in plain] + ps, comm)
        results: list = [None] * len(tensors)
        for i, total in zip(plain, summed):
            results[i] = (total / n, tensors[i].clone() if with_local else None)
        # Orthonormal columns: the sum or the mean of the Ps span the same space.
        ps = [_orthonormal_columns(p) for p in summed[len(plain):]]
        qs = [torch.bmm(p.transpose(1, 2), m).transpose(1, 2) for m, p in zip(matrices, ps)]
        local = [torch.bmm(p, q.transpose(1, 2)) if with_local else None for p, q in zip(ps, qs)]
        for batch, p, q, own in zip(batches.values(), ps, all_reduce_flat(qs, comm), local):
            q = q / n
            approximation = torch.bmm(p, q.transpose(1, 2))
            for b, i in enumerate(batch):
                self.q_memory[keys[i]] = q[b].clone()  # its own storage: it is saved
                results[i] = (approximation[b].view_as(tensors[i]),
                              own[b].view_as(tensors[i]) if with_local else None)
        return results


def _batch(matrices: list[torch.Tensor]) -> torch.Tensor:
    """The matrices as one batch [B, n, m]: a view of a batch of one, else a copy."""
    return matrices[0].unsqueeze(0) if len(matrices) == 1 else torch.stack(matrices)


# Up to this rank the columns are orthonormalized by Gram–Schmidt, in a few batched products;
# above it by a batched QR.
GRAM_SCHMIDT_MAX_RANK = 4


def _orthonormal_columns(p: torch.Tensor) -> torch.Tensor:
    """Orthonormal columns spanning those of each matrix of the batch p [B, n, r] (in place).
    Modified Gram–Schmidt for small ranks: each column divided by its norm, then removed from
    the columns after it. A zero column stays zero (its norm is clamped away from 0), where
    QR would choose some direction: its product with the gradient is zero either way."""
    if p.shape[2] > GRAM_SCHMIDT_MAX_RANK:
        return torch.linalg.qr(p).Q
    for j in range(p.shape[2]):
        column = p[:, :, j:j + 1]
        column.div_(torch.linalg.vector_norm(column, dim=1, keepdim=True).clamp_min(1e-30))
        if j + 1 < p.shape[2]:
            rest = p[:, :, j + 1:]
            rest.sub_(column * (column * rest).sum(dim=1, keepdim=True))
    return p


def _transposed_product(matrix: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Mᵀ P as (Pᵀ M)ᵀ: the same numbers, but a product with M untransposed, which CPU BLAS
    computes several times faster for a thin P (measured: 0.8 against 5 ms for 1024 × 1024)."""
    return (p.T @ matrix).T
