"""The catalogue of communication graphs: a `Topology` says *who talks to whom* at a given step
(`out_peers` / `in_peers` / `adjacency`); `make_topology` builds one by name; connectivity
checks. Every graph is a deterministic function of its arguments, so every worker builds the
same graph locally without communicating."""

from __future__ import annotations

import math
import random
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass
from typing import Iterable, Literal, Sequence

import numpy as np




# --------------------------------------------------------------------------
# Base class
# --------------------------------------------------------------------------


class Topology(ABC):
    """A (possibly time-varying) communication graph over ``world_size`` workers.

    Subclasses implement :meth:`_out` (and optionally :meth:`_in` when a
    closed form is cheaper than scanning every worker).  The public methods
    normalise the result: indices taken modulo ``world_size``, self removed,
    duplicates removed, sorted.
    """

    name = "topology"

    def __init__(self, world_size: int, directed: bool):
        if isinstance(world_size, bool) or not isinstance(world_size, (int, np.integer)):
            raise ValueError(f"world_size must be an int, got {world_size!r}")
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = int(world_size)
        self.directed = bool(directed)

    # -- to implement -------------------------------------------------------

    @abstractmethod
    def _out(self, rank: int, step: int) -> Iterable[int]:
        """Raw out-neighbours of ``rank`` at ``step`` (``0 <= step < period``)."""

    def _in(self, rank: int, step: int) -> Iterable[int]:
        """Raw in-neighbours; the default scans all workers (O(n * degree))."""
        if not self.directed:
            return self._out(rank, step)
        return [j for j in range(self.world_size) if rank in self.out_peers(j, step)]

    # -- public API ---------------------------------------------------------

    @property
    def period(self) -> int:
        """Number of distinct steps before the graph repeats (1 if static)."""
        return 1

    @property
    def is_time_varying(self) -> bool:
        return self.period > 1

    def out_peers(self, rank: int, step: int = 0) -> list[int]:
        """Workers ``rank`` sends to at ``step`` (sorted, no self, no duplicates)."""
        self._check_rank(rank)
        return self._clean(rank, self._out(rank, step % self.period))

    def in_peers(self, rank: int, step: int = 0) -> list[int]:
        """Workers that send to ``rank`` at ``step`` (sorted, no self, no duplicates)."""
        self._check_rank(rank)
        return self._clean(rank, self._in(rank, step % self.period))

    def adjacency(self, step: int = 0) -> np.ndarray:
        """Boolean ``n x n`` matrix, ``A[i, j]`` True iff ``i`` sends to ``j``."""
        n = self.world_size
        adj = np.zeros((n, n), dtype=bool)
        for i in range(n):
            adj[i, self.out_peers(i, step)] = True
        return adj

    def out_counts(self, rank: int, step: int = 0) -> dict[int, int]:
        """How many shares ``rank`` sends each of its out-peers at ``step``: one each, except
        on a schedule that lists a peer twice in one step (:class:`HopScheduleTopology`)."""
        return dict.fromkeys(self.out_peers(rank, step), 1)

    def count_matrix(self, step: int = 0) -> np.ndarray:
        """``C[i, j]``: how many shares ``i`` sends ``j`` at ``step`` (float64; the adjacency
        matrix where no peer is listed twice)."""
        n = self.world_size
        counts = np.zeros((n, n), dtype=np.float64)
        for i in range(n):
            for peer, count in self.out_counts(i, step).items():
                counts[i, peer] = count
        return counts

    def __repr__(self) -> str:
        kind = "directed" if self.directed else "undirected"
        return f"{type(self).__name__}(world_size={self.world_size}, {kind}, period={self.period})"

    # -- helpers ------------------------------------------------------------

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} out of range for world_size {self.world_size}")

    def _clean(self, rank: int, peers: Iterable[int]) -> list[int]:
        n = self.world_size
        return sorted({int(p) % n for p in peers} - {rank})


# --------------------------------------------------------------------------
# Concrete topologies
# --------------------------------------------------------------------------


class RingTopology(Topology):
    """Ring: undirected (peers ``i-1``, ``i+1``) or directed (send to ``i+1``)."""

    name = "ring"

    def __init__(self, world_size: int, directed: bool = False):
        super().__init__(world_size, directed)

    def _out(self, rank, step):
        return [rank + 1] if self.directed else [rank - 1, rank + 1]

    def _in(self, rank, step):
        return [rank - 1] if self.directed else [rank - 1, rank + 1]


class TorusTopology(Topology):
    """2-D torus with wraparound, ``rows x cols`` the most square factorisation.

    Rank ``r`` sits at ``(r // cols, r % cols)``; ``rows <= cols``.  A prime
    ``world_size`` gives a ``1 x n`` torus, i.e. a ring.
    """

    name = "torus"

    def __init__(self, world_size: int):
        super().__init__(world_size, directed=False)
        rows = math.isqrt(self.world_size)
        while self.world_size % rows:
            rows -= 1
        self.rows = rows
        self.cols = self.world_size // rows

    def _out(self, rank, step):
        r, c = divmod(rank, self.cols)
        rows, cols = self.rows, self.cols
        return [
            ((r - 1) % rows) * cols + c,
            ((r + 1) % rows) * cols + c,
            r * cols + (c - 1) % cols,
            r * cols + (c + 1) % cols,
        ]


class CompleteTopology(Topology):
    """Every worker talks to every other worker."""

    name = "complete"

    def __init__(self, world_size: int):
        super().__init__(world_size, directed=False)

    def _out(self, rank, step):
        return range(self.world_size)


def _num_exponents(n: int) -> int:
    """Number of distinct hops ``2^k < n``, i.e. ``floor(log2(n-1)) + 1`` (0 for n=1)."""
    return (n - 1).bit_length()


class ExponentialTopology(Topology):
    """Static exponential graph: out-peers ``i + 2^k mod n`` for every ``2^k < n``.

    The undirected variant also adds the reverse edges ``i - 2^k``.
    """

    name = "exponential"

    def __init__(self, world_size: int, directed: bool = True):
        super().__init__(world_size, directed)
        self.hops = [1 << k for k in range(_num_exponents(self.world_size))]

    def _out(self, rank, step):
        fwd = [rank + h for h in self.hops]
        return fwd if self.directed else fwd + [rank - h for h in self.hops]

    def _in(self, rank, step):
        back = [rank - h for h in self.hops]
        return back if self.directed else back + [rank + h for h in self.hops]


class TimeVaryingExponentialTopology(Topology):
    """One-peer (or few-peer) exponential graph that cycles through the hops.

    With ``K`` distinct hops ``2^0 .. 2^(K-1)`` (all ``< n``), at ``step`` the
    worker sends to ``i + 2^k`` for ``k`` in
    ``{(step * peers_per_step + j) mod K : 0 <= j < peers_per_step}``.
    The period is ``K / gcd(K, peers_per_step)`` (``peers_per_step`` is capped
    at ``K``).  For ``n`` a power of two and ``peers_per_step=1``, one period
    of push-sum with weights 1/2 averages exactly.

    With one peer per step this is the SGP reference's n-peer graph with one peer
    (:class:`NPeerDynamicDirectedExponentialTopology`); with more it is not: the
    reference then hops ``j * (p + 1)^i``, this graph powers of two.
    """

    name = "time_varying_exponential"

    def __init__(self, world_size: int, peers_per_step: int = 1):
        super().__init__(world_size, directed=True)
        if isinstance(peers_per_step, bool) or not isinstance(peers_per_step, (int, np.integer)) \
                or peers_per_step < 1:
            raise ValueError(f"peers_per_step must be an int >= 1, got {peers_per_step!r}")
        self.num_exponents = _num_exponents(self.world_size)
        self.peers_per_step = min(int(peers_per_step), max(self.num_exponents, 1))

    @property
    def period(self) -> int:
        k = self.num_exponents
        return k // math.gcd(k, self.peers_per_step) if k else 1

    def hops_at(self, step: int) -> list[int]:
        """The hops ``2^k`` used at ``step`` (empty for a single worker)."""
        k = self.num_exponents
        if k == 0:
            return []
        base = (step % self.period) * self.peers_per_step
        return sorted({1 << ((base + j) % k) for j in range(self.peers_per_step)})

    def _out(self, rank, step):
        return [rank + h for h in self.hops_at(step)]

    def _in(self, rank, step):
        return [rank - h for h in self.hops_at(step)]


class HopScheduleTopology(Topology):
    """A directed circulant graph that cycles through a list of hops: the graphs of the SGP
    reference implementation (Assran, Loizou, Ballas, Rabbat, ICML 2019, "Stochastic Gradient
    Push for Distributed Deep Learning", whose code keeps the list as each worker's "phone
    book").

    Every worker has the same list of hops ``h_0, h_1, ..., h_(L-1)`` (signed: ``-2`` is two
    ranks back), repeats included. At step ``t`` worker ``i`` sends to ``i + h`` for the
    ``peers_per_step`` hops from position ``t * peers_per_step`` on, wrapping around the list,
    so the period is ``L / gcd(L, peers_per_step)``. A hop listed twice in one step sends two
    shares to that peer (:meth:`out_counts`), as the reference does; a hop that is a multiple
    of ``n`` (the worker itself, which the reference does not handle) is left out of the step.
    Subclasses give the list (:meth:`schedule`).
    """

    def __init__(self, world_size: int, peers_per_step: int = 1):
        super().__init__(world_size, directed=True)
        if isinstance(peers_per_step, bool) or not isinstance(peers_per_step, (int, np.integer)) \
                or peers_per_step < 1:
            raise ValueError(f"peers_per_step must be an int >= 1, got {peers_per_step!r}")
        self.peers_per_step = int(peers_per_step)
        self.hops = self.schedule() if self.world_size > 1 else []
        if self.peers_per_step > max(len(self.hops), 1):
            raise ValueError(
                f"{self.name} with {self.world_size} workers cycles through {len(self.hops)} "
                f"hops, so peers_per_step must be at most {len(self.hops)}, got "
                f"{self.peers_per_step}")

    @abstractmethod
    def schedule(self) -> list[int]:
        """The signed hops, in the order the steps use them (``world_size`` >= 2)."""

    @property
    def period(self) -> int:
        length = len(self.hops)
        return length // math.gcd(length, self.peers_per_step) if length else 1

    def hops_at(self, step: int) -> list[int]:
        """The hops used at ``step``, in schedule order, repeats included."""
        if not self.hops:
            return []
        start = (step % self.period) * self.peers_per_step
        return [self.hops[(start + j) % len(self.hops)] for j in range(self.peers_per_step)]

    def _out(self, rank, step):
        return [rank + hop for hop in self.hops_at(step)]

    def _in(self, rank, step):
        return [rank - hop for hop in self.hops_at(step)]

    def out_counts(self, rank: int, step: int = 0) -> dict[int, int]:
        self._check_rank(rank)
        n = self.world_size
        counts: dict[int, int] = {}
        for hop in self.hops_at(step):
            if hop % n:
                peer = (rank + hop) % n
                counts[peer] = counts.get(peer, 0) + 1
        return dict(sorted(counts.items()))


def _powers(base: int, limit: int) -> list[int]:
    """``base^0, base^1, ...`` up to and including ``limit`` (exact integers, no logarithms)."""
    powers, power = [], 1
    while power <= limit:
        powers.append(power)
        power *= base
    return powers


def _both_ways(hops: Iterable[int]) -> list[int]:
    """Each hop forward, then the same hop backward: ``[h0, -h0, h1, -h1, ...]``."""
    return [signed for hop in hops for signed in (hop, -hop)]


class DynamicDirectedExponentialTopology(HopScheduleTopology):
    """The SGP reference's directed exponential graph (its graph_type 0, used by its job
    scripts): hops ``+1, -1, +2, -2, +4, -4, ...`` for every ``2^k <= n - 1``, one per step by
    default. Repeats are kept: with 2 workers ``+1`` and ``-1`` are the same peer, and the
    period is still 2."""

    name = "dynamic_directed_exponential"

    def schedule(self):
        return _both_ways(_powers(2, self.world_size - 1))


class NPeerDynamicDirectedExponentialTopology(HopScheduleTopology):
    """The SGP reference's n-peer exponential graph (its default): with ``p`` peers per step,
    forward hops ``j * (p + 1)^i`` for ``j = 1..p`` and every ``(p + 1)^i <= n - 1``, listed
    ``i`` by ``i``, so step ``t`` uses the ``p`` hops of ``i = t mod (number of powers)``.
    With 8 workers and 2 peers: ``{1, 2}``, then ``{3, 6}``. With one peer it is
    ``time_varying_exponential``. ``peers_per_step`` is at most ``n - 1``."""

    name = "npeer_dynamic_directed_exponential"

    def schedule(self):
        p, n = self.peers_per_step, self.world_size
        if p > n - 1:
            raise ValueError(f"{self.name} with {n} workers takes peers_per_step at most {n - 1}, "
                             f"got {p}")
        return [j * power for power in _powers(p + 1, n - 1) for j in range(1, p + 1)]


def _check_even(topology: Topology) -> None:
    n = topology.world_size
    if n % 2:
        raise ValueError(f"{topology.name} needs an even number of workers (even ranks on one "
                         f"side, odd ranks on the other), got {n}")


def _crossing(hops: list[int]) -> list[int]:
    """The hops that join the even and the odd ranks: the odd ones, for an even ``n``."""
    return [hop for hop in hops if hop % 2]


class DynamicBipartiteExponentialTopology(HopScheduleTopology):
    """The SGP reference's bipartite exponential graph (its graph_type 1): even ranks on one
    side, odd ranks on the other, hops ``±1`` then ``±(1 + 2^k)`` for ``k >= 1`` and
    ``2^k <= n - 1`` (odd, so each joins the two sides). Needs an even number of workers."""

    name = "dynamic_bipartite_exponential"

    def schedule(self):
        _check_even(self)
        powers = _powers(2, self.world_size - 1)
        return _crossing(_both_ways([1] + [1 + power for power in powers[1:]]))


class DynamicDirectedLinearTopology(HopScheduleTopology):
    """The SGP reference's directed linear graph (its graph_type 2): hops ``±1, ±3, ±5, ...``,
    every odd hop below ``n``, forward then backward."""

    name = "dynamic_directed_linear"

    def schedule(self):
        return _both_ways(range(1, self.world_size, 2))


class DynamicBipartiteLinearTopology(HopScheduleTopology):
    """The SGP reference's bipartite linear graph (its graph_type 3): of the hops ``±1, ±2,
    ..., ±(n - 1)``, those that join the even and the odd ranks. Needs an even number of
    workers; it then has the schedule of ``dynamic_directed_linear``."""

    name = "dynamic_bipartite_linear"

    def schedule(self):
        _check_even(self)
        return _crossing(_both_ways(range(1, self.world_size)))


class HypercubeTopology(Topology):
    """Hypercube: peers ``i XOR 2^k``; ``world_size`` must be a power of two."""

    name = "hypercube"

    def __init__(self, world_size: int):
        super().__init__(world_size, directed=False)
        n = self.world_size
        if n & (n - 1):
            raise ValueError(
                f"hypercube topology needs world_size to be a power of 2, got {n}"
            )
        self.dim = n.bit_length() - 1

    def _out(self, rank, step):
        return [rank ^ (1 << k) for k in range(self.dim)]


class RandomRegularTopology(Topology):
    """Seeded, connected, undirected ``degree``-regular graph.

    A deterministic function of ``(world_size, degree, seed)``: every worker
    builds the same graph.  Built by random stub matching (retrying with
    derived seeds until simple and connected); degree 2 is a random
    Hamiltonian cycle, and dense requests are built as the complement of a
    sparse one.
    """

    name = "random_regular"
    max_attempts = 1000

    def __init__(self, world_size: int, degree: int | None = None, seed: int = 0):
        super().__init__(world_size, directed=False)
        n = self.world_size
        if degree is None:
            degree = min(3, n - 1)
        if isinstance(degree, bool) or not isinstance(degree, (int, np.integer)):
            raise ValueError(f"random_regular degree must be an int, got {degree!r}")
        degree = int(degree)
        if not 0 <= degree < n:
            raise ValueError(
                f"random_regular needs 0 <= degree < world_size, got degree={degree} "
                f"with world_size={n}"
            )
        if (n * degree) % 2:
            raise ValueError(
                f"random_regular needs world_size * degree to be even, got "
                f"world_size={n}, degree={degree}"
            )
        if (n > 1 and degree == 0) or (n > 2 and degree == 1):
            raise ValueError(
                f"no connected {degree}-regular graph on {n} workers; use degree >= 2"
            )
        self.degree = degree
        self.seed = seed
        self._peers = self._build()

    def _out(self, rank, step):
        return self._peers[rank]

    def _build(self) -> list[list[int]]:
        n, d = self.world_size, self.degree
        for attempt in range(self.max_attempts):
            # String seeds are hashed with SHA-512 by `random`, independent of
            # PYTHONHASHSEED, so every process derives the same stream.
            rng = random.Random(f"random_regular:{n}:{d}:{self.seed}:{attempt}")
            if 2 * d > n - 1:  # dense: build the sparse complement instead
                sparse = _random_regular(n, n - 1 - d, rng)
                adj = None if sparse is None else [set(range(n)) - {v} - sparse[v] for v in range(n)]
            else:
                adj = _random_regular(n, d, rng)
            if adj is not None and is_connected(adj):
                return [sorted(s) for s in adj]
        raise RuntimeError(  # pragma: no cover - astronomically unlikely
            f"could not build a connected {d}-regular graph on {n} nodes "
            f"in {self.max_attempts} attempts"
        )


def _random_regular(n: int, d: int, rng: random.Random) -> list[set[int]] | None:
    """A random simple d-regular graph as adjacency sets, or None on a dead end."""
    adj: list[set[int]] = [set() for _ in range(n)]
    if d == 0:
        return adj
    if d == 2:
        order = list(range(n))
        rng.shuffle(order)
        for a, b in zip(order, order[1:] + order[:1]):
            adj[a].add(b)
            adj[b].add(a)
        return adj
    # Stub matching: pair random free stubs, skipping self-loops and repeated
    # edges; when random picks keep failing, check whether any valid pair is
    # left at all and give up on this attempt if not.
    stubs = [v for v in range(n) for _ in range(d)]
    while stubs:
        m = len(stubs)
        for _ in range(64):
            a = rng.randrange(m)
            b = rng.randrange(m - 1)
            b += b >= a
            u, v = stubs[a], stubs[b]
            if u != v and v not in adj[u]:
                break
        else:
            left = sorted(set(stubs))
            if not any(v not in adj[u] for i, u in enumerate(left) for v in left[i + 1:]):
                return None
            continue
        adj[u].add(v)
        adj[v].add(u)
        for idx in sorted((a, b), reverse=True):  # swap-remove, larger index first
            stubs[idx] = stubs[-1]
            stubs.pop()
    return adj


class CustomTopology(Topology):
    """A topology given by explicit adjacency matrices (``A[i, j]``: i sends to j).

    Pass one matrix for a static graph or a sequence for a time-varying one
    (step ``s`` uses ``matrices[s % len(matrices)]``).  ``directed`` defaults to
    whether any matrix is asymmetric.  Useful for tests and experiments.
    """

    name = "custom"

    def __init__(self, adjacency, directed: bool | None = None):
        arr = np.asarray(adjacency)
        mats = [arr] if arr.ndim == 2 else list(arr) if arr.ndim == 3 else None
        if not mats:
            raise ValueError("CustomTopology needs an n x n matrix or a non-empty sequence of them")
        mats = [np.asarray(m).astype(bool) for m in mats]
        n = mats[0].shape[0]
        for m in mats:
            if m.shape != (n, n):
                raise ValueError(f"adjacency matrices must all be {n} x {n}, got {m.shape}")
            if m.diagonal().any():
                raise ValueError("adjacency matrices must not have self-loops")
        if directed is None:
            directed = any((m != m.T).any() for m in mats)
        super().__init__(n, directed)
        self._mats = mats

    @property
    def period(self) -> int:
        return len(self._mats)

    def _out(self, rank, step):
        return np.flatnonzero(self._mats[step][rank]).tolist()

    def _in(self, rank, step):
        return np.flatnonzero(self._mats[step][:, rank]).tolist()

    def adjacency(self, step: int = 0) -> np.ndarray:
        return self._mats[step % self.period].copy()


# --------------------------------------------------------------------------
# Factory
# --------------------------------------------------------------------------

@dataclass(frozen=True)
class TopologyKind:
    """A built-in topology as :func:`make_topology` builds it."""

    cls: type[Topology]
    directions: tuple[bool, ...]  # the variants it has (True: directed), its default first
    takes: tuple[str, ...] = ()   # make_topology's keyword arguments the class is given

    @property
    def seeded(self) -> bool:
        """Whether the graph depends on the seed (the same seed gives the same graph)."""
        return "seed" in self.takes


# The one table of built-in topologies: the names a spec may use, their classes and variants.
TOPOLOGY_KINDS: dict[str, TopologyKind] = {
    "ring": TopologyKind(RingTopology, directions=(False, True), takes=("directed",)),
    "torus": TopologyKind(TorusTopology, directions=(False,)),
    "complete": TopologyKind(CompleteTopology, directions=(False,)),
    "exponential": TopologyKind(ExponentialTopology, directions=(True, False),
                                takes=("directed",)),
    "time_varying_exponential": TopologyKind(TimeVaryingExponentialTopology, directions=(True,),
                                             takes=("peers_per_step",)),
    "hypercube": TopologyKind(HypercubeTopology, directions=(False,)),
    "random_regular": TopologyKind(RandomRegularTopology, directions=(False,),
                                   takes=("degree", "seed")),
    # The SGP reference implementation's graphs (Assran et al., ICML 2019), named after it.
    "dynamic_directed_exponential": TopologyKind(DynamicDirectedExponentialTopology,
                                                 directions=(True,), takes=("peers_per_step",)),
    "npeer_dynamic_directed_exponential": TopologyKind(NPeerDynamicDirectedExponentialTopology,
                                                       directions=(True,),
                                                       takes=("peers_per_step",)),
    "dynamic_bipartite_exponential": TopologyKind(DynamicBipartiteExponentialTopology,
                                                  directions=(True,), takes=("peers_per_step",)),
    "dynamic_directed_linear": TopologyKind(DynamicDirectedLinearTopology, directions=(True,),
                                            takes=("peers_per_step",)),
    "dynamic_bipartite_linear": TopologyKind(DynamicBipartiteLinearTopology, directions=(True,),
                                             takes=("peers_per_step",)),
}
TOPOLOGIES = tuple(TOPOLOGY_KINDS)
TopologyName = Literal[TOPOLOGIES]  # a plugin option's type: one of TOPOLOGIES


def topology_kind(name: str) -> TopologyKind:
    """The table's entry for ``name`` (case-insensitive, ``-`` accepted for ``_``); ValueError
    naming the known topologies if there is none."""
    kind = TOPOLOGY_KINDS.get(str(name).strip().lower().replace("-", "_"))
    if kind is None:
        raise ValueError(f"unknown topology {name!r}; known topologies: {', '.join(TOPOLOGIES)}")
    return kind


def make_topology(
    name: str,
    world_size: int,
    *,
    directed: bool | None = None,
    seed: int = 0,
    peers_per_step: int = 1,
    degree: int | None = None,
) -> Topology:
    """Build a topology by name (one of :data:`TOPOLOGIES`).

    ``directed=None`` picks each topology's default, the first of its
    directions in :data:`TOPOLOGY_KINDS`: ``ring`` undirected, ``exponential``
    and ``time_varying_exponential`` directed.  Asking for a
    direction a topology does not support raises ValueError.  Arguments that a
    topology does not use (``seed``, ``peers_per_step``, ``degree``) are
    ignored.  Names are case-insensitive and ``-`` is accepted for ``_``.
    """
    kind = topology_kind(name)
    default = kind.directions[0]
    if directed is not None and bool(directed) not in kind.directions:
        both = [other for other, k in TOPOLOGY_KINDS.items() if len(k.directions) == 2]
        raise ValueError(
            f"topology {kind.cls.name!r} is {'directed' if default else 'undirected'} only; leave "
            f"directed unset or {default} (topologies with both variants: {', '.join(both)})"
        )
    arguments = {"directed": default if directed is None else bool(directed), "seed": seed,
                 "peers_per_step": peers_per_step, "degree": degree}
    return kind.cls(world_size, **{argument: arguments[argument] for argument in kind.takes})


# --------------------------------------------------------------------------
# Connectivity
# --------------------------------------------------------------------------


def is_connected(neighbours: Sequence[Iterable[int]]) -> bool:
    """Whether worker 0 reaches every worker, ``neighbours[i]`` being the workers ``i`` has
    an edge to.  For an undirected graph: whether it is connected."""
    seen = {0}
    queue = deque([0])
    while queue:
        for v in neighbours[queue.popleft()]:
            if v not in seen:
                seen.add(v)
                queue.append(v)
    return len(seen) == len(neighbours)


def is_strongly_connected(graph: Topology | np.ndarray, step: int = 0) -> bool:
    """Whether every worker can reach every other along the edges of ``graph``: a topology
    at ``step``, or a boolean adjacency matrix (``A[i, j]``: ``i`` sends to ``j``)."""
    adj = graph.adjacency(step) if isinstance(graph, Topology) else np.asarray(graph, dtype=bool)
    fwd = [np.flatnonzero(row).tolist() for row in adj]
    back = [np.flatnonzero(col).tolist() for col in adj.T]
    return is_connected(fwd) and is_connected(back)
