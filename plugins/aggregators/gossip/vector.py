"""The model as one flat vector: what gossip algorithms send, average and push.

It holds the parameters, followed by the floating-point buffers (batch-norm statistics) when
`sync_buffers` is on; otherwise buffers stay local to each worker (docs/plugins.md, the options every
aggregator accepts).
"""

from __future__ import annotations

import torch

import numba_kernels
from dsgd_cli.api import WorkerContext, unflatten_into


class ModelVector:
    def __init__(self, ctx: WorkerContext, include_buffers: bool):
        self.tensors = [p.detach() for p in ctx.parameters()]
        if include_buffers:
            self.tensors += [b for b in ctx.buffers()]
        self.numel = sum(t.numel() for t in self.tensors)
        dtype = torch.float32
        for t in self.tensors:
            dtype = torch.promote_types(dtype, t.dtype)
        self.dtype = dtype
        self.device = self.tensors[0].device if self.tensors else torch.device("cpu")

    def read(self) -> torch.Tensor:
        """A fresh flat copy of the model's current values."""
        if not self.tensors:
            return torch.zeros(0, dtype=self.dtype, device=self.device)
        return torch.cat([t.reshape(-1).to(self.dtype) for t in self.tensors])

    def write(self, flat: torch.Tensor) -> None:
        """Copy `flat` into the model."""
        unflatten_into(flat, self.tensors)

    def empty(self, extra: int = 0, device: torch.device | str | None = None) -> torch.Tensor:
        """An uninitialised buffer for a message: `extra` header entries, then the vector."""
        return torch.empty(extra + self.numel, dtype=self.dtype, device=device or self.device)


def to_wire(tensor: torch.Tensor) -> torch.Tensor:
    """Messages travel on a gloo group, which takes CPU tensors."""
    return tensor if tensor.device.type == "cpu" else tensor.cpu()


def weighted_sum(tensors: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
    """Σ_k w_k x_k over flat vectors in one pass (the numba kernel, for float32)."""
    if tensors[0].dtype == torch.float32:
        return numba_kernels.weighted_sum(tensors, weights)
    total = tensors[0] * weights[0]
    for tensor, weight in zip(tensors[1:], weights[1:]):
        total.add_(tensor, alpha=weight)
    return total
