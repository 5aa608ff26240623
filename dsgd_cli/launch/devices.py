"""Where a launch's workers compute (the spec's `device`), and whether numba's CUDA kernels can
run there.

- `auto` (the default): one GPU each with NCCL when the machine has as many GPUs as the
  launch has workers on it; otherwise the CPU with gloo, and a notice says why.
- `cpu`: the CPU with gloo, whatever the machine has.
- `cuda`: the GPUs. With as many as workers, one each with NCCL; with fewer, the workers
  share them in turn (worker i on GPU i mod G) and communicate over gloo, whose messages
  travel through host memory (`Comm.on_wire`). Workers sharing a GPU take turns on it, so a
  run's measured compute time is not a cluster's: with a `compute` model the modeled clock
  is exact as ever; a measured-clock run says so (a notice and the run's `workers_per_gpu`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from dsgd_cli.errors import DsgdError
from dsgd_cli.spec import registry

if TYPE_CHECKING:
    from dsgd_cli.launch.launcher import Launch
    from dsgd_cli.spec.experiments import Experiment

CPU, CUDA, SHARED_CUDA = "cpu", "cuda", "cuda_shared"  # the kinds a launch plan names


@dataclass(frozen=True)
class DevicePlan:
    """Where a run's workers compute: CUDA (one GPU each, NCCL), SHARED_CUDA (GPUs taken in
    turn, gloo) or CPU (gloo); `workers_per_gpu` on shared GPUs."""

    kind: str
    notice: str | None = None  # why a machine with CUDA runs on the CPU, or shares its GPUs
    workers_per_gpu: float | None = None

    @property
    def uses_gpus(self) -> bool:
        return self.kind in (CUDA, SHARED_CUDA)


def choose_device(workers: int, requested: str = "auto", measured_clock: bool = True,
                  name: str = "") -> DevicePlan:
    """The plan for a launch of `workers` workers on this machine whose experiments ask for
    `requested` (`auto`, `cpu` or `cuda`); `measured_clock`: the run has no compute model."""
    import torch  # already loaded by the spec; not needed by the reading commands

    if requested == CPU:
        return DevicePlan(CPU)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus >= workers:
        return DevicePlan(CUDA) if gpus else DevicePlan(CPU)
    if requested == "auto":
        return DevicePlan(CPU, f"{workers} workers but {_gpus(gpus)} on this machine: running "
                               "on the CPU with gloo (device: cuda shares the GPUs)" if gpus
                          else None)
    if not gpus:
        raise DsgdError(f"{name}: device: cuda, but torch finds no CUDA GPU on this machine "
                        "(device: auto or cpu runs on the CPU)")
    share = workers / gpus
    notice = (f"{workers} workers share {_gpus(gpus)} (worker i on GPU i mod {gpus}), "
              "communicating over gloo")
    if measured_clock:
        notice += ("; they take turns on the GPUs, so the measured times are not a cluster's "
                   "(a compute model gives modeled times)")
    return DevicePlan(SHARED_CUDA, notice, share)


def plan_for(experiment: Experiment, workers: int) -> DevicePlan:
    """`choose_device` for one experiment's launch on this machine."""
    resolved = experiment.resolved
    return choose_device(workers, resolved.device, resolved.compute is None, experiment.name)


def cuda_kernels_problem(launches: list[Launch]) -> str | None:
    """Why a GPU launch among `launches` whose plugins call numba's kernels cannot run them
    here (numba_kernels/cuda_check.py; None when it can, or none needs them): asked before
    anything is recorded, rather than failing at rank 0's first step."""
    def needs_kernels(experiment: Experiment) -> bool:
        return any(registry.load(kind, getattr(experiment.resolved, kind).name).uses_numba_kernels
                   for kind in ("aggregator", "compressor"))

    if not any(launch.device.uses_gpus and any(map(needs_kernels, launch.experiments))
               for launch in launches):
        return None
    from numba_kernels import cuda_check

    return cuda_check.problem()


def _gpus(count: int) -> str:
    return f"{count} GPU{'s' if count != 1 else ''}"
