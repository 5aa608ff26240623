"""`Comm`'s byte accounting of a receive that gets a message shorter than its buffer (gloo
delivers it into the buffer's start, as OSGP's and AD-PSGD's header-only last messages do)."""

from __future__ import annotations

import torch

from distributed import run_workers
from dsgd_cli.comm import Comm


def _short_then_full(rank, world_size):
    comm = Comm(rank, world_size)
    if rank == 0:  # each message's first number is its length
        comm.send(torch.tensor([3.0, 7.0, 8.0]), 1)
        comm.send(torch.full((10,), 10.0), 1)
        return comm.take_traffic().bytes_sent, None
    buffer = torch.zeros(10)
    received = []
    for _ in range(2):
        comm.irecv(buffer, 0, length=lambda message: int(message[0])).wait()
        received.append(buffer.clone())
    return comm.take_traffic().bytes_received, received


def test_irecv_counts_the_bytes_that_arrived_not_the_buffer():
    (sent, _), (received, messages) = run_workers(_short_then_full, 2, preloaded=True)
    assert messages[0][:3].tolist() == [3.0, 7.0, 8.0]
    assert messages[1].tolist() == [10.0] * 10
    assert sent == received == (3 + 10) * 4
