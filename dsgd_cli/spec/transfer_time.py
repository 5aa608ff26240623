"""A refusal at validation: a run whose model cannot cross its emulated network within the
experiment's `timeout`.

The network emulation makes a worker wait, in real time, as long as the modeled link takes
(stretched by `compute.time_scale`). On a link of 1 bit/s even a small model takes days, and
the run would sit at its first step. Every algorithm moves the model (or its gradient) across
the widest level of the network the run spans, so one copy of it crossing that level is what
some step waits for at least:

    latency + model bytes / (bandwidth × network cards in parallel)

in modeled seconds, times `time_scale` in real ones. The cards are those on one side of the
level that can carry parts of the model at once: one per node with `nic: shared`, one per
worker with `nic: dedicated` (one for `network:` and within a node). The run is refused when
that reaches the `timeout`. With a compressor the bytes sent are known only when it runs:
only the latency is checked. An algorithm that sends the model in parts over several steps
(streaming_diloco) is held to the whole model all the same. With a link per pair of regions
(`inter_region` a matrix), the crossing is the fastest any pair could be: the lowest latency
and the highest bandwidth of the matrix, so that only a run no pair could serve in time is
refused. docs/cluster.md ("Runs that could not make progress") says the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dsgd_cli.emulation.clock import Clock
from dsgd_cli.comm.cluster import INTER_NODE, INTER_REGION, INTRA_NODE
from dsgd_cli.errors import SpecError
from dsgd_cli.spec import registry
from dsgd_cli.spec.resolved import Link, read_key
from dsgd_cli.units import readable_duration


@dataclass(frozen=True)
class Crossing:
    """The link a copy of the model must cross: where the spec gives it (`key`), its latency
    (s) and bandwidth (bytes per second, None: unlimited), and how many such links can carry
    parts of the model at once."""

    key: str
    latency_s: float
    bytes_per_second: float | None
    links_in_parallel: int = 1

    def seconds(self, nbytes: int) -> float:
        """Modeled seconds for `nbytes` to cross."""
        if self.bytes_per_second is None:
            return self.latency_s
        return self.latency_s + nbytes / (self.bytes_per_second * self.links_in_parallel)


def widest_crossing(config: dict[str, Any]) -> Crossing | None:
    """The link of the widest level the run spans (`config`: its stored configuration): the
    `network` link, or the cluster's inter-region, else inter-node, else intra-node link. None
    when nothing is modeled or one worker has no one to talk to."""
    workers = read_key(config, "workers")
    if workers < 2:
        return None
    cluster = read_key(config, "cluster")
    if cluster is None:
        network = read_key(config, "network")
        if network is None:
            return None
        return Crossing("network", network.latency_s, network.bytes_per_second)
    nodes, regions = cluster.nodes, cluster.regions or [cluster.nodes]
    if len(regions) > 1:
        level, nodes_on_one_side = INTER_REGION, max(regions)
    elif nodes > 1:
        level, nodes_on_one_side = INTER_NODE, 1
    else:
        link = cluster.links[INTRA_NODE]
        return Crossing(f"cluster.links.{INTRA_NODE}", link.latency_s, link.bytes_per_second)
    link = cluster.links[level]
    if isinstance(link, list):  # one link per pair of regions: the fastest any pair is
        link = _fastest(entry for row in link for entry in row if entry is not None)
    cards_per_node = workers // nodes if cluster.nic == "dedicated" else 1
    return Crossing(f"cluster.links.{level}", link.latency_s, link.bytes_per_second,
                    nodes_on_one_side * cards_per_node)


def _fastest(links) -> Link:
    """A link at least as fast as each of `links`: their lowest latency, their highest bandwidth
    (None, unlimited, when one is)."""
    links = list(links)
    rates = [link.bytes_per_second for link in links]
    return Link(latency_s=min(link.latency_s for link in links),
                bytes_per_second=None if None in rates else max(rates))


def needs_model_size(config: dict[str, Any], compressed: bool) -> bool:
    """Whether `check_model_crosses_in_time` reads the model's size: with a modeled bandwidth
    and no compressor (`compressed`: the run has one)."""
    crossing = widest_crossing(config)
    return crossing is not None and crossing.bytes_per_second is not None and not compressed


def model_bytes(task_section: dict[str, Any]) -> int | None:
    """The bytes of the parameters of the task's model; None if it cannot be built here. The
    model is built on PyTorch's meta device: shapes and dtypes, no memory, no computation, and
    no random number drawn."""
    import torch

    try:
        task = registry.build("task", task_section)
        with torch.device("meta"):
            model = task.build_model()
    except Exception:
        # Third-party code, or a model the meta device cannot build: the bytes are not
        # checked here, and the workers build the model for real.
        return None
    return sum(p.numel() * p.element_size() for p in model.parameters())


def check_model_crosses_in_time(config: dict[str, Any], compressed: bool, nbytes: int | None,
                                path: str) -> None:
    """Refuse a run where one copy of the model (`nbytes`; None or 0, or `compressed`: a
    message of no size) takes, in real time, at least the experiment's timeout to cross the
    widest level."""
    crossing = widest_crossing(config)
    if crossing is None:
        return
    nbytes = 0 if compressed or nbytes is None else nbytes
    compute = read_key(config, "compute")
    time_scale = compute.time_scale if compute is not None else 1.0
    modeled = crossing.seconds(nbytes)
    real, timeout = Clock(time_scale).to_real(modeled), read_key(config, "timeout")
    if real < timeout:
        return
    what = (f"sending the model once ({_si(nbytes, 'B')})" if nbytes
            else "one message, its latency alone,")
    scaled = (f" modeled, {readable_duration(real)} in real time (× time_scale {time_scale:g})"
              if time_scale != 1 else "")
    raise SpecError(f"{what} takes {readable_duration(modeled)}{scaled} over "
                    f"{_describe(crossing)}, not less than the experiment's timeout of "
                    f"{timeout:g} s: no step that waits for it would end; raise the bandwidth or "
                    f"the timeout", path=f"{path}.{crossing.key}")


def _describe(crossing: Crossing) -> str:
    """`this link (1 bit/s, latency 50 µs)`, with the cards that carry parts at once."""
    parts = []
    if crossing.bytes_per_second is not None:
        parts.append(_si(crossing.bytes_per_second * 8, "bit/s"))
    parts.append(f"latency {readable_duration(crossing.latency_s)}")
    if crossing.links_in_parallel > 1:
        parts.append(f"{crossing.links_in_parallel} network cards in parallel")
    return f"this link ({', '.join(parts)})"


def _si(value: float, unit: str) -> str:
    """`value` with a decimal prefix: 34600 B is `34.6 kB`."""
    for prefix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if value >= scale:
            return f"{value / scale:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"
