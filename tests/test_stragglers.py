"""The straggler-tolerant aggregators (backup, wagma, lsgd, dasgd), random stragglers and
budgets, each checked against its definition.

Two kinds of test, as in test_gossip.py:

* the plugins driven by a hand-written training loop in 4 worker processes on a real gloo
  group (one start of the workers runs every scenario), where losses, gradients and delays
  are under the test's control;
* real `dsgd run` launches under torchrun (one launch runs every experiment).

Assertions are on values, step counts and the order of events; the one bound on seconds
(wagma's fast workers) compares two times measured in the same run with a wide margin.
"""

from __future__ import annotations

import faulthandler
import math
import statistics
import time

import pytest
import torch
from torch import nn

from conftest import dsgd_in_process, write_spec
from distributed import run_workers
from dsgd_cli.api import Comm, RunLength, WorkerContext, flatten
from dsgd_cli.errors import SpecError
from dsgd_cli.worker.schedule import Straggling
from dsgd_cli.spec.experiments import load_spec
from dsgd_cli.results.store import Store
from plugins.aggregators.backup import Backup
from plugins.aggregators.dasgd import DaSGD
from plugins.aggregators.lsgd import LSGD
from plugins.aggregators.wagma import WAGMA, group_of

WORKERS = 4


# -- the in-process harness -------------------------------------------------------------------

class _Metrics:
    def __init__(self):
        self.values: dict[str, list[float]] = {}

    def log(self, name, value):
        self.values.setdefault(name, []).append(float(value))


def _context(rank: int, n: int, lr: float, model_seed: int | None = None,
             features: int = 3) -> WorkerContext:
    torch.manual_seed(100 + rank if model_seed is None else model_seed)
    model = nn.Linear(features, 1, bias=False, dtype=torch.float64)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    return WorkerContext(rank=rank, world_size=n, device=torch.device("cpu"), model=model,
                         optimizer=optimizer, comm=Comm(rank, n), metrics=_Metrics(), seed=0,
                         compressor=None, config={})


def _flat(model: nn.Module) -> torch.Tensor:
    return flatten([p.detach() for p in model.parameters()]).clone()


def _step(aggregator, ctx, step: int, gradient: torch.Tensor, loss: float = 0.0) -> None:
    """One step in the runtime's order, with the gradient set by the test."""
    ctx.optimizer.zero_grad(set_to_none=True)
    aggregator.before_forward(step)
    for p in ctx.model.parameters():
        p.grad = gradient.view_as(p).clone()
    ctx.loss = torch.tensor(loss)
    aggregator.after_backward(step)
    ctx.optimizer.step()
    aggregator.after_step(step)


def _gradient(rank: int, step: int) -> torch.Tensor:
    """A different, known gradient per rank and step."""
    return torch.tensor([rank + 1.0, -0.5 * step, 0.25 * (rank - step)], dtype=torch.float64)


BACKUP_UPDATES = 12


def _scenario_backup(rank, n, late: int):
    """Rank `late` is the straggler (backups: 1; the run is 12 updates long). Deterministic:
    before each step it waits until the update for its model version is out, so its gradient
    is always stale; the other three are the first three every time."""
    ctx = _context(rank, n, lr=0.1, model_seed=0)
    ctx.length = RunLength(steps=BACKUP_UPDATES)
    aggregator = Backup(Backup.Options(backups=1))
    aggregator.setup(ctx)
    local_steps = 0
    while not aggregator.finished():
        if rank == late:
            while aggregator._published_count() <= aggregator.applied:
                time.sleep(0.001)
        version = aggregator.applied
        _step(aggregator, ctx, local_steps, _gradient(rank, version))
        local_steps += 1
    aggregator.finish()
    return {"steps": local_steps, "model": _flat(ctx.model), "metrics": ctx.metrics.values,
            "totals": aggregator.run_totals(), "sent": ctx.comm.take_traffic().bytes_sent,
            "numel": aggregator.numel}


def _scenario_wagma(rank, n):
    """Rank 1 is a straggler doing 10 steps while the others do 40; tau = 5."""
    ctx = _context(rank, n, lr=0.05)
    aggregator = WAGMA(WAGMA.Options(group_size=2, tau=5))
    aggregator.setup(ctx)
    steps = 10 if rank == 1 else 40
    for step in range(steps):
        if rank == 1:
            time.sleep(0.05)
        _step(aggregator, ctx, step, _gradient(rank, step))
    aggregator.finish()
    return {"steps": steps, "metrics": ctx.metrics.values}


HANG_SECONDS = 60  # the scenario takes well under a second


def _scenario_wagma_uneven(rank, n):
    """Ranks 0 and 1 stop after 10 steps, 2 and 3 after 20 (as a budget may stop them);
    group_size 2, no global round. Rounds 10, 12, … pair the two stopped workers with each
    other, rounds 11, 13, … each with one still training."""
    ctx = _context(rank, n, lr=0.05)
    aggregator = WAGMA(WAGMA.Options(group_size=2, tau=1000))
    aggregator.setup(ctx)
    steps = 10 if rank < 2 else 20
    # A worker that stopped and waits for a round nobody starts hangs every rank: end the
    # process then (with its threads' stacks), so that the test fails at once.
    faulthandler.dump_traceback_later(HANG_SECONDS, exit=True)
    for step in range(steps):
        _step(aggregator, ctx, step, _gradient(rank, step))
    aggregator.finish()
    faulthandler.cancel_dump_traceback_later()
    return {"steps": steps, "rounds": aggregator.rounds_completed,
            "metrics": ctx.metrics.values}


# The WAGMA replay: 8 iterations, tau 4 (rounds 3 and 7 are global), rank 1 the straggler.
# Fast workers publish iteration t and contribute it to round t (patience: a fast worker drawn
# in early waits for its own model). The straggler's steps are published at fixed points of
# the rounds, in the order its lateness would give, fixed by the test (counters in the
# rendezvous store), never by sleeping. Per round t:
# * BEFORE[t]: its steps published before its thread takes part in round t (after round t - 1
#   is over); a step t among them is the fresh model of a global round;
# * DURING[t]: a step published while round t is under way: its thread was drawn in with its
#   previous model P, and one fast member of its group is held back until the step is out,
#   so the round must apply A + (x - P) to the model that has the step;
# * otherwise the straggler takes part in round t with its latest published model.
WAGMA_TAU, WAGMA_ROUNDS, WAGMA_STRAGGLER, WAGMA_FEATURES = 4, 8, 1, 8
WAGMA_BEFORE = {3: [1, 2, 3], 5: [4], 7: [6, 7]}
WAGMA_DURING = {2: 0, 6: 5}
WAGMA_LR, PATIENT = 0.1, 1e6


def _wagma_gradient(rank: int, step: int) -> torch.Tensor:
    return torch.linspace(-1.0, 1.0, WAGMA_FEATURES, dtype=torch.float64) * (rank + 1) + 0.3 * step


def _wait_until(counter, value: int) -> None:
    while counter.value() < value:
        time.sleep(0.002)


def _wait_for_state(aggregator, ready) -> None:
    """Until `ready(aggregator)` holds, read under the aggregator's lock."""
    while True:
        with aggregator.lock:
            if ready(aggregator):
                return
        time.sleep(0.002)


def _butterfly_group(rank: int, round_index: int, n: int, size: int) -> list[int]:
    """WAGMA's group of `rank` in a round, written from the paper's rule and independently of
    `group_of`: the ranks equal to `rank` outside the log2 S mask bits, which start at bit
    (round · log2 S) mod log2 n and wrap around; a global round (every tau-th) is everyone."""
    if (round_index + 1) % WAGMA_TAU == 0:
        return list(range(n))
    bits, group_bits = int(math.log2(n)), int(math.log2(size))
    mask = sum(1 << ((round_index * group_bits + k) % bits) for k in range(group_bits))
    return [other for other in range(n) if (other ^ rank) & ~mask == 0]


def _held_back(round_index: int, n: int, size: int) -> int:
    """The fast member held back in a DURING round: the lowest fast rank of the straggler's
    group (with S >= 4 another fast member draws the straggler in)."""
    return min(m for m in _butterfly_group(WAGMA_STRAGGLER, round_index, n, size)
               if m != WAGMA_STRAGGLER)


def _scenario_wagma_replay(rank, n, group_size):
    ctx = _context(rank, n, lr=WAGMA_LR, features=WAGMA_FEATURES)
    straggler = rank == WAGMA_STRAGGLER
    aggregator = WAGMA(WAGMA.Options(group_size=group_size, tau=WAGMA_TAU,
                                     patience=0.0 if straggler else PATIENT))
    peers = _record_peers(ctx.comm)
    aggregator.setup(ctx)
    name = f"wagma-replay-{n}-{group_size}"
    # settled: rounds the straggler has prepared; held: DURING steps out; fast_done: fast steps
    settled, held, fast_done = (ctx.comm.counter(f"{name}/{c}")
                                for c in ("settled", "held", "fast-done"))
    initial, models = _flat(ctx.model), []
    if not straggler:
        for t in range(WAGMA_ROUNDS):
            _wait_until(settled, t + 1)
            if t in WAGMA_DURING and rank == _held_back(t, n, group_size):
                _wait_until(held, sum(1 for r in WAGMA_DURING if r <= t))
            _step(aggregator, ctx, t, _wagma_gradient(rank, t))
            models.append(_flat(ctx.model))
            fast_done.add(1)
    else:
        def publish(step):
            _step(aggregator, ctx, step, _wagma_gradient(rank, step))
            models.append(_flat(ctx.model))
        for t in range(WAGMA_ROUNDS):
            _wait_until(fast_done, (n - 1) * t)
            before = WAGMA_BEFORE.get(t, [])
            if before:
                _wait_for_state(aggregator, lambda a: a.rounds_completed >= t)
            for step in before:
                if step < t:
                    publish(step)
            settled.add(1)
            if t in before:  # the fresh model of a global round: waits for the round
                publish(t)
            if t in WAGMA_DURING:
                _wait_for_state(aggregator, lambda a: a.last_contributed >= t)
                publish(WAGMA_DURING[t])
                held.add(1)
    aggregator.finish()
    traffic = ctx.comm.take_traffic()
    return {"initial": initial, "models": models, "final": _flat(ctx.model),
            "metrics": ctx.metrics.values, "sent": traffic.bytes_sent,
            "received": traffic.bytes_received, "peers": peers}


def _record_peers(comm: Comm) -> dict[str, set]:
    """The ranks `comm`'s point-to-point calls name from now on (None: any member)."""
    peers = {"sent to": set(), "received from": set()}
    isend, irecv = comm.isend, comm.irecv

    def recording_isend(tensor, dst, group=None):
        peers["sent to"].add(dst)
        return isend(tensor, dst, group)

    def recording_irecv(tensor, src=None, group=None, length=None):
        peers["received from"].add(src)
        return irecv(tensor, src, group, length)
    comm.isend, comm.irecv = recording_isend, recording_irecv
    return peers


def _wagma_replays_on_8(rank, n):
    torch.set_num_threads(1)
    results = {}
    for group_size in (4, 8):
        results[group_size] = _scenario_wagma_replay(rank, n, group_size)
        torch.distributed.barrier()
    return results


LSGD_LOSSES = [3.0, 1.0, 2.0, 0.5]  # local leaders: 1 in {0, 1}, 3 in {2, 3}; global: 3


def _scenario_lsgd(rank, n, pull: float):
    """No gradient (lr 0): only the pulls move the models. Local election every step, global
    election every second step, both with strength `pull`."""
    ctx = _context(rank, n, lr=0.0)
    aggregator = LSGD(LSGD.Options(period=1, pull=pull, group_size=2, global_period=2,
                                   global_pull=pull))
    aggregator.setup(ctx)
    models = [_flat(ctx.model)]
    for step in range(2):
        _step(aggregator, ctx, step, torch.zeros(3, dtype=torch.float64), LSGD_LOSSES[rank])
        models.append(_flat(ctx.model))
    return {"models": models, "metrics": ctx.metrics.values}


LSGD_WINDOW = {"period": 2, "global_period": 4, "steps": 8, "pull": 0.5, "global_pull": 0.25}


def _lsgd_losses() -> list[list[float]]:
    """Each rank's training loss at each step, changing from step to step (seeded)."""
    generator = torch.Generator().manual_seed(4)
    return (torch.rand(WORKERS, LSGD_WINDOW["steps"], generator=generator, dtype=torch.float64)
            * 4).round(decimals=2).tolist()


def _scenario_lsgd_window(rank, n):
    """No gradient (lr 0): losses that change every step, local elections in {0, 1} and
    {2, 3} every 2 steps, global ones every 4."""
    ctx = _context(rank, n, lr=0.0)
    options = {k: v for k, v in LSGD_WINDOW.items() if k != "steps"}
    aggregator = LSGD(LSGD.Options(group_size=2, **options))
    aggregator.setup(ctx)
    losses = _lsgd_losses()[rank]
    models = [_flat(ctx.model)]
    for step in range(LSGD_WINDOW["steps"]):
        _step(aggregator, ctx, step, torch.zeros(3, dtype=torch.float64), losses[step])
        models.append(_flat(ctx.model))
    return {"models": models, "metrics": ctx.metrics.values}


def _scenario_lsgd_independent(rank, n):
    """pull: 0 and global_pull: 0 with real gradient steps: each worker runs its own SGD."""
    ctx = _context(rank, n, lr=0.1)
    aggregator = LSGD(LSGD.Options(period=1, pull=0.0, group_size=2, global_period=1,
                                   global_pull=0.0))
    aggregator.setup(ctx)
    reference = _flat(ctx.model)
    for step in range(5):
        _step(aggregator, ctx, step, _gradient(rank, step), loss=float(rank))
        reference = reference - 0.1 * _gradient(rank, step)
    return {"model": _flat(ctx.model), "reference": reference}


DASGD = {"period": 2, "delay": 1, "lr": 0.1, "steps": 7}


def _scenario_dasgd(rank, n):
    ctx = _context(rank, n, lr=DASGD["lr"])
    aggregator = DaSGD(DaSGD.Options(period=DASGD["period"], delay=DASGD["delay"]))
    aggregator.setup(ctx)
    initial = _flat(ctx.model)
    models = []
    for step in range(DASGD["steps"]):
        _step(aggregator, ctx, step, _gradient(rank, step))
        models.append(_flat(ctx.model))
    aggregator.finish()
    return {"initial": initial, "models": models, "final": _flat(ctx.model)}


DASGD_GRID = [(period, delay) for period in range(1, 5) for delay in range(6)]
DASGD_GRID_STEPS = 16


def _dasgd_accepts(period: int, delay: int) -> bool:
    try:
        DaSGD.Options(period=period, delay=delay)
    except ValueError:
        return False
    return True


def _scenario_dasgd_zero_gradients(rank, n):
    """Every (period, delay) of DASGD_GRID that the options accept, run with zero gradients
    from models that differ: only the averages move them."""
    runs = {}
    for period, delay in DASGD_GRID:
        if not _dasgd_accepts(period, delay):
            continue
        ctx = _context(rank, n, lr=0.1)
        aggregator = DaSGD(DaSGD.Options(period=period, delay=delay))
        aggregator.setup(ctx)
        models = [_flat(ctx.model)]
        for step in range(DASGD_GRID_STEPS):
            _step(aggregator, ctx, step, torch.zeros(3, dtype=torch.float64))
            models.append(_flat(ctx.model))
        aggregator.finish()
        runs[period, delay] = models
    return runs


def _all_scenarios(rank, n):
    torch.set_num_threads(1)
    results = {}
    for late in (3, 0):
        results[f"backup_late{late}"] = _scenario_backup(rank, n, late)
        torch.distributed.barrier()
    results["wagma_replay"] = _scenario_wagma_replay(rank, n, 4)
    torch.distributed.barrier()
    for name, scenario in [("wagma", _scenario_wagma),
                           ("wagma_uneven", _scenario_wagma_uneven),
                           ("dasgd", _scenario_dasgd),
                           ("dasgd_zero_gradients", _scenario_dasgd_zero_gradients),
                           ("lsgd_independent", _scenario_lsgd_independent),
                           ("lsgd_window", _scenario_lsgd_window)]:
        results[name] = scenario(rank, n)
        torch.distributed.barrier()
    for pull in (0.0, 0.5, 1.0):
        results[f"lsgd_{pull}"] = _scenario_lsgd(rank, n, pull)
        torch.distributed.barrier()
    return results


@pytest.fixture(scope="module")
def spawned() -> list[dict]:
    return run_workers(_all_scenarios, WORKERS, timeout=240, preloaded=True)


@pytest.fixture(scope="module")
def spawned_8() -> list[dict]:
    return run_workers(_wagma_replays_on_8, 8, timeout=240, preloaded=True)


# -- backup ---------------------------------------------------------------------------------

@pytest.mark.parametrize("late", [3, 0])
def test_backup_drops_the_stragglers_gradients_and_never_waits_for_it(spawned, late):
    runs = [r[f"backup_late{late}"] for r in spawned]
    fast = [r for rank, r in enumerate(runs) if rank != late]
    straggler = runs[late]
    # The fast workers did every one of the 12 updates, each of them in all 12 (the straggler
    # never was): no update waited for the straggler, rank 0's coordinator included.
    assert [r["steps"] for r in fast] == [BACKUP_UPDATES] * 3
    for r in fast:
        assert r["metrics"]["dropped_own"] == [0.0] * BACKUP_UPDATES
    assert straggler["metrics"]["dropped_own"] == [1.0] * straggler["steps"]
    assert sum(straggler["metrics"]["updates_applied"]) == BACKUP_UPDATES  # it caught up
    # Per-rank counts over the run, as every worker saw them: the straggler was left out of
    # all 12 updates, the others of none (b = 1 dropped per update).
    expected = {f"dropped_rank{rank}": float(BACKUP_UPDATES if rank == late else 0)
                for rank in range(WORKERS)}
    for r in runs:
        assert r["totals"] == expected
    # Every worker applied the same 12 updates: identical models.
    for r in runs[1:]:
        assert torch.equal(r["model"], runs[0]["model"])


@pytest.mark.parametrize("late", [3, 0])
def test_backup_updates_average_the_first_gradients(spawned, late):
    """Update s is the average of the fast ranks' gradients for version s."""
    expected = _context(0, WORKERS, lr=0.1, model_seed=0)
    model = _flat(expected.model)
    fast = [rank for rank in range(WORKERS) if rank != late]
    for version in range(BACKUP_UPDATES):
        model = model - 0.1 * sum(_gradient(rank, version) for rank in fast) / 3
    torch.testing.assert_close(spawned[0][f"backup_late{late}"]["model"], model,
                               rtol=1e-12, atol=1e-12)


def test_backup_counts_rank_0s_gradients_as_sent_over_the_network(spawned):
    """Rank 0's gradient message costs what any rank's does: with rank 3 late, ranks 0, 1
    and 2 each sent 12 gradient messages and one goodbye of 3 + d values; rank 0 also sent
    every update (2 + n + d values) to the 3 others."""
    runs = [r["backup_late3"] for r in spawned]
    d, value = runs[0]["numel"], 8  # float64
    request = (3 + d) * value
    assert [r["sent"] for r in runs[1:3]] == [(BACKUP_UPDATES + 1) * request] * 2
    assert runs[0]["sent"] == (BACKUP_UPDATES + 1) * request + \
        BACKUP_UPDATES * 3 * (2 + WORKERS + d) * value


# -- wagma ----------------------------------------------------------------------------------

@pytest.mark.parametrize("n,size", [(2, 2), (4, 2), (8, 2), (8, 4), (16, 4), (32, 2),
                                    (32, 8), (64, 8), (16, 16)])
def test_wagma_groups_partition_and_connect_everyone_in_log_s_n_rounds(n, size):
    rounds = math.ceil(math.log2(n) / math.log2(size))
    for start in range(6):
        mixing = torch.eye(n, dtype=torch.float64)
        for r in range(start, start + rounds):
            step = torch.zeros(n, n, dtype=torch.float64)
            for rank in range(n):
                group = group_of(rank, r, n, size)
                assert len(group) == size and rank in group
                assert all(group_of(member, r, n, size) == group for member in group)
                step[rank, list(group)] = 1.0 / size
            mixing = step @ mixing
        assert (mixing > 0).all(), f"round {start}: not everyone reached everyone"
        if math.log2(n) % math.log2(size) == 0:  # disjoint masks: exactly the global average
            torch.testing.assert_close(mixing, torch.full((n, n), 1.0 / n, dtype=torch.float64))


def test_wagma_checks_its_world():
    for workers, options, message in [
            (3, {}, "power-of-two number of workers"),
            (4, {"group_size": 8}, "no larger than the 4 workers"),
            (8, {"group_size": 3}, "power of two")]:
        with pytest.raises(ValueError, match=message):
            WAGMA.check_world(WAGMA.Options(**options), workers)


def test_wagma_fast_workers_do_not_wait_for_the_straggler(spawned):
    runs = [r["wagma"] for r in spawned]
    straggler, fast = runs[1], [runs[0], runs[2], runs[3]]
    # 40 rounds completed by fast workers while the straggler published only 10 models: the
    # straggler's peers went on with its latest model, which it reports as stale. One round
    # per iteration: the straggler's rounds after its last step are in no step of its own.
    assert max(straggler["metrics"]["staleness"]) >= 1
    # A fast worker drawn into round t + 1 by a faster peer before it reaches t + 1 counts two
    # rounds in one step and none in the next: one round per iteration over the run.
    for r in fast:
        assert len(r["metrics"]["rounds"]) == 40 and sum(r["metrics"]["rounds"]) == 40
    assert sum(straggler["metrics"]["rounds"]) == 10
    # Staleness is bounded by the global average every tau = 5 rounds.
    for r in runs:
        assert max(r["metrics"]["staleness"]) <= 4
    # Fast workers wait only for communication in group rounds and for the straggler in the
    # one global round in five: their typical wait is below its 50 ms step, which a group
    # that waited for the straggler would pay in every round it shares with it.
    for r in fast:
        assert statistics.median(r["metrics"]["wait_seconds"]) < 0.05


def test_wagma_workers_that_stopped_take_part_in_every_later_round(spawned):
    """Over the run every worker takes part in one round per iteration of the longest
    worker, those that stopped early with their final model; in their own steps, one per
    step (a worker drawn into round t + 1 by its partner before its loop wakes from round t
    counts two in one step and none in the next, as the straggler test says)."""
    for rank, r in enumerate(spawned):
        run = r["wagma_uneven"]
        assert run["rounds"] == 20, rank
        rounds = run["metrics"]["rounds"]
        assert len(rounds) == run["steps"] and sum(rounds) == run["steps"], rank


def _wagma_reference(n: int, group_size: int, initial: list[torch.Tensor]):
    """WAGMA by its definition, in one process. Round t averages, in each group, the models
    its members contribute, A = (1/S) Σ P_m, and each member applies x_m <- A + (x_m - P_m) to
    its current model. P_m is the member's latest published model: a fast worker's model of
    iteration t; the straggler's as the schedule has it, its step applied to x only when
    published (the gradients do not depend on the model). Returns each worker's models as
    they stand right after each of its steps, and the final ones."""
    x = [m.clone() for m in initial]
    after_steps: list[list[torch.Tensor]] = [[] for _ in range(n)]
    s = WAGMA_STRAGGLER

    def step(rank: int, index: int) -> None:
        x[rank] = x[rank] - WAGMA_LR * _wagma_gradient(rank, index)
    for t in range(WAGMA_ROUNDS):
        for rank in range(n):
            if rank != s:
                step(rank, t)
        for index in WAGMA_BEFORE.get(t, []):
            step(s, index)
            if index < t:  # its step returns before round t: the model as it is now
                after_steps[s].append(x[s].clone())
        contributed = [m.clone() for m in x]
        if t in WAGMA_DURING:  # published after the straggler's thread contributed
            step(s, WAGMA_DURING[t])
            after_steps[s].append(x[s].clone())
        for group in {tuple(_butterfly_group(rank, t, n, group_size)) for rank in range(n)}:
            average = sum(contributed[m] for m in group) / len(group)
            for m in group:
                x[m] = average + (x[m] - contributed[m])
        for rank in range(n):
            if rank != s or t in WAGMA_BEFORE.get(t, []):  # this step waited for round t
                after_steps[rank].append(x[rank].clone())
    return after_steps, x


def _wagma_runs(spawned, spawned_8, n: int, group_size: int) -> list[dict]:
    if n == WORKERS:
        return [r["wagma_replay"] for r in spawned]
    return [r[group_size] for r in spawned_8]


@pytest.mark.parametrize("n,group_size", [(4, 4), (8, 4), (8, 8)])
def test_wagma_replays_its_definition_with_a_late_worker(spawned, spawned_8, n, group_size):
    """The models after each step and at the end are the definition's, the straggler's
    included when it publishes during a round (the round must keep its step: A + (x - P))."""
    runs = _wagma_runs(spawned, spawned_8, n, group_size)
    after_steps, final = _wagma_reference(n, group_size, [r["initial"] for r in runs])
    for rank, run in enumerate(runs):
        assert len(run["models"]) == len(after_steps[rank]) == WAGMA_ROUNDS
        for index, (model, expected) in enumerate(zip(run["models"], after_steps[rank])):
            torch.testing.assert_close(model, expected, rtol=1e-12, atol=1e-12,
                                       msg=f"rank {rank}, model {index}")
        torch.testing.assert_close(run["final"], final[rank], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("n,group_size", [(4, 4), (8, 4), (8, 8)])
def test_wagma_rounds_are_one_to_one_with_iterations(spawned, spawned_8, n, group_size):
    """Every worker takes part in exactly one round per iteration of the run: the straggler
    in three during its first step (drawn into rounds 0 and 1 with its initial model, and
    into round 2, which completes after the step), none during its third, one per step
    after. Staleness is the age, in iterations, of the models it contributed meanwhile."""
    runs = _wagma_runs(spawned, spawned_8, n, group_size)
    straggler = runs[WAGMA_STRAGGLER]["metrics"]
    assert straggler["rounds"] == [2.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    assert straggler["staleness"] == [3.0, 0.0, 0.0, 0.0, 1.0, 2.0, 0.0, 0.0]
    for rank, run in enumerate(runs):
        assert sum(run["metrics"]["rounds"]) == WAGMA_ROUNDS
        if rank != WAGMA_STRAGGLER:
            assert run["metrics"]["rounds"] == [1.0] * WAGMA_ROUNDS
            assert run["metrics"]["staleness"] == [0.0] * WAGMA_ROUNDS


@pytest.mark.parametrize("n,group_size", [(4, 4), (8, 4), (8, 8)])
def test_wagma_group_rounds_send_2_s_minus_1_over_s_of_a_model(spawned, spawned_8, n, group_size):
    """Per member and round: 2(S - 1)/S of the model (8 float64 values), plus a header of 4
    values on each of its 2 log2 S messages; a global round is the same with S = n. Besides,
    each worker took part in one all-reduce of its step count (finish) and sent one goodbye
    (a header) to each of its log2 n partners."""
    runs = _wagma_runs(spawned, spawned_8, n, group_size)
    value = 8

    def round_bytes(size: int) -> int:
        payload = 2 * (size - 1) * WAGMA_FEATURES * value // size
        return payload + 2 * int(math.log2(size)) * 4 * value
    global_rounds = WAGMA_ROUNDS // WAGMA_TAU
    expected = ((WAGMA_ROUNDS - global_rounds) * round_bytes(group_size)
                + global_rounds * round_bytes(n) + 2 * (n - 1) * value // n
                + int(math.log2(n)) * 4 * value)
    for rank, run in enumerate(runs):
        assert run["sent"] == expected, rank
        assert run["received"] == expected, rank


@pytest.mark.parametrize("n,group_size", [(4, 4), (8, 4), (8, 8)])
def test_wagma_exchanges_only_with_its_log2_n_partners(spawned, spawned_8, n, group_size):
    """Every message goes to, and every receive names, a rank one bit away: gloo then
    connects each worker to log2 n others, where a receive from any member of the group
    connects it to all n - 1 (at 1,024 workers, half a million connections)."""
    runs = _wagma_runs(spawned, spawned_8, n, group_size)
    for rank, run in enumerate(runs):
        one_bit_away = {rank ^ (1 << bit) for bit in range(int(math.log2(n)))}
        assert run["peers"]["sent to"] == one_bit_away, rank
        assert run["peers"]["received from"] == one_bit_away, rank


# -- lsgd -----------------------------------------------------------------------------------

def test_lsgd_elects_the_lowest_loss_worker(spawned):
    for rank, r in enumerate(spawned):
        metrics = r["lsgd_0.5"]["metrics"]
        assert metrics["leader_rank"] == ([1.0, 1.0] if rank < 2 else [3.0, 3.0])
        assert metrics["global_leader_rank"] == [3.0]


def test_lsgd_pulls_towards_the_leader(spawned):
    initial = [r["lsgd_0.5"]["models"][0] for r in spawned]
    after_local = [r["lsgd_0.5"]["models"][1] for r in spawned]
    local_leader = {0: 1, 1: 1, 2: 3, 3: 3}
    for rank in range(WORKERS):  # x_i - 0.5 (x_i - x_leader)
        leader = initial[local_leader[rank]]
        expected = initial[rank] - 0.5 * (initial[rank] - leader)
        torch.testing.assert_close(after_local[rank], expected)
    # Step 2: local pull again, then the global pull towards rank 3.
    final = [r["lsgd_0.5"]["models"][2] for r in spawned]
    local = [after_local[r] - 0.5 * (after_local[r] - after_local[local_leader[r]])
             for r in range(WORKERS)]
    for rank in range(WORKERS):
        expected = local[rank] if rank == 3 else local[rank] - 0.5 * (local[rank] - local[3])
        torch.testing.assert_close(final[rank], expected)


def test_lsgd_pull_1_copies_the_leader_and_pull_0_is_independent_sgd(spawned):
    leader_model = spawned[3]["lsgd_1.0"]["models"][1]
    for r in spawned:
        assert torch.equal(r["lsgd_1.0"]["models"][2], leader_model)
        assert torch.equal(r["lsgd_0.0"]["models"][2], r["lsgd_0.0"]["models"][0])
        torch.testing.assert_close(r["lsgd_independent"]["model"],
                                   r["lsgd_independent"]["reference"], rtol=0, atol=1e-14)


def _elect(losses, ranks, steps) -> int:
    """The rank of `ranks` with the lowest mean loss over `steps` (ties: the lowest rank)."""
    means = [sum(losses[r][s] for s in steps) / len(steps) for r in ranks]
    return ranks[min(range(len(ranks)), key=lambda i: (means[i], i))]


def test_lsgd_elects_by_the_mean_loss_since_the_levels_last_election(spawned):
    losses, steps = _lsgd_losses(), LSGD_WINDOW["steps"]
    period, global_period = LSGD_WINDOW["period"], LSGD_WINDOW["global_period"]
    groups = {0: (0, 1), 1: (0, 1), 2: (2, 3), 3: (2, 3)}
    local_ends = [t for t in range(steps) if (t + 1) % period == 0]
    global_ends = [t for t in range(steps) if (t + 1) % global_period == 0]

    def window(end, length):
        return list(range(end - length + 1, end + 1))
    for rank, r in enumerate(spawned):
        metrics = r["lsgd_window"]["metrics"]
        assert metrics["leader_rank"] == [_elect(losses, groups[rank], window(t, period))
                                          for t in local_ends]
        assert metrics["global_leader_rank"] == [
            _elect(losses, tuple(range(WORKERS)), window(t, global_period)) for t in global_ends]
    # The losses tell the window apart from the last step's loss, from the mean since the
    # start and, for the global level, from the local level's shorter window.
    def leaders(ranks, ends, steps_of):
        return [_elect(losses, ranks, steps_of(t)) for t in ends]

    def last(t):
        return [t]

    def since_start(t):
        return list(range(t + 1))
    local = {g: leaders(g, local_ends, lambda t: window(t, period)) for g in ((0, 1), (2, 3))}
    assert any(local[g] != leaders(g, local_ends, last) for g in local)
    assert any(local[g] != leaders(g, local_ends, since_start) for g in local)
    everyone = tuple(range(WORKERS))
    expected = leaders(everyone, global_ends, lambda t: window(t, global_period))
    assert expected != leaders(everyone, global_ends, last)
    assert expected != leaders(everyone, global_ends, since_start)
    assert expected != leaders(everyone, global_ends, lambda t: window(t, period))


def test_lsgd_applies_the_local_pull_then_the_global_pull(spawned):
    """Where both levels elect, the global pull acts on the model the local pull made (the
    authors' order): x' = x − λ(x − x_l), then x'' = x' − λ_G(x' − x'_g), which differs from
    the paper's sum x − λ(x − x_l) − λ_G(x − x_g) by λ·λ_G·(x − x_l)."""
    losses, pull, global_pull = _lsgd_losses(), LSGD_WINDOW["pull"], LSGD_WINDOW["global_pull"]
    groups = [(0, 1), (2, 3)]
    models = [r["lsgd_window"]["models"][0] for r in spawned]
    for t in range(LSGD_WINDOW["steps"]):
        if (t + 1) % LSGD_WINDOW["period"] == 0:
            pulled = list(models)
            for group in groups:
                leader = _elect(losses, group, [t - 1, t])
                for rank in group:
                    if rank != leader:
                        pulled[rank] = torch.lerp(models[rank], models[leader], pull)
            models = pulled
        if (t + 1) % LSGD_WINDOW["global_period"] == 0:
            leader = _elect(losses, (0, 1, 2, 3), list(range(t - 3, t + 1)))
            models = [m if rank == leader else torch.lerp(m, models[leader], global_pull)
                      for rank, m in enumerate(models)]
        for rank, r in enumerate(spawned):
            torch.testing.assert_close(r["lsgd_window"]["models"][t + 1], models[rank],
                                       rtol=1e-12, atol=1e-12)


# -- dasgd ----------------------------------------------------------------------------------

def test_dasgd_applies_the_average_from_delay_steps_before(spawned):
    """Replays the definition: the average of the models after step t (t + 1 a multiple of
    the period) replaces them at step t + delay, keeping the progress made since."""
    period, delay, lr, steps = (DASGD[k] for k in ("period", "delay", "lr", "steps"))
    models = [r["dasgd"]["initial"].clone() for r in spawned]
    snapshots: dict[int, list[torch.Tensor]] = {}
    for step in range(steps):
        models = [models[rank] - lr * _gradient(rank, step) for rank in range(WORKERS)]
        if (step + 1) % period == 0:
            snapshots[step + delay] = [m.clone() for m in models]
        if step in snapshots:
            sent = snapshots.pop(step)
            average = sum(sent) / WORKERS
            models = [average + (models[rank] - sent[rank]) for rank in range(WORKERS)]
        for rank in range(WORKERS):
            torch.testing.assert_close(spawned[rank]["dasgd"]["models"][step], models[rank],
                                       rtol=1e-12, atol=1e-12)
    # An average still in flight at the end is applied by finish().
    for step, sent in snapshots.items():
        average = sum(sent) / WORKERS
        models = [average + (models[rank] - sent[rank]) for rank in range(WORKERS)]
    for rank in range(WORKERS):
        torch.testing.assert_close(spawned[rank]["dasgd"]["final"], models[rank],
                                   rtol=1e-12, atol=1e-12)


def _spread(models: list[torch.Tensor]) -> float:
    """The largest difference between two workers' values of one parameter."""
    stacked = torch.stack(models)
    return float((stacked.max(dim=0).values - stacked.min(dim=0).values).max())


def test_dasgd_accepts_exactly_the_delays_within_a_period():
    accepted = {(period, delay) for period, delay in DASGD_GRID if _dasgd_accepts(period, delay)}
    assert accepted == {(period, delay) for period, delay in DASGD_GRID if delay < period}
    assert {(1, 0), (4, 0), (4, 3)} <= accepted  # the edges of the admissible range


def test_dasgd_models_contract_for_every_accepted_period_and_delay(spawned):
    """With zero gradients the spread between workers never grows, and the first applied
    average (after step period - 1 + delay) makes the models agree."""
    runs = [r["dasgd_zero_gradients"] for r in spawned]
    assert set(runs[0]) == {(p, d) for p, d in DASGD_GRID if _dasgd_accepts(p, d)}
    for (period, delay), _ in runs[0].items():
        spreads = [_spread([r[period, delay][i] for r in runs])
                   for i in range(DASGD_GRID_STEPS + 1)]
        assert spreads[0] > 0.1
        first_applied = period + delay  # models[i] is the model after step i - 1
        for before, after in zip(spreads, spreads[1:]):
            assert after <= before + 1e-12, (period, delay, spreads)
        assert max(spreads[first_applied:]) < 1e-12, (period, delay, spreads)


@pytest.mark.parametrize("period,delay", [(4, 4), (4, 5), (1, 1), (1, 2)])
def test_dasgd_rejects_a_delay_of_a_period_or_more(tmp_path, period, delay):
    spec = write_spec(tmp_path, f"""
        experiments:
          - {{name: a, task: logreg, aggregator: {{name: dasgd, period: {period}, delay: {delay}}}}}
    """)
    result = dsgd_in_process("run", str(spec), "--db", str(tmp_path / "r.db"))
    assert result.returncode == 2
    assert result.stderr.strip() == (
        f"dsgd: error: {spec}: experiments[0].aggregator: delay: expected a value < period "
        f"({period}): an average is applied within its period, got {delay}")
    assert not (tmp_path / "r.db").exists()


# -- random stragglers ------------------------------------------------------------------------

def test_random_stragglers_are_drawn_from_the_seed():
    config = {"ranks": [], "slowdown": 1.0, "random": {"probability": 0.2, "slowdown": 4.0}}
    draws = [Straggling(config, rank=1, seed=7).factor(step) for step in range(2000)]
    assert draws == [Straggling(config, rank=1, seed=7).factor(step) for step in range(2000)]
    assert draws != [Straggling(config, rank=1, seed=8).factor(step) for step in range(2000)]
    assert draws != [Straggling(config, rank=2, seed=7).factor(step) for step in range(2000)]
    assert set(draws) == {1.0, 4.0}
    slow = draws.count(4.0) / len(draws)
    assert abs(slow - 0.2) < 4 * math.sqrt(0.2 * 0.8 / len(draws))  # 4 standard deviations
    fixed = {"ranks": [1], "slowdown": 3.0, "random": config["random"]}
    assert {Straggling(fixed, 1, 7).factor(s) for s in range(100)} == {3.0, 12.0}
    assert {Straggling(fixed, 0, 7).factor(s) for s in range(100)} == {1.0, 4.0}


@pytest.mark.parametrize("section,message", [
    ("{random: {probability: 1.5, slowdown: 2}}",
     "stragglers.random.probability: expected a number >= 0 and <= 1, got 1.5"),
    ("{random: {probability: 0.5}}", "stragglers.random.slowdown: required"),
    ("{random: {probability: 0.5, slowdown: 0.5}}",
     "stragglers.random.slowdown: expected a number >= 1, got 0.5"),
    ("{random: {probability: 0.5, slowdown: x}}",
     "stragglers.random.slowdown: expected a number >= 1, got 'x'"),
    ("{random: [0.5]}", "stragglers.random: expected a mapping with keys probability, slowdown"),
])
def test_random_stragglers_are_validated(tmp_path, section, message):
    spec = write_spec(tmp_path, f"""
        experiments:
          - {{name: a, task: logreg, stragglers: {section}}}
    """)
    with pytest.raises(SpecError) as error:
        load_spec(spec)
    assert str(error.value) == f"{spec}: experiments[0].{message}"


def test_a_bad_straggler_spec_is_one_line_and_exit_2(tmp_path):
    spec = write_spec(tmp_path, """
        experiments:
          - {name: a, task: logreg, stragglers: {random: {probability: 2, slowdown: 3}}}
    """)
    result = dsgd_in_process("run", str(spec), "--db", str(tmp_path / "r.db"))
    assert result.returncode == 2
    assert result.stderr.strip() == (f"dsgd: error: {spec}: experiments[0].stragglers.random."
                                     "probability: expected a number >= 0 and <= 1, got 2")
    assert not (tmp_path / "r.db").exists()


@pytest.mark.parametrize("section,message", [
    ("{samples: 100, seconds: 3}", "budget: expected exactly one of samples, seconds"),
    ("{}", "budget: expected exactly one of samples, seconds"),
    ("{samples: 0}", "budget.samples: expected an integer between 1 and 4611686018427387904, got 0"),
    ("{seconds: -1}", "budget.seconds: expected a number > 0, got -1"),
    ("{samples: 10, evaluations: 0}", "budget.evaluations: expected an integer between 1 and 10000, got 0"),
    ("{steps: 10}", "budget.steps: unknown key"),
])
def test_budget_is_validated(tmp_path, section, message):
    spec = write_spec(tmp_path, f"""
        experiments:
          - {{name: a, task: logreg, budget: {section}}}
    """)
    with pytest.raises(SpecError) as error:
        load_spec(spec)
    assert str(error.value).startswith(f"{spec}: experiments[0].{message}")


def test_stragglers_and_budget_are_recorded_in_the_config(tmp_path):
    spec = write_spec(tmp_path, """
        experiments:
          - name: a
            task: logreg
            stragglers: {ranks: [0], slowdown: 2, random: {probability: 0.25, slowdown: 3}}
            budget: {seconds: 5}
    """)
    (experiment,) = load_spec(spec)
    assert experiment.config["stragglers"] == {
        "ranks": [0], "slowdown": 2.0, "random": {"probability": 0.25, "slowdown": 3.0}}
    assert experiment.config["budget"] == {"samples": None, "seconds": 5.0, "evaluations": 10}


# -- real launches ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """One `dsgd run` of every experiment these tests need, models saved."""
    tmp = tmp_path_factory.mktemp("stragglers")
    spec = write_spec(tmp, f"""
        defaults:
          task: {{name: logreg}}
          workers: 2
          epochs: 2
          steps_per_epoch: 8
          batch_size: 32
          log_interval: 1
          optimizer: {{name: sgd, lr: 0.5}}
          save_dir: {tmp / "models"}
        experiments:
          - name: allreduce
            aggregator: {{name: allreduce}}
          - name: backup-0
            aggregator: {{name: backup, backups: 0}}
          - name: backup-1
            aggregator: {{name: backup, backups: 1}}
          - name: local-1
            aggregator: {{name: local_sgd, period: 1}}
          - name: local-2
            aggregator: {{name: local_sgd, period: 2}}
          - name: dasgd-0
            aggregator: {{name: dasgd, period: 2, delay: 0}}
          - name: wagma-tau-1
            aggregator: {{name: wagma, tau: 1}}
          - name: wagma-patient
            aggregator: {{name: wagma, group_size: 2, tau: 10, patience: 30}}
          - name: random-stragglers
            stragglers: {{random: {{probability: 0.3, slowdown: 2}}}}
            aggregator: {{name: allreduce}}
          - name: random-compute
            task: {{name: mnist1d_cnn}}
            steps_per_epoch: 40
            epochs: 1
            stragglers: {{random: {{probability: 0.5, slowdown: 4}}}}
            # Modeled compute, 8x dilated: the recorded times do not depend on the machine's load.
            compute: {{step_seconds: 0.005, time_scale: 8}}
            aggregator: {{name: local_sgd, period: 1000}}
          - name: budget-allreduce
            steps_per_epoch: null
            budget: {{samples: 1000, evaluations: 4}}
            target_accuracy: 0.55
            aggregator: {{name: allreduce}}
          - name: budget-adpsgd
            task: {{name: mnist1d_mlp}}
            steps_per_epoch: null
            batch_size: 40  # divides each worker's 2,000 examples: every batch is full
            budget: {{samples: 3200, evaluations: 4}}
            stragglers: {{ranks: [1], slowdown: 20}}
            compute: {{step_seconds: 0.005, time_scale: 4}}  # rank 1 20x slower, whatever the load
            aggregator: {{name: adpsgd}}
          - name: budget-seconds
            steps_per_epoch: null
            budget: {{seconds: 1.5, evaluations: 3}}
            aggregator: {{name: local_sgd, period: 3}}
    """)
    db = tmp / "results.db"
    result = dsgd_in_process("run", str(spec), "--db", str(db))
    assert result.returncode == 0, result.stdout + result.stderr
    store = Store(str(db))
    runs = {run.experiment: run for run in store.runs()}

    def weights(name: str, rank: int) -> torch.Tensor:
        return torch.load(tmp / "models" / name / f"rank{rank}.pt")["weight"][0]

    def history(name: str, metric: str):
        return store.metric_history(runs[name].id, metric)

    return runs, weights, history


def test_equivalences_to_synchronous_algorithms(launched):
    _, weights, _ = launched
    for rank in (0, 1):
        # backups: 0 uses every gradient: allreduce (summed in another order).
        torch.testing.assert_close(weights("backup-0", rank), weights("allreduce", 0),
                                   rtol=1e-5, atol=1e-6)
        # delay 0 applies each average at once: local SGD, bit for bit.
        assert torch.equal(weights("dasgd-0", rank), weights("local-2", rank))
        # Every round global (tau 1), or every member fresh (S = n, patience): local SGD(1).
        for name in ("wagma-tau-1", "wagma-patient"):
            assert torch.equal(weights(name, rank), weights("local-1", 0)), name
    assert not torch.equal(weights("local-2", 0), weights("local-1", 0))


def test_backup_summaries_count_the_drops_per_rank(launched):
    runs, _, _ = launched
    none = {s.name: s.final for s in runs["backup-0"].summaries}
    assert (none["dropped_rank0"], none["dropped_rank1"]) == (0.0, 0.0)
    one = {s.name: s.final for s in runs["backup-1"].summaries}
    # 2 epochs of 8 updates, each made without one of the two gradients.
    assert one["dropped_rank0"] + one["dropped_rank1"] == 16.0
    assert "dropped" not in one


def test_random_straggler_delays_follow_the_seed(launched):
    runs, _, history = launched
    config = runs["random-stragglers"].config
    recorded = {(m.rank, m.step): m.value for m in history("random-stragglers", "slowdown")}
    assert len(recorded) == 2 * 16
    for (rank, step), value in recorded.items():  # metric step s is loop step s - 1
        assert value == Straggling(config["stragglers"], rank, config["seed"]).factor(step - 1)
    assert set(recorded.values()) == {1.0, 2.0}


def test_a_slowed_step_sleeps_the_missing_compute_time():
    """A step drawn `s` times slower sleeps (s - 1) times the median of the worker's recent
    forward+backward times, so its compute takes s times its natural time."""
    assert Straggling.delay(4.0, [0.010, 0.030, 0.020]) == pytest.approx(3 * 0.020)
    assert Straggling.delay(2.5, [0.1, 0.1, 0.9, 0.1]) == pytest.approx(1.5 * 0.1)
    assert Straggling.delay(1.0, [0.5]) == 0.0
    assert Straggling.delay(3.0, []) == 0.0  # no natural time measured yet


def test_slowed_steps_compute_longer_in_a_real_run(launched):
    """Within each worker, the steps drawn slow take longer to compute than the others (no
    communication: local SGD with a period longer than the run). Under the `compute` model a
    slowed step lasts 4 modeled steps, whatever the machine's load; the margins allow for steps
    whose real work overran their dilated time."""
    _, _, history = launched
    slowdown = {(m.rank, m.step): m.value for m in history("random-compute", "slowdown")}
    for rank in (0, 1):
        times = {1.0: [], 4.0: []}
        for m in history("random-compute", "compute_seconds"):
            if m.rank == rank and m.step > 3:  # the first steps set the natural time
                times[slowdown[(rank, m.step)]].append(m.value)
        ratio = statistics.median(times[4.0]) / statistics.median(times[1.0])
        assert 2.0 < ratio < 12.0, (rank, ratio)


def _steps(history, name) -> dict[int, int]:
    steps: dict[int, int] = {}
    for m in history(name, "train_loss"):
        steps[m.rank] = max(steps.get(m.rank, 0), m.step)
    return steps


def test_a_samples_budget_processes_that_many_samples(launched):
    runs, _, history = launched
    for name, budget, batch in (("budget-allreduce", 1000, 32), ("budget-adpsgd", 3200, 40)):
        steps = _steps(history, name)
        samples = batch * sum(steps.values())
        assert budget <= samples < budget + 2 * batch, (name, steps)
    allreduce = _steps(history, "budget-allreduce")
    assert allreduce == {0: 16, 1: 16}  # in step: ceil(1000 / 64)
    # Asynchronous, with rank 1 twenty times slower: the fast worker does more of the work.
    adpsgd = _steps(history, "budget-adpsgd")
    assert adpsgd[0] > 1.5 * adpsgd[1], adpsgd


def test_a_budget_evaluates_the_average_model_on_schedule(launched):
    runs, _, history = launched
    for name, evaluations in (("budget-allreduce", 4), ("budget-adpsgd", 4),
                              ("budget-seconds", 3)):
        accuracy = history(name, "test_accuracy")
        assert len(accuracy) == evaluations, name  # the scheduled ones, then the final one
        assert all(m.rank is None for m in accuracy)
        seconds = [m.seconds for m in accuracy]
        assert seconds == sorted(seconds)
    summaries = {s.name: s.final for s in runs["budget-allreduce"].summaries}
    assert 0 < summaries["time_to_accuracy"] <= summaries["wall_seconds"]


def test_a_seconds_budget_stops_workers_in_step_together(launched):
    runs, _, history = launched
    steps = _steps(history, "budget-seconds")
    assert steps[0] == steps[1] > 3
    summaries = {s.name: s.final for s in runs["budget-seconds"].summaries}
    assert summaries["wall_seconds"] >= 1.5


def test_counts_may_be_written_in_scientific_notation(tmp_path):
    spec = write_spec(tmp_path, """
        experiments:
          - {name: a, task: logreg, budget: {samples: 2e4}, aggregator: {name: lsgd, period: 1e1}}
          - {name: b, task: logreg, budget: {samples: 2.5}}
    """)
    with pytest.raises(SpecError, match=r"experiments\[1\].budget.samples: expected an integer, got 2.5"):
        load_spec(spec)
    spec.write_text(spec.read_text().replace("samples: 2.5", "samples: 1e3"))
    a, b = load_spec(spec)
    assert a.config["budget"]["samples"] == 20000 and isinstance(a.config["budget"]["samples"], int)
    assert a.config["aggregator"]["period"] == 10 and b.config["budget"]["samples"] == 1000
