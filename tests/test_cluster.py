"""The emulated cluster of nodes and regions (`cluster:`): the spec section, the link model
checked against hand-worked formulas, node speeds and the ledger of bytes per link level.

Everything asserts modeled times and recorded values, never wall-clock time.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

import torch

from cluster_helpers import emulated_seconds, halving_doubling_seconds
from conftest import compare_json, dsgd_in_process, write_spec
from distributed import run_workers
from dsgd_cli.comm.cluster import LEVELS, Cluster, Link
from dsgd_cli.commands.cluster_picture import cluster_picture
from dsgd_cli.commands.reference import REQUIRED, experiment_key_rows
from dsgd_cli.commands.output import readable_bytes
from dsgd_cli.emulation.clock import Clock
from dsgd_cli.emulation.network import real_cluster
from dsgd_cli.results.store import Store
from dsgd_cli.errors import SpecError
from dsgd_cli.spec.cluster_spec import cluster_model
from dsgd_cli.spec.compute_model import PaddedCompute
from dsgd_cli.spec.experiments import load_spec

GB, MB = 1e9, 1e6


# -- the spec ---------------------------------------------------------------------------------

CLUSTER = """
    cluster:
      nodes: 4
      regions: [2, 2]
      links:
        intra_node:   {bandwidth: 300GB/s, latency: 2us}
        inter_node:   {bandwidth: 10Gbit,  latency: 50us}
        inter_region: {bandwidth: 500Mbit, latency: 30ms}
      nic: dedicated
      speed: [1, 1, 0.5, 1]
"""


def _load(tmp_path, experiment: str, defaults: str = "{task: logreg, workers: 8}"):
    spec = write_spec(tmp_path, f"defaults: {defaults}\nexperiments:\n  - {experiment}\n")
    return spec, load_spec(spec)


def test_the_issues_cluster_resolves_in_the_network_sections_units(tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text("defaults: {task: logreg, workers: 8, compute: {step_seconds: 0.01}}\n"
                    "experiments:\n  - name: a\n" + "\n".join(
                        "    " + line for line in CLUSTER.strip().splitlines()) + "\n")
    cluster = load_spec(spec)[0].config["cluster"]
    assert cluster == {
        "nodes": 4, "regions": [2, 2], "nic": "dedicated", "speed": [1.0, 1.0, 0.5, 1.0],
        "links": {"intra_node": {"bytes_per_second": 300e9, "latency_s": 2 * 1e-6},
                  "inter_node": {"bytes_per_second": 10e9 / 8, "latency_s": 50 * 1e-6},
                  "inter_region": {"bytes_per_second": 500e6 / 8, "latency_s": 0.03}}}


def test_nic_defaults_to_shared_and_levels_the_cluster_lacks_are_not_required(tmp_path):
    # One worker per node: no intra-node link; no regions: no inter-region link.
    _, experiments = _load(tmp_path, "{name: a, workers: 4, cluster: {nodes: 4, links: "
                                     "{inter_node: {bandwidth: 1Gbit}}}}")
    cluster = experiments[0].config["cluster"]
    assert cluster["nic"] == "shared" and cluster["regions"] is None and cluster["speed"] is None
    assert cluster["links"] == {"inter_node": {"bytes_per_second": 1e9 / 8, "latency_s": 0.0}}
    assert experiments[0].config["network"] is None


INTRA = "intra_node: {bandwidth: 1GB/s}"
INTER = "inter_node: {bandwidth: 1Gbit}"
REGION = "inter_region: {bandwidth: 1Mbit}"


@pytest.mark.parametrize("cluster,message", [
    ("{nodes: 3, links: {%s, %s}}" % (INTRA, INTER),
     "cluster.nodes: 8 workers cannot be split evenly over 3 nodes"),
    ("{nodes: 0, links: {%s}}" % INTRA, "cluster.nodes: expected an integer >= 1, got 0"),
    ("{links: {%s}}" % INTRA, "cluster.nodes: required"),
    ("{nodes: 4, regions: [2, 1], links: {%s, %s, %s}}" % (INTRA, INTER, REGION),
     "cluster.regions: the regions hold 3 nodes, expected 4 (cluster.nodes)"),
    ("{nodes: 4, regions: [4, 0], links: {%s, %s}}" % (INTRA, INTER),
     "cluster.regions: expected a list of node counts >= 1"),
    ("{nodes: 4, links: {%s}}" % INTRA, "cluster.links.inter_node: required: this cluster has "
                                        "inter-node links"),
    ("{nodes: 4, links: {%s}}" % INTER, "cluster.links.intra_node: required"),
    ("{nodes: 4, regions: [2, 2], links: {%s, %s}}" % (INTRA, INTER),
     "cluster.links.inter_region: required"),
    ("{nodes: 4, links: {%s, %s, %s}}" % (INTRA, INTER, REGION),
     "cluster.links.inter_region: an inter_region link needs regions (cluster.regions)"),
    ("{nodes: 4, links: {%s, inter_node: {bandwidth: fast}}}" % INTRA,
     "cluster.links.inter_node.bandwidth: expected a bandwidth such as 1Gbit"),
    ("{nodes: 4, links: {%s, inter_node: {latency: -1}}}" % INTRA,
     "cluster.links.inter_node.latency: expected a duration"),
    ("{nodes: 4, links: {%s, %s, inter_rack: {}}}" % (INTRA, INTER),
     "cluster.links.inter_rack: unknown key"),
    ("{nodes: 4, links: {%s, %s}, nic: private}" % (INTRA, INTER),
     "cluster.nic: expected one of shared, dedicated, got 'private'"),
    ("{nodes: 4, links: {%s, %s}, speed: [1, 1, 1]}" % (INTRA, INTER),
     "cluster.speed: expected 4 speeds (one per node), got 3"),
    ("{nodes: 4, links: {%s, %s}, speed: [1, 1, 0, 1]}" % (INTRA, INTER),
     "cluster.speed[2]: expected a number > 0 and <= 1000, got 0"),
    ("{nodes: 4, links: {%s, %s}, speed: [1, 1, 1, 1]}" % (INTRA, INTER),
     "cluster.speed: node speeds scale the modeled compute: add a compute section"),
    ("[4]", "cluster: expected a mapping with keys nodes, regions, links, nic, speed"),
])
def test_a_cluster_that_does_not_fit_is_refused_at_its_key(tmp_path, cluster, message):
    spec = write_spec(tmp_path, f"""
        experiments:
          - {{name: a, task: logreg, workers: 8, cluster: {cluster}}}
    """)
    with pytest.raises(SpecError) as error:
        load_spec(spec)
    assert str(error.value).startswith(f"{spec}: experiments[0].{message}"), str(error.value)


# Values the generic option types would take or word otherwise: 2.0 is not a node count,
# a list item names its index, a count of speeds names the nodes.
@pytest.mark.parametrize("cluster,message", [
    ("{nodes: 2.0, links: {%s, %s}}" % (INTRA, INTER),
     "cluster.nodes: expected an integer >= 1, got 2.0"),
    ("{nodes: true, links: {%s, %s}}" % (INTRA, INTER),
     "cluster.nodes: expected an integer >= 1, got True"),
    ("{nodes: null, links: {%s, %s}}" % (INTRA, INTER),
     "cluster.nodes: expected an integer >= 1, got None"),
    ("{nodes: 4, regions: [2.0, 2], links: {%s, %s}}" % (INTRA, INTER),
     "cluster.regions: expected a list of node counts >= 1, one per region, got [2.0, 2]"),
    ("{nodes: 4, regions: [], links: {%s, %s}}" % (INTRA, INTER),
     "cluster.regions: expected a list of node counts >= 1, one per region, got []"),
    ("{nodes: 4, links: {%s, %s}, speed: 1}" % (INTRA, INTER),
     "cluster.speed: expected a list of 4 speeds, one per node, got 1"),
    ("{nodes: 4, links: {%s, %s}, speed: [1, 1, true, 1]}" % (INTRA, INTER),
     "cluster.speed[2]: expected a number > 0 and <= 1000, got True"),
    ("{nodes: 4, links: {%s, %s}, nic: null}" % (INTRA, INTER),
     "cluster.nic: expected one of shared, dedicated, got None"),
    ("{nodes: 4, links: [1]}", "cluster.links: expected a mapping with keys intra_node, "
                               "inter_node, inter_region"),
    ("{nodes: 4, links: {%s, inter_node: 5}}" % INTRA,
     "cluster.links.inter_node: expected a mapping with keys bandwidth, latency"),
    ("{nodes: 4, links: {%s, inter_node: null}}" % INTRA,
     "cluster.links.inter_node: required: this cluster has inter-node links, "
     "such as {bandwidth: 10Gbit, latency: 50us}"),
    ("{nodes: 4}", "cluster.links.intra_node: required: this cluster has intra-node links, "
                   "such as {bandwidth: 10Gbit, latency: 50us}"),
    ("{}", "cluster.nodes: required: the number of nodes the workers are split over"),
    ("{nodes: 4, links: {%s, %s}, color: red}" % (INTRA, INTER),
     "cluster.color: unknown key (expected one of links, nic, nodes, regions, speed)"),
])
def test_cluster_values_keep_their_own_messages(tmp_path, cluster, message):
    spec = write_spec(tmp_path, f"""
        experiments:
          - {{name: a, task: logreg, workers: 8, compute: {{step_seconds: 0.01}},
             cluster: {cluster}}}
    """)
    with pytest.raises(SpecError) as error:
        load_spec(spec)
    assert str(error.value) == f"{spec}: experiments[0].{message}"


def test_the_resolved_cluster_keeps_its_layout_and_the_links_given_in_level_order(tmp_path):
    # One worker per node crosses no intra-node link, which is kept all the same (a grid
    # over nodes gives every point the same links); written out of order, stored in order.
    _, experiments = _load(tmp_path, "{name: a, workers: 4, cluster: {nodes: 4, links: "
                                     "{inter_node: {bandwidth: 8Mbit}, intra_node: {}}}}")
    assert json.dumps(experiments[0].config["cluster"]) == (
        '{"nodes": 4, "regions": null, "links": {'
        '"intra_node": {"bytes_per_second": null, "latency_s": 0.0}, '
        '"inter_node": {"bytes_per_second": 1000000.0, "latency_s": 0.0}}, '
        '"nic": "shared", "speed": null}')


def test_the_cluster_is_declared_with_its_keys_in_the_reference():
    rows = {row["option"]: row for row in experiment_key_rows()}
    assert rows["cluster"]["type"] == "a section"
    assert rows["cluster.nodes"]["default"] == REQUIRED
    assert rows["cluster.nic"]["type"] == "one of shared, dedicated"
    assert rows["cluster.nic"]["default"] == "shared"
    assert [key for key in rows if key.startswith("cluster.links.") and key.count(".") == 2] == [
        "cluster.links.intra_node", "cluster.links.inter_node", "cluster.links.inter_region"]
    assert all(rows[key]["help"] for key in rows if key.startswith("cluster"))


def test_network_and_cluster_together_are_refused_with_exit_2(tmp_path):
    spec = write_spec(tmp_path, """
        defaults: {task: logreg, workers: 4, network: {bandwidth: 1Gbit}}
        experiments:
          - {name: a, cluster: {nodes: 2, links: {intra_node: {bandwidth: 1GB/s},
                                                  inter_node: {bandwidth: 1Gbit}}}}
    """)
    result = dsgd_in_process("run", str(spec), "--db", str(tmp_path / "r.db"))
    assert result.returncode == 2
    assert result.stderr.strip() == (
        f"dsgd: error: {spec}: experiments[0].cluster: give either network (one link for "
        "every worker) or cluster, not both; set network: null where a default sets it")
    assert not (tmp_path / "r.db").exists()


def test_the_worker_override_is_checked_against_the_nodes(tmp_path):
    spec = write_spec(tmp_path, """
        experiments:
          - {name: a, task: logreg, workers: 4,
             cluster: {nodes: 2, links: {intra_node: {bandwidth: 1GB/s}, inter_node: {bandwidth: 1Gbit}}}}
    """)
    with pytest.raises(SpecError, match=r"cluster.nodes: 3 workers cannot be split evenly over 2"):
        load_spec(spec, workers=3)


def test_the_slowest_node_counts_in_the_timeout_check(tmp_path):
    spec = write_spec(tmp_path, """
        experiments:
          - {name: a, task: logreg, workers: 2, timeout: 10, compute: {step_seconds: 6},
             cluster: {nodes: 2, links: {inter_node: {bandwidth: 1Gbit}}, speed: [1, 0.5]}}
    """)
    with pytest.raises(SpecError, match=r"experiments\[0\].compute: a step lasts 12 real seconds"):
        load_spec(spec)


# -- the model, against hand-worked formulas --------------------------------------------------

def four_by_two(nic_shared: bool = True) -> Cluster:
    """4 nodes × 2 workers: NVLink-class inside a node, a slow link between nodes."""
    return Cluster(workers=8, nodes=4, nic_shared=nic_shared,
                   links={"intra_node": Link(2e-6, 300 * GB), "inter_node": Link(50e-6, 1.25 * GB)})


def test_ranks_sit_on_nodes_and_regions_in_order():
    cluster = Cluster(workers=8, nodes=4, regions=(1, 3), links={})
    assert [cluster.node(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [cluster.region(r) for r in range(8)] == [0, 0, 1, 1, 1, 1, 1, 1]
    assert cluster.level(0, 1) == "intra_node"
    assert cluster.level(2, 7) == "inter_node"
    assert cluster.level(1, 2) == "inter_region"


def test_a_message_takes_the_link_of_the_highest_level_it_crosses():
    cluster = Cluster(workers=4, nodes=2, regions=(1, 1),
                      links={"intra_node": Link(1e-6, 100 * GB), "inter_region": Link(0.03, 62.5 * MB)})
    assert cluster.message_seconds(0, 1, 1e6) == pytest.approx(1e-6 + 1e6 / (100 * GB))
    assert cluster.message_seconds(1, 2, 1e6) == pytest.approx(0.03 + 1e6 / (62.5 * MB))


def test_ring_all_reduce_over_four_nodes_of_two_workers_waits_for_the_inter_node_hops():
    # The ring 0→1→…→7→0: hops 1→2, 3→4, 5→6, 7→0 cross nodes, one leaving each node, so
    # the NIC is not shared. Each of the 2(p-1) = 14 steps sends B/8 and lasts as long as an
    # inter-node hop: 14 × (50 µs + (B/8) / 1.25 GB/s).
    model_bytes = 4 * 10_000_000
    step = 50e-6 + (model_bytes / 8) / (1.25 * GB)
    for nic_shared in (True, False):
        cluster = four_by_two(nic_shared)
        assert cluster.ring_all_reduce_seconds(range(8), model_bytes) == pytest.approx(14 * step)


def test_ring_all_reduce_on_one_level_is_the_flat_network_model():
    # The flat model: 2(p-1) messages × latency + 2(p-1)/p × B / bandwidth.
    cluster = Cluster(workers=4, nodes=4, links={"inter_node": Link(1e-4, 1e8)})
    flat = 6 * 1e-4 + 2 * 3 / 4 * 8e6 / 1e8
    assert cluster.ring_all_reduce_seconds(range(4), 8e6) == pytest.approx(flat)


def test_a_ring_whose_hops_leave_a_node_twice_shares_its_nic():
    # The ring 0→2→4→6→1→3→5→7→0: every hop crosses nodes and two leave each node (from
    # node 0: 0→2 and 1→3), so a shared NIC halves each hop's bandwidth.
    ring = [0, 2, 4, 6, 1, 3, 5, 7]
    chunk = 1e6 / 8
    shared, dedicated = four_by_two(True), four_by_two(False)
    assert dedicated.ring_all_reduce_seconds(ring, 1e6) == pytest.approx(
        14 * (50e-6 + chunk / (1.25 * GB)))
    assert shared.ring_all_reduce_seconds(ring, 1e6) == pytest.approx(
        14 * (50e-6 + 2 * chunk / (1.25 * GB)))


@pytest.mark.parametrize("k", [1, 2, 4])
def test_k_workers_of_a_node_sending_across_a_shared_nic_take_k_times_the_dedicated_time(k):
    # k workers of node 0 each send one model to a worker of node 1 at once.
    links = {"intra_node": Link(0.0, 100 * GB), "inter_node": Link(0.0, 1.25 * GB)}
    model_bytes = 100 * MB
    pairs = [(i, k + i) for i in range(k)]
    shared = Cluster(workers=2 * k, nodes=2, links=links, nic_shared=True)
    dedicated = Cluster(workers=2 * k, nodes=2, links=links, nic_shared=False)
    assert dedicated.concurrent_seconds(pairs, model_bytes) == pytest.approx(model_bytes / (1.25 * GB))
    assert shared.concurrent_seconds(pairs, model_bytes) == pytest.approx(
        k * dedicated.concurrent_seconds(pairs, model_bytes))
    # The point-to-point rule the communicator uses assumes the same k concurrent sends.
    assert shared.p2p_seconds(0, k, model_bytes) == pytest.approx(k * model_bytes / (1.25 * GB))
    assert dedicated.p2p_seconds(0, k, model_bytes) == pytest.approx(model_bytes / (1.25 * GB))


def test_recursive_halving_doubling_pays_each_exchange_by_its_pairs_level():
    # 8 ranks, 4 nodes × 2: exchange 0 pairs r with r^4 (across nodes, B/2 each, both
    # workers of a node sending across: a shared NIC halves it), exchange 1 r with r^2
    # (across nodes, B/4, shared by 2), exchange 2 r with r^1 (inside a node, B/8). The
    # all-gather repeats them: twice each.
    cluster = four_by_two(True)
    B = 8e6
    inter = Link(50e-6, 1.25 * GB)
    intra = Link(2e-6, 300 * GB)
    expected = 2 * (inter.seconds(B / 2, 2) + inter.seconds(B / 4, 2) + intra.seconds(B / 8))
    assert halving_doubling_seconds(cluster, list(range(8)), B) == pytest.approx(expected)


def test_broadcast_sends_one_copy_per_member_by_its_level():
    cluster = four_by_two(False)
    expected = (Link(2e-6, 300 * GB).seconds(1e6)
                + 6 * Link(50e-6, 1.25 * GB).seconds(1e6))
    assert cluster.broadcast_seconds(0, range(8), 1e6) == pytest.approx(expected)


def test_bytes_per_level_sum_to_the_bytes_sent():
    cluster = Cluster(workers=8, nodes=4, regions=(2, 2), links={})
    sends = [(0, 1, 10), (1, 2, 20), (3, 4, 40), (5, 6, 80)]
    ledger = cluster.bytes_by_level(sends)
    assert ledger == {"intra_node": 10, "inter_node": 100, "inter_region": 40}
    assert sum(ledger.values()) == sum(nbytes for _, _, nbytes in sends)


def test_the_scaled_cluster_is_the_modeled_one_in_real_time():
    cluster = real_cluster(four_by_two(), Clock(4))
    assert cluster.ring_all_reduce_seconds(range(8), 1e6) == pytest.approx(
        4 * four_by_two().ring_all_reduce_seconds(range(8), 1e6))


def test_the_cluster_model_of_a_resolved_spec(tmp_path):
    _, experiments = _load(tmp_path, "{name: a, compute: {step_seconds: 0.01}, cluster: "
                                     "{nodes: 4, regions: [2, 2], speed: [1, 1, 0.5, 1], links: "
                                     "{%s, %s, %s}}}" % (INTRA, INTER, REGION))
    cluster = cluster_model(experiments[0].config)
    assert cluster.workers_per_node == 2 and cluster.nic_shared
    assert [cluster.speed(rank) for rank in range(8)] == [1, 1, 1, 1, 0.5, 0.5, 1, 1]
    assert cluster.link("inter_region") == Link(0.0, 1e6 / 8)
    assert cluster.link("intra_node") == Link(0.0, 1e9)


# -- node speeds --------------------------------------------------------------------------------

def test_a_node_at_half_speed_computes_a_step_in_twice_the_modeled_time():
    compute = {"step_seconds": 0.05, "variation": {"distribution": "lognormal", "sigma": 0.3},
               "time_scale": 1}
    full = PaddedCompute(compute, seed=3, rank=5, blocked=lambda: 0.0)
    half = PaddedCompute(compute, seed=3, rank=5, blocked=lambda: 0.0, speed=0.5)
    for step in range(5):  # on top of the variation and the stragglers' slowdown
        assert half.modeled_seconds(step, 3.0) == pytest.approx(2 * full.modeled_seconds(step, 3.0))
    assert full.modeled_seconds(0) != full.modeled_seconds(1)
    assert not math.isclose(full.modeled_seconds(0, 3.0), full.modeled_seconds(0))


# -- the example and the dry run ----------------------------------------------------------------

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "hierarchy.yaml"


def test_the_example_validates_and_the_dry_run_shows_its_cluster(tmp_path):
    experiments = load_spec(EXAMPLE)
    assert [e.config["aggregator"]["name"] for e in experiments] == [
        "allreduce", "allreduce", "sgp", "wagma"]
    assert experiments[1].config["aggregator"]["hierarchical"] is True
    assert all(e.config["cluster"]["nodes"] == 4 and e.workers == 8 for e in experiments)
    result = dsgd_in_process("run", str(EXAMPLE), "--dry-run", "--db", str(tmp_path / "r.db"))
    assert result.returncode == 0, result.stderr
    assert result.stdout.count(
        "cluster: 4 nodes × 2 workers; intra_node 12.5 GB/s = 100 Gbit/s, latency 5 µs; "
        "inter_node 12.5 MB/s = 100 Mbit/s, latency 1 ms; NIC shared") == 4


def test_the_published_settings_examples_are_the_papers_networks():
    examples = EXAMPLE.parent
    sgp = {e.name: e.config for e in load_spec(examples / "sgp_networks.yaml")}
    assert {c["aggregator"]["name"] for c in sgp.values()} == {"allreduce", "sgp"}
    inter_node = {name.split("[")[0]: c["cluster"]["links"]["inter_node"]["bytes_per_second"]
                  for name, c in sgp.items()}
    assert inter_node == {"sgp-networks-ethernet": 10e9 / 8, "sgp-networks-infiniband": 100e9 / 8}
    compression = [e.config for e in load_spec(examples / "compression_crossover.yaml")]
    assert {(c["network"]["bytes_per_second"] * 8 / 1e9, c["compressor"]["name"])
            for c in compression} == {(100, "none"), (100, "fp16"), (10, "none"), (10, "fp16")}
    # ResNet-50's parameter count, a V100's step, 8 workers (Agarwal et al., 2022).
    assert all(c["task"]["params"] == "25.6M" and c["compute"]["step_seconds"] == 0.1
               and c["workers"] == 8 for c in compression)


@pytest.mark.parametrize("aggregator,message", [
    ("{name: allreduce, hierarchical: true, compressor: {name: topk, ratio: 0.1}}",
     "aggregator.compressor: hierarchical: true averages gradients uncompressed"),
    ("{name: allreduce, hierarchical: true, momentum_before_compression: 0.9}",
     "aggregator: hierarchical: true averages gradients uncompressed; it does not take "
     "momentum_before_compression"),
])
def test_hierarchical_allreduce_refuses_what_it_cannot_do(tmp_path, aggregator, message):
    spec = write_spec(tmp_path, f"""
        experiments:
          - {{name: a, task: logreg, workers: 4, aggregator: {aggregator}}}
    """)
    with pytest.raises(SpecError) as error:
        load_spec(spec)
    assert str(error.value).startswith(f"{spec}: experiments[0].{message}"), str(error.value)


# -- the communicator on a cluster (4 gloo workers: 2 nodes × 2) ---------------------------------

def _cluster_2x2(nic_shared: bool = True) -> Cluster:
    return Cluster(workers=4, nodes=2, nic_shared=nic_shared,
                   links={"intra_node": Link(1e-6, 1e9), "inter_node": Link(1e-3, 1e7)})


def _collectives_on_a_cluster(rank, world_size):
    from dsgd_cli.comm.communicator import Comm

    cluster = _cluster_2x2()
    comm = Comm(rank, world_size, cluster=cluster)
    tensor = torch.ones(1000)  # 4000 bytes
    handle = comm.all_reduce(tensor, async_op=True)
    handle.wait()
    reduced = (tensor.tolist()[0], emulated_seconds(handle))
    after_all_reduce = comm.take_traffic()
    p2p = comm.isend(torch.zeros(250), (rank + 2) % 4)  # 1000 bytes to the other node
    comm.recv(torch.zeros(250), (rank + 2) % 4)
    p2p.wait()
    after_p2p = comm.take_traffic()
    gathered = comm.all_gather(torch.full((10,), float(rank)), async_op=True)
    gathered.wait()
    after_gather = comm.take_traffic()
    node = [comm.new_group([0, 1]), comm.new_group([2, 3])][rank // 2]
    scattered = comm.reduce_scatter(torch.arange(4.0) + rank, group=node, async_op=True)
    chunk = scattered.wait().tolist()
    after_scatter = comm.take_traffic()
    if rank == 0:  # to its own thread: as from the farthest worker, on the other node
        comm.send_within_process(torch.zeros(10))
    comm.broadcast(torch.zeros(5), 0)
    root = comm.take_traffic()
    comm.close()
    return (reduced, vars(after_all_reduce), emulated_seconds(p2p), vars(after_p2p),
            emulated_seconds(gathered), vars(after_gather), (chunk, emulated_seconds(scattered)),
            vars(after_scatter), vars(root))


def test_the_communicator_costs_collectives_and_messages_by_the_links_they_cross():
    results = run_workers(_collectives_on_a_cluster, 4, preloaded=True)
    cluster = _cluster_2x2()
    ring_seconds = cluster.ring_all_reduce_seconds(range(4), 4000)
    # 2(p-1) = 6 steps of 1000 bytes, each waiting for the inter-node hop (1→2 or 3→0)
    assert ring_seconds == pytest.approx(6 * (1e-3 + 1000 / 1e7))
    for rank, (reduced, reduce_traffic, p2p_seconds, p2p_traffic, gather_seconds,
               gather_traffic, scattered, scatter_traffic, root) in enumerate(results):
        assert reduced == (4.0, pytest.approx(ring_seconds))
        # Each worker sends 2(p-1)/p of the tensor to its ring successor: ranks 1 and 3
        # across the node, ranks 0 and 2 inside it.
        across = rank in (1, 3)
        assert reduce_traffic["bytes_sent"] == 6000
        assert reduce_traffic["sent_by_level"] == {
            "intra_node": 0 if across else 6000, "inter_node": 6000 if across else 0,
            "inter_region": 0}
        # A message across the node shares the NIC with the node's other worker's.
        assert p2p_seconds == pytest.approx(1e-3 + 2 * 1000 / 1e7)
        assert p2p_traffic["sent_by_level"] == {"intra_node": 0, "inter_node": 1000,
                                                "inter_region": 0}
        assert gather_seconds == pytest.approx(3 * (1e-3 + 40 / 1e7))
        assert sum(gather_traffic["sent_by_level"].values()) == gather_traffic["bytes_sent"] == 120
        # Inside a node: member i gets the sum's i-th half, one step of 8 bytes on NVLink.
        first = 2 * (rank // 2)
        own = rank - first
        expected = [float(2 * (2 * own + k) + 2 * first + 1) for k in range(2)]
        assert scattered == (expected, pytest.approx(1e-6 + 8 / 1e9))
        assert scatter_traffic["sent_by_level"] == {"intra_node": 8, "inter_node": 0,
                                                    "inter_region": 0}
        # Rank 0 broadcasts 20 bytes to one worker of its node and two of the other.
        if rank == 0:
            assert root["sent_by_level"] == {"intra_node": 20, "inter_node": 40 + 40,
                                             "inter_region": 0}
        else:
            assert root["sent_by_level"] == {"intra_node": 0, "inter_node": 0, "inter_region": 0}


# -- a run: the ledger per link level, flat and hierarchical all-reduce ---------------------------

@pytest.fixture(scope="module")
def ledger_runs(tmp_path_factory):
    """4 workers on 2 nodes of 2, a few steps of logreg: the flat ring and the hierarchical
    all-reduce, and SGP."""
    tmp = tmp_path_factory.mktemp("ledger")
    spec = write_spec(tmp, """
        defaults:
          task: {name: logreg}
          workers: 4
          steps_per_epoch: 4
          log_interval: 2
          cluster:
            nodes: 2
            links: {intra_node: {bandwidth: 10GB/s}, inter_node: {bandwidth: 1Gbit, latency: 1ms}}
        experiments:
          - {name: flat, aggregator: {name: allreduce, sync_buffers: false}}
          - {name: hierarchical, aggregator: {name: allreduce, hierarchical: true, sync_buffers: false}}
          - {name: sgp, aggregator: {name: sgp}}
    """)
    db = tmp / "results.db"
    result = dsgd_in_process("run", str(spec), "--db", str(db))
    assert result.returncode == 0, result.stdout + result.stderr
    store = Store(str(db))
    return {run.experiment: run for run in store.runs()}, store, db


def _per_step(store, run, metric):
    return {(m.rank, m.step): m.value for m in store.metric_history(run.id, metric)}


LEDGER = ("bytes_sent_intra_node", "bytes_sent_inter_node", "bytes_sent_inter_region")


@pytest.mark.parametrize("name", ["flat", "hierarchical", "sgp"])
def test_the_ledger_per_level_sums_to_bytes_sent(ledger_runs, name):
    runs, store, _ = ledger_runs
    sent = _per_step(store, runs[name], "bytes_sent")
    levels = [_per_step(store, runs[name], metric) for metric in LEDGER]
    assert sent and all(level.keys() == sent.keys() for level in levels)
    for key, value in sent.items():
        assert sum(level[key] for level in levels) == pytest.approx(value)
    assert all(value == 0 for value in levels[2].values())  # no regions


def test_hierarchical_all_reduce_sends_2_n_minus_1_over_n_of_a_model_across_each_node(ledger_runs):
    runs, store, _ = ledger_runs
    model = 10 * 4  # logreg: a 10-weight linear model, float32
    flat = _per_step(store, runs["flat"], "bytes_sent_inter_node")
    hierarchical = _per_step(store, runs["hierarchical"], "bytes_sent_inter_node")
    steps = {step for _, step in flat}
    assert steps == {step for _, step in hierarchical} == {2, 4}

    def per_node(ledger, step, node):  # node k holds ranks 2k and 2k + 1
        return sum(ledger[rank, step] for rank in (2 * node, 2 * node + 1))
    for step in steps:
        for node in (0, 1):
            # The flat ring (p = 4): the node's one crossing hop carries 2(p-1)/p of a model.
            assert per_node(flat, step, node) == 2 * 3 * model // 4
            # Hierarchical (N = 2 nodes): 2(N-1)/N of a model leaves each node.
            assert per_node(hierarchical, step, node) == 2 * 1 * model // 2
    # Inside the node it reduce-scatters and all-gathers: (w-1)/w of a model each way.
    intra = _per_step(store, runs["hierarchical"], "bytes_sent_intra_node")
    assert set(intra.values()) == {model // 2 + model // 2}


def test_hierarchical_all_reduce_trains_the_flat_ones_models(ledger_runs):
    runs, store, _ = ledger_runs
    flat = _per_step(store, runs["flat"], "train_loss")
    hierarchical = _per_step(store, runs["hierarchical"], "train_loss")
    assert flat.keys() == hierarchical.keys()
    for key, loss in flat.items():  # the same sums, added in another order
        assert hierarchical[key] == pytest.approx(loss, rel=1e-6, abs=1e-7)


def test_compare_shows_the_ledger_as_metrics(ledger_runs):
    _, _, db = ledger_runs
    rows = compare_json(db, "--metric", "bytes_sent_inter_node", "--metric",
                        "bytes_sent_intra_node", "--metric", "peak_rate_inter_node")
    by_name = {row["experiment"]: row for row in rows}
    assert by_name["flat"]["bytes_sent_inter_node"] > by_name["hierarchical"]["bytes_sent_inter_node"] > 0
    assert by_name["hierarchical"]["peak_rate_inter_node"] > 0


def test_show_draws_the_runs_cluster_with_its_bytes_per_level(ledger_runs):
    runs, store, db = ledger_runs
    run = runs["hierarchical"]
    result = dsgd_in_process("show", str(run.id), "--db", str(db))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    start = lines.index("cluster: 2 nodes × 2 workers, NIC shared")
    assert lines[start + 1] == "  node 0 [r0 r1]  node 1 [r2 r3]"
    finals = {s.name: s.final for s in run.summaries}
    peak = max(m.value for m in store.metric_history(run.id, "peak_rate_inter_node"))
    rows = {line.split()[0]: line for line in lines[start + 2:start + 6]}
    # Hierarchical over 2 nodes of 2, 4 steps of a 40-byte model: per step, 40 bytes leave
    # each node and each worker reduce-scatters and all-gathers 20 + 20 bytes inside it.
    assert finals["total_bytes_sent_inter_node"] == 4 * 2 * 40 == 320
    assert finals["total_bytes_sent_intra_node"] == 4 * 4 * 40 == 640
    assert rows["intra_node"].split()[1:11] == ["10", "GB/s", "=", "80", "Gbit/s,", "latency",
                                               "0", "s", "640", "B"]
    assert rows["inter_node"].split()[1:11] == ["125", "MB/s", "=", "1", "Gbit/s,", "latency",
                                               "1", "ms", "320", "B"]
    assert rows["inter_node"].endswith(readable_bytes(peak) + "/s")
    assert "inter_region" not in rows  # no regions


def test_the_picture_draws_regions_and_node_speeds():
    config = {"workers": 8, "cluster": {
        "nodes": 4, "regions": [2, 2], "nic": "dedicated", "speed": [1.0, 0.5, 1.0, 1.0],
        "links": {"intra_node": {"bytes_per_second": 1e9, "latency_s": 0.0},
                  "inter_node": {"bytes_per_second": 1e8, "latency_s": 1e-3},
                  "inter_region": {"bytes_per_second": 1e6, "latency_s": 0.03}}}}
    finals = {"total_bytes_sent_intra_node": 2e6, "total_bytes_sent_inter_node": 3e5,
              "total_bytes_sent_inter_region": 1234}
    lines = cluster_picture(config, finals, {"intra_node": 5e8, "inter_node": 2e7,
                                             "inter_region": None}.get)
    assert lines[:3] == ["cluster: 4 nodes × 2 workers in 2 regions, NIC dedicated",
                         "  region 0: node 0 [r0 r1]  node 1 ×0.5 [r2 r3]",
                         "  region 1: node 2 [r4 r5]  node 3 [r6 r7]"]
    table = [line.split() for line in lines[3:]]
    assert [row[0] for row in table if row[0] in LEVELS] == list(LEVELS)
    sent_and_rate = {row[0]: row[-4:] for row in table if row[0] in LEVELS}
    assert sent_and_rate["intra_node"] == ["2", "MB", "500", "MB/s"]
    assert sent_and_rate["inter_node"] == ["300", "kB", "20", "MB/s"]
    assert sent_and_rate["inter_region"][-2:] == ["1.23", "kB"]  # no rate recorded
    assert cluster_picture({"workers": 2, "cluster": None}, {}, lambda level: None) == []


# -- a slow node, on the modeled clock ------------------------------------------------------------

@pytest.fixture(scope="module")
def slow_node_runs(tmp_path_factory):
    """4 workers on 2 nodes, node 1 at half speed: allreduce waits for it, backup workers
    (b = 2, the slow node's workers) do not."""
    tmp = tmp_path_factory.mktemp("speed")
    spec = write_spec(tmp, """
        defaults:
          task: {name: logreg}
          workers: 4
          steps_per_epoch: 12
          log_interval: 1
          compute: {step_seconds: 0.02, time_scale: 5}
          cluster:
            nodes: 2
            links: {intra_node: {bandwidth: 10GB/s}, inter_node: {bandwidth: 10Gbit}}
            speed: [1, 0.5]
        experiments:
          - {name: allreduce, aggregator: {name: allreduce}}
          - {name: backup, aggregator: {name: backup, backups: 2}}
    """)
    db = tmp / "results.db"
    result = dsgd_in_process("run", str(spec), "--db", str(db))
    assert result.returncode == 0, result.stdout + result.stderr
    store = Store(str(db))
    return {run.experiment: run for run in store.runs()}, store


def _fitted_median(store, run, metric, ranks):
    """The median of a metric over the ranks' steps whose real work fit the model."""
    overrun = _per_step(store, run, "emulation_overrun")
    values = sorted(value for (rank, step), value in _per_step(store, run, metric).items()
                    if rank in ranks and step > 1 and overrun[rank, step] == 0)
    assert len(values) >= 6
    return values[len(values) // 2]


def test_a_node_at_half_speed_computes_in_twice_the_time_and_allreduce_waits_for_it(slow_node_runs):
    runs, store = slow_node_runs
    run = runs["allreduce"]
    assert _fitted_median(store, run, "compute_seconds", (2, 3)) == pytest.approx(0.04, rel=0.15)
    # The fast node computes its 0.02 s, then waits in the all-reduce for the slow one.
    assert _fitted_median(store, run, "step_seconds", (0, 1)) == pytest.approx(0.04, rel=0.15)


def test_backup_workers_as_many_as_the_slow_nodes_keep_the_fast_nodes_rate(slow_node_runs):
    runs, store = slow_node_runs
    assert _fitted_median(store, runs["backup"], "step_seconds", (0, 1)) == pytest.approx(
        0.02, rel=0.25)


# -- the ledger in the interval metrics ---------------------------------------------------------

class _Events:
    def __init__(self):
        self.metrics = {}

    def metric(self, name, value, step, epoch):
        self.metrics[name] = value


def _traffic(intra: int, inter: int, seconds: float = 0.0):
    from dsgd_cli.comm.communicator import Traffic

    return Traffic(bytes_sent=intra + inter, seconds=seconds,
                   sent_by_level={"intra_node": intra, "inter_node": inter, "inter_region": 0})


def test_interval_metrics_record_the_ledger_its_peak_rates_and_resume_them():
    from dsgd_cli.worker.interval_metrics import IntervalMetrics

    interval = IntervalMetrics()
    interval.add(1.0, 0.5, _traffic(100, 40))   # 80 inter-node bytes per second
    saved = interval.state()
    interval = IntervalMetrics()  # a resumed run continues the interval from the checkpoint
    interval.restore(saved)
    interval.add(1.0, 0.1, _traffic(300, 20))   # 200 per second: the peak
    interval.add_bytes(_traffic(0, 60))         # what finish() sent after the last step
    events = _Events()
    interval.flush(events, step=2, epoch=0, lr=0.1)
    metrics = events.metrics
    assert metrics["bytes_sent"] == (140 + 320 + 60) / 2
    assert (metrics["bytes_sent_intra_node"], metrics["bytes_sent_inter_node"],
            metrics["bytes_sent_inter_region"]) == (200, 60, 0)
    assert sum(metrics[f"bytes_sent_{level}"] for level in
               ("intra_node", "inter_node", "inter_region")) == metrics["bytes_sent"]
    assert metrics["peak_rate_inter_node"] == pytest.approx(200)
    assert metrics["peak_rate_intra_node"] == pytest.approx(3000)
    events = _Events()
    interval.add(1.0, 0.5, _traffic(0, 0))  # the next interval starts afresh
    interval.flush(events, step=3, epoch=0, lr=0.1)
    assert events.metrics["peak_rate_inter_node"] == 0


def test_without_a_cluster_no_ledger_is_recorded():
    from dsgd_cli.comm.communicator import Traffic
    from dsgd_cli.worker.interval_metrics import IntervalMetrics

    interval = IntervalMetrics()
    interval.add(1.0, 0.5, Traffic(bytes_sent=10))
    events = _Events()
    interval.flush(events, step=1, epoch=0, lr=0.1)
    assert "bytes_sent" in events.metrics
    assert not [name for name in events.metrics if "node" in name or "region" in name]
