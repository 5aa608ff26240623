"""An operation that makes no progress for the run's `timeout` fails with a message naming the
operation and the peer, instead of hanging."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from conftest import dsgd, write_spec
from distributed import run_workers
from dsgd_cli.comm.communicator import Comm, CommTimeout
from dsgd_cli.results.store import Store

TIMEOUT_S = 1.0


def _rank_0_waits_for_a_silent_peer(rank: int, world_size: int, done: str) -> list[str]:
    comm = Comm(rank, world_size, timeout_s=TIMEOUT_S)
    # A timeout closes the links it used: each operation gets a group of its own.
    groups = [comm.new_group(range(world_size)) for _ in range(4)]
    if rank == 1:  # alive, but never takes part, until rank 0 has tried every operation
        deadline = time.monotonic() + 60
        while not Path(done).exists() and time.monotonic() < deadline:
            time.sleep(0.05)
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
    Path(done).touch()
    return messages


def test_operations_that_make_no_progress_fail_naming_operation_and_peer(tmp_path):
    messages, _ = run_workers(_rank_0_waits_for_a_silent_peer, 2, str(tmp_path / "done"),
                              timeout=90, preloaded=True)
    assert messages == [
        "all_reduce over all 2 workers: no progress for 1 s (the spec's timeout); "
        "ranks behind: 1",
        "recv from rank 1: no progress for 1 s (the spec's timeout)",
        "recv from any of all 2 workers: no progress for 1 s (the spec's timeout)",
        "broadcast from rank 1 over all 2 workers: no progress for 1 s (the spec's timeout); "
        "ranks behind: 1",
    ]


@pytest.mark.slow  # a launch that waits out its timeout; the in-process test above names the
# operation and peer by default (CI runs -m slow)
def test_a_run_whose_peer_stops_answering_fails_naming_the_wait(tmp_path):
    """Rank 1 stalls (an emulated straggler a million times slower) for longer than the spec's
    timeout: rank 0's all-reduce gives up and the run fails with that reason, not a hang.
    (A timeout of 3 s, not 1: on two loaded cores rank 0 itself can be descheduled for a
    second, and rank 1, waiting for it, would then time out first.)"""
    spec = write_spec(tmp_path, """
        experiments:
          - name: stalls
            task: {name: logreg, samples: 256}
            steps_per_epoch: 4
            timeout: 3
            stragglers: {ranks: [1], slowdown: 1000000}
          - name: after
            task: {name: logreg, samples: 256}
            steps_per_epoch: 2
    """)
    db = tmp_path / "r.db"
    result = dsgd("run", str(spec), "--db", str(db), timeout=240)
    assert result.returncode == 1, result.stderr
    stalled, after = Store(str(db)).runs()
    assert (stalled.status, stalled.failed_rank) == ("failed", 1)  # the straggler
    assert stalled.reason == ("rank 1: never entered the collective that rank 0 waited in "
                              "(CommTimeout: all_reduce over all 2 workers: no progress for 3 s "
                              "(the spec's timeout); ranks behind: 1)")
    assert after.status == "completed"

