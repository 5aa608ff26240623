"""The spec's `failures:` section: its options, what each aggregator may be given, and the
checks at validation (a schedule that leaves no time for steps, an aggregator that cannot be
failed). The failures themselves happen on the modeled clock in
`dsgd_cli.emulation.failures` (docs/failures.md)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

from dsgd_cli.errors import SpecError
from dsgd_cli.options import option, options_to_dict, parse_options, show
from dsgd_cli.units import parse_duration, readable_duration

FAILURE_MODES = ("restart", "continue")
# Without a compute model a step lasts the machine's real time, unknown before the run; the
# refusal of failures faster than steps counts such a step as this long. The shortest real
# steps are shorter (2 logreg workers: about 0.6 ms under diloco, 3 ms under allreduce, on a
# 2-core machine), but an mtbf this short on the real clock is no experiment.
UNMODELED_STEP_S = 0.01
# Under `restart` a failure rolls the job back to its last checkpoint: a run is refused when
# getting through the steps between two checkpoints is expected to take more than this many
# times their failure-free time (about 6.5 failures expected in that span).
HOPELESS_SLOWDOWN = 100.0


@dataclass(frozen=True)
class FixedFailure:
    """One failure at a fixed modeled time: `{node: 1, time: 300s}`."""

    spec_section: ClassVar[bool] = True

    node: int = option(min=0, help="the node that fails (the worker without cluster.nodes)")
    time: Any = option(help="modeled time since the start of training, such as 300s")

    def __post_init__(self):
        object.__setattr__(self, "time", parse_duration(self.time, "time"))


@dataclass(frozen=True)
class FailureOptions:
    """The spec's `failures:` section. Durations are stored in seconds."""

    spec_section: ClassVar[bool] = True

    restart: Any = option(help="modeled time a failed node is away before it can rejoin")
    mtbf: Any = option(None, help="mean modeled time between failures of one node (of one "
                                  "worker without cluster.nodes), exponential; null: only `at`")
    checkpoint_every: int | None = option(
        None, min=1, max=2**31 - 1,
        help="steps between the emulated checkpoints a restart rolls back to "
             "(null: back to the start)")
    checkpoint_seconds: Any = option(0.0, help="modeled cost of writing one checkpoint")
    seed: int = option(0, min=0, max=2**32 - 1, help="same seed, same failure times")
    at: list[Any] = option([], help="failures at fixed times: [{node: 1, time: 300s}]")

    def __post_init__(self):
        convert = object.__setattr__
        if self.mtbf is not None:
            convert(self, "mtbf", parse_duration(self.mtbf, "mtbf", positive=True))
        convert(self, "restart", parse_duration(self.restart, "restart"))
        convert(self, "checkpoint_seconds",
                parse_duration(self.checkpoint_seconds, "checkpoint_seconds"))
        fixed = []
        for index, entry in enumerate(self.at):
            if not isinstance(entry, dict):
                raise SpecError(f"expected a mapping with keys node, time, got {show(entry)}",
                                path=f"at[{index}]")
            parsed = parse_options(FixedFailure, entry, f"at[{index}]")  # a path in the section
            fixed.append({"node": parsed.node, "time": parsed.time})
        convert(self, "at", fixed)
        if self.mtbf is None and not self.at:
            raise SpecError("no failure would ever happen: give mtbf, at, or both", path="mtbf")
        if self.checkpoint_every is None and self.checkpoint_seconds > 0:
            raise SpecError("checkpoint_seconds needs checkpoint_every (no checkpoint is "
                            "written without it)", path="checkpoint_seconds")


def parse_failures(raw: Any, path: str) -> dict[str, Any] | None:
    """The spec's `failures` section as stored in the run's configuration (plain data,
    seconds), or None without one."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise SpecError("expected a mapping with keys mtbf, restart, checkpoint_every, "
                        "checkpoint_seconds, seed, at", path=path)
    return options_to_dict(parse_options(FailureOptions, raw, path))


@dataclass(frozen=True)
class FailureDomains:
    """What fails: `count` domains, the cluster's nodes (`on_cluster`) or, without a
    cluster, one per worker."""

    count: int
    on_cluster: bool

    @classmethod
    def of(cls, workers: int, cluster: Any) -> FailureDomains:
        """Of an experiment's `workers` and its typed `cluster` (None without one)."""
        return cls(workers if cluster is None else cluster.nodes, cluster is not None)

    @property
    def noun(self) -> str:
        return "node" if self.on_cluster else "worker"


def failure_domains(experiment: Any) -> int:
    """The failure domains of a resolved experiment (`ctx.experiment`): the cluster's
    nodes, or one per worker without them."""
    return FailureDomains.of(experiment.workers, experiment.cluster).count


def node_of(rank: int, workers: int, nodes: int) -> int:
    """The node rank `rank` runs on: workers are split over nodes in consecutive blocks."""
    return rank // (workers // nodes)


def check_failures(failures: dict[str, Any] | None, aggregator_cls: type, path: str, *,
                   domains: FailureDomains, samples_budget: bool,
                   step_seconds: float | None, total_steps: int | None = None) -> None:
    """Refuse a failure model the run cannot emulate: a fixed failure of a node that does not
    exist, an aggregator that cannot run under failures, a samples budget, failures that
    would come faster than steps (`step_seconds`: the compute model's, None without one), or
    so often that a restart's rollback is hardly ever outrun (`total_steps`: the run's steps
    per worker, None where unknown before the run)."""
    if failures is None:
        return
    nodes = domains.count
    for index, fixed in enumerate(failures["at"]):
        if fixed["node"] >= nodes:
            domain = "cluster.nodes" if domains.on_cluster else "workers"
            raise SpecError(f"expected a node between 0 and {nodes - 1} (the run has {nodes} "
                            f"{domain}), got {fixed['node']}", path=f"{path}.at[{index}].node")
    if samples_budget:
        raise SpecError("a samples budget would count the samples of rolled-back steps; use "
                        "epochs or a seconds budget with failures", path=path)
    reason = unsupported_reason(aggregator_cls)
    if reason is not None:
        raise SpecError(f"aggregator {aggregator_cls.plugin_name!r} cannot run under failures: "
                        f"{reason}", path=path)
    mode = failure_mode(aggregator_cls)
    check_failures_leave_time_for_steps(failures["mtbf"], mode, path,
                                        domains=domains, step_seconds=step_seconds)
    if mode == "restart":
        check_rollbacks_are_outrun(failures, path, domains=domains, step_seconds=step_seconds,
                                   total_steps=total_steps)


def failure_mode(aggregator_cls: type) -> str | None:
    """The aggregator's declared `failure_mode` (FAILURE_MODES, None: refused): `restart`
    unless it says otherwise."""
    return getattr(aggregator_cls, "failure_mode", "restart")


def check_failures_leave_time_for_steps(mtbf: float | None, mode: str, path: str, *,
                                        domains: FailureDomains,
                                        step_seconds: float | None) -> None:
    """Refuse an `mtbf` not longer than one step: failures would come faster than steps. Under
    `restart` any node's failure stops every worker, so the job fails every mtbf / nodes, and a
    failure at nearly every step boundary rolls the run back for ever. Under `continue` a node
    would be failing at nearly every step (and the schedule would draw many failures per step).
    A step lasts at least `compute.step_seconds`; without a compute model, UNMODELED_STEP_S."""
    if mtbf is None:  # only the fixed failures of `at`: a finite number
        return
    step = step_seconds if step_seconds is not None else UNMODELED_STEP_S
    step_is = ("compute.step_seconds" if step_seconds is not None else
               "what a step without a compute model counts as")
    nodes, domain = domains.count, domains.noun
    if mode == "restart":
        between = mtbf / nodes
        failing = (f"the job would fail every {readable_duration(between)} on average (mtbf "
                   f"{readable_duration(mtbf)} / {nodes} {domain}s: any {domain}'s failure "
                   f"restarts every worker)")
        outcome = "the run would be rolled back at nearly every step and never end"
    else:
        between = mtbf
        failing = f"each {domain} would fail every {readable_duration(mtbf)} on average (mtbf)"
        outcome = f"its {domain}s would be failing at nearly every step"
    if between <= step:
        raise SpecError(f"{failing}, not longer than one step ({readable_duration(step)}, "
                        f"{step_is}): {outcome}; raise mtbf", path=f"{path}.mtbf")


def check_rollbacks_are_outrun(failures: dict[str, Any], path: str, *, domains: FailureDomains,
                               step_seconds: float | None, total_steps: int | None) -> None:
    """Refuse a `restart` job whose steps between two checkpoints (the whole run without
    `checkpoint_every`) would see so many failures that getting past them is hopeless. With
    failures at rate λ (nodes / mtbf), a span of T seconds and a restart of R, the expected
    time to get through the span is (e^(λT) − 1)(1/λ + R) (each failure loses the attempt's
    time and R): refused above HOPELESS_SLOWDOWN times T. T counts each step at its shortest
    (`compute.step_seconds`, or UNMODELED_STEP_S), so only runs hopeless at that are refused."""
    mtbf = failures["mtbf"]
    every = failures["checkpoint_every"]
    span_steps = every if total_steps is None else min(every or total_steps, total_steps)
    if mtbf is None or span_steps is None:
        return
    step = step_seconds if step_seconds is not None else UNMODELED_STEP_S
    span, rate = span_steps * step, domains.count / mtbf
    try:
        expected = math.expm1(rate * span) * (1 / rate + failures["restart"])
    except OverflowError:
        expected = math.inf
    if expected <= HOPELESS_SLOWDOWN * span:
        return
    if every is None:
        back_to = "to the start of training (no checkpoint_every)"
    elif span_steps != every:
        back_to = "to the start of training (checkpoint_every is longer than the run)"
    else:
        back_to = f"to its last checkpoint (every {every} steps)"
    taking = ("forever (beyond any float)" if math.isinf(expected) else
              f"{readable_duration(expected)}, {expected / span:.3g} times that")
    raise SpecError(
        f"the job would fail every {readable_duration(mtbf / domains.count)} on average (mtbf "
        f"{readable_duration(mtbf)} / {domains.count} {domains.noun}s) and each failure rolls "
        f"it back {back_to}: {span_steps} steps of at least {readable_duration(step)} "
        f"({readable_duration(span)}) see {rate * span:.3g} failures on average, so getting "
        f"past them is expected to take {taking}; raise mtbf or checkpoint more often",
        path=f"{path}.mtbf")


def unsupported_reason(aggregator_cls: type) -> str | None:
    """Why `aggregator_cls` cannot run under the failure emulation, or None if it can."""
    mode = failure_mode(aggregator_cls)
    if mode is None:
        return getattr(aggregator_cls, "failure_refusal", None) or "it declares failure_mode = None"
    if mode == "continue":
        return None  # it goes on without the down workers (ContinueEmulation)
    if mode != "restart":
        return f"unknown failure_mode {mode!r} (expected one of {', '.join(FAILURE_MODES)})"
    if aggregator_cls.asynchronous or aggregator_cls.steps_may_differ or aggregator_cls.decides_stop:
        return ("a restart rolls every worker back to the same step, and its workers do not "
                "run in step (asynchronous, or steps that may differ)")
    return None
