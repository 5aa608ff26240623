"""Many tensors in one collective: what compressed averaging sends each step.

A model has many parameters; a collective per parameter pays the network's per-message
latency (and, on an oversubscribed machine, a scheduling round-trip) that many times. These
helpers concatenate the tensors, run one collective, and split the result again, so the bytes
are the same and the message count does not grow with the number of parameters.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from dsgd_cli.comm.communicator import Comm


def all_reduce_flat(tensors: list[torch.Tensor], comm: "Comm", op: str = "sum") -> list[torch.Tensor]:
    """The element-wise reduction of each tensor over all workers, shaped like the input:
    one all-reduce per dtype present (usually one). The inputs are left unchanged."""
    results: list[torch.Tensor | None] = [None] * len(tensors)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, tensor in enumerate(tensors):
        by_dtype.setdefault(tensor.dtype, []).append(i)
    for indices in by_dtype.values():
        flat = torch.cat([tensors[i].reshape(-1) for i in indices])
        comm.all_reduce(flat, op)
        for i, part in zip(indices, flat.split([tensors[i].numel() for i in indices])):
            results[i] = part.view(tensors[i].shape)
    return results


def all_gather_flat(tensors: list[torch.Tensor], comm: "Comm",
                    uniform: bool = True) -> list[list[torch.Tensor]]:
    """Every worker's `tensors`, as a list per worker in rank order, from one all-gather of
    all their bytes.

    `uniform`: every worker's tensors have this worker's shapes. Otherwise their lengths may
    differ (their dtypes may not), they must be 1-D, and the byte counts are all-gathered
    first; the data then travels padded to the longest worker's.
    """
    if not tensors:  # every worker has the same tensor count, so all of them skip alike
        return [[] for _ in range(comm.world_size)]
    as_bytes = [t.contiguous().reshape(-1).view(torch.uint8) for t in tensors]
    device = tensors[0].device
    flat = torch.cat(as_bytes)
    own_sizes = [b.numel() for b in as_bytes]
    if uniform:
        sizes = [own_sizes] * comm.world_size
        gathered = comm.all_gather(flat)
    else:
        counts = comm.all_gather(torch.tensor(own_sizes, dtype=torch.int64, device=device))
        sizes = [c.tolist() for c in counts]
        padded = torch.zeros(max(sum(s) for s in sizes), dtype=torch.uint8, device=device)
        padded[: flat.numel()] = flat
        gathered = comm.all_gather(padded)
    result = []
    for data, worker_sizes in zip(gathered, sizes):
        chunks = data[: sum(worker_sizes)].split(worker_sizes)
        # A slice of a byte buffer may be misaligned for wider dtypes: copy before the view.
        result.append([chunk.clone().view(t.dtype).view(t.shape if uniform else (-1,))
                       for chunk, t in zip(chunks, tensors)])
    return result
