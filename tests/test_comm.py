"""`Comm`'s byte accounting of a receive that gets a message shorter than its buffer (gloo
delivers it into the buffer's start, as OSGP's and AD-PSGD's header-only last messages do),
and of a message handed to a thread of the same process."""

from __future__ import annotations

import pytest
import torch

from distributed import run_workers
from dsgd_cli.comm import Comm, NetworkModel


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


def test_a_send_within_the_process_costs_what_a_send_would():
    """Counted as one message each way and blocked for at least the emulated transfer time,
    as `send` is (backup's rank 0 hands its gradient to its coordinator thread so)."""
    network = NetworkModel(latency_s=0.05, bytes_per_second=400_000.0)
    comm = Comm(0, 1, network)
    comm.send_within_process(torch.zeros(10_000))  # 40 kB: 0.05 + 0.1 s
    traffic = comm.take_traffic()
    assert (traffic.bytes_sent, traffic.bytes_received, traffic.calls) == (40_000, 40_000, 1)
    assert traffic.seconds >= network.duration(40_000, 1) == pytest.approx(0.15)
