"""All-reduce of a large group as point-to-point messages: recursive doubling.

gloo's all-reduce is a ring: each member takes 2(n-1) steps, one message each, so a group of
n members exchanges 2n(n-1) messages per all-reduce. On a real network that is the
bandwidth-optimal choice. When every member is a process of one machine (the emulated
cluster), each message is a wake-up of two processes on a handful of cores: at 256 members a
ring all-reduce of 16,000 floats measured 18 CPU seconds (10 s on 2 cores), and it grows as
n squared. Recursive doubling (Thakur, Rabenseifner and Gropp, "Optimization of Collective
Communication Operations in MPICH", 2005) takes log2(n) steps of one exchange each: 0.7 CPU
seconds at 256 members, 8 at 1,024 (benchmarks/RESULTS.md).

The emulated network still charges what the model says a ring costs (`Comm` counts the
bytes and the modeled time apart from how the bytes move); only the real transport differs.
Groups of at most GLOO_RING_MAX members (the spec's `compute.ring_max`) keep gloo's ring, so
their results are bit for bit those of earlier dsgd and of torch DDP; above it the sums are
added in another order, which changes the last bits of a result (every member still gets the
same bits). A smaller `ring_max` trades those bits for a real all-reduce that fits a smaller
time scale (docs/cluster.md, "Limits").

Steps, for members 0..n-1 of the group and p the largest power of two ≤ n: member p+i
(i < n-p) first sends its tensor to member i, which adds it; then for d = 1, 2, 4, ... < p
members i and i XOR d exchange their tensors and each combines the two (addition is
commutative, so both hold the same bits); last, member i sends the result to member p+i.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist

from dsgd_cli.emulation.network import GLOO_RING_MAX  # by default: larger groups go by messages

# Tags of these messages: apart from a plugin's own point-to-point messages (tag 0), and one
# per collective on a group, so two in flight on one group cannot take each other's.
TAGS_FROM = 1 << 24
TAG_SPACE = 1 << 24

COMBINE = {"sum": torch.add, "max": torch.maximum, "min": torch.minimum}


def wanted(group_size: int, tensor: torch.Tensor, ring_max: int = GLOO_RING_MAX) -> bool:
    """Whether an all-reduce of `tensor` over a group of this size goes by messages: groups
    of more than `ring_max` members (the spec's `compute.ring_max`) do."""
    return group_size > ring_max and tensor.device.type == "cpu"


def tag(count: int) -> int:
    """The tag of the group's `count`-th collective by messages (the same on every member:
    members enter a group's collectives in one order)."""
    return TAGS_FROM + count % TAG_SPACE


def all_reduce(tensor: torch.Tensor, op: str, ranks: Sequence[int], rank: int,
               process_group: Any, message_tag: int) -> None:
    """Combine `tensor` in place over the members `ranks` (global ranks, this worker's
    `rank` among them) with `op` (sum, max or min)."""
    combine = COMBINE[op]
    members = len(ranks)
    me = ranks.index(rank)
    power = 1 << (members.bit_length() - 1)

    def send(to: int) -> None:
        dist.send(tensor, ranks[to], group=process_group, tag=message_tag)

    def receive(source: int, into: torch.Tensor) -> None:
        dist.recv(into, ranks[source], group=process_group, tag=message_tag)

    if me >= power:  # fold into member me - power, and get the result back from it
        send(me - power)
        receive(me - power, tensor)
        return
    other = torch.empty_like(tensor)
    if me + power < members:
        receive(me + power, other)
        combine(tensor, other, out=tensor)
    distance = 1
    while distance < power:
        partner = me ^ distance
        sent = dist.isend(tensor, ranks[partner], group=process_group, tag=message_tag)
        receive(partner, other)
        sent.wait()  # before the tensor it sends changes
        combine(tensor, other, out=tensor)
        distance <<= 1
    if me + power < members:
        send(me + power)
