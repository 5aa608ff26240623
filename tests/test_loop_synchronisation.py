"""The training loop reads nothing back from the device between log intervals where the device
is not the CPU (dsgd_cli/worker/training.py: `check_each_step`).

On a GPU, every read of a tensor on the host (`float(loss)`, `.item()`, `.tolist()`, `.cpu()`)
waits for all the work queued before it: with one per step (`float(loss)` before backward, as
the loop had) the host can never queue the next step while the GPU runs this one. Here the loop
runs on CPU tensors with the GPU's setting, and every such read is counted."""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

import pytest
import torch

from distributed import run_workers

STEPS, LOG_INTERVAL = 24, 12
READS = ("__float__", "__int__", "__bool__", "item", "tolist", "cpu", "numpy")


def _train_counting_reads(rank, world_size, directory, check_each_step, poison_at):
    import torch.distributed  # noqa: F401  (the group is up: run_workers made it)

    from dsgd_cli.comm.events import EventWriter
    from dsgd_cli.emulation.clock import Clock
    from dsgd_cli.spec.experiments import load_spec
    from dsgd_cli.worker import training
    from dsgd_cli.worker.parts import build_worker

    spec = Path(directory) / "spec.yaml"
    (config,) = [experiment.config for experiment in load_spec(spec)]
    events = EventWriter(Path(directory) / f"rank{rank}.jsonl", rank, Clock(1.0))
    worker = build_worker(config, events, rank, world_size, torch.device("cpu"))
    loop = training.TrainingLoop(worker, events, training.StopRequest(None, ""),
                                 check_each_step=check_each_step)
    reads_by_step: list[int] = []
    counter = {"reads": 0, "in_loop": False}
    originals = {name: getattr(torch.Tensor, name) for name in READS}

    def counting(name):
        original = originals[name]

        def read(self, *args, **kwargs):
            if counter["in_loop"]:
                counter["reads"] += 1
            return original(self, *args, **kwargs)
        return read

    step = loop._step

    def counted_step(index, x, y):
        # The reads since the previous step began: this step's and the loop's work after it.
        counter["in_loop"] = True
        reads_by_step.append(counter["reads"])
        counter["reads"] = 0
        if index == poison_at:
            with torch.no_grad():
                next(worker.model.parameters()).fill_(math.nan)
        return step(index, x, y)

    loop._step = counted_step
    for name in READS:
        setattr(torch.Tensor, name, counting(name))
    try:
        loop.run()
        diverged = None
    except training.Diverged as error:
        diverged = (error.step, str(error.value))
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
    return reads_by_step[1:], diverged  # the first: the set-up before the first step


def _spec(directory: Path) -> None:
    (directory / "spec.yaml").write_text(textwrap.dedent(f"""
        defaults: {{task: logreg, workers: 1, epochs: 1, steps_per_epoch: {STEPS},
                   log_interval: {LOG_INTERVAL}}}
        experiments:
          - {{name: plain}}
    """))


def test_losses_stay_on_the_device_between_log_intervals(tmp_path):
    _spec(tmp_path)
    (reads, diverged), = run_workers(_train_counting_reads, 1, str(tmp_path), False, None)
    assert diverged is None
    # Between one step's start and the next, nothing is read back, except after the step
    # that ends a log interval: the interval's losses, in one read.
    flushes = [index for index in range(len(reads)) if (index + 1) % LOG_INTERVAL == 0]
    assert [index for index, count in enumerate(reads) if count] == flushes[:1]
    assert reads[LOG_INTERVAL - 1] == 1


@pytest.mark.slow  # the CPU's per-step check: test_faults' diverging runs take it by default
def test_on_the_cpu_each_steps_loss_is_read_before_its_backward(tmp_path):
    """The CPU keeps the exact, immediate check (a read costs nothing there)."""
    _spec(tmp_path)
    (reads, _), = run_workers(_train_counting_reads, 1, str(tmp_path), True, None)
    assert all(count >= 1 for count in reads)


def test_a_divergence_kept_on_the_device_is_found_at_its_exact_step(tmp_path):
    _spec(tmp_path)
    (_, diverged), = run_workers(_train_counting_reads, 1, str(tmp_path), False, 5)
    assert diverged == (5, "nan")
    (_, on_cpu), = run_workers(_train_counting_reads, 1, str(tmp_path), True, 5)
    assert on_cpu == diverged  # the same step either way


READ_WAIT_S = 100.0  # what each read of an interval's losses waits, on the fake clock


def _train_with_reads_that_wait(rank, world_size, directory, check_each_step):
    """The loop on a clock that stands still except while an interval's losses are read,
    which waits READ_WAIT_S (as a GPU finishing the work queued before the read would):
    returns the run's training seconds and the step seconds its intervals recorded."""
    import json
    import types

    from dsgd_cli.comm.events import EventWriter
    from dsgd_cli.emulation.clock import Clock
    from dsgd_cli.spec.experiments import load_spec
    from dsgd_cli.worker import interval_metrics, training
    from dsgd_cli.worker.parts import build_worker

    spec = Path(directory) / "spec.yaml"
    (config,) = [experiment.config for experiment in load_spec(spec)]
    log = Path(directory) / f"rank{rank}-{check_each_step}.jsonl"
    events = EventWriter(log, rank, Clock(1.0))
    worker = build_worker(config, events, rank, world_size, torch.device("cpu"))
    loop = training.TrainingLoop(worker, events, training.StopRequest(None, ""),
                                 check_each_step=check_each_step)
    now = [0.0]
    read = interval_metrics.IntervalMetrics.read_losses

    def waiting_read(self):
        now[0] += READ_WAIT_S
        return read(self)

    training.time = types.SimpleNamespace(perf_counter=lambda: now[0], sleep=lambda s: None)
    interval_metrics.IntervalMetrics.read_losses = waiting_read
    totals = loop.run()
    events.close()
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    recorded = [row["value"] for row in rows
                if row["type"] == "metric" and row["name"] == "step_seconds"]
    return totals.train_seconds, recorded


def test_the_wait_for_the_devices_queued_work_is_the_steps_time(tmp_path):
    """Steps whose host time is nothing (the GPU's work only queued) and reads that wait:
    the run's training time is the reads' waits, one per log interval (24 steps, intervals
    of 12: two reads), and each interval's mean step time is its wait over its 12 steps.
    Where each step's loss is read on the host (the CPU) no interval read waits."""
    _spec(tmp_path)
    (seconds, recorded), = run_workers(_train_with_reads_that_wait, 1, str(tmp_path), False)
    assert seconds == 2 * READ_WAIT_S
    assert recorded == [READ_WAIT_S / LOG_INTERVAL] * 2
    (seconds, _), = run_workers(_train_with_reads_that_wait, 1, str(tmp_path), True)
    assert seconds == 0.0


def _diverge_recording(rank, world_size, directory, check_each_step, poison_at):
    """The loop diverging at step `poison_at`; returns what it recorded: (name, step, epoch,
    value) of the metrics that do not depend on timing."""
    import json

    from dsgd_cli.comm.events import EventWriter
    from dsgd_cli.emulation.clock import Clock
    from dsgd_cli.spec.experiments import load_spec
    from dsgd_cli.worker import training
    from dsgd_cli.worker.parts import build_worker

    (config,) = [experiment.config for experiment in load_spec(Path(directory) / "spec.yaml")]
    log = Path(directory) / f"diverging-{check_each_step}.jsonl"
    events = EventWriter(log, rank, Clock(1.0))
    worker = build_worker(config, events, rank, world_size, torch.device("cpu"))
    loop = training.TrainingLoop(worker, events, training.StopRequest(None, ""),
                                 check_each_step=check_each_step)
    step = loop._step

    def poisoned_step(index, x, y):
        if index == poison_at:
            with torch.no_grad():
                next(worker.model.parameters()).fill_(math.nan)
        return step(index, x, y)

    loop._step = poisoned_step
    with pytest.raises(training.Diverged):
        loop.run()
    events.close()
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    return [(row["name"], row["step"], row["epoch"], row["value"]) for row in rows
            if row["type"] == "metric" and row["name"] in ("train_loss", "bytes_sent", "lr")]


@pytest.mark.parametrize("poison_at", [5, 14])
def test_a_divergence_found_at_the_intervals_end_keeps_the_steps_before_it(tmp_path, poison_at):
    """Kept on the device, the losses of steps 0..11 are read after step 11: a divergence at
    step 5 is found then, and the 5 sound steps before it are recorded as the CPU's immediate
    check records them (at step 5), the steps after it not; at step 14, the first interval
    and the 2 steps of the second before it."""
    _spec(tmp_path)
    (on_device,), (on_cpu,) = (run_workers(_diverge_recording, 1, str(tmp_path), check, poison_at)
                               for check in (False, True))
    assert on_device == on_cpu
    assert {step for _, step, _, _ in on_device} == (
        {5} if poison_at == 5 else {LOG_INTERVAL, 14})
