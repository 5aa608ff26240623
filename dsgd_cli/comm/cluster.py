"""The emulated cluster of nodes and regions: which link a message takes and how long it lasts.

The spec's `cluster:` section (docs/cluster.md, "A cluster of nodes and regions") places `workers`
ranks on `nodes` nodes, rank r on node r // (workers / nodes), and optionally the nodes in
regions, in node order. Three levels of link join them:

* `intra_node`: two workers of one node (NVLink, PCIe);
* `inter_node`: two nodes of one region (or of the cluster, without regions);
* `inter_region`: two regions (a WAN): one link for every pair of regions, or one per
  ordered pair (`region_links[a][b]`: from region a to region b, as the geo-distributed
  cluster of HALoS, Kim et al., ICML 2025, gives its bandwidths).

A message takes the link of the highest level it crosses: latency + bytes / bandwidth; across
regions, the link of its pair of regions (`link_between`). A
node's messages that leave it (inter-node and inter-region) go through its NIC: with
`nic: shared` (the default) the transfers leaving one node at once divide its bandwidth
equally, with `nic: dedicated` each worker has a link of its own.

Everything here is a pure function of the cluster and the message sizes: the communicator
asks it how long an operation lasts (in real time, after `scaled`), the tests check it
against hand-worked formulas.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Sequence

LEVELS = ("intra_node", "inter_node", "inter_region")
INTRA_NODE, INTER_NODE, INTER_REGION = LEVELS


@dataclass(frozen=True)
class Link:
    """One level's link: per-message latency (s) and bandwidth (bytes per second)."""

    latency_s: float = 0.0
    bytes_per_second: float = math.inf

    def seconds(self, nbytes: float, sharing: int = 1) -> float:
        """One message of `nbytes` while `sharing` transfers divide the link equally."""
        return self.latency_s + nbytes * sharing / self.bytes_per_second


@dataclass(frozen=True)
class Cluster:
    """`workers` ranks on `nodes` nodes; `regions`: nodes per region, in node order (empty:
    one region); `links`: level -> Link for the levels the cluster has; `speeds`: relative
    compute speed per node, each a number (all the node's workers) or a tuple of one per
    worker of the node, in rank order; `region_links`: one Link per ordered pair of regions,
    `region_links[a][b]` from region a to region b (None on the diagonal, whose pairs take
    the intra-node or inter-node link), which replaces `links["inter_region"]` (empty: that
    link for every pair)."""

    workers: int
    nodes: int
    links: dict[str, Link]
    regions: tuple[int, ...] = ()
    nic_shared: bool = True
    speeds: tuple[float | tuple[float, ...], ...] = ()
    region_links: tuple[tuple[Link | None, ...], ...] = ()

    @property
    def workers_per_node(self) -> int:
        return self.workers // self.nodes

    def node(self, rank: int) -> int:
        return rank // self.workers_per_node

    def region(self, rank: int) -> int:
        node, first = self.node(rank), 0
        for index, count in enumerate(self.regions):
            first += count
            if node < first:
                return index
        return 0

    def speed(self, rank: int) -> float:
        """The relative compute speed of `rank` (1: as `step_seconds` says): its node's, or
        its own where the node's speeds are given per worker."""
        if not self.speeds:
            return 1.0
        speed = self.speeds[self.node(rank)]
        if isinstance(speed, tuple):
            return speed[rank % self.workers_per_node]  # the worker's place in its node
        return speed

    def level(self, source: int, destination: int) -> str:
        """The highest level a message from `source` to `destination` crosses."""
        if self.region(source) != self.region(destination):
            return INTER_REGION
        if self.node(source) != self.node(destination):
            return INTER_NODE
        return INTRA_NODE

    def link(self, level: str) -> Link:
        """A level's one link. A level the spec did not need (one worker per node has no
        intra-node link) is free. Across regions with `region_links`, ask `link_between`."""
        return self.links.get(level, Link())

    def link_between(self, source: int, destination: int) -> Link:
        """The link a message from `source` to `destination` takes: that of the highest level
        it crosses, across regions the one of its ordered pair of regions."""
        level = self.level(source, destination)
        if level == INTER_REGION and self.region_links:
            return self.region_links[self.region(source)][self.region(destination)]
        return self.link(level)

    # -- one message ---------------------------------------------------------------------

    def message_seconds(self, source: int, destination: int, nbytes: float,
                        sharing: int = 1) -> float:
        """One message; `sharing`: the transfers leaving `source`'s node at the same time,
        this one included, which divide its NIC when it is shared (only messages that leave
        the node go through the NIC)."""
        shared = self.nic_shared and self.level(source, destination) != INTRA_NODE
        return self.link_between(source, destination).seconds(nbytes, sharing if shared else 1)

    def p2p_sharing(self, source: int, destination: int) -> int:
        """The documented rule for a point-to-point message, whose concurrent transfers the
        communicator cannot see: one that leaves its node shares the NIC with one message
        from each other worker of that node, as in a synchronous step where every worker
        sends at once (gossip's peers, WAGMA's exchanges across nodes)."""
        if not self.nic_shared or self.level(source, destination) == INTRA_NODE:
            return 1
        return self.workers_per_node

    def p2p_seconds(self, source: int, destination: int, nbytes: float) -> float:
        """What the communicator charges one point-to-point message of `nbytes` from
        `source` to `destination` (`Comm.isend`): its pair's link, the NIC shared by the
        rule of `p2p_sharing`. In the cluster's time: modeled for a spec's cluster
        (`spec.cluster_spec.cluster_model`), real for `Comm.cluster` (`real_cluster`)."""
        return self.message_seconds(source, destination, nbytes,
                                    self.p2p_sharing(source, destination))

    # -- collectives -----------------------------------------------------------------------

    def concurrent_seconds(self, pairs: Sequence[tuple[int, int]], nbytes: float,
                           copies: int = 1) -> float:
        """Messages of `nbytes` sent at the same time, one per (source, destination) pair:
        they last as long as the slowest, with the transfers leaving one node sharing its NIC.
        `copies`: the same pattern runs that many times at once on other ranks of the same
        nodes (a hierarchical all-reduce's per-slice rings), multiplying what leaves a node."""
        leaving = Counter(self.node(source) for source, destination in pairs
                          if self.level(source, destination) != INTRA_NODE)
        return max((self.message_seconds(s, d, nbytes, copies * leaving[self.node(s)])
                    for s, d in pairs), default=0.0)

    @staticmethod
    def ring(ranks: Sequence[int]) -> list[tuple[int, int]]:
        """Each member's hop to the next in the ring (group order, as gloo's ring runs)."""
        return [(ranks[i], ranks[(i + 1) % len(ranks)]) for i in range(len(ranks))]

    def ring_all_reduce_seconds(self, ranks: Sequence[int], nbytes: float,
                                copies: int = 1) -> float:
        """Ring all-reduce of `nbytes` per member: 2(p-1) steps, each sending nbytes/p to the
        next member and waiting for the slowest hop (`copies`: see `concurrent_seconds`)."""
        p = len(ranks)
        if p < 2:
            return 0.0
        return 2 * (p - 1) * self.concurrent_seconds(self.ring(ranks), nbytes / p, copies)

    def ring_reduce_scatter_seconds(self, ranks: Sequence[int], nbytes: float) -> float:
        """Ring reduce-scatter of `nbytes` per member: p-1 steps of nbytes/p each."""
        p = len(ranks)
        if p < 2:
            return 0.0
        return (p - 1) * self.concurrent_seconds(self.ring(ranks), nbytes / p)

    def ring_all_gather_seconds(self, ranks: Sequence[int], nbytes: float) -> float:
        """Ring all-gather of `nbytes` per member: p-1 steps of one member's tensor each."""
        p = len(ranks)
        if p < 2:
            return 0.0
        return (p - 1) * self.concurrent_seconds(self.ring(ranks), nbytes)

    def broadcast_seconds(self, root: int, ranks: Sequence[int], nbytes: float) -> float:
        """The root sends one copy to each other member, one after the other on its link."""
        return sum(self.message_seconds(root, rank, nbytes) for rank in ranks if rank != root)

    # -- the ledger --------------------------------------------------------------------------

    def bytes_by_level(self, sends: Sequence[tuple[int, int, int]]) -> dict[str, int]:
        """Bytes per level of (source, destination, bytes) sends; every level present."""
        ledger = dict.fromkeys(LEVELS, 0)
        for source, destination, nbytes in sends:
            ledger[self.level(source, destination)] += nbytes
        return ledger

