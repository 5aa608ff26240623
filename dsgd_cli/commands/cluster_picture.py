"""The cluster a run ran on, as text for `dsgd show`: its regions, nodes and workers, each
node's (or worker's) speed, and what the run sent on each link level.

    cluster: 4 nodes × 2 workers in 2 regions, NIC shared
      region 0: node 0 [r0 r1]  node 1 ×0.5 [r2 r3]
      region 1: node 2 [r4 r5×0.8]  node 3 [r6 r7]
    level         link                                   sent      peak rate
    intra_node    12.5 GB/s = 100 Gbit/s, latency 5 µs   1.2 MB    3.1 GB/s
    ...

With a link per pair of regions the inter_region row says so, and the matrix follows it
(bandwidth, then latency where one is not 0; row: from region, column: to region).
"""

from __future__ import annotations

from typing import Any, Callable

from dsgd_cli.comm.cluster import LEVELS
from dsgd_cli.commands.output import readable_bytes, render
from dsgd_cli.spec.describe import network
from dsgd_cli.spec.resolved import Link, read_key


def cluster_picture(config: dict[str, Any], finals: dict[str, float],
                    peak_rate: Callable[[str], float | None]) -> list[str]:
    """The lines that draw `config`'s cluster (none without one). `finals`: the run's final
    metrics (the per-run `total_bytes_sent_{level}`); `peak_rate(level)`: the most one
    worker's step sent per modeled second on the level, over the run, or None."""
    section = read_key(config, "cluster")
    if section is None:
        return []
    nodes, workers = section.nodes, read_key(config, "workers")
    per_node = workers // nodes
    regions = section.regions or [nodes]
    speeds = section.speed or [1.0] * nodes
    heading = f"cluster: {nodes} nodes × {per_node} workers"
    if section.regions:
        heading += f" in {len(regions)} regions"
    lines = [heading + f", NIC {section.nic}"]
    first = 0
    for region, count in enumerate(regions):
        drawn = "  ".join(_node(node, per_node, speeds[node])
                          for node in range(first, first + count))
        lines.append(f"  region {region}: {drawn}" if section.regions else f"  {drawn}")
        first += count
    rows, matrix = [], None
    for level in LEVELS:
        link = section.links.get(level)
        sent = finals.get(f"total_bytes_sent_{level}")
        if link is None and not sent:
            continue  # a level the cluster lacks
        if isinstance(link, list):
            matrix, shown = link, "per pair of regions (below)"
        else:
            shown = network(link) if link else "free"
        rate = peak_rate(level)
        rows.append({"level": level, "link": shown,
                     "sent": "" if sent is None else readable_bytes(sent),
                     "peak rate": "" if rate is None else readable_bytes(rate) + "/s"})
    lines.extend(render(rows).splitlines())
    if matrix is not None:
        lines.extend(_matrix(matrix))
    return lines


def _node(node: int, per_node: int, speed: float | list[float]) -> str:
    """`node 1 ×0.5 [r2 r3]`: its ranks, and its speed where it is not 1; speeds per worker
    go with their ranks (`node 1 [r2×0.5 r3]`)."""
    ranks = range(node * per_node, (node + 1) * per_node)
    if isinstance(speed, list):
        drawn = " ".join(f"r{rank}" + ("" if s == 1 else f"×{s:g}") for rank, s in zip(ranks, speed))
        return f"node {node} [{drawn}]"
    shown_speed = "" if speed == 1 else f" ×{speed:g}"
    return f"node {node}{shown_speed} [{' '.join(f'r{rank}' for rank in ranks)}]"


def _matrix(matrix: list[list[Link | None]]) -> list[str]:
    """The inter-region links, one row per source region, one column per destination."""
    def cell(entry: Link | None) -> str:
        if entry is None:
            return "-"
        rate = entry.bytes_per_second
        text = "unlimited" if rate is None else _bits_per_second(rate)
        if entry.latency_s:
            text += f" {entry.latency_s * 1e3:.4g} ms"
        return text
    rows = [{"from": f"region {a}", **{f"to region {b}": cell(entry)
                                       for b, entry in enumerate(row)}}
            for a, row in enumerate(matrix)]
    return ["inter_region links, from region (row) to region (column):",
            *render(rows).splitlines()]


def _bits_per_second(bytes_per_second: float) -> str:
    """`537 Mbit/s`: a bandwidth in bits per second, with a decimal prefix."""
    bits = bytes_per_second * 8
    for prefix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if bits >= scale:
            return f"{bits / scale:.4g} {prefix}bit/s"
    return f"{bits:.4g} bit/s"
