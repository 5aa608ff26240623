"""The spec's `cluster:` section: nodes, regions, one link per level, the NIC, node speeds.

    cluster:
      nodes: 4                    # workers split evenly, rank r on node r // (workers / nodes)
      regions: [2, 2]             # optional: nodes per region, in node order
      links:
        intra_node:   {bandwidth: 300GB/s, latency: 2us}
        inter_node:   {bandwidth: 10Gbit,  latency: 50us}
        inter_region: {bandwidth: 500Mbit, latency: 30ms}   # only with regions
      nic: shared                 # or dedicated
      speed: [1, 1, 0.5, 1]       # optional: relative compute speed per node

`inter_region` may also be a matrix, one link per ordered pair of regions (row: from, column:
to, null on the diagonal), and a node's speed a list, one per worker of the node:

      links:
        inter_region:
          - [null,                {bandwidth: 537Mbit}]
          - [{bandwidth: 386Mbit}, null]
      speed: [1, [1, 0.5]]

Each link takes what `network:` takes (the same units). The section is declared, checked and
defaulted by `experiment_options.ClusterOptions`; its resolved form keeps the links given, in
bytes per second (None: unlimited) and seconds, as `network` does (a matrix entry by entry,
None on its diagonal). This module makes the models of that resolved form: the cluster
model, the network model, the workers' speeds and the modeled time of one message; from the
resolved experiment (`cluster_of`, `network_of`: the worker's) or from a configuration as
stored (`cluster_model`, `network_model`: validation, `dsgd show`).
"""

from __future__ import annotations

import math
from typing import Any

from dsgd_cli.comm.communicator import NetworkModel
from dsgd_cli.comm.cluster import Cluster, Link
from dsgd_cli.spec.resolved import Cluster as ResolvedCluster, Link as ResolvedLink, read_key


def slowest_speed(config: dict[str, Any]) -> float:
    """The lowest worker speed of the experiment's cluster (1 without speeds)."""
    cluster = read_key(config, "cluster")
    if cluster is None or not cluster.speed:
        return 1.0
    return min(min(speed) if isinstance(speed, list) else speed for speed in cluster.speed)


def cluster_model(config: dict[str, Any]) -> Cluster | None:
    """A configuration's cluster, in modeled time (None without a `cluster` section)."""
    return cluster_of(read_key(config, "cluster"), read_key(config, "workers"))


def cluster_of(section: ResolvedCluster | None, workers: int) -> Cluster | None:
    """The resolved experiment's cluster (`experiment.cluster`), in modeled time."""
    if section is None:
        return None
    links, region_links = {}, ()
    for level, link in section.links.items():
        if isinstance(link, list):  # inter_region, one link per ordered pair of regions
            region_links = tuple(tuple(None if entry is None else _link(entry) for entry in row)
                                 for row in link)
        else:
            links[level] = _link(link)
    speeds = tuple(tuple(speed) if isinstance(speed, list) else speed
                   for speed in section.speed or ())
    return Cluster(workers=workers, nodes=section.nodes, links=links,
                   regions=tuple(section.regions or ()),
                   nic_shared=section.nic == "shared", speeds=speeds,
                   region_links=region_links)


def _link(link: ResolvedLink) -> Link:
    bytes_per_second = link.bytes_per_second  # None: unlimited
    return Link(link.latency_s, math.inf if bytes_per_second is None else bytes_per_second)


def message_seconds(config: dict[str, Any], source: int, destination: int,
                    nbytes: float) -> float:
    """The modeled seconds the emulated network charges one point-to-point message of
    `nbytes` from rank `source` to rank `destination` (what `Comm.isend` waits for, before
    the time scale): on a cluster the link of the pair (across regions, of their pair of
    regions), its NIC shared by the point-to-point rule (`Cluster.p2p_seconds`); with
    `network`, its latency + bytes / bandwidth; 0 with neither. Inside a worker, the same in
    real time is `comm.cluster.p2p_seconds(source, destination, nbytes)` (or
    `comm.network.duration(nbytes, 1)` without a cluster)."""
    cluster = cluster_model(config)
    if cluster is not None:
        return cluster.p2p_seconds(source, destination, nbytes)
    network = network_model(config)
    return 0.0 if network is None else network.duration(nbytes, 1)


def network_model(config: dict[str, Any]) -> NetworkModel | None:
    """A configuration's `network` link, in modeled time (None without one)."""
    return network_of(read_key(config, "network"))


def network_of(link: ResolvedLink | None) -> NetworkModel | None:
    """The resolved experiment's `network` link (`experiment.network`), in modeled time."""
    if link is None:
        return None
    bytes_per_second = link.bytes_per_second  # None: unlimited
    return NetworkModel(link.latency_s, math.inf if bytes_per_second is None else bytes_per_second)


def node_speed(config: dict[str, Any], rank: int) -> float:
    """The relative compute speed of `rank`: its node's, or its own where its node's speeds
    are given per worker (1 without a cluster or speeds). The compute model divides the
    rank's modeled step time by it."""
    cluster = cluster_model(config)
    return 1.0 if cluster is None else cluster.speed(rank)


worker_speed = node_speed  # the same: a worker's speed, given per node or per worker
