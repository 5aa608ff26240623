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

Each link takes what `network:` takes (the same units). The resolved section keeps the links
the cluster has, in bytes per second (None: unlimited) and seconds, as `network` does.
"""

from __future__ import annotations

import math
from typing import Any

from dsgd_cli.comm.communicator import NetworkModel
from dsgd_cli.comm.cluster import INTER_NODE, INTER_REGION, INTRA_NODE, LEVELS, Cluster, Link
from dsgd_cli.errors import SpecError
from dsgd_cli.options import as_float, show
from dsgd_cli.spec.experiment_options import parse_network
from dsgd_cli.spec.specfile import check_keys

NIC_KINDS = ("shared", "dedicated")
MAX_SPEED = 1000.0


def parse_cluster(raw: Any, path: str, workers: int) -> dict[str, Any] | None:
    """The resolved `cluster` section for `workers` workers, or None without one."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise SpecError("expected a mapping with keys nodes, regions, links, nic, speed", path=path)
    check_keys(raw, path, {"nodes", "regions", "links", "nic", "speed"})
    nodes = _nodes(raw, path, workers)
    regions = _regions(raw.get("regions"), f"{path}.regions", nodes)
    nic = raw.get("nic", "shared")
    if not isinstance(nic, str) or nic not in NIC_KINDS:
        raise SpecError(f"expected one of {', '.join(NIC_KINDS)}, got {show(nic)}",
                        path=f"{path}.nic")
    return {"nodes": nodes, "regions": regions,
            "links": _links(raw.get("links"), f"{path}.links", workers // nodes, regions, nodes),
            "nic": nic, "speed": _speeds(raw.get("speed"), f"{path}.speed", nodes)}


def _nodes(raw: dict, path: str, workers: int) -> int:
    if "nodes" not in raw:
        raise SpecError("required: the number of nodes the workers are split over",
                        path=f"{path}.nodes")
    nodes = raw["nodes"]
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        raise SpecError(f"expected an integer >= 1, got {show(nodes)}", path=f"{path}.nodes")
    if workers % nodes:
        raise SpecError(f"{workers} workers cannot be split evenly over {nodes} nodes: "
                        f"workers must be a multiple of nodes", path=f"{path}.nodes")
    return nodes


def _regions(raw: Any, path: str, nodes: int) -> list[int] | None:
    if raw is None:
        return None
    if (not isinstance(raw, list) or not raw
            or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in raw)):
        raise SpecError(f"expected a list of node counts >= 1, one per region, got {show(raw)}",
                        path=path)
    if sum(raw) != nodes:
        raise SpecError(f"the regions hold {sum(raw)} nodes, expected {nodes} (cluster.nodes)",
                        path=path)
    return list(raw)


def _levels_present(workers_per_node: int, regions: list[int] | None, nodes: int) -> list[str]:
    """The levels some pair of workers crosses."""
    levels = [INTRA_NODE] if workers_per_node > 1 else []
    if any(count > 1 for count in (regions or [nodes])):
        levels.append(INTER_NODE)
    if regions is not None and len(regions) > 1:
        levels.append(INTER_REGION)
    return levels


def _links(raw: Any, path: str, workers_per_node: int, regions: list[int] | None,
           nodes: int) -> dict[str, dict[str, float | None]]:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise SpecError(f"expected a mapping with keys {', '.join(LEVELS)}", path=path)
    check_keys(raw, path, set(LEVELS))
    if INTER_REGION in raw and regions is None:
        raise SpecError("an inter_region link needs regions (cluster.regions)",
                        path=f"{path}.{INTER_REGION}")
    links = {}
    for level in _levels_present(workers_per_node, regions, nodes):
        if raw.get(level) is None:
            raise SpecError(f"required: this cluster has {level.replace('_', '-')} links, "
                            f"such as {{bandwidth: 10Gbit, latency: 50us}}",
                            path=f"{path}.{level}")
    for level in LEVELS:  # a level the cluster lacks may still be given (a grid over nodes)
        if raw.get(level) is not None:
            links[level] = parse_network(raw[level], f"{path}.{level}")
    return links


def _speeds(raw: Any, path: str, nodes: int) -> list[float] | None:
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise SpecError(f"expected a list of {nodes} speeds, one per node, got {show(raw)}",
                        path=path)
    if len(raw) != nodes:
        raise SpecError(f"expected {nodes} speeds (one per node), got {len(raw)}", path=path)
    speeds = []
    for index, value in enumerate(raw):
        speed = as_float(value)
        if speed is None or not (0 < speed <= MAX_SPEED):
            raise SpecError(f"expected a number > 0 and <= {MAX_SPEED:g}, got {show(value)}",
                            path=f"{path}[{index}]")
        speeds.append(speed)
    return speeds


def check_cluster_fits(config: dict[str, Any], path: str) -> None:
    """What the cluster needs from the rest of the experiment: one network model, and a
    compute model to scale when nodes have speeds."""
    cluster = config.get("cluster")
    if cluster is None:
        return
    if config.get("network") is not None:
        raise SpecError("give either network (one link for every worker) or cluster, not "
                        "both; set network: null where a default sets it", path=f"{path}.cluster")
    if cluster["speed"] is not None and config.get("compute") is None:
        raise SpecError("node speeds scale the modeled compute: add a compute section "
                        "(compute.step_seconds)", path=f"{path}.cluster.speed")


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
