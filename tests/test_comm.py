"""`Comm`'s byte accounting of a receive that gets a message shorter than its buffer (gloo
delivers it into the buffer's start, as OSGP's and AD-PSGD's header-only last messages do),
and of a message handed to a thread of the same process."""

from __future__ import annotations

import pytest
import torch

from distributed import run_workers
from dsgd_cli.comm.communicator import Comm, NetworkModel


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


# -- a payload (several tensors of mixed dtypes) point to point -----------------------------------

def _payloads(rank: int):
    """A top-k payload (int32 indices, float32 values), a QSGD-like one (one float32 norm,
    packed uint8 codes of an odd length, so the norm after it is misaligned in the byte
    stream), and a float64 matrix. Each rank's differ in value."""
    g = torch.Generator().manual_seed(rank)
    return [[torch.randint(0, 1000, (7,), generator=g, dtype=torch.int32), torch.randn(7, generator=g)],
            [torch.randint(0, 255, (13,), generator=g).to(torch.uint8), torch.randn(1, generator=g)],
            [torch.randn(3, 4, generator=g, dtype=torch.float64)]]


def _exchange_payloads(rank, world_size):
    comm, peer = Comm(rank, world_size), 1 - rank
    received = []
    for payload in _payloads(rank):
        receive = comm.irecv_tensors(payload, peer)  # like: this rank's own payload
        send = comm.isend_tensors(payload, peer)
        received.append(receive.wait())
        send.wait()
    uniform = vars(comm.take_traffic())
    # Lengths that differ between the ranks (dqsgd): rank 1's codes are longer.
    codes = torch.arange(5 + 4 * rank, dtype=torch.uint8)
    mine = [torch.tensor([rank + 1], dtype=torch.int8), codes]
    receive = comm.irecv_tensors(mine, peer, uniform=False)
    send = comm.isend_tensors(mine, peer, uniform=False)
    uneven = receive.wait()
    send.wait()
    return received, uniform, uneven, vars(comm.take_traffic())


def test_payloads_travel_point_to_point_with_exactly_their_bytes_counted():
    results = run_workers(_exchange_payloads, 2, preloaded=True)
    payload_bytes = [sum(t.numel() * t.element_size() for t in p) for p in _payloads(0)]
    assert payload_bytes == [7 * 8, 13 + 4, 12 * 8]
    for rank, (received, uniform, uneven, traffic) in enumerate(results):
        for got, sent in zip(received, _payloads(1 - rank)):
            assert [t.dtype for t in got] == [t.dtype for t in sent]
            assert all(torch.equal(a, b) for a, b in zip(got, sent))
        # one message per payload: its bytes, nothing else
        assert uniform["bytes_sent"] == uniform["bytes_received"] == sum(payload_bytes)
        assert uniform["calls"] == 2 * 3
        # uneven: the int64 byte length of each of the 2 tensors, then the bytes themselves
        assert uneven[0].tolist() == [2 - rank] and uneven[1].tolist() == list(range(5 + 4 * (1 - rank)))
        assert traffic["bytes_sent"] == 2 * 8 + 1 + 5 + 4 * rank
        assert traffic["bytes_received"] == 2 * 8 + 1 + 5 + 4 * (1 - rank)


# -- a group's collectives one after the other ----------------------------------------------------

def _two_buckets_at_once(rank, world_size):
    """Two all-reduces issued back to back without waiting (DDP's buckets during backward),
    then one on another group, each on a link of 0.1 s per 40 kB."""
    network = NetworkModel(latency_s=0.0, bytes_per_second=400_000.0)
    comm = Comm(rank, world_size, network)
    other = comm.new_group([0, 1])
    first = comm.all_reduce(torch.zeros(20_000), async_op=True)   # 2(n-1)/n x 80 kB = 80 kB
    second = comm.all_reduce(torch.zeros(10_000), async_op=True)  # 40 kB
    apart = comm.all_reduce(torch.zeros(10_000), group=other, async_op=True)
    modeled_end = {name: handle._issued_at + handle._emulated_s
                   for name, handle in (("first", first), ("second", second), ("apart", apart))}
    for handle in (first, second, apart):
        handle.wait()
    comm.close()
    return (modeled_end["first"] - first._issued_at, modeled_end["second"] - first._issued_at,
            modeled_end["apart"] - apart._issued_at)


def test_a_groups_collectives_are_modeled_one_after_the_other():
    """gloo and NCCL run a group's collectives in the order issued, one at a time: the second
    bucket's transfer starts, in the model, when the first one's ends (0.2 s + 0.1 s), not at
    its issue (which made an overlapped all-reduce of two buckets cost the larger one only).
    Another group's collective is not queued behind them."""
    for first, second, apart in run_workers(_two_buckets_at_once, 2, preloaded=True):
        assert first == pytest.approx(0.2)   # from its issue
        assert second == pytest.approx(0.3)  # from the first's issue: queued behind it
        assert apart == pytest.approx(0.1)   # from its own issue
