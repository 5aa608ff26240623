"""Averaging tensors through a compressor: the communication side of compression.

GRACE (Xu et al., "GRACE: A Compressed Communication Framework for Distributed Machine
Learning", ICDCS 2021) keeps three parts apart: the compressor turns a tensor into a payload
and back, the memory (error feedback) keeps what the payloads left out, and the communicator
moves the payloads. Here the compressor (`dsgd_cli.api.Compressor`) only declares what its
payloads allow, and this module chooses the collective from that:

- `summable`: the payloads of all workers are summed by one all-reduce (one per payload
  dtype) and the sum is decompressed once;
- otherwise they are all-gathered (their lengths first, unless `uniform_payload`) and the
  compressor's `combine` turns them into the average.

Aggregators call `compressed_average`. A compressor that needs several rounds (PowerSGD)
overrides `Compressor.exchange`, and one written for an earlier dsgd may override
`Compressor.average_many`: both overrides are honoured.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable

import torch

from dsgd_cli.comm.batching import all_gather_flat, all_reduce_flat

if TYPE_CHECKING:  # the plugin API imports this module
    from dsgd_cli.api import Compressor, ErrorFeedback
    from dsgd_cli.comm.communicator import Comm

Exchanged = list[tuple[torch.Tensor, torch.Tensor | None]]  # per tensor: (average, own)


def compressed_average(compressor: Compressor, comm: Comm, tensors: list[torch.Tensor],
                       keys: list[str], step: int,
                       memory: ErrorFeedback | None = None) -> list[torch.Tensor]:
    """Each tensor averaged over all workers, compressed; `keys` name the tensors, `step` is
    the training step (for the compressor's seeds).

    With `memory`, error feedback: each tensor is sent compensated with its residual, and the
    residual becomes what this worker's payload left out."""
    if _overridden(compressor, "average_many"):
        return compressor.average_many(tensors, keys, step, comm, memory)
    return average_with_memory(compressor, comm, tensors, keys, step, memory)


def compressed_exchange(compressor: Compressor, comm: Comm, tensors: list[torch.Tensor],
                        keys: list[str], step: int, with_local: bool = False) -> Exchanged:
    """Per tensor: its average over all workers and, when `with_local`, what this worker's own
    payload decompresses to."""
    if _overridden(compressor, "exchange"):
        return compressor.exchange(tensors, keys, step, comm, with_local)
    return exchange_in_one_collective(compressor, comm, tensors, keys, step, with_local)


def average_with_memory(compressor: Compressor, comm: Comm, tensors: list[torch.Tensor],
                        keys: list[str], step: int,
                        memory: ErrorFeedback | None) -> list[torch.Tensor]:
    """`compressed_average` whatever `average_many` the compressor has."""
    if memory is not None:
        tensors = [memory.compensate(key, tensor) for key, tensor in zip(keys, tensors)]
    results = compressed_exchange(compressor, comm, tensors, keys, step,
                                  with_local=memory is not None)
    if memory is not None:
        for key, tensor, (_, local) in zip(keys, tensors, results):
            memory.update(key, tensor, local)
    return [average for average, _ in results]


def exchange_in_one_collective(compressor: Compressor, comm: Comm, tensors: list[torch.Tensor],
                               keys: list[str], step: int, with_local: bool = False) -> Exchanged:
    """`compressed_exchange` for a compressor of one round: every tensor compressed on its
    own, all payloads in one collective (one per payload dtype when summable)."""
    # An empty tensor has nothing to send; every worker skips it alike.
    live = [i for i, t in enumerate(tensors) if t.numel() > 0]
    results = [None if t.numel() else (t.clone(), t.clone() if with_local else None)
               for t in tensors]
    payloads = [compressor.compress(tensors[i], keys[i], step) for i in live]
    sent = [t for payload in payloads for t in payload.tensors]
    if compressor.summable:  # one "worker": the sum of everyone's payloads
        workers = [iter(all_reduce_flat(sent, comm))]
    else:
        workers = [iter(w) for w in all_gather_flat(sent, comm, compressor.uniform_payload)]
    for payload, i in zip(payloads, live):
        theirs = [dataclasses.replace(payload, tensors=[next(w) for _ in payload.tensors])
                  for w in workers]
        average = (compressor.decompress(theirs[0], tensors[i]) / comm.world_size
                   if compressor.summable else compressor.combine(theirs, tensors[i]))
        own = compressor.decompress(payload, tensors[i]).clone() if with_local else None
        results[i] = (average, own)
    return results


def delegated(method: Callable) -> Callable:
    """Marks a `Compressor` method that only calls this module: a compressor that overrides
    it is asked instead."""
    method.delegated_to_comm = True
    return method


def _overridden(compressor: Compressor, name: str) -> bool:
    return not getattr(getattr(compressor, name), "delegated_to_comm", False)
