"""What an experiment will run, in the words and units a person reads: its length per worker
(epochs and steps, or its budget and the step count it makes), the compute model, the network,
the stragglers, the failures and, where the steps are modeled, the least real time its
training takes. `dsgd run --dry-run` prints it for each experiment."""

from __future__ import annotations

import json
from dsgd_cli.emulation.clock import Clock
from dsgd_cli.emulation.network import GLOO_RING_MAX
from dsgd_cli.spec import registry
from dsgd_cli.spec.learning_rate import last_step
from dsgd_cli.spec.resolved import Cluster, Compute, Link, ResolvedExperiment, Stragglers
from dsgd_cli.spec.sharding import Shard, samples_in_steps, steps_per_epoch


class Describer:
    """Describes resolved experiments (`Experiment.resolved`); remembers each task's
    training-set size (a grid's points share a few tasks)."""

    def __init__(self):
        self._examples: dict[str, int | None] = {}

    def lines(self, experiment: ResolvedExperiment) -> list[str]:
        return [f"length: {self.length(experiment)}",
                f"compute: {compute(experiment.compute)}",
                f"network: {network(experiment.network)}"
                if experiment.cluster is None else
                f"cluster: {cluster(experiment.cluster, experiment.workers)}",
                f"stragglers: {stragglers(experiment.stragglers)}",
                f"failures: {failures(experiment)}",
                f"real time: {self.real_time(experiment)}"]

    def real_time(self, experiment: ResolvedExperiment) -> str:
        """The least real time the steps take: each modeled step lasts at least its
        `step_seconds` (× the time scale); communication, evaluation, failures and start-up
        come on top. Unknown without a compute model or a known step count."""
        section = experiment.compute
        if section is None:
            return "unknown before the run (measured steps take what this machine takes)"
        budget = experiment.budget
        if budget is not None and budget.seconds is not None:
            modeled = budget.seconds
        else:
            sizes = self._sizes(experiment)
            if sizes is None:
                return "unknown before the task's data is loaded"
            modeled = last_step(experiment, *sizes) * section.step_seconds
        real = Clock(section.time_scale).to_real(modeled)
        return (f"at least {_seconds(real)} of training ({_seconds(modeled)} modeled "
                f"× time scale {section.time_scale:g}), plus communication, evaluation, "
                "failures and start-up")

    def length(self, experiment: ResolvedExperiment) -> str:
        """How long each worker trains, with the step count when it is known before the run."""
        batch, budget = experiment.batch_size, experiment.budget
        sizes = self._sizes(experiment)  # (shard size, steps per epoch), None: known when loaded
        if budget is None:
            epochs = f"{experiment.epochs} epoch{'s' if experiment.epochs != 1 else ''}"
            if sizes is None:
                return f"{epochs} per worker, of batch {batch}"
            steps = last_step(experiment, *sizes)
            return f"{epochs} × {sizes[1]} steps = {steps} steps per worker, of batch {batch}"
        evaluations = (f"{budget.evaluations} evaluation"
                       f"{'s' if budget.evaluations != 1 else ''} of the average model")
        if budget.seconds is not None:
            return (f"budget {budget.seconds:g} s of training (modeled), batch {batch}, "
                    f"{evaluations}; epochs ignored")
        spent = f"budget {budget.samples:,} samples over all workers, batch {batch}"
        if sizes is None:
            return f"{spent}, {evaluations}; epochs ignored"
        steps = last_step(experiment, *sizes)
        cls = registry.load("aggregator", experiment.aggregator.name)
        if cls.steps_may_differ or cls.decides_stop:
            return (f"{spent}: each worker stops once they are spent ({steps} steps per worker "
                    f"at equal speed), {evaluations}; epochs ignored")
        trained = experiment.workers * samples_in_steps(steps, sizes[0], batch, sizes[1])
        return (f"{spent}: {steps} steps per worker ({trained:,} samples), {evaluations}; "
                f"epochs ignored")

    def _sizes(self, experiment: ResolvedExperiment) -> tuple[int, int] | None:
        task = experiment.task.to_dict()
        key = json.dumps(task, sort_keys=True)
        if key not in self._examples:
            self._examples[key] = experiment.task.build("task").train_examples()
        examples = self._examples[key]
        if examples is None:
            return None
        shard = Shard(examples, 0, experiment.workers, experiment.seed)
        return shard.size, steps_per_epoch(shard, experiment.batch_size,
                                           experiment.steps_per_epoch)


def compute(section: Compute | None) -> str:
    if section is None:
        return "measured (no compute model: steps take the time they take)"
    text = f"{_seconds(section.step_seconds)} per step (modeled)"
    variation = section.variation
    if variation is not None:
        options = ", ".join(f"{k} {v:g}" for k, v in variation.items() if k != "distribution")
        text += f", {variation['distribution']} variation ({options})"
    text += f", time scale {section.time_scale:g} (real seconds per modeled second)"
    if section.ring_max != GLOO_RING_MAX:
        text += f", real all-reduce by messages above {section.ring_max} members"
    return text


def network(link: Link | None) -> str:
    if link is None:
        return "not emulated"
    per_second = link.bytes_per_second
    bandwidth = ("unlimited bandwidth" if per_second is None else
                 f"{_si(per_second, 'B/s')} = {_si(per_second * 8, 'bit/s')}")
    return f"{bandwidth}, latency {_seconds(link.latency_s)}"


def cluster(section: Cluster, workers: int) -> str:
    """`4 nodes × 2 workers in regions 2, 2; intra_node …; NIC shared`."""
    text = f"{section.nodes} nodes × {workers // section.nodes} workers"
    if section.regions:
        text += f" in regions of {', '.join(map(str, section.regions))} nodes"
    links = "; ".join(f"{level} {_cluster_link(link)}" for level, link in section.links.items())
    text += f"; {links}; NIC {section.nic}"
    if section.speed:
        text += f"; node speeds {', '.join(map(_speed, section.speed))}"
    return text


def _cluster_link(link: Link | list[list[Link | None]]) -> str:
    """A level's link, or a matrix of links per pair of regions: its range."""
    if not isinstance(link, list):
        return network(link)
    entries = [entry for row in link for entry in row if entry is not None]
    rates = [entry.bytes_per_second for entry in entries]
    latencies = [entry.latency_s for entry in entries]
    bandwidth = ("unlimited bandwidth" if None in rates and len(set(rates)) == 1 else
                 " to ".join(dict.fromkeys(
                     "unlimited" if rate is None else f"{_si(rate * 8, 'bit/s')}"
                     for rate in (min(rates, key=_rate_order), max(rates, key=_rate_order)))))
    latency = " to ".join(dict.fromkeys(_seconds(x) for x in (min(latencies), max(latencies))))
    return f"per pair of regions, {bandwidth}, latency {latency}"


def _rate_order(rate: float | None) -> float:
    return float("inf") if rate is None else rate


def _speed(speed: float | list[float]) -> str:
    """A node's speed, or its workers' (`[1, 0.5]`)."""
    if isinstance(speed, list):
        return "[" + ", ".join(f"{worker:g}" for worker in speed) + "]"
    return f"{speed:g}"


def failures(experiment: ResolvedExperiment) -> str:
    """`mtbf 1 h per node (exponential, seed 0), restart 5 s: every worker rolls back …`."""
    section = experiment.failures  # as stored: a mapping, durations in seconds
    if section is None:
        return "none"
    cls = registry.load("aggregator", experiment.aggregator.name)
    domain = "worker" if experiment.cluster is None else "node"
    parts = []
    if section["mtbf"] is not None:
        parts.append(f"mtbf {_seconds(section['mtbf'])} per {domain} (exponential, seed "
                     f"{section['seed']})")
    for fixed in section["at"]:
        parts.append(f"{domain} {fixed['node']} at {_seconds(fixed['time'])}")
    away = f"away {_seconds(section['restart'])}"
    if getattr(cls, "failure_mode", "restart") == "continue":
        mode = f"{away}; the others go on without it (continue mode), and it rejoins"
    else:
        every = section["checkpoint_every"]
        back = (f"the checkpoint of every {every} steps" if every else "the start")
        mode = f"{away}; every worker rolls back to {back} (restart mode)"
    return f"{'; '.join(parts)}; {mode}"


def stragglers(section: Stragglers | None) -> str:
    if section is None:
        return "none"
    parts = []
    if section.ranks and section.slowdown > 1:
        ranks = ", ".join(str(rank) for rank in section.ranks)
        parts.append(f"rank{'s' if len(section.ranks) > 1 else ''} {ranks} "
                     f"{section.slowdown:g}× slower")
    randomly = section.random
    if randomly is not None:
        parts.append(f"each step of each worker {randomly.slowdown:g}× slower with "
                     f"probability {randomly.probability:g}")
    return "; ".join(parts) or "none"


def _si(value: float, unit: str) -> str:
    """`value` with a decimal prefix: 1e9 B/s is `1 GB/s`."""
    for prefix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if value >= scale:
            return f"{value / scale:.4g} {prefix}{unit}"
    return f"{value:.4g} {unit}"


def _seconds(value: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if value >= scale:
            return f"{value / scale:.4g} {unit}"
    return "0 s" if value == 0 else f"{value * 1e9:.4g} ns"
