"""Communication graphs and mixing weights for decentralized (gossip) SGD.

Two separate concerns, in two modules (`graphs`, `mixing`):

* a :class:`Topology` says *who talks to whom* at a given step
  (``out_peers`` / ``in_peers`` / ``adjacency``);
* the mixing functions say *with what weights* values are combined
  (:func:`mixing_matrix` for pull-style averaging as in D-PSGD,
  :func:`push_weights` / :func:`push_matrix` for push-sum as in SGP/OSGP).

Conventions used throughout:

* ``A = topology.adjacency(step)``: ``A[i, j]`` is True iff worker ``i`` sends
  to worker ``j``.  Self-loops are never present.
* ``W = mixing_matrix(...)``: ``W[i, j]`` is the weight worker ``i`` gives to
  the value it holds from worker ``j``; one gossip round is ``x <- W @ x``.
* ``P = push_matrix(...)``: ``P[j, i]`` is the share worker ``i`` sends to
  ``j`` (``P[i, i]`` is what it keeps); one push-sum round is ``x <- P @ x``.
  Columns of ``P`` sum to 1.
* Steps are taken modulo ``topology.period``; static graphs have period 1.

Everything here is a deterministic function of its arguments, so every worker
can build the same graph locally without communicating.  Only NumPy is used.
"""

from dsgd_cli.topology.graphs import (  # noqa: F401
    TOPOLOGIES, TOPOLOGY_KINDS, CompleteTopology, CustomTopology,
    DynamicBipartiteExponentialTopology, DynamicBipartiteLinearTopology,
    DynamicDirectedExponentialTopology, DynamicDirectedLinearTopology, ExponentialTopology,
    HopScheduleTopology, HypercubeTopology, NPeerDynamicDirectedExponentialTopology,
    RandomRegularTopology, RingTopology, TimeVaryingExponentialTopology, Topology, TopologyKind,
    TopologyName, TorusTopology, is_connected, is_strongly_connected, make_topology,
    topology_kind)
from dsgd_cli.topology.mixing import (MIXINGS, MixingName, mixing_matrix, mixing_product, push_matrix,  # noqa: F401
                                      push_weights, spectral_gap)

__all__ = [
    "TOPOLOGY_KINDS",
    "TOPOLOGIES",
    "MIXINGS",
    "TopologyKind",
    "TopologyName",
    "MixingName",
    "Topology",
    "RingTopology",
    "TorusTopology",
    "CompleteTopology",
    "ExponentialTopology",
    "TimeVaryingExponentialTopology",
    "HopScheduleTopology",
    "DynamicDirectedExponentialTopology",
    "NPeerDynamicDirectedExponentialTopology",
    "DynamicBipartiteExponentialTopology",
    "DynamicDirectedLinearTopology",
    "DynamicBipartiteLinearTopology",
    "HypercubeTopology",
    "RandomRegularTopology",
    "CustomTopology",
    "topology_kind",
    "make_topology",
    "mixing_matrix",
    "push_weights",
    "push_matrix",
    "mixing_product",
    "spectral_gap",
    "is_connected",
    "is_strongly_connected",
]
