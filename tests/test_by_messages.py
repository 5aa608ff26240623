"""All-reduce of large groups by point-to-point messages (dsgd_cli/comm/by_messages.py):
the same result as gloo's ring, the same bits on every member, the ring's accounting, and
never a plugin's message taken for one of its own. The tests lower the size above which a
group goes by messages (a spec's `compute.ring_max`), so that three real gloo workers take
that path (three: one of them folds into a partner, as a group whose size is not a power of
two does)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from conftest import dsgd, write_spec
from distributed import run_workers


def _sums_like_gloo(rank: int, world_size: int) -> dict:
    from dsgd_cli.comm.communicator import Comm

    comm = Comm(rank, world_size, ring_max=world_size - 1)  # the world goes by messages
    exact = torch.arange(10, dtype=torch.float64) * (rank + 1)  # integers: every order exact
    by_ring = exact.clone()
    dist.all_reduce(by_ring)
    results = {}
    for op in ("sum", "avg", "max", "min"):
        tensor = exact.clone()
        comm.all_reduce(tensor, op)
        results[op] = tensor
    results["ring"] = by_ring
    noisy = torch.randn(1000, generator=torch.Generator().manual_seed(rank))
    comm.all_reduce(noisy, "sum")
    results["noisy"] = noisy
    handle = comm.all_reduce(torch.ones(4), "sum", async_op=True)
    results["async"] = handle.wait()
    comm.barrier()
    results["traffic"] = comm.take_traffic()
    comm.close()
    return results


def test_an_all_reduce_by_messages_sums_like_gloo_and_counts_like_a_ring():
    results = run_workers(_sums_like_gloo, 3, preloaded=True)
    n = 3
    expected = torch.arange(10, dtype=torch.float64) * (1 + 2 + 3)
    for result in results:
        assert torch.equal(result["sum"], result["ring"]) and torch.equal(result["sum"], expected)
        assert torch.equal(result["avg"], expected / n)
        assert torch.equal(result["max"], torch.arange(10, dtype=torch.float64) * 3)
        assert torch.equal(result["min"], torch.arange(10, dtype=torch.float64))
        assert torch.equal(result["async"], torch.full((4,), 3.0))
        # The same bits everywhere, however the additions were ordered.
        assert torch.equal(result["noisy"], results[0]["noisy"])
    # The emulated network charges a ring all-reduce: 2(n-1)/n of the buffer each way, per call.
    sizes = [10 * 8] * 4 + [1000 * 4, 4 * 4]
    ring_bytes = sum(2 * (n - 1) * size // n for size in sizes)
    for result in results:
        traffic = result["traffic"]
        assert (traffic.bytes_sent, traffic.bytes_received) == (ring_bytes, ring_bytes)
        assert traffic.calls == len(sizes) + 1  # the barrier too


def _beside_a_plugins_message(rank: int, world_size: int) -> list[float]:
    from dsgd_cli.comm.communicator import Comm

    comm = Comm(rank, world_size, ring_max=world_size - 1)  # the world goes by messages
    # Rank 1 sends a plugin's message to rank 0 first; rank 0 receives it only after an
    # all-reduce in which it also receives from rank 1.
    if rank == 1:
        sent = comm.isend(torch.full((3,), 7.0), 0)
    total = torch.full((3,), float(rank))
    comm.all_reduce(total, "sum")
    message = None
    if rank == 0:
        message = comm.recv(torch.empty(3), 1).tolist()
    if rank == 1:
        sent.wait()
    comm.close()
    return [total.tolist(), message]


def test_an_all_reduce_by_messages_never_takes_a_plugins_message():
    results = run_workers(_beside_a_plugins_message, 3, preloaded=True)
    assert [total for total, _ in results] == [[3.0] * 3] * 3
    assert results[0][1] == [7.0] * 3


def test_small_groups_keep_gloos_ring():
    from dsgd_cli.comm import by_messages

    assert not by_messages.wanted(by_messages.GLOO_RING_MAX, torch.ones(1))
    assert by_messages.wanted(by_messages.GLOO_RING_MAX + 1, torch.ones(1))
    assert by_messages.GLOO_RING_MAX == 64  # bit for bit with earlier dsgd up to 64 workers
    assert by_messages.wanted(3, torch.ones(1), ring_max=2)  # a spec's lower compute.ring_max
    assert not by_messages.wanted(3, torch.ones(1), ring_max=3)


def _two_groups_of_everyone_at_once(rank: int, world_size: int) -> list[list[float]]:
    import random
    import threading
    import time

    from dsgd_cli.comm.communicator import Comm

    comm = Comm(rank, world_size, ring_max=world_size - 1)  # the world goes by messages
    everyone = comm.new_group(range(world_size))  # the same members as the world
    totals: dict[str, list[float]] = {"world": [], "group": []}
    jitter = random.Random(rank)

    def reduce(name, group):
        for round_index in range(6):
            time.sleep(jitter.random() * 0.02)  # each rank enters the two in its own order
            tensor = torch.full((5,), float(rank + round_index))
            comm.all_reduce(tensor, "sum", group=group)
            totals[name].append(tensor[0].item())

    threads = [threading.Thread(target=reduce, args=("world", None)),
               threading.Thread(target=reduce, args=("group", everyone))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    comm.close()
    return [totals["world"], totals["group"]]


def test_groups_of_the_same_members_keep_their_collectives_apart():
    """A plugin's group of everyone beside the world (as WAGMA's): when threads all-reduce on
    both at once, each rank may enter them in another order; each group's messages must still
    meet their own."""
    results = run_workers(_two_groups_of_everyone_at_once, 3, preloaded=True, timeout=90)
    expected = [float(sum(rank + r for rank in range(3))) for r in range(6)]
    assert results == [[expected, expected]] * 3


RING_MAX_SPEC = """
defaults:
  task: {{name: logreg, samples: 512, features: 200}}  # enough sums that some round differently
  workers: 3
  epochs: 1
  steps_per_epoch: 4
  batch_size: 8
  save_dir: {save_dir}
  aggregator: allreduce
experiments:
  - {{name: ring, compute: {{step_seconds: 0.001}}}}
  - {{name: messages, compute: {{step_seconds: 0.001, ring_max: 2}}}}
"""


def test_a_specs_ring_max_sends_its_workers_all_reduces_by_messages(tmp_path):
    """`compute.ring_max: 2` at 3 workers: the run all-reduces by recursive doubling. Its
    sums are added in another order than the ring's, so its parameters match the ring's run
    to rounding but not bit for bit; within the run every worker holds the same bits."""
    spec = write_spec(tmp_path, RING_MAX_SPEC.format(save_dir=tmp_path / "models"))
    result = dsgd("run", str(spec), "--db", str(tmp_path / "r.db"))
    assert result.returncode == 0, result.stderr
    models = {name: [torch.load(tmp_path / "models" / name / f"rank{rank}.pt",
                                weights_only=True) for rank in range(3)]
              for name in ("ring", "messages")}
    for ranks in models.values():
        for state in ranks[1:]:
            assert all(torch.equal(state[key], ranks[0][key]) for key in state)
    ring, messages = models["ring"][0], models["messages"][0]
    assert all(torch.allclose(ring[key], messages[key], atol=1e-6) for key in ring)
    assert not all(torch.equal(ring[key], messages[key]) for key in ring)
