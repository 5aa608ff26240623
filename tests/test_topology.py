"""Tests for dsgd_cli.topology: graphs, mixing weights and their spectral properties."""

import math
import os
import subprocess
import sys

import numpy as np
import pytest


from dsgd_cli.topology import (
    MIXINGS,
    TOPOLOGIES,
    TOPOLOGY_KINDS,
    CustomTopology,
    Topology,
    TorusTopology,
    TimeVaryingExponentialTopology,
    is_strongly_connected,
    make_topology,
    mixing_matrix,
    mixing_product,
    push_matrix,
    push_weights,
    spectral_gap,
)

SIZES = (1, 2, 3, 4, 5, 8, 16)
REFERENCE_GRAPHS = ("dynamic_directed_exponential", "npeer_dynamic_directed_exponential",
                    "dynamic_bipartite_exponential", "dynamic_directed_linear",
                    "dynamic_bipartite_linear")


def _valid_sizes(name):
    if name == "hypercube":
        return [n for n in SIZES if n & (n - 1) == 0]
    if name == "random_regular":  # default degree min(3, n-1) needs n*d even
        return [n for n in SIZES if (n * min(3, n - 1)) % 2 == 0]
    if "bipartite" in name:
        return [n for n in SIZES if n == 1 or n % 2 == 0]
    return list(SIZES)


def _variants():
    """(label, topology) for every topology/direction/size combination built in."""
    out = []
    for name in TOPOLOGIES:
        for n in _valid_sizes(name):
            directions = [None]
            if name in ("ring", "exponential"):
                directions = [False, True]
            for d in directions:
                out.append((f"{name}-n{n}-d{d}", make_topology(name, n, directed=d)))
    out.append(("tv-exp-pps2-n16", make_topology("time_varying_exponential", 16, peers_per_step=2)))
    out.append(("tv-exp-pps2-n8", make_topology("time_varying_exponential", 8, peers_per_step=2)))
    for name in REFERENCE_GRAPHS:  # two peers per step: repeated peers and (n=6) a self-hop
        for n in (4, 6, 8):
            out.append((f"{name}-pps2-n{n}", make_topology(name, n, peers_per_step=2)))
    out.append(("rr-n10-d2", make_topology("random_regular", 10, degree=2, seed=3)))
    out.append(("rr-n8-d5", make_topology("random_regular", 8, degree=5, seed=1)))
    return out


VARIANTS = _variants()
VARIANT_IDS = [label for label, _ in VARIANTS]
ALL_TOPOS = [t for _, t in VARIANTS]
UNDIRECTED = [t for t in ALL_TOPOS if not t.directed]
UNDIRECTED_IDS = [label for label, t in VARIANTS if not t.directed]
DIRECTED = [t for t in ALL_TOPOS if t.directed]
DIRECTED_IDS = [label for label, t in VARIANTS if t.directed]


def _reachable_all(adj):
    """Independent connectivity check: boolean transitive closure from the identity."""
    n = adj.shape[0]
    reach = np.eye(n, dtype=bool)
    for _ in range(n):
        reach = reach | ((reach.astype(int) @ adj.astype(int)) > 0)
    return bool(reach.all())


def _peer_table(topo, step=0):
    return [topo.out_peers(i, step) for i in range(topo.world_size)]


# ---------------------------------------------------------------------------
# Peer sets of each topology
# ---------------------------------------------------------------------------


def test_names():
    assert TOPOLOGIES == (
        "ring", "torus", "complete", "exponential",
        "time_varying_exponential", "hypercube", "random_regular", *REFERENCE_GRAPHS,
    )
    assert MIXINGS == ("uniform", "metropolis")


@pytest.mark.parametrize("directed", [False, True])
def test_single_worker_has_no_peers(directed):
    for name in TOPOLOGIES:
        d = directed if name in ("ring", "exponential") else None
        t = make_topology(name, 1, directed=d)
        assert t.out_peers(0) == [] and t.in_peers(0) == []
        assert not t.adjacency(0).any()


def test_ring_undirected():
    assert _peer_table(make_topology("ring", 2)) == [[1], [0]]
    assert _peer_table(make_topology("ring", 3)) == [[1, 2], [0, 2], [0, 1]]
    t = make_topology("ring", 5)
    assert not t.directed and t.period == 1 and not t.is_time_varying
    assert _peer_table(t) == [[1, 4], [0, 2], [1, 3], [2, 4], [0, 3]]
    t16 = make_topology("ring", 16, directed=False)
    assert all(len(p) == 2 for p in _peer_table(t16))


def test_ring_directed():
    t = make_topology("ring", 5, directed=True)
    assert t.directed
    assert _peer_table(t) == [[1], [2], [3], [4], [0]]
    assert [t.in_peers(i) for i in range(5)] == [[4], [0], [1], [2], [3]]
    t2 = make_topology("ring", 2, directed=True)
    assert _peer_table(t2) == [[1], [0]]


@pytest.mark.parametrize(
    "n,rows,cols", [(1, 1, 1), (2, 1, 2), (3, 1, 3), (4, 2, 2), (5, 1, 5), (6, 2, 3),
                    (8, 2, 4), (12, 3, 4), (16, 4, 4), (18, 3, 6)]
)
def test_torus_shape(n, rows, cols):
    t = make_topology("torus", n)
    assert isinstance(t, TorusTopology)
    assert (t.rows, t.cols) == (rows, cols)
    assert not t.directed


def test_torus_peers():
    t16 = make_topology("torus", 16)  # 4x4
    assert t16.out_peers(5) == [1, 4, 6, 9]
    assert t16.out_peers(0) == [1, 3, 4, 12]
    assert all(len(p) == 4 for p in _peer_table(t16))
    t12 = make_topology("torus", 12)  # 3x4
    assert t12.out_peers(0) == [1, 3, 4, 8]
    t8 = make_topology("torus", 8)  # 2x4: up == down, deduplicated
    assert t8.out_peers(0) == [1, 3, 4]
    assert all(len(p) == 3 for p in _peer_table(t8))
    t4 = make_topology("torus", 4)  # 2x2
    assert _peer_table(t4) == [[1, 2], [0, 3], [0, 3], [1, 2]]
    t5 = make_topology("torus", 5)  # prime: 1x5, a ring
    assert _peer_table(t5) == _peer_table(make_topology("ring", 5))
    assert _peer_table(make_topology("torus", 2)) == [[1], [0]]


@pytest.mark.parametrize("n", SIZES)
def test_complete(n):
    t = make_topology("complete", n)
    for i in range(n):
        assert t.out_peers(i) == [j for j in range(n) if j != i]
    assert not t.directed


def test_exponential_directed():
    t = make_topology("exponential", 16)
    assert t.directed  # default
    assert t.out_peers(0) == [1, 2, 4, 8]
    assert t.out_peers(3) == [4, 5, 7, 11]
    assert t.in_peers(0) == [8, 12, 14, 15]
    t5 = make_topology("exponential", 5)
    assert t5.out_peers(0) == [1, 2, 4]
    assert t5.out_peers(3) == [0, 2, 4]
    assert make_topology("exponential", 8).out_peers(0) == [1, 2, 4]
    assert make_topology("exponential", 3).out_peers(0) == [1, 2]
    assert _peer_table(make_topology("exponential", 2)) == [[1], [0]]
    for n in (3, 4, 5, 8, 16):
        degrees = {len(p) for p in _peer_table(make_topology("exponential", n))}
        assert degrees == {math.floor(math.log2(n - 1)) + 1}


def test_exponential_undirected():
    t = make_topology("exponential", 16, directed=False)
    assert not t.directed
    assert t.out_peers(0) == [1, 2, 4, 8, 12, 14, 15]
    assert t.in_peers(0) == t.out_peers(0)
    assert make_topology("exponential", 8, directed=False).out_peers(0) == [1, 2, 4, 6, 7]
    assert make_topology("exponential", 5, directed=False).out_peers(0) == [1, 2, 3, 4]
    assert _peer_table(make_topology("exponential", 2, directed=False)) == [[1], [0]]


def test_time_varying_exponential_peers_and_period():
    t = make_topology("time_varying_exponential", 8)
    assert t.directed and t.is_time_varying and t.period == 3
    assert [t.out_peers(0, s) for s in range(7)] == [[1], [2], [4], [1], [2], [4], [1]]
    assert [t.in_peers(0, s) for s in range(3)] == [[7], [6], [4]]
    assert t.out_peers(6, 2) == [2]
    t16 = make_topology("time_varying_exponential", 16)
    assert t16.period == 4
    assert [t16.out_peers(3, s) for s in range(4)] == [[4], [5], [7], [11]]
    t5 = make_topology("time_varying_exponential", 5)  # hops 1, 2, 4
    assert t5.period == 3 and t5.out_peers(0, 2) == [4]
    t2 = make_topology("time_varying_exponential", 2)
    assert t2.period == 1 and not t2.is_time_varying and t2.out_peers(0, 5) == [1]
    t1 = make_topology("time_varying_exponential", 1)
    assert t1.period == 1 and t1.out_peers(0, 3) == []


def test_time_varying_exponential_peers_per_step():
    t = make_topology("time_varying_exponential", 16, peers_per_step=2)
    assert t.period == 2
    assert [t.out_peers(0, s) for s in range(4)] == [[1, 2], [4, 8], [1, 2], [4, 8]]
    t8 = make_topology("time_varying_exponential", 8, peers_per_step=2)
    assert t8.period == 3
    assert [t8.out_peers(0, s) for s in range(3)] == [[1, 2], [1, 4], [2, 4]]
    t3 = make_topology("time_varying_exponential", 16, peers_per_step=3)
    assert t3.period == 4
    assert t3.out_peers(0, 1) == [1, 2, 8]
    tall = make_topology("time_varying_exponential", 16, peers_per_step=10)  # capped at 4
    assert tall.period == 1 and tall.out_peers(0) == [1, 2, 4, 8]
    with pytest.raises(ValueError, match="peers_per_step"):
        TimeVaryingExponentialTopology(8, peers_per_step=0)


@pytest.mark.parametrize("n", [4, 5, 8, 16])
def test_time_varying_exponential_cycles(n):
    t = make_topology("time_varying_exponential", n)
    p = t.period
    assert p == (n - 1).bit_length()
    mats = [t.adjacency(s) for s in range(p)]
    for s in range(3 * p):
        assert np.array_equal(t.adjacency(s), mats[s % p])
    for a in range(p):  # distinct within one period
        for b in range(a + 1, p):
            assert not np.array_equal(mats[a], mats[b])
    # The union over one period is the static exponential graph.
    assert np.array_equal(np.logical_or.reduce(mats), make_topology("exponential", n).adjacency())


def test_hypercube():
    t = make_topology("hypercube", 8)
    assert not t.directed
    assert t.out_peers(5) == [1, 4, 7]
    assert make_topology("hypercube", 16).out_peers(0) == [1, 2, 4, 8]
    assert _peer_table(make_topology("hypercube", 2)) == [[1], [0]]
    assert _peer_table(make_topology("hypercube", 4)) == [[1, 2], [0, 3], [0, 3], [1, 2]]
    for n in (2, 4, 8, 16):
        assert {len(p) for p in _peer_table(make_topology("hypercube", n))} == {int(math.log2(n))}


@pytest.mark.parametrize("n", [3, 5, 6, 12])
def test_hypercube_rejects_non_power_of_two(n):
    with pytest.raises(ValueError, match="power of 2"):
        make_topology("hypercube", n)


# ---------------------------------------------------------------------------
# Random regular
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "n,degree,expected_degree",
    [(2, None, 1), (3, None, 2), (4, None, 3), (8, None, 3), (16, None, 3),
     (10, 2, 2), (8, 5, 5), (5, 4, 4), (16, 6, 6), (64, 6, 6), (12, 10, 10)],
)
def test_random_regular_is_regular_and_connected(n, degree, expected_degree):
    t = make_topology("random_regular", n, degree=degree, seed=7)
    adj = t.adjacency()
    assert not t.directed
    assert np.array_equal(adj, adj.T)
    assert not adj.diagonal().any()
    assert set(adj.sum(axis=1).tolist()) == {expected_degree}
    assert _reachable_all(adj)


def test_random_regular_deterministic_and_seed_dependent():
    a = make_topology("random_regular", 16, seed=0).adjacency()
    b = make_topology("random_regular", 16, seed=0).adjacency()
    c = make_topology("random_regular", 16, seed=1).adjacency()
    assert np.array_equal(a, b)
    assert not np.array_equal(a, c)
    d1 = make_topology("random_regular", 16, degree=4, seed=5).adjacency()
    d2 = make_topology("random_regular", 16, degree=4, seed=5).adjacency()
    assert np.array_equal(d1, d2)


def test_random_regular_same_graph_in_another_process():
    """Workers are separate processes (with their own hash seeds): same graph."""
    code = (
        "from dsgd_cli.topology import make_topology;"
        "t = make_topology('random_regular', 16, degree=3, seed=11);"
        "print([t.out_peers(i) for i in range(16)])"
    )
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", code], env=env,
                         capture_output=True, text=True, check=True).stdout.strip()
    local = make_topology("random_regular", 16, degree=3, seed=11)
    assert out == str([local.out_peers(i) for i in range(16)])


def test_random_regular_retries_until_connected(monkeypatch):
    """A disconnected draw (two K4s) must be rejected and another seed tried."""
    import dsgd_cli.topology.graphs as topology

    real = topology._random_regular
    calls = []

    def first_draw_disconnected(n, d, rng):
        calls.append(n)
        if len(calls) == 1:
            return [set(range(4)) - {v} if v < 4 else set(range(4, 8)) - {v} for v in range(8)]
        return real(n, d, rng)

    monkeypatch.setattr(topology, "_random_regular", first_draw_disconnected)
    t = make_topology("random_regular", 8, degree=3, seed=0)
    assert len(calls) >= 2
    assert _reachable_all(t.adjacency())
    assert set(t.adjacency().sum(axis=1).tolist()) == {3}


@pytest.mark.parametrize(
    "n,degree,match",
    [(5, 3, "even"), (4, 4, "degree < world_size"), (4, 7, "degree < world_size"),
     (4, 1, "connected"), (3, 0, "connected"), (4, -1, "degree")],
)
def test_random_regular_rejects_bad_degree(n, degree, match):
    with pytest.raises(ValueError, match=match):
        make_topology("random_regular", n, degree=degree)


def test_random_regular_default_degree_odd_n_rejected():
    with pytest.raises(ValueError, match="even"):
        make_topology("random_regular", 5)  # default degree 3, 5*3 odd


# ---------------------------------------------------------------------------
# Generic invariants over every topology
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("topo", ALL_TOPOS, ids=VARIANT_IDS)
def test_peer_lists_clean_and_consistent(topo):
    n = topo.world_size
    for step in range(max(topo.period, 1) + 1):
        outs = [topo.out_peers(i, step) for i in range(n)]
        ins = [topo.in_peers(i, step) for i in range(n)]
        adj = topo.adjacency(step)
        assert adj.dtype == bool and adj.shape == (n, n)
        for i in range(n):
            for peers in (outs[i], ins[i]):
                assert peers == sorted(set(peers))
                assert i not in peers
                assert all(0 <= p < n for p in peers)
            assert outs[i] == np.flatnonzero(adj[i]).tolist()
            assert ins[i] == np.flatnonzero(adj[:, i]).tolist()
            assert ins[i] == [j for j in range(n) if i in outs[j]]
        if not topo.directed:
            assert np.array_equal(adj, adj.T)
            assert outs == ins


@pytest.mark.parametrize("topo", ALL_TOPOS, ids=VARIANT_IDS)
def test_connected_over_one_period(topo):
    union = np.logical_or.reduce([topo.adjacency(s) for s in range(topo.period)])
    assert _reachable_all(union)
    if topo.period == 1:
        assert is_strongly_connected(topo)


def test_is_strongly_connected_detects_one_way_and_disconnected():
    one_way = np.array([[0, 1, 0], [0, 0, 1], [0, 0, 0]], dtype=bool)  # path 0->1->2
    assert not is_strongly_connected(CustomTopology(one_way))
    two_parts = np.zeros((4, 4), dtype=bool)
    two_parts[0, 1] = two_parts[1, 0] = two_parts[2, 3] = two_parts[3, 2] = True
    assert not is_strongly_connected(CustomTopology(two_parts))
    assert is_strongly_connected(make_topology("ring", 5, directed=True))
    assert not is_strongly_connected(one_way) and not is_strongly_connected(two_parts)
    assert is_strongly_connected(one_way | one_way.T)


def test_bad_rank_rejected():
    t = make_topology("ring", 4)
    with pytest.raises(ValueError, match="rank"):
        t.out_peers(4)
    with pytest.raises(ValueError, match="rank"):
        t.in_peers(-1)


# ---------------------------------------------------------------------------
# Factory
# ---------------------------------------------------------------------------


def test_factory_unknown_name_lists_known():
    with pytest.raises(ValueError) as info:
        make_topology("star", 4)
    msg = str(info.value)
    assert "star" in msg
    for name in TOPOLOGIES:
        assert name in msg


def test_factory_defaults_and_direction_errors():
    assert make_topology("ring", 4).directed is False
    assert make_topology("exponential", 4).directed is True
    assert make_topology("time_varying_exponential", 4).directed is True
    assert make_topology("Time-Varying-Exponential", 8).period == 3
    for name in ("torus", "complete", "hypercube", "random_regular"):
        with pytest.raises(ValueError, match="undirected"):
            make_topology(name, 4, directed=True)
        assert make_topology(name, 4, directed=False).directed is False
    with pytest.raises(ValueError, match="directed only"):
        make_topology("time_varying_exponential", 4, directed=False)
    with pytest.raises(ValueError, match="world_size"):
        make_topology("ring", 0)


def test_table_of_topologies_describes_what_make_topology_builds():
    """Each entry's class, variants and seed dependence are what the factory gives."""
    assert [name for name, kind in TOPOLOGY_KINDS.items() if kind.seeded] == ["random_regular"]
    for name, kind in TOPOLOGY_KINDS.items():
        assert kind.cls.name == name
        built = make_topology(name, 16)
        assert type(built) is kind.cls and built.directed is kind.directions[0]
        for directed in (False, True):
            if directed in kind.directions:
                assert make_topology(name, 16, directed=directed).directed is directed
            else:
                with pytest.raises(ValueError, match="only; leave directed unset"):
                    make_topology(name, 16, directed=directed)
        graphs = {make_topology(name, 16, seed=seed).adjacency().tobytes() for seed in range(3)}
        assert (len(graphs) > 1) is kind.seeded, name


def test_option_types_list_the_table():
    from typing import get_args

    from dsgd_cli.topology import MixingName, TopologyName
    from plugins.aggregators.gossip import graph

    assert get_args(TopologyName) == TOPOLOGIES and graph.TopologyName is TopologyName
    assert get_args(MixingName) == MIXINGS and graph.MixingName is MixingName


def test_docs_table_lists_every_topology():
    from pathlib import Path

    plugins_page = (Path(__file__).resolve().parent.parent / "docs" / "plugins.md").read_text()
    for name in TOPOLOGIES:
        assert f"| `{name}` |" in plugins_page, name


def test_base_class_is_abstract():
    with pytest.raises(TypeError):
        Topology(3, directed=False)


# ---------------------------------------------------------------------------
# Mixing weights
# ---------------------------------------------------------------------------


class Lopsided(Topology):
    """A small non-regular, strongly connected directed graph on 4 workers."""

    name = "lopsided"
    _edges = {0: [1, 2, 3], 1: [2], 2: [0], 3: [0, 1]}

    def __init__(self):
        super().__init__(4, directed=True)

    def _out(self, rank, step):
        return self._edges[rank]


def _path(n):
    adj = np.zeros((n, n), dtype=bool)
    for i in range(n - 1):
        adj[i, i + 1] = adj[i + 1, i] = True
    return CustomTopology(adj)


def _assert_doubly_stochastic(w):
    assert w.dtype == np.float64
    assert (w >= -1e-15).all()
    np.testing.assert_allclose(w.sum(axis=1), 1.0, atol=1e-12)
    np.testing.assert_allclose(w.sum(axis=0), 1.0, atol=1e-12)


@pytest.mark.parametrize("scheme", MIXINGS)
@pytest.mark.parametrize("topo", UNDIRECTED, ids=UNDIRECTED_IDS)
def test_mixing_doubly_stochastic_on_undirected(topo, scheme):
    w = mixing_matrix(topo, 0, scheme)
    _assert_doubly_stochastic(w)
    adj = topo.adjacency(0)
    # Support is exactly self + neighbours.
    off = ~np.eye(topo.world_size, dtype=bool)
    assert np.array_equal((w > 0) & off, adj)
    if scheme == "metropolis":
        np.testing.assert_allclose(w, w.T)


def test_uniform_weights_values():
    w = mixing_matrix(make_topology("ring", 5), 0, "uniform")
    assert w[0, 0] == pytest.approx(1 / 3) and w[0, 1] == pytest.approx(1 / 3)
    assert w[0, 4] == pytest.approx(1 / 3) and w[0, 2] == 0
    # Directed: worker i averages itself with its in-peer (i - 1).
    wd = mixing_matrix(make_topology("ring", 5, directed=True), 0, "uniform")
    assert wd[1, 0] == pytest.approx(0.5) and wd[1, 1] == pytest.approx(0.5) and wd[1, 2] == 0
    _assert_doubly_stochastic(wd)


def test_metropolis_on_non_regular_path():
    t = _path(3)  # degrees 1, 2, 1
    w = mixing_matrix(t, 0, "metropolis")
    expected = np.array([[2 / 3, 1 / 3, 0], [1 / 3, 1 / 3, 1 / 3], [0, 1 / 3, 2 / 3]])
    np.testing.assert_allclose(w, expected)
    _assert_doubly_stochastic(mixing_matrix(_path(6), 0, "metropolis"))
    # A star (very non-regular) too.
    star = np.zeros((5, 5), dtype=bool)
    star[0, 1:] = star[1:, 0] = True
    _assert_doubly_stochastic(mixing_matrix(CustomTopology(star), 0, "metropolis"))
    # Uniform weights are only row stochastic on non-regular graphs.
    wu = mixing_matrix(t, 0, "uniform")
    np.testing.assert_allclose(wu.sum(axis=1), 1.0)
    assert not np.allclose(wu.sum(axis=0), 1.0)


def test_metropolis_rejects_directed():
    with pytest.raises(ValueError, match="undirected"):
        mixing_matrix(make_topology("exponential", 8), 0, "metropolis")
    with pytest.raises(ValueError, match="undirected"):
        mixing_matrix(Lopsided(), 0, "metropolis")


def test_unknown_scheme():
    with pytest.raises(ValueError, match="uniform, metropolis"):
        mixing_matrix(make_topology("ring", 4), 0, "laplacian")


@pytest.mark.parametrize("topo", DIRECTED + [Lopsided()], ids=DIRECTED_IDS + ["lopsided"])
def test_push_matrix_column_stochastic(topo):
    for step in range(topo.period):
        p = push_matrix(topo, step)
        assert (p >= 0).all()
        np.testing.assert_allclose(p.sum(axis=0), 1.0, atol=1e-12)
        for i in range(topo.world_size):
            shares = push_weights(topo, i, step)
            assert sum(shares.values()) == pytest.approx(1.0)
            assert sorted(shares) == sorted(topo.out_peers(i, step) + [i])


def test_push_on_non_regular_graph():
    t = Lopsided()
    assert push_weights(t, 0) == pytest.approx({0: 0.25, 1: 0.25, 2: 0.25, 3: 0.25})
    assert push_weights(t, 3) == pytest.approx({3: 1 / 3, 0: 1 / 3, 1: 1 / 3})
    p = push_matrix(t)
    assert p[1, 0] == pytest.approx(0.25) and p[0, 1] == 0
    assert not np.allclose(p.sum(axis=1), 1.0)  # genuinely not doubly stochastic
    # Push-sum converges to the true average despite the non-regular graph.
    x = np.array([4.0, -1.0, 7.0, 2.0])
    weight = np.ones(4)
    for _ in range(200):
        x, weight = p @ x, p @ weight
    np.testing.assert_allclose(x / weight, np.full(4, 3.0), atol=1e-9)


# ---------------------------------------------------------------------------
# Spectral properties
# ---------------------------------------------------------------------------


def test_spectral_gap_known_values():
    assert spectral_gap(np.full((4, 4), 0.25)) == pytest.approx(1.0)
    assert spectral_gap(np.eye(3)) == pytest.approx(0.0)
    assert spectral_gap(np.ones((1, 1))) == 1.0
    w = mixing_matrix(make_topology("ring", 16), 0, "uniform")
    expected = 1 - (1 + 2 * math.cos(2 * math.pi / 16)) / 3
    assert spectral_gap(w) == pytest.approx(expected)
    # Complete graph with uniform weights averages in one step.
    assert spectral_gap(mixing_matrix(make_topology("complete", 6), 0, "uniform")) == pytest.approx(1.0)
    # A disconnected graph has no gap.
    two_parts = np.zeros((4, 4), dtype=bool)
    two_parts[0, 1] = two_parts[1, 0] = two_parts[2, 3] = two_parts[3, 2] = True
    assert spectral_gap(mixing_matrix(CustomTopology(two_parts), 0, "metropolis")) == pytest.approx(0.0, abs=1e-12)


def test_exponential_mixes_faster_than_ring():
    ring = spectral_gap(mixing_matrix(make_topology("ring", 16), 0, "uniform"))
    expo = spectral_gap(mixing_matrix(make_topology("exponential", 16, directed=False), 0, "uniform"))
    assert expo > ring
    assert expo > 3 * ring


@pytest.mark.parametrize("n", [2, 4, 8, 16, 32])
def test_one_peer_exponential_averages_exactly_in_one_period(n):
    t = make_topology("time_varying_exponential", n)
    assert t.period == int(math.log2(n))
    prod = mixing_product(t, "push")
    np.testing.assert_allclose(prod, np.full((n, n), 1.0 / n), atol=1e-12)
    # Pull with uniform weights is the same matrix for a one-peer circulant.
    np.testing.assert_allclose(mixing_product(t, "uniform"), prod, atol=1e-12)
    # Each single step alone does not average (for n > 2).
    if n > 2:
        assert not np.allclose(push_matrix(t, 0), 1.0 / n)


def test_one_peer_exponential_not_exact_for_non_power_of_two():
    t = make_topology("time_varying_exponential", 6)
    prod = mixing_product(t, "push")
    np.testing.assert_allclose(prod.sum(axis=0), 1.0)
    assert not np.allclose(prod, 1.0 / 6)


def test_mixing_product_order_and_start():
    t = make_topology("time_varying_exponential", 8)
    m0, m1 = push_matrix(t, 0), push_matrix(t, 1)
    np.testing.assert_allclose(mixing_product(t, "push", steps=2), m1 @ m0)
    np.testing.assert_allclose(mixing_product(t, "push", steps=1, start=1), m1)
    np.testing.assert_allclose(mixing_product(t, "push", steps=0), np.eye(8))


def test_custom_time_varying_topology():
    a = np.zeros((3, 3), dtype=bool)
    b = np.zeros((3, 3), dtype=bool)
    a[0, 1] = True
    b[1, 2] = b[2, 0] = True
    t = CustomTopology([a, b])
    assert t.directed and t.period == 2 and t.is_time_varying
    assert t.out_peers(0, 0) == [1] and t.out_peers(0, 1) == []
    assert t.in_peers(0, 3) == [2]
    with pytest.raises(ValueError, match="self-loops"):
        CustomTopology(np.eye(3))


def test_random_regular_graph_depends_on_the_seed():
    """The spec loader checks a gossip graph with the run's seed (dsgd_cli.spec.experiments.check_world)
    because random_regular draws a different graph per seed, the same one in every process."""
    graphs = {seed: make_topology("random_regular", 8, seed=seed).adjacency().tobytes()
              for seed in range(4)}
    assert len(set(graphs.values())) > 1
    assert make_topology("random_regular", 8, seed=2).adjacency().tobytes() == graphs[2]


# ---------------------------------------------------------------------------
# The SGP reference implementation's graphs (Assran et al., ICML 2019)
# ---------------------------------------------------------------------------
# The reference gives every worker a "phone book": its destinations, in a fixed order, repeats
# kept. A worker starts at the first `p` entries (p peers per step) and after every gossip
# step moves each of its positions `p` entries on, cyclically. It receives from the workers
# whose entry at one of its positions is itself. Its uniform mixing keeps 1/(p + 1) and sends
# 1/(p + 1) along each entry. The phone books below are written from that description,
# destination by destination, independently of dsgd_cli.topology.


def _largest_exponent(base, limit):
    """The largest e with base**e <= limit (limit >= 1)."""
    exponent = 0
    while base ** (exponent + 1) <= limit:
        exponent += 1
    return exponent


def _reference_phone_book(graph, rank, n, p):
    ahead = lambda hop: (rank + hop) % n     # noqa: E731
    behind = lambda hop: (rank - hop) % n    # noqa: E731
    passive = lambda r: r % 2 == 0           # noqa: E731
    two_ways = lambda hops: [d for h in hops for d in (ahead(h), behind(h))]  # noqa: E731
    exponents = range(_largest_exponent(2, n - 1) + 1)
    if graph == "dynamic_directed_exponential":
        return two_ways(2 ** k for k in exponents)
    if graph == "npeer_dynamic_directed_exponential":
        return [ahead(j * (p + 1) ** i) for i in range(_largest_exponent(p + 1, n - 1) + 1)
                for j in range(1, p + 1)]
    if graph == "dynamic_directed_linear":
        return two_ways(i for i in range(1, n) if i % 2 == 1)
    hops = ([1 if k == 0 else 1 + 2 ** k for k in exponents]
            if graph == "dynamic_bipartite_exponential" else range(1, n))
    book = []
    for hop in hops:  # a pair of destinations is kept only if both are on the other side
        forward, backward = ahead(hop), behind(hop)
        if passive(forward) != passive(rank) and passive(backward) != passive(rank):
            book += [forward, backward]
    return book


def _reference_steps(graph, n, p, steps):
    """Per step: every rank's destinations (repeats kept) and its senders, by the reference's
    rule; None where the reference cannot run (a worker with fewer entries than p, or an
    empty phone book)."""
    books = [_reference_phone_book(graph, rank, n, p) for rank in range(n)]
    if min(len(book) for book in books) < p:
        return None
    assert len({len(book) for book in books}) == 1  # every rank moves through the same positions
    positions, schedule = list(range(p)), []
    for _ in range(steps):
        destinations = [[books[rank][g] for g in positions] for rank in range(n)]
        senders = [[] for _ in range(n)]
        for rank in range(n):
            for g in positions:
                if books[rank][g] != rank:
                    senders[books[rank][g]].append(rank)
        schedule.append((destinations, senders))
        positions = [(g + p) % len(books[0]) for g in positions]
    return schedule


@pytest.mark.parametrize("graph", REFERENCE_GRAPHS)
def test_reference_graphs_have_the_reference_peers_and_weights_at_every_step(graph):
    """n = 2..33 and 1..3 peers per step: every worker's out- and in-peers at every step of a
    whole pass through the phone book and one step more, and its uniform push shares, are the
    reference's."""
    for n in range(2, 34):
        for p in (1, 2, 3):
            length = len(_reference_phone_book(graph, 0, n, p))
            expected = _reference_steps(graph, n, p, length + 1)
            runnable = (expected is not None and length > 0
                        and not (graph.startswith("npeer") and p > n - 1))
            if not runnable:
                with pytest.raises(ValueError, match="peers_per_step|even number of workers"):
                    make_topology(graph, n, peers_per_step=p)
                continue
            topology = make_topology(graph, n, peers_per_step=p)
            for step, (destinations, senders) in enumerate(expected):
                for rank in range(n):
                    label = (graph, n, p, step, rank)
                    out_peers = sorted(set(destinations[rank]) - {rank})
                    assert topology.out_peers(rank, step) == out_peers, label
                    assert topology.in_peers(rank, step) == sorted(set(senders[rank])), label
                    entries = destinations[rank]
                    if rank in entries:  # the reference would send itself a share: left out
                        entries = [d for d in entries if d != rank]
                    share = 1 / (len(entries) + 1)
                    reference = {rank: share}
                    for d in entries:
                        reference[d] = reference.get(d, 0) + share
                    assert push_weights(topology, rank, step) == pytest.approx(reference), label


def test_reference_graphs_cannot_be_bipartite_with_an_odd_number_of_workers():
    """With odd n the reference leaves rank 0's phone book empty; dsgd refuses the graph."""
    for graph in ("dynamic_bipartite_exponential", "dynamic_bipartite_linear"):
        for n in (3, 5, 9, 33):
            assert _reference_phone_book(graph, 0, n, 1) == []
            with pytest.raises(ValueError, match="needs an even number of workers"):
                make_topology(graph, n)
        assert make_topology(graph, 1).out_peers(0) == []


def test_time_varying_exponential_is_the_reference_npeer_graph_with_one_peer():
    for n in range(2, 34):
        ours = make_topology("time_varying_exponential", n)
        reference = make_topology("npeer_dynamic_directed_exponential", n)
        assert ours.period == reference.period
        for step in range(ours.period):
            assert np.array_equal(ours.adjacency(step), reference.adjacency(step)), (n, step)
    # With more peers the reference hops j·(p+1)^i, time_varying_exponential powers of two.
    two = make_topology("npeer_dynamic_directed_exponential", 8, peers_per_step=2)
    assert [two.out_peers(0, step) for step in range(3)] == [[1, 2], [3, 6], [1, 2]]
    powers = make_topology("time_varying_exponential", 8, peers_per_step=2)
    assert [powers.out_peers(0, step) for step in range(3)] == [[1, 2], [1, 4], [2, 4]]


def test_reference_graphs_schedules():
    """The hop lists and periods, written out for 8 workers."""
    examples = {
        "dynamic_directed_exponential": [1, 7, 2, 6, 4, 4],
        "dynamic_bipartite_exponential": [1, 7, 3, 5, 5, 3],
        "dynamic_directed_linear": [1, 7, 3, 5, 5, 3, 7, 1],
        "dynamic_bipartite_linear": [1, 7, 3, 5, 5, 3, 7, 1],
        "npeer_dynamic_directed_exponential": [1, 2, 4],
    }
    for graph, peers in examples.items():
        topology = make_topology(graph, 8)
        assert topology.directed and topology.period == len(peers), graph
        assert [topology.out_peers(0, step)[0] for step in range(len(peers))] == peers, graph
    # Two peers per step: positions 0-1, 2-3, 4-5, then back to 0-1.
    two = make_topology("dynamic_directed_exponential", 8, peers_per_step=2)
    assert two.period == 3
    assert [two.out_peers(0, step) for step in range(4)] == [[1, 7], [2, 6], [4], [1, 7]]
    assert two.out_counts(0, 2) == {4: 2}  # +4 and -4 are one peer, which gets two shares
    assert push_weights(two, 0, 2) == pytest.approx({0: 1 / 3, 4: 2 / 3})
    np.testing.assert_allclose(mixing_matrix(two, 2)[4], [1 / 3 * (j == 4) + 2 / 3 * (j == 0)
                                                          for j in range(8)])
    # A hop that lands on the worker itself (6 with 6 workers) is left out of its step.
    six = make_topology("npeer_dynamic_directed_exponential", 6, peers_per_step=2)
    assert [six.out_peers(0, step) for step in range(2)] == [[1, 2], [3]]
    assert push_weights(six, 0, 1) == pytest.approx({0: 0.5, 3: 0.5})


@pytest.mark.parametrize("graph, n, peers, match", [
    ("dynamic_directed_exponential", 4, 5, "at most 4"),
    ("npeer_dynamic_directed_exponential", 4, 4, "at most 3"),
    ("dynamic_directed_linear", 8, 0, "int >= 1"),
    ("dynamic_bipartite_linear", 6, 2.5, "int >= 1"),
])
def test_reference_graphs_reject_bad_peers_per_step(graph, n, peers, match):
    with pytest.raises(ValueError, match=match):
        make_topology(graph, n, peers_per_step=peers)
