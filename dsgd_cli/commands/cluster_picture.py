"""The cluster a run ran on, as text for `dsgd show`: its regions, nodes and workers, each
node's speed, and what the run sent on each link level.

    cluster: 4 nodes × 2 workers in 2 regions, NIC shared
      region 0: node 0 [r0 r1]  node 1 ×0.5 [r2 r3]
      region 1: node 2 [r4 r5]  node 3 [r6 r7]
    level         link                                   sent      peak rate
    intra_node    12.5 GB/s = 100 Gbit/s, latency 5 µs   1.2 MB    3.1 GB/s
    ...
"""

from __future__ import annotations

from typing import Any, Callable

from dsgd_cli.comm.cluster import LEVELS
from dsgd_cli.commands.output import readable_bytes, render
from dsgd_cli.spec.describe import network


def cluster_picture(config: dict[str, Any], finals: dict[str, float],
                    peak_rate: Callable[[str], float | None]) -> list[str]:
    """The lines that draw `config`'s cluster (none without one). `finals`: the run's final
    metrics (the per-run `total_bytes_sent_{level}`); `peak_rate(level)`: the most one
    worker's step sent per modeled second on the level, over the run, or None."""
    section = config.get("cluster")
    if not section:
        return []
    nodes, workers = section["nodes"], config["workers"]
    per_node = workers // nodes
    regions = section["regions"] or [nodes]
    speeds = section["speed"] or [1.0] * nodes
    heading = f"cluster: {nodes} nodes × {per_node} workers"
    if section["regions"]:
        heading += f" in {len(regions)} regions"
    lines = [heading + f", NIC {section['nic']}"]
    first = 0
    for region, count in enumerate(regions):
        drawn = "  ".join(_node(node, per_node, speeds[node])
                          for node in range(first, first + count))
        lines.append(f"  region {region}: {drawn}" if section["regions"] else f"  {drawn}")
        first += count
    rows = []
    for level in LEVELS:
        link = section["links"].get(level)
        sent = finals.get(f"total_bytes_sent_{level}")
        if link is None and not sent:
            continue  # a level the cluster lacks
        rate = peak_rate(level)
        rows.append({"level": level, "link": network(link) if link else "free",
                     "sent": "" if sent is None else readable_bytes(sent),
                     "peak rate": "" if rate is None else readable_bytes(rate) + "/s"})
    lines.extend(render(rows).splitlines())
    return lines


def _node(node: int, per_node: int, speed: float) -> str:
    """`node 1 ×0.5 [r2 r3]`: its ranks, and its speed where it is not 1."""
    ranks = " ".join(f"r{rank}" for rank in range(node * per_node, (node + 1) * per_node))
    shown_speed = "" if speed == 1 else f" ×{speed:g}"
    return f"node {node}{shown_speed} [{ranks}]"
