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

Each link takes what `network:` takes (the same units). The section is declared, checked and
defaulted by `experiment_options.ClusterOptions`; its resolved form keeps the links given, in
bytes per second (None: unlimited) and seconds, as `network` does. This module reads that
resolved form back: the cluster model, the network model and node speeds.
"""

from __future__ import annotations

import math
from typing import Any

from dsgd_cli.comm.communicator import NetworkModel
from dsgd_cli.comm.cluster import Cluster, Link


def slowest_speed(config: dict[str, Any]) -> float:
    """The lowest node speed of the experiment's cluster (1 without speeds)."""
    cluster = config.get("cluster")
    if cluster is None or not cluster["speed"]:
        return 1.0
    return min(cluster["speed"])


def cluster_model(config: dict[str, Any]) -> Cluster | None:
    """The resolved experiment's cluster, in modeled time (None without a `cluster` section)."""
    section = config.get("cluster")
    if section is None:
        return None
    links = {level: Link(link["latency_s"], math.inf if link["bytes_per_second"] is None
                         else link["bytes_per_second"])
             for level, link in section["links"].items()}
    return Cluster(workers=config["workers"], nodes=section["nodes"], links=links,
                   regions=tuple(section["regions"] or ()),
                   nic_shared=section["nic"] == "shared", speeds=tuple(section["speed"] or ()))


def network_model(config: dict[str, Any]) -> NetworkModel | None:
    """The resolved experiment's `network` link, in modeled time (None without one)."""
    network = config["network"]
    if network is None:
        return None
    bytes_per_second = network["bytes_per_second"]  # None: unlimited
    return NetworkModel(network["latency_s"], math.inf if bytes_per_second is None else bytes_per_second)


def node_speed(config: dict[str, Any], rank: int) -> float:
    """The relative compute speed of `rank`'s node (1 without a cluster or speeds)."""
    cluster = cluster_model(config)
    return 1.0 if cluster is None else cluster.speed(rank)
