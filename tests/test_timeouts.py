"""An operation that makes no progress for the run's `timeout` fails with a message naming the
operation and the peer, instead of hanging."""

from __future__ import annotations

import time

import torch

from distributed import run_workers
from dsgd_cli.comm import Comm, CommTimeout

TIMEOUT_S = 1.0


def _rank_0_waits_for_a_silent_peer(rank: int, world_size: int) -> list[str]:
    comm = Comm(rank, world_size, timeout_s=TIMEOUT_S)
    # A timeout closes the links it used: each operation gets a group of its own.
    groups = [comm.new_group(range(world_size)) for _ in range(4)]
    if rank == 1:  # alive, but never takes part
        time.sleep(6 * TIMEOUT_S)
        return []
    operations = [
        lambda: comm.all_reduce(torch.zeros(4), group=groups[0]),
        lambda: comm.recv(torch.zeros(4), src=1, group=groups[1]),
        lambda: comm.irecv(torch.zeros(4), src=None, group=groups[2]).wait(),
        lambda: comm.broadcast(torch.zeros(4), src=1, group=groups[3]),
    ]
    messages = []
    for operation in operations:
        try:
            operation()
            messages.append("completed")
        except CommTimeout as error:
            messages.append(str(error))
    return messages


def test_operations_that_make_no_progress_fail_naming_operation_and_peer():
    messages, _ = run_workers(_rank_0_waits_for_a_silent_peer, 2, timeout=60)
    assert messages == [
        "all_reduce over all 2 workers: no progress for 1 s (the spec's timeout)",
        "recv from rank 1: no progress for 1 s (the spec's timeout)",
        "recv from any of all 2 workers: no progress for 1 s (the spec's timeout)",
        "broadcast from rank 1 over all 2 workers: no progress for 1 s (the spec's timeout)",
    ]
