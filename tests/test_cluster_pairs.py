"""Links per pair of regions (`links.inter_region` as a matrix) and speeds per worker
(`speed` with a list for a node), and HALoS's cluster written with them
(examples/halos_env.yaml).

Everything asserts modeled times and recorded values, never wall-clock time.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cluster_helpers import emulated_seconds
from conftest import dsgd_in_process, write_spec
from distributed import run_workers
from dsgd_cli.comm.cluster import Cluster, Link
from dsgd_cli.commands.cluster_picture import cluster_picture
from dsgd_cli.emulation.clock import Clock
from dsgd_cli.emulation.network import real_cluster
from dsgd_cli.errors import SpecError
from dsgd_cli.spec.cluster_spec import (
    cluster_model, message_seconds, node_speed, slowest_speed, worker_speed)
from dsgd_cli.spec.compute_model import PaddedCompute
from dsgd_cli.spec.experiments import load_spec
from dsgd_cli.spec.transfer_time import widest_crossing

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "halos_env.yaml"

INTRA = "intra_node: {bandwidth: 10GB/s, latency: 2us}"
INTER = "inter_node: {bandwidth: 1Gbit, latency: 50us}"
WAN = "{bandwidth: 500Mbit, latency: 30ms}"


def _config(tmp_path, cluster: str, workers: int = 8, name: str = "spec.yaml") -> dict:
    spec = write_spec(tmp_path, f"""
        experiments:
          - {{name: a, task: logreg, workers: {workers}, compute: {{step_seconds: 0.01}},
             cluster: {cluster}}}
    """, name=name)
    return load_spec(spec)[0].config


# -- the matrix, resolved -----------------------------------------------------------------

def test_a_matrix_resolves_pair_by_pair_in_the_network_sections_units(tmp_path):
    config = _config(tmp_path, "{nodes: 4, regions: [2, 1, 1], links: {%s, %s, inter_region: ["
                               "[null, {bandwidth: 8Mbit, latency: 30ms}, {bandwidth: 1GB/s}],"
                               "[{bandwidth: 16Mbit}, null, {bandwidth: 2Gbit, latency: 1ms}],"
                               "[{latency: 5ms}, {bandwidth: 24000000}, null]]}}" % (INTRA, INTER))
    assert config["cluster"]["links"]["inter_region"] == [
        [None, {"bytes_per_second": 1e6, "latency_s": 0.03},
         {"bytes_per_second": 1e9, "latency_s": 0.0}],
        [{"bytes_per_second": 2e6, "latency_s": 0.0}, None,
         {"bytes_per_second": 2.5e8, "latency_s": 1e-3}],
        [{"bytes_per_second": None, "latency_s": 0.005},  # no bandwidth: unlimited
         {"bytes_per_second": 3e6, "latency_s": 0.0}, None]]
    cluster = cluster_model(config)
    assert "inter_region" not in cluster.links  # every pair has its own
    assert cluster.link_between(1, 4) == Link(0.03, 1e6)   # region 0 -> 1
    assert cluster.link_between(4, 1) == Link(0.0, 2e6)    # region 1 -> 0
    assert cluster.link_between(6, 4) == Link(0.0, 3e6)    # region 2 -> 1
    assert cluster.link_between(6, 0) == Link(0.005, float("inf"))
    assert cluster.link_between(0, 2) == Link(50 * 1e-6, 1e9 / 8)  # inside region 0: inter_node
    assert cluster.link_between(4, 5) == Link(2 * 1e-6, 1e10)  # inside a node: intra_node
    # The typed configuration plugins see reads it too, and writes it back key for key.
    from dsgd_cli.spec.resolved import ResolvedExperiment, Link as Resolved
    typed = ResolvedExperiment.from_config(config)
    assert typed.cluster.links["inter_region"][1][2] == Resolved(2.5e8, 1e-3)
    assert typed.cluster.links["inter_region"][0][0] is None
    assert typed.to_dict()["cluster"] == config["cluster"]


# -- all pairs equal: today's figures, to the bit ---------------------------------------------

def _scalar_and_equal_matrix(tmp_path, nic: str = "shared") -> tuple[dict, dict]:
    """The same cluster (3 regions of 1, 2 and 1 nodes of 2 workers) with one inter-region
    link, and with that link written for every pair."""
    layout = "nodes: 4, regions: [1, 2, 1], nic: %s" % nic
    scalar = _config(tmp_path, "{%s, links: {%s, %s, inter_region: %s}}"
                     % (layout, INTRA, INTER, WAN), name="scalar.yaml")
    rows = ", ".join("[%s]" % ", ".join("null" if a == b else WAN for b in range(3))
                     for a in range(3))
    matrix = _config(tmp_path, "{%s, links: {%s, %s, inter_region: [%s]}}"
                     % (layout, INTRA, INTER, rows), name="matrix.yaml")
    return scalar, matrix


def _figures(cluster: Cluster) -> list[float]:
    """Every cost the communicator asks of a cluster, on groups that cross regions."""
    everyone, shuffled = list(range(8)), [0, 5, 2, 7, 4, 1, 6, 3]
    figures = []
    for nbytes in (4.0, 40_000.0, 1.7e6, 123_457.0):
        figures += [cluster.ring_all_reduce_seconds(everyone, nbytes),
                    cluster.ring_all_reduce_seconds(shuffled, nbytes),
                    cluster.ring_all_reduce_seconds([1, 6], nbytes, copies=2),
                    cluster.ring_reduce_scatter_seconds(shuffled, nbytes),
                    cluster.ring_all_gather_seconds(everyone, nbytes),
                    cluster.broadcast_seconds(3, everyone, nbytes),
                    cluster.concurrent_seconds([(0, 7), (1, 6), (7, 2)], nbytes)]
        figures += [cluster.p2p_seconds(a, b, nbytes) for a in range(8) for b in range(8)]
        figures += [cluster.message_seconds(a, b, nbytes, 3) for a in range(8) for b in range(8)]
    return figures


@pytest.mark.parametrize("nic", ["shared", "dedicated"])
def test_a_matrix_with_every_pair_equal_costs_everything_as_one_link_to_the_bit(tmp_path, nic):
    scalar, matrix = _scalar_and_equal_matrix(tmp_path, nic)
    one, pairs = cluster_model(scalar), cluster_model(matrix)
    assert pairs.region_links and not one.region_links
    assert _figures(pairs) == _figures(one)  # ==: the same floats, not approximately
    clock = Clock(7.0)
    assert _figures(real_cluster(pairs, clock)) == _figures(real_cluster(one, clock))
    assert widest_crossing(matrix) == widest_crossing(scalar)
    assert ([message_seconds(matrix, a, b, 5e5) for a in range(8) for b in range(8)]
            == [message_seconds(scalar, a, b, 5e5) for a in range(8) for b in range(8)])


def _both_clusters_on_the_communicator(rank, world_size, clusters):
    """The same operations on a Comm over each cluster: the modeled seconds of each and the
    bytes per level."""
    from dsgd_cli.comm.communicator import Comm

    results = []
    for index, cluster in enumerate(clusters):
        comm = Comm(rank, world_size, cluster=cluster, namespace=f"c{index}")
        tensor = torch.ones(1000)
        reduced = comm.all_reduce(tensor, async_op=True)
        reduced.wait()
        gathered = comm.all_gather(torch.ones(10), async_op=True)
        gathered.wait()
        sent = comm.isend(torch.zeros(250), (rank + 3) % world_size)
        comm.recv(torch.zeros(250), (rank - 3) % world_size)
        sent.wait()
        comm.broadcast(torch.zeros(5), 2)
        traffic = comm.take_traffic()
        comm.close()
        results.append((emulated_seconds(reduced), emulated_seconds(gathered),
                        emulated_seconds(sent), traffic.sent_by_level, traffic.bytes_sent))
    return results


def test_the_communicator_charges_an_equal_matrix_as_one_link_to_the_bit(tmp_path):
    # 4 workers on 4 nodes in regions of 1, 2 and 1 nodes: fast links, short real waits.
    fast = "{bandwidth: 10Gbit, latency: 10us}"
    layout = "nodes: 4, regions: [1, 2, 1]"
    scalar = _config(tmp_path, "{%s, links: {inter_node: %s, inter_region: %s}}"
                     % (layout, fast, fast), workers=4, name="scalar.yaml")
    rows = ", ".join("[%s]" % ", ".join("null" if a == b else fast for b in range(3))
                     for a in range(3))
    matrix = _config(tmp_path, "{%s, links: {inter_node: %s, inter_region: [%s]}}"
                     % (layout, fast, rows), workers=4, name="matrix.yaml")
    clusters = (cluster_model(scalar), cluster_model(matrix))
    for scalar_run, matrix_run in run_workers(_both_clusters_on_the_communicator, 4, clusters,
                                              preloaded=True):
        assert matrix_run == scalar_run
        assert scalar_run[0] > 0 and scalar_run[3]["inter_region"] > 0


# -- an asymmetric matrix: each message by its pair ---------------------------------------------

# One worker per region, three regions; row = from, column = to, every pair different.
PAIRS = {(0, 1): Link(0.010, 1e6), (1, 0): Link(0.001, 4e6),
         (0, 2): Link(0.002, 2e6), (2, 0): Link(0.020, 0.5e6),
         (1, 2): Link(0.005, 8e6), (2, 1): Link(0.003, 1e6)}


def _three_regions(faster: float = 1.0) -> Cluster:
    """`faster`: every pair's times divided by it (for the communicator's real waits)."""
    matrix = tuple(tuple(None if a == b else Link(PAIRS[a, b].latency_s / faster,
                                                  PAIRS[a, b].bytes_per_second * faster)
                         for b in range(3)) for a in range(3))
    return Cluster(workers=3, nodes=3, regions=(1, 1, 1), links={}, region_links=matrix)


def test_an_asymmetric_matrix_costs_each_message_by_its_ordered_pair():
    cluster = _three_regions()
    B = 3e5
    # latency + B / bandwidth of the pair, from the row's region to the column's.
    expected = {(0, 1): 0.010 + 0.3, (1, 0): 0.001 + 0.075, (0, 2): 0.002 + 0.15,
                (2, 0): 0.020 + 0.6, (1, 2): 0.005 + 0.0375, (2, 1): 0.003 + 0.3}
    for (a, b), seconds in expected.items():
        assert cluster.p2p_seconds(a, b, B) == pytest.approx(seconds, rel=1e-12)
        assert cluster.message_seconds(a, b, B) == pytest.approx(seconds, rel=1e-12)
    # A ring all-reduce: 2(p-1) = 4 steps of B/3 = 1e5 bytes, each as long as its slowest
    # hop. Ring 0→1→2→0: 0.11, 0.0175, 0.22 s; the other way round, 0→2→1→0: 0.052, 0.103,
    # 0.026 s.
    assert cluster.ring_all_reduce_seconds([0, 1, 2], B) == pytest.approx(4 * 0.22, rel=1e-12)
    assert cluster.ring_all_reduce_seconds([0, 2, 1], B) == pytest.approx(4 * 0.103, rel=1e-12)
    assert cluster.ring_all_gather_seconds([0, 1, 2], 1e5) == pytest.approx(2 * 0.22, rel=1e-12)
    # A broadcast from rank 1: its copies to 0 and to 2, one after the other.
    assert cluster.broadcast_seconds(1, [0, 1, 2], B) == pytest.approx(0.076 + 0.0425, rel=1e-12)
    # In real time every pair is stretched alike.
    assert real_cluster(cluster, Clock(3.0)).p2p_seconds(2, 0, B) == pytest.approx(3 * 0.62)


def _asymmetric_messages(rank, world_size):
    from dsgd_cli.comm.communicator import Comm

    comm = Comm(rank, world_size, cluster=_three_regions(faster=100.0))
    sent = comm.isend(torch.zeros(75_000), (rank + 1) % 3)   # 300 kB to the next region
    comm.recv(torch.zeros(75_000), (rank - 1) % 3)
    sent.wait()
    tensor = torch.ones(75_000)
    reduced = comm.all_reduce(tensor, async_op=True)
    reduced.wait()
    traffic = comm.take_traffic()
    comm.close()
    return emulated_seconds(sent), emulated_seconds(reduced), traffic.sent_by_level


def test_the_communicator_charges_each_message_the_link_of_its_pair():
    results = run_workers(_asymmetric_messages, 3, preloaded=True)
    # The same figures as above, 100 times faster: rank r sends to r + 1.
    for rank, next_rank in ((0, 1), (1, 2), (2, 0)):
        sent, reduced, levels = results[rank]
        link = PAIRS[rank, next_rank]
        assert sent == pytest.approx((link.latency_s + 3e5 / link.bytes_per_second) / 100,
                                     rel=1e-12)
        assert reduced == pytest.approx(4 * 0.22 / 100, rel=1e-12)
        assert levels == {"intra_node": 0, "inter_node": 0,
                          "inter_region": 300_000 + 2 * 2 * 300_000 // 3}


# -- the refusal before the run: the fastest pair -----------------------------------------------

def test_the_model_must_cross_the_fastest_pair_in_time(tmp_path):
    # logreg's 40 bytes over the fastest pair (the lowest latency, 0, and the highest
    # bandwidth, 8 bit/s), 2 links in parallel (a region's 2 nodes, nic: shared): 20 s. The
    # slower pair would take 40 s: a 30 s timeout passes, a 15 s one does not.
    def spec(timeout: int) -> Path:
        return write_spec(tmp_path, f"""
            experiments:
              - {{name: a, task: logreg, workers: 4, timeout: {timeout},
                 cluster: {{nodes: 4, regions: [2, 2], links: {{inter_node: {{bandwidth: 1Gbit}},
                            inter_region: [[null, {{bandwidth: 4}}],
                                           [{{bandwidth: 8, latency: 1ms}}, null]]}}}}}}
        """, name=f"timeout{timeout}.yaml")
    assert load_spec(spec(30))
    with pytest.raises(SpecError) as error:
        load_spec(spec(15))
    assert str(error.value) == (
        f"{spec(15)}: experiments[0].cluster.links.inter_region: sending the model once (40 B) "
        "takes 20 s over this link (8 bit/s, latency 0 s, 2 network cards in parallel), not "
        "less than the experiment's timeout of 15 s: no step that waits for it would end; "
        "raise the bandwidth or the timeout")


# -- speeds per worker --------------------------------------------------------------------------

def test_a_nodes_speeds_may_be_given_per_worker(tmp_path):
    config = _config(tmp_path, "{nodes: 2, links: {%s, %s}, speed: [0.5, [1, 2, 0.25, 1]]}"
                     % (INTRA, INTER))
    assert config["cluster"]["speed"] == [0.5, [1.0, 2.0, 0.25, 1.0]]
    cluster = cluster_model(config)
    assert [cluster.speed(rank) for rank in range(8)] == [0.5] * 4 + [1, 2, 0.25, 1]
    assert [node_speed(config, rank) for rank in range(8)] == [0.5] * 4 + [1, 2, 0.25, 1]
    assert worker_speed is node_speed
    assert slowest_speed(config) == 0.25


def test_a_workers_speed_changes_exactly_its_own_modeled_step_time(tmp_path):
    even = _config(tmp_path, "{nodes: 2, links: {%s, %s}, speed: [1, 1]}" % (INTRA, INTER),
                   name="even.yaml")
    one_slow = _config(tmp_path, "{nodes: 2, links: {%s, %s}, speed: [1, [1, 1, 0.25, 1]]}"
                       % (INTRA, INTER), name="slow.yaml")
    compute = {"step_seconds": 0.05, "variation": {"distribution": "lognormal", "sigma": 0.3},
               "time_scale": 1}

    def modeled(config, rank, step):  # as the worker builds its padding (worker/parts.py)
        padded = PaddedCompute(compute, seed=3, rank=rank, blocked=lambda: 0.0,
                               speed=node_speed(config, rank))
        return padded.modeled_seconds(step, 2.0)
    for step in range(4):
        for rank in range(8):
            factor = 4 if rank == 6 else 1  # rank 6: node 1's third worker
            assert modeled(one_slow, rank, step) == factor * modeled(even, rank, step)


def test_the_slowest_worker_counts_in_the_timeout_check(tmp_path):
    spec = write_spec(tmp_path, """
        experiments:
          - {name: a, task: logreg, workers: 4, timeout: 10, compute: {step_seconds: 6},
             cluster: {nodes: 2, links: {intra_node: {bandwidth: 1GB/s},
                       inter_node: {bandwidth: 1Gbit}}, speed: [1, [1, 0.5]]}}
    """)
    with pytest.raises(SpecError, match=r"experiments\[0\].compute: a step lasts 12 real seconds"):
        load_spec(spec)


# -- what is refused, at its key ------------------------------------------------------------------

def _matrix(*rows: str) -> str:
    return "[%s]" % ", ".join(rows)


L = "{bandwidth: 1Mbit}"
TWO = "{nodes: 4, regions: [2, 2], links: {%s, %s, inter_region: %%s}}" % (INTRA, INTER)
THREE = "{nodes: 4, regions: [2, 1, 1], links: {%s, %s, inter_region: %%s}}" % (INTRA, INTER)


@pytest.mark.parametrize("cluster,message", [
    (TWO % _matrix(f"[null, {L}, {L}]", f"[{L}, null, {L}]", f"[{L}, {L}, null]"),
     "cluster.links.inter_region: expected a 2 × 2 matrix, one row and one column per region "
     "(cluster.regions), got 3 × 3"),
    (TWO % _matrix(f"[null, {L}]", f"[{L}]"),
     "cluster.links.inter_region[1]: expected a row of 2 links, one per region (a square "
     "matrix: as many columns as rows), got a row of 1"),
    (TWO % _matrix("5", f"[{L}, null]"),
     "cluster.links.inter_region[0]: expected a row of 2 links, one per region (a square "
     "matrix: as many columns as rows), got 5"),
    (TWO % _matrix(f"[null, {L}]", f"[{L}, {L}]"),
     "cluster.links.inter_region[1][1]: expected null: two workers of region 1 take the "
     "intra_node or inter_node link, not an inter-region one"),
    (THREE % _matrix(f"[null, {L}, {L}]", f"[{L}, null, {L}]", f"[{L}, null, null]"),
     "cluster.links.inter_region[2][1]: required: the link from region 2 to region 1, such as "
     "{bandwidth: 10Gbit, latency: 50us}"),
    (THREE % _matrix(f"[null, {L}, {L}]", f"[{L}, null, {L}]", f"[{L}, 5, null]"),
     "cluster.links.inter_region[2][1]: expected a link such as {bandwidth: 10Gbit, "
     "latency: 50us}, got 5"),
    (TWO % _matrix(f"[null, {L}]", "[{bandwidth: fast}, null]"),
     "cluster.links.inter_region[1][0].bandwidth: expected a bandwidth such as 1Gbit, 100Mbit "
     "or 10GB/s, got 'fast'"),
    (TWO % _matrix(f"[null, {L}]", "[{latency: -1}, null]"),
     "cluster.links.inter_region[1][0].latency: expected a duration such as 100us, 2ms or "
     "0.01 (seconds), got -1"),
    (TWO % _matrix(f"[null, {L}]", "[{bandwidth: 1Mbit, jitter: 1ms}, null]"),
     "cluster.links.inter_region[1][0].jitter: unknown key (expected one of bandwidth, "
     "latency)"),
    (TWO % "5", "cluster.links.inter_region: expected a link such as {bandwidth: 10Gbit, "
                "latency: 50us}, or a matrix of links (a list of rows, one row and one column "
                "per region), got 5"),
    (TWO % "[]", "cluster.links.inter_region: expected a link such as {bandwidth: 10Gbit, "
                 "latency: 50us}, or a matrix of links (a list of rows, one row and one column "
                 "per region), got []"),
    ("{nodes: 4, links: {%s, %s, inter_region: [[null]]}}" % (INTRA, INTER),
     "cluster.links.inter_region: an inter_region link needs regions (cluster.regions)"),
    ("{nodes: 2, links: {%s, %s}, speed: [1, [1, 1, 1]]}" % (INTRA, INTER),
     "cluster.speed[1]: expected 4 speeds (one per worker of node 1: 8 workers on 2 nodes), "
     "got 3"),
    ("{nodes: 2, links: {%s, %s}, speed: [1, [1, 1, 0, 1]]}" % (INTRA, INTER),
     "cluster.speed[1][2]: expected a number > 0 and <= 1000, got 0"),
    ("{nodes: 2, links: {%s, %s}, speed: [1, [1, true, 1, 1]]}" % (INTRA, INTER),
     "cluster.speed[1][1]: expected a number > 0 and <= 1000, got True"),
    ("{nodes: 2, links: {%s, %s}, speed: [1, [1, [1], 1, 1]]}" % (INTRA, INTER),
     "cluster.speed[1][1]: expected a number > 0 and <= 1000, got [1]"),
    ("{nodes: 2, links: {%s, %s}, speed: [[], 1]}" % (INTRA, INTER),
     "cluster.speed[0]: expected a number, or a list of one speed per worker of the node, "
     "got []"),
])
def test_a_matrix_or_speeds_that_do_not_fit_are_refused_at_their_key(tmp_path, cluster, message):
    spec = write_spec(tmp_path, f"""
        experiments:
          - {{name: a, task: logreg, workers: 8, compute: {{step_seconds: 0.01}},
             cluster: {cluster}}}
    """)
    with pytest.raises(SpecError) as error:
        load_spec(spec)
    assert str(error.value) == f"{spec}: experiments[0].{message}"


def test_a_bad_matrix_entry_exits_2_with_one_line_naming_the_file_and_key(tmp_path):
    spec = write_spec(tmp_path, """
        defaults: {task: logreg, workers: 4}
        experiments:
          - name: a
            workers: 3
            cluster:
              nodes: 3
              regions: [1, 1, 1]
              links:
                inter_region:
                  - [null, {bandwidth: 1Gbit}, {bandwidth: 1Gbit}]
                  - [{bandwidth: 1Gbit}, null, {bandwidth: 1Gbit}]
                  - [{bandwidth: 1Gbit}, {bandwidth: 0}, null]
    """)
    result = dsgd_in_process("run", str(spec), "--db", str(tmp_path / "r.db"))
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"dsgd: error: {spec}: experiments[0].cluster.links.inter_region[2][1].bandwidth: "
        "expected a bandwidth such as 1Gbit, 100Mbit or 10GB/s, got 0"]
    assert not (tmp_path / "r.db").exists()


# -- the picture ----------------------------------------------------------------------------------

def test_the_picture_draws_worker_speeds_and_the_matrix():
    link = {"bytes_per_second": 1e8 / 8, "latency_s": 0.0}
    config = {"workers": 4, "cluster": {
        "nodes": 2, "regions": [1, 1], "nic": "dedicated", "speed": [[1.0, 0.5], 0.25],
        "links": {"intra_node": {"bytes_per_second": 1e9, "latency_s": 0.0},
                  "inter_region": [[None, link],
                                   [{"bytes_per_second": 537e6 / 8, "latency_s": 0.03}, None]]}}}
    lines = cluster_picture(config, {"total_bytes_sent_inter_region": 1000}, lambda level: None)
    assert lines[:3] == ["cluster: 2 nodes × 2 workers in 2 regions, NIC dedicated",
                         "  region 0: node 0 [r0 r1×0.5]",
                         "  region 1: node 1 ×0.25 [r2 r3]"]
    assert any(line.split()[:5] == ["inter_region", "per", "pair", "of", "regions"]
               for line in lines)
    start = lines.index("inter_region links, from region (row) to region (column):")
    table = [line for line in lines[start + 1:] if line.startswith("region")]
    assert [row.split() for row in table] == [
        ["region", "0", "-", "100", "Mbit/s"],
        ["region", "1", "537", "Mbit/s", "30", "ms", "-"]]


# -- HALoS's cluster --------------------------------------------------------------------------------

# Kim et al., ICML 2025: bandwidths between regions in Gbit/s, and the workers' relative speeds
# (region × worker), as the paper's setting publishes them.
HALOS_GBITS = [[None, 0.537, 0.935, 0.202],
               [0.537, None, 0.386, 0.117],
               [0.935, 0.386, None, 0.127],
               [0.202, 0.117, 0.127, None]]
HALOS_SPEEDS = [[0.232, 0.907, 0.828, 0.347],
                [0.574, 0.531, 0.722, 0.194],
                [0.852, 0.132, 0.896, 0.107],
                [0.827, 0.515, 0.527, 0.788]]


@pytest.fixture
def shakespeare(tmp_path, monkeypatch):
    (tmp_path / "tinyshakespeare.txt").write_text("To be, or not to be: that is the question.\n" * 400)
    monkeypatch.setenv("DSGD_DATA", str(tmp_path))
    return tmp_path


def test_the_halos_example_is_the_papers_cluster(shakespeare):
    experiments = load_spec(EXAMPLE)
    assert [e.config["aggregator"]["name"] for e in experiments] == [
        "allreduce", "diloco", "async_local_sgd", "halos"]
    for experiment in experiments:
        config = experiment.config
        section = config["cluster"]
        assert config["workers"] == 16 and section["regions"] == [1, 1, 1, 1]
        assert section["links"]["intra_node"]["bytes_per_second"] * 8 == 100e9
        gbits = [[None if entry is None else entry["bytes_per_second"] * 8 / 1e9
                  for entry in row] for row in section["links"]["inter_region"]]
        assert gbits == [[None if g is None else pytest.approx(g, rel=1e-12) for g in row]
                         for row in HALOS_GBITS]
        assert section["speed"] == HALOS_SPEEDS
        cluster = cluster_model(config)
        assert [cluster.speed(rank) for rank in range(16)] == sum(HALOS_SPEEDS, [])
        assert [cluster.region(rank) for rank in range(16)] == [r // 4 for r in range(16)]
        # region 3's worker 1 (rank 13) to region 1's (rank 5): 0.117 Gbit/s, no latency
        assert cluster.p2p_seconds(13, 5, 1.17e6) == pytest.approx(0.08, rel=1e-12)
        assert cluster.p2p_seconds(12, 13, 1.25e6) == pytest.approx(1e-4, rel=1e-12)


def test_the_halos_example_dry_runs(shakespeare, tmp_path):
    result = dsgd_in_process("run", str(EXAMPLE), "--dry-run", "--db", str(tmp_path / "r.db"))
    assert result.returncode == 0, result.stderr
    assert result.stdout.count(
        "cluster: 4 nodes × 4 workers in regions of 1, 1, 1, 1 nodes; intra_node 12.5 GB/s = "
        "100 Gbit/s, latency 0 s; inter_region per pair of regions, 117 Mbit/s to 935 Mbit/s, "
        "latency 0 s; NIC dedicated; node speeds [0.232, 0.907, 0.828, 0.347]") == 4
