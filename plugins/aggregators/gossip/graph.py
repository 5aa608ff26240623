"""Which graph a gossip plugin runs on, and whether it can run on it with n workers.

Plugins name a topology (`topology` option) and, for the graphs that cycle through their peers
(`time_varying_exponential` and the SGP reference's graphs), how many peers a worker talks to per
step (`peers_per_step`). The graph itself comes from the public
`dsgd_cli.topology`; this module turns options into a `Topology` and checks the properties each
algorithm relies on, raising ValueError with a message a spec author can act on.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from dsgd_cli.topology import (TOPOLOGY_KINDS, MixingName, Topology, TopologyName, is_connected,
                               is_strongly_connected, make_topology, mixing_matrix, mixing_product,
                               spectral_gap, topology_kind)


def build(name: str, world_size: int, *, peers_per_step: int = 1, seed: int = 0,
          undirected: bool = False) -> Topology:
    """The topology `name` over `world_size` workers; `undirected` picks the undirected variant
    of ring and exponential (the others have one variant only)."""
    kind = topology_kind(name)
    if peers_per_step != 1 and "peers_per_step" not in kind.takes:
        takers = [other for other, k in TOPOLOGY_KINDS.items() if "peers_per_step" in k.takes]
        raise ValueError(f"peers_per_step applies to topologies {', '.join(map(repr, takers))} "
                         f"only; topology {name!r} fixes its peers (leave peers_per_step at 1)")
    directed = False if undirected and False in kind.directions else None
    try:
        return make_topology(name, world_size, directed=directed, seed=seed,
                             peers_per_step=peers_per_step)
    except ValueError as error:
        raise ValueError(f"topology {name!r} cannot connect {world_size} workers: {error}") from None


def union_adjacency(topology: Topology, undirected: bool = False) -> np.ndarray:
    """Every edge used in one period of the graph (made symmetric if `undirected`)."""
    adjacency = np.zeros((topology.world_size,) * 2, dtype=bool)
    for step in range(topology.period):
        adjacency |= topology.adjacency(step)
    return adjacency | adjacency.T if undirected else adjacency


def check_doubly_stochastic(topology: Topology, scheme: str) -> None:
    """D-PSGD needs a doubly stochastic mixing matrix at every step and consensus over a period."""
    n = topology.world_size
    for step in range(topology.period):
        w = mixing_matrix(topology, step, scheme)  # raises for metropolis on one-way edges
        if not (np.allclose(w.sum(axis=0), 1.0) and np.allclose(w.sum(axis=1), 1.0)):
            raise ValueError(f"mixing {scheme!r} on topology {topology.name!r} with {n} workers is "
                             f"not doubly stochastic at step {step}, so D-PSGD would not average")
    if n > 1 and spectral_gap(mixing_product(topology, scheme)) < 1e-9:
        raise ValueError(f"topology {topology.name!r} with {n} workers does not reach consensus")


def check_push_sum(topology: Topology, *, balanced_rounds: bool = False) -> None:
    """Push-sum converges when the graph over a period is strongly connected. The overlapped
    variant also needs every step's graph to be balanced (in-degree = out-degree, so each
    connected part is strongly connected): a worker that has stopped computing then still
    receives the messages that tell it to take part in a round its peers wait for."""
    n = topology.world_size
    if not is_strongly_connected(union_adjacency(topology)):
        raise ValueError(f"topology {topology.name!r} with {n} workers is not strongly connected, "
                         f"so push-sum cannot reach consensus")
    if balanced_rounds:
        for step in range(topology.period):
            adjacency = topology.adjacency(step)
            if (adjacency.sum(axis=0) != adjacency.sum(axis=1)).any():
                raise ValueError(f"topology {topology.name!r} with {n} workers has a worker whose "
                                 f"in- and out-degree differ at step {step}; osgp needs balanced "
                                 f"graphs")


def in_degrees(topology: Topology, rank: int) -> list[int]:
    """How many messages `rank` receives at each step of one period."""
    return [len(topology.in_peers(rank, step)) for step in range(topology.period)]


def messages_through(degrees: list[int], last_round: int) -> int:
    """Messages received in rounds 0..last_round, given the per-step in-degrees of a period."""
    rounds = last_round + 1
    if rounds <= 0:
        return 0
    full, rest = divmod(rounds, len(degrees))
    return full * sum(degrees) + sum(degrees[:rest])


def bipartite_split(topology: Topology) -> tuple[list[bool], list[list[int]]]:
    """AD-PSGD's active/passive split: (is_active per rank, neighbours of the other side).

    If the undirected graph (union over a period) is bipartite, its two colour classes are the
    sides (rank 0 active). Otherwise even ranks are active, odd ranks passive, and only the
    edges between the two sides are used; that subgraph must still connect every worker.
    """
    n = topology.world_size
    adjacency = union_adjacency(topology, undirected=True)
    if n == 1:
        return [True], [[]]
    colour = _two_colouring(adjacency)
    active = [c == 0 for c in colour] if colour is not None else [r % 2 == 0 for r in range(n)]
    neighbours = [[j for j in np.flatnonzero(adjacency[i]).tolist() if active[j] != active[i]]
                  for i in range(n)]
    if not is_connected(neighbours):
        raise ValueError(
            f"topology {topology.name!r} with {n} workers has no usable active/passive split: "
            f"the edges between even (active) and odd (passive) ranks do not connect every "
            f"worker; use a bipartite topology such as ring with an even number of workers")
    return active, neighbours


def _two_colouring(adjacency: np.ndarray) -> list[int] | None:
    n = adjacency.shape[0]
    colour = [-1] * n
    for start in range(n):
        if colour[start] >= 0:
            continue
        colour[start] = 0
        queue = deque([start])
        while queue:
            i = queue.popleft()
            for j in np.flatnonzero(adjacency[i]).tolist():
                if colour[j] < 0:
                    colour[j] = 1 - colour[i]
                    queue.append(j)
                elif colour[j] == colour[i]:
                    return None
    return colour


__all__ = ["MixingName", "TopologyName", "bipartite_split", "build", "check_doubly_stochastic",
           "check_push_sum", "in_degrees", "messages_through", "union_adjacency"]
