"""What tests ask of the emulated cluster and the communicator that no run needs."""

from __future__ import annotations

from typing import Sequence

from dsgd_cli.comm.cluster import Cluster
from dsgd_cli.comm.communicator import Handle


def halving_doubling_seconds(cluster: Cluster, ranks: Sequence[int], nbytes: float) -> float:
    """Recursive halving then doubling over a power-of-two group (WAGMA's group average,
    Rabenseifner's all-reduce), in closed form: exchange k pairs members at distance
    p / 2^(k+1) and each sends nbytes / 2^(k+1); the all-gather repeats the exchanges in
    reverse order. Each exchange waits for its slowest pair."""
    p = len(ranks)
    exchanges = p.bit_length() - 1
    total = 0.0
    for k in range(exchanges):
        half = p >> (k + 1)
        pairs = [(ranks[i], ranks[i ^ half]) for i in range(p)]
        total += 2 * cluster.concurrent_seconds(pairs, nbytes / 2 ** (k + 1))
    return total


def emulated_seconds(handle: Handle) -> float:
    """The real seconds the network emulation makes `handle`'s operation last at least."""
    return handle._emulated_s
