"""The network model: an emulated link's latency and bandwidth, and the stretch of every
emulated link into real time.

The spec gives links in modeled time (`network`, or a cluster's levels, `comm.cluster`);
`Comm` waits in real time, so the runtime hands it links `time_scale` times slower
(`real_network`, `real_cluster`): the real timeline is then the modeled one, stretched.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dsgd_cli.emulation.clock import Clock

if TYPE_CHECKING:  # comm imports this module: the emulation sits below it
    from dsgd_cli.comm.cluster import Cluster

# How the real bytes of an all-reduce move (`compute.ring_max`): groups of at most this many
# members by gloo's ring, larger ones by messages (comm/by_messages.py). The modeled time is a
# ring's either way.
GLOO_RING_MAX = 64


@dataclass(frozen=True)
class NetworkModel:
    """An emulated link: per-message latency (s) and bandwidth (bytes per second)."""

    latency_s: float = 0.0
    bytes_per_second: float = float("inf")

    def duration(self, bytes_sent: int, messages: int) -> float:
        return messages * self.latency_s + bytes_sent / self.bytes_per_second


def real_network(network: NetworkModel | None, clock: Clock | float) -> NetworkModel | None:
    """The emulated link (or None) in the real time of `clock` (or of a clock of that time
    scale, as callers from before the clock pass it): every duration `time_scale` times
    longer."""
    if not isinstance(clock, Clock):
        clock = Clock(clock)
    if network is None or clock.time_scale == 1:
        return network
    return _real_link(network, clock)


def real_cluster(cluster: Cluster | None, clock: Clock) -> Cluster | None:
    """The same cluster (or None) in the real time of `clock`: every link's durations
    `time_scale` times longer, those of each pair of regions too."""
    if cluster is None or clock.time_scale == 1:
        return cluster
    links = {level: _real_link(link, clock) for level, link in cluster.links.items()}
    region_links = tuple(tuple(None if link is None else _real_link(link, clock) for link in row)
                         for row in cluster.region_links)
    return dataclasses.replace(cluster, links=links, region_links=region_links)


def _real_link(link, clock: Clock):
    """A link (a `NetworkModel` or a cluster's `Link`) in real time: a message takes
    `time_scale` times longer, so a real second carries `time_scale` times fewer bytes."""
    return dataclasses.replace(link, latency_s=clock.to_real(link.latency_s),
                               bytes_per_second=clock.to_real_rate(link.bytes_per_second))
