"""Where workers compute: one GPU each with NCCL when there are enough, else the CPU with
gloo; and every collective's tensor on its group's device. The GPU count is mocked."""

from __future__ import annotations

import pytest
import torch

from conftest import dsgd_in_process, write_spec
from dsgd_cli.errors import DsgdError
from dsgd_cli.launch import launcher
from dsgd_cli.worker import process as runtime
from dsgd_cli.launch import torchrun
from dsgd_cli.comm.communicator import Comm, Group
from dsgd_cli.launch.launcher import DevicePlan, choose_device
from dsgd_cli.spec.experiments import load_spec
from dsgd_cli.results.store import Store
from dsgd_cli.spec.sharding import Shard


def planned_devices(monkeypatch) -> list[str]:
    """The device each launch's plan names, as the workers read it, in launch order."""
    seen = []
    write_plan = torchrun.Torchrun.write_plan

    def spy(self, plan):
        seen.append(plan["device"])
        write_plan(self, plan)

    monkeypatch.setattr(torchrun.Torchrun, "write_plan", spy)
    return seen


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
        "cpu", "4 workers but 1 GPU on this machine: running on the CPU with gloo (device: cuda "
               "shares the GPUs)")
    gpus(2)
    assert choose_device(3).notice.startswith("3 workers but 2 GPUs on this machine")


def test_device_cpu_stays_on_the_cpu_and_device_cuda_shares_the_gpus(gpus):
    gpus(4)
    assert choose_device(4, "cpu") == DevicePlan("cpu")
    assert choose_device(4, "cuda") == DevicePlan("cuda")  # one each: NCCL as with auto
    gpus(1)
    assert choose_device(8, "cuda", measured_clock=False) == DevicePlan(
        "cuda_shared", "8 workers share 1 GPU (worker i on GPU i mod 1), communicating over gloo",
        8.0)
    gpus(3)
    measured = choose_device(8, "cuda")
    assert (measured.kind, measured.workers_per_gpu) == ("cuda_shared", 8 / 3)
    assert measured.notice.endswith("so the measured times are not a cluster's (a compute "
                                    "model gives modeled times)")
    gpus(0)
    with pytest.raises(DsgdError, match="^e: device: cuda, but torch finds no CUDA GPU"):
        choose_device(2, "cuda", name="e")


def test_a_worker_sharing_gpus_takes_its_turn_and_talks_over_gloo(gpus, monkeypatch):
    gpus(3)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    assert [runtime.device_and_backend(rank, "cuda_shared") for rank in range(5)] == [
        (torch.device("cuda", rank % 3), "gloo") for rank in range(5)]


def test_the_spec_asks_for_a_device_and_the_dry_run_says_where(tmp_path, gpus):
    gpus(1)
    spec = write_spec(tmp_path, """
    defaults: {task: {name: logreg}, workers: 4, steps_per_epoch: 2}
    experiments:
      - {name: shared, device: cuda}
      - {name: plain}
    """)
    shared, plain = load_spec(spec)
    assert shared.config["device"] == "cuda" and "device" not in plain.config
    launches = launcher.plan_launches([shared, plain])
    assert [launch.device.kind for launch in launches] == ["cuda_shared", "cpu"]
    result = dsgd_in_process("run", str(spec), "--dry-run")
    assert result.returncode == 0, result.stderr
    assert "launch 1: 1 experiment on 4 workers (cuda_shared)" in result.stdout
    assert "4 workers share 1 GPU (worker i on GPU i mod 1), communicating over gloo" in result.stdout
    bad = write_spec(tmp_path, "experiments: [{name: e, device: gpu}]", name="bad.yaml")
    refused = dsgd_in_process("run", str(bad), "--dry-run")
    assert refused.returncode == 2
    assert "experiments[0].device: expected one of auto, cpu, cuda, got 'gpu'" in refused.stderr


def test_a_shared_gpu_run_records_how_many_workers_shared_each(tmp_path, gpus, monkeypatch):
    """The plan the workers read names the shared GPUs, and the run records
    `workers_per_gpu` (this machine has no GPU: the workers then fail, as they would without
    one)."""
    gpus(1)
    spec = write_spec(tmp_path, """
    experiments:
      - {name: shared, device: cuda, task: {name: logreg}, workers: 2, steps_per_epoch: 2,
         compute: {step_seconds: 0.01}}
    """)
    (experiment,) = load_spec(spec)
    seen = planned_devices(monkeypatch)
    store = Store(str(tmp_path / "r.db"))
    result = launcher.launch(experiment, store, str(spec))
    assert seen == ["cuda_shared"]
    assert [m.value for m in store.metric_history(result.run_id, "workers_per_gpu")] == [2.0]


def test_the_launchers_choice_reaches_the_workers(tmp_path, gpus, monkeypatch):
    """`dsgd run` on a machine with fewer GPUs than workers trains on the CPU: the workers are
    told so and never touch CUDA (which this machine lacks, so the run fails if they do)."""
    gpus(1)
    spec = write_spec(tmp_path, """
    experiments:
      - {name: cpu, task: {name: logreg}, workers: 2, steps_per_epoch: 2}
    """)
    (experiment,) = load_spec(spec)
    seen = planned_devices(monkeypatch)
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


def test_messages_of_workers_sharing_a_gpu_are_staged_in_page_locked_host_memory(monkeypatch):
    """gloo carries host tensors: a GPU tensor's message is copied into a pinned host buffer
    (DMA, cached by torch), a host tensor goes as it is. No GPU here: the tensor is a stand-in
    on device cuda:0 and torch.empty is watched."""
    from types import SimpleNamespace

    from dsgd_cli.comm import communicator

    made = []
    real_empty = torch.empty

    def watched_empty(*shape, **kwargs):
        made.append(kwargs.get("pin_memory"))
        return real_empty(*shape, dtype=kwargs["dtype"])

    copied = []
    on_gpu = SimpleNamespace(device=torch.device("cuda", 0), shape=(3,), dtype=torch.float16)
    monkeypatch.setattr(torch, "empty", watched_empty)
    monkeypatch.setattr(torch.Tensor, "copy_", lambda self, source: copied.append(source) or self)
    comm = SimpleNamespace(_wire_device=lambda group: torch.device("cpu"))
    wire = communicator.Comm.on_wire(comm, on_gpu, None)
    assert made == [True] and copied == [on_gpu]
    assert (wire.device.type, wire.dtype, tuple(wire.shape)) == ("cpu", torch.float16, (3,))
    on_host = real_empty(3)
    assert communicator.Comm.on_wire(comm, on_host, None) is on_host
    assert communicator.host_buffer_like(on_host).is_pinned() is False
