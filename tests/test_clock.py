"""The emulation's clock (dsgd_cli/emulation/clock.py): its arithmetic, the runtime's users of
it, and that it is the only place real and modeled seconds are converted."""

from __future__ import annotations

import ast
import json
import math
from pathlib import Path

import pytest

from dsgd_cli.api import RunLength, WorkerContext
from dsgd_cli.comm.cluster import Cluster, Link
from dsgd_cli.comm.events import EventWriter
from dsgd_cli.emulation.clock import Clock
from dsgd_cli.emulation.compute import PaddedCompute
from dsgd_cli.emulation.network import NetworkModel, real_cluster, real_network

ROOT = Path(__file__).resolve().parent.parent


class FakeTime:
    """A real clock that moves only when told, and a sleep that moves it."""

    def __init__(self, now: float = 1000.0):
        self.now = now
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def _clock(scale: float, real: FakeTime) -> Clock:
    return Clock(scale, now=real, sleep=real.sleep)


# -- arithmetic ---------------------------------------------------------------------------

def test_conversions_divide_and_multiply_by_the_time_scale():
    clock = Clock(4)
    assert clock.to_modeled(10.0) == 2.5
    assert clock.to_real(2.5) == 10.0
    assert clock.to_real_rate(1e6) == 250_000.0  # bytes per modeled second, per real one
    assert Clock().to_modeled(3.0) == 3.0 == Clock().to_real(3.0)


def test_elapsed_counts_modeled_seconds_from_the_common_start():
    real = FakeTime()
    clock = _clock(4, real)
    real.now += 8.0  # before the start: not the run's time
    clock.start()
    assert clock.elapsed() == 0.0 and clock.started_at == real.now
    real.now += 10.0
    assert clock.elapsed() == 2.5


def test_a_resumed_start_goes_on_from_the_checkpoints_time():
    real = FakeTime()
    clock = _clock(2, real)
    clock.start(30.0)
    assert clock.elapsed() == 30.0
    assert clock.started_at == real.now - 60.0  # 30 modeled seconds are 60 real ones
    real.now += 4.0
    assert clock.elapsed() == 32.0


def test_skip_moves_modeled_time_forward_without_waiting():
    real = FakeTime()
    clock = _clock(4, real)
    clock.start()
    real.now += 4.0
    clock.skip(10.0)
    clock.skip(2.5)
    assert clock.elapsed() == 13.5 and clock.skipped == 12.5
    assert real.slept == []  # nothing slept
    real.now += 4.0
    assert clock.elapsed() == 14.5  # and the clock goes on from there
    with pytest.raises(ValueError, match="only goes forward"):
        clock.skip(-1.0)


def test_deadlines_and_durations_between_the_timelines():
    real = FakeTime()
    clock = _clock(5, real)
    assert clock.real_deadline(2.0) == real.now + 10.0  # a modeled patience, waited in real time
    started = real.now
    real.now += 15.0
    assert clock.modeled_since(started) == 3.0


def test_sleeps_wait_the_real_seconds_of_a_modeled_time():
    real = FakeTime()
    clock = _clock(3, real)
    clock.start()
    clock.sleep(2.0)
    assert real.slept == [6.0] and clock.elapsed() == 2.0
    clock.sleep_until(5.0)
    assert real.slept == [6.0, 9.0] and clock.elapsed() == 5.0
    clock.sleep_until(1.0)  # already past it
    clock.sleep(0.0)
    assert real.slept == [6.0, 9.0]


@pytest.mark.parametrize("scale", [0, -1.0, math.nan])
def test_a_time_scale_is_positive(scale):
    with pytest.raises(ValueError, match="positive"):
        Clock(scale)


# -- its users ----------------------------------------------------------------------------

def test_the_run_length_reads_the_workers_clock():
    real = FakeTime()
    clock = _clock(4, real)
    clock.start()
    length = RunLength(seconds=10.0, started_at=clock.started_at, time_scale=4, clock=clock)
    real.now += 36.0
    assert length.elapsed() == 9.0 and not length.spent()
    clock.skip(1.0)  # time lost counts against a budget in seconds
    assert length.elapsed() == 10.0 and length.spent()


def test_a_run_length_without_a_clock_keeps_its_public_fields_meaning():
    import time
    length = RunLength(seconds=10.0, started_at=time.perf_counter() - 40.0, time_scale=4)
    assert 10.0 <= length.elapsed() < 10.5 and length.spent()


def test_a_plugins_context_has_a_clock_of_scale_one_by_default():
    ctx = WorkerContext(rank=0, world_size=1, device=None, model=None, optimizer=None,
                        comm=None, metrics=None, seed=0, compressor=None)
    assert isinstance(ctx.clock, Clock) and ctx.clock.time_scale == 1


def test_metrics_are_stamped_with_the_modeled_time_of_the_writers_clock(tmp_path):
    real = FakeTime()
    clock = _clock(4, real)
    writer = EventWriter(tmp_path / "rank0.jsonl", 0, clock)
    clock.start()
    real.now += 20.0
    writer.metric("train_loss", 1.0, step=1)
    clock.skip(3.0)
    writer.metric("train_loss", 0.5, step=2)
    writer.continue_from(100.0)  # a resume: the same clock goes on from there
    writer.metric("train_loss", 0.25, step=3)
    writer.close()
    lines = [json.loads(line) for line in (tmp_path / "rank0.jsonl").read_text().splitlines()]
    assert [line["seconds"] for line in lines] == [5.0, 8.0, 100.0]
    assert clock.elapsed() == 100.0


def test_links_are_stretched_into_the_clocks_real_time():
    network = NetworkModel(latency_s=0.01, bytes_per_second=1e6)
    assert real_network(network, Clock(4)) == NetworkModel(0.04, 250_000.0)
    assert real_network(network, 4.0) == NetworkModel(0.04, 250_000.0)  # a bare scale, as before
    assert real_network(network, Clock(1)) is network and real_network(None, Clock(4)) is None
    cluster = Cluster(workers=4, nodes=2, regions=(2,),
                      links={"inter_node": Link(0.002, 1e8), "intra_node": Link(0.0, 1e9)})
    stretched = real_cluster(cluster, Clock(5))
    assert stretched.links == {"inter_node": Link(0.01, 2e7), "intra_node": Link(0.0, 2e8)}
    assert stretched.nodes == 2 and real_cluster(None, Clock(5)) is None


def test_the_padding_budget_is_the_modeled_step_in_the_clocks_real_seconds():
    compute = {"step_seconds": 0.5, "variation": None, "time_scale": 3}
    padding = PaddedCompute(compute, seed=0, rank=0, blocked=lambda: 0.0, clock=Clock(6))
    assert padding.clock.to_real(padding.modeled_seconds(0, slowdown=2.0)) == 6.0
    # without a clock, one of the section's time scale
    assert PaddedCompute(compute, seed=0, rank=0, blocked=lambda: 0.0).clock.time_scale == 3


# -- one owner ----------------------------------------------------------------------------

SCANNED = ("dsgd_cli", "plugins")
OWNER = ROOT / "dsgd_cli" / "emulation" / "clock.py"


def _is_time_scale(node: ast.AST, aliases: set[str]) -> bool:
    """Whether an expression holds a time scale: a name or attribute called `time_scale` (or
    bound from one in the same module), a `["time_scale"]` look-up, or a call of a function
    called `time_scale`."""
    if isinstance(node, ast.Name):
        return node.id == "time_scale" or node.id in aliases
    if isinstance(node, ast.Attribute):
        return node.attr == "time_scale" or node.attr in aliases
    if isinstance(node, ast.Subscript):
        key = node.slice
        return isinstance(key, ast.Constant) and key.value == "time_scale"
    if isinstance(node, ast.Call):
        return _is_time_scale(node.func, set())
    return False


def _target_names(target: ast.AST) -> list[str]:
    if isinstance(target, ast.Name):
        return [target.id]
    if isinstance(target, ast.Attribute):
        return [target.attr]
    return []


def time_scale_arithmetic(source: str) -> list[int]:
    """The lines of `source` that multiply or divide by a time scale: a `*`, `/`, `//`, `*=`,
    `/=` or `//=` with a time scale (`_is_time_scale`) on either side. Names bound to a time
    scale (`scale = time_scale(config)`, `self.scale = compute["time_scale"]`) count as one."""
    tree = ast.parse(source)
    aliases: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None \
                and _is_time_scale(node.value, set()):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                aliases.update(_target_names(target))
    scaling = (ast.Mult, ast.Div, ast.FloorDiv)
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and isinstance(node.op, scaling) \
                and (_is_time_scale(node.left, aliases) or _is_time_scale(node.right, aliases)):
            lines.append(node.lineno)
        elif isinstance(node, ast.AugAssign) and isinstance(node.op, scaling) \
                and _is_time_scale(node.value, aliases):
            lines.append(node.lineno)
    return sorted(lines)


@pytest.mark.parametrize("site", [
    "seconds /= ctx.length.time_scale",
    "wait = (now - started) / self.ctx.length.time_scale",
    "until = now + patience * wagma.ctx.length.time_scale",
    "real = compute['step_seconds'] * compute['time_scale']",
    "x = waited / time_scale(config)",
    "scale = time_scale(config)\nx = waited / scale",
    "self.scale = compute['time_scale']\nbudget = self.scale * modeled",
    "links = Link(latency * time_scale, rate // time_scale)",
])
def test_the_scan_finds_a_conversion_outside_the_clock(site):
    assert time_scale_arithmetic(site)


@pytest.mark.parametrize("fine", [
    "clock = Clock(time_scale(config))",
    "x = clock.to_modeled(waited)",
    "RunLength(time_scale=clock.time_scale)",
    "message = f'raise time_scale (now {time_scale(config):g})'",
    "lr = base * scale",  # not a time scale
])
def test_the_scan_leaves_what_converts_nothing(fine):
    assert time_scale_arithmetic(fine) == []


def test_only_the_emulation_converts_between_real_and_modeled_seconds():
    """The only module that multiplies or divides by the time scale is the clock's: everything
    else, the rest of the emulation included, converts through a `Clock` (`ctx.clock`)."""
    found = []
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*.py")):
            if path == OWNER:
                continue
            for line in time_scale_arithmetic(path.read_text()):
                found.append(f"{path.relative_to(ROOT)}:{line}")
    assert found == []


def test_the_emulations_parts_are_still_found_where_they_were():
    """Code written against the former homes keeps working: the same objects."""
    from dsgd_cli import api
    from dsgd_cli.comm import communicator
    from dsgd_cli.emulation import compute, network, stragglers
    from dsgd_cli.spec import compute_model
    from dsgd_cli.worker import schedule

    assert schedule.Straggling is stragglers.Straggling
    assert communicator.NetworkModel is network.NetworkModel is api.NetworkModel
    assert api.Clock is Clock
    for name in ("PaddedCompute", "variation_factor", "mean_factor", "time_scale",
                 "STEP_OVERRUN_TOLERANCE"):
        assert getattr(compute_model, name) is getattr(compute, name)
    assert compute_model.real_network is network.real_network
