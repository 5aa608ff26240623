"""Mixing weights over a communication graph: *with what weights* values are combined
(`mixing_matrix` for pull-style averaging as in D-PSGD, `push_weights` / `push_matrix` for
push-sum as in SGP/OSGP), products of rounds and the spectral gap."""

from __future__ import annotations

from typing import Literal

import numpy as np

from dsgd_cli.topology.graphs import Topology

MIXINGS = ("uniform", "metropolis")
MixingName = Literal[MIXINGS]  # a plugin option's type: one of MIXINGS


# --------------------------------------------------------------------------
# Mixing weights
# --------------------------------------------------------------------------


def mixing_matrix(topology: Topology, step: int = 0, scheme: str = "uniform") -> np.ndarray:
    """Pull-style mixing matrix ``W`` (float64, ``n x n``) for one gossip round.

    ``W[i, j]`` is the weight worker ``i`` gives to the value from ``j``;
    worker ``i`` computes ``x_i <- sum_j W[i, j] x_j`` over itself and its
    in-peers.

    * ``uniform``: ``1 / (in_degree_i + 1)`` on itself and each in-peer.
      Always row stochastic; doubly stochastic when every worker has the same
      in- and out-degree (all built-in topologies).  A peer that sends two
      shares in a step (:meth:`Topology.out_counts`) counts twice.
    * ``metropolis``: ``W[i, j] = 1 / (1 + max(deg_i, deg_j))`` for neighbours,
      ``W[i, i] = 1 - sum``; symmetric and doubly stochastic on any undirected
      graph.  Raises ValueError if the graph at ``step`` is not symmetric.
    """
    adj = topology.adjacency(step)
    n = adj.shape[0]
    if scheme == "uniform":
        incoming = topology.count_matrix(step).T  # incoming[i, j]: shares j sends to i
        w = incoming + np.eye(n)
        return w / w.sum(axis=1, keepdims=True)
    if scheme == "metropolis":
        if (adj != adj.T).any():
            raise ValueError(
                f"metropolis weights need an undirected graph; {topology!r} has one-way "
                f"edges at step {step} (use 'uniform' or push-sum weights)"
            )
        deg = adj.sum(axis=1)
        w = np.where(adj, 1.0 / (1.0 + np.maximum.outer(deg, deg)), 0.0)
        np.fill_diagonal(w, 1.0 - w.sum(axis=1))
        return w
    raise ValueError(f"unknown mixing scheme {scheme!r}; known schemes: {', '.join(MIXINGS)}")


def push_weights(topology: Topology, rank: int, step: int = 0) -> dict[int, float]:
    """Push-sum shares of worker ``rank`` at ``step``: ``{rank: keep, peer: share, ...}``.

    Uniform ``1 / (out_degree + 1)`` for itself and each out-peer; sums to 1.  A peer
    listed twice in the step (:meth:`Topology.out_counts`) gets two shares.
    """
    counts = topology.out_counts(rank, step)
    share = 1.0 / (sum(counts.values()) + 1)
    weights = {rank: share}
    weights.update((peer, count * share) for peer, count in counts.items())
    return weights


def push_matrix(topology: Topology, step: int = 0) -> np.ndarray:
    """Column-stochastic ``P`` with ``P[j, i]`` = share worker ``i`` sends to ``j``."""
    n = topology.world_size
    p = np.zeros((n, n), dtype=np.float64)
    for i in range(n):
        for j, share in push_weights(topology, i, step).items():
            p[j, i] = share
    return p


def mixing_product(
    topology: Topology, scheme_or_push: str, steps: int | None = None, start: int = 0
) -> np.ndarray:
    """Product ``M_{start+steps-1} @ ... @ M_start`` of per-step matrices.

    ``scheme_or_push`` is a name from :data:`MIXINGS` or ``"push"``.  ``steps``
    defaults to one period, so the result is the effect of one full cycle of a
    time-varying graph on ``x`` (``x <- M x``).
    """
    if steps is None:
        steps = topology.period
    out = np.eye(topology.world_size)
    for s in range(start, start + steps):
        if scheme_or_push == "push":
            m = push_matrix(topology, s)
        else:
            m = mixing_matrix(topology, s, scheme_or_push)
        out = m @ out
    return out


def spectral_gap(w: np.ndarray) -> float:
    """``1 - |lambda_2|``: one minus the second-largest eigenvalue modulus of ``w``.

    Larger is faster mixing; 0 means no consensus (e.g. a disconnected graph).
    A 1 x 1 matrix has gap 1.
    """
    w = np.asarray(w, dtype=np.float64)
    if w.shape[0] < 2:
        return 1.0
    moduli = np.sort(np.abs(np.linalg.eigvals(w)))[::-1]
    return float(1.0 - moduli[1])
