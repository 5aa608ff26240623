"""Where workers compute: one GPU each with NCCL when there are enough, else the CPU with
gloo; and every collective's tensor on its group's device. The GPU count is mocked."""

from __future__ import annotations

import pytest
import torch

from conftest import write_spec
from dsgd_cli.launch import launcher
from dsgd_cli.worker import process as runtime
from dsgd_cli.launch import torchrun
from dsgd_cli.comm.communicator import Comm, Group
from dsgd_cli.launch.launcher import DevicePlan, choose_device
from dsgd_cli.spec.experiments import load_spec
from dsgd_cli.results.store import Store
from dsgd_cli.spec.sharding import Shard


@pytest.fixture
def gpus(monkeypatch):
    """Pretend this machine has CUDA with `gpus(n)` devices."""
    def pretend(count: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    return pretend


def test_one_gpu_per_worker_or_the_cpu_with_a_notice(gpus):
    gpus(0)
    assert choose_device(4) == DevicePlan("cpu")
    gpus(4)
    assert choose_device(4) == DevicePlan("cuda")
    assert choose_device(2) == DevicePlan("cuda")
    gpus(1)
    assert choose_device(4) == DevicePlan(
        "cpu", "4 workers but 1 GPU on this machine: running on the CPU with gloo")
    gpus(2)
    assert choose_device(3).notice == "3 workers but 2 GPUs on this machine: running on the CPU with gloo"


def test_the_launchers_choice_reaches_the_workers(tmp_path, gpus, monkeypatch):
    """`dsgd run` on a machine with fewer GPUs than workers trains on the CPU: the workers are
    told so and never touch CUDA (which this machine lacks, so the run fails if they do)."""
    gpus(1)
    spec = write_spec(tmp_path, """
    experiments:
      - {name: cpu, task: {name: logreg}, workers: 2, steps_per_epoch: 2}
    """)
    (experiment,) = load_spec(spec)
    seen = []
    write_plan = torchrun.Torchrun.write_plan

    def spy(self, plan):
        seen.append(plan["device"])
        write_plan(self, plan)

    monkeypatch.setattr(torchrun.Torchrun, "write_plan", spy)
    result = launcher.launch(experiment, Store(str(tmp_path / "r.db")), str(spec))
    assert seen == ["cpu"]
    assert result.status == "completed", result.reason


def test_a_worker_uses_the_device_it_is_told(gpus, monkeypatch):
    gpus(8)
    assert runtime.device_and_backend(local_rank=3, kind="cpu") == (torch.device("cpu"), "gloo")
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    assert runtime.device_and_backend(local_rank=3, kind="cuda") == (torch.device("cuda", 3), "nccl")
    assert runtime.device_and_backend(local_rank=3) == (torch.device("cuda", 3), "nccl")


@pytest.mark.parametrize("call", [
    lambda comm, t, g: comm.all_reduce(t, group=g),
    lambda comm, t, g: comm.all_gather(t, group=g),
    lambda comm, t, g: comm.broadcast(t, src=0, group=g),
    lambda comm, t, g: comm.isend(t, dst=1, group=g),
    lambda comm, t, g: comm.irecv(t, src=1, group=g),
], ids=["all_reduce", "all_gather", "broadcast", "isend", "irecv"])
def test_a_cpu_tensor_on_an_nccl_group_is_named(call):
    comm = Comm(0, 2)
    nccl = Group((0, 1), None, "nccl")
    with pytest.raises(ValueError, match="a cpu tensor on an nccl group; make it on comm.device"):
        call(comm, torch.zeros(3), nccl)
    comm.world = nccl  # the world group itself: group=None
    with pytest.raises(ValueError, match="on an nccl group"):
        call(comm, torch.zeros(3), None)


def test_more_workers_than_training_examples_is_named():
    assert Shard(5, rank=4, world_size=5, seed=0).size == 1
    with pytest.raises(ValueError, match="^4 training examples cannot be shared by 5 workers: "
                                         "each needs at least one$"):
        Shard(4, rank=0, world_size=5, seed=0)
