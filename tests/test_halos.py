"""`halos` (issue 51): HALoS's local servers (one per region) and global server, every event on
the modeled clock. Four gloo workers in two regions (a fake cluster: ranks 0–1 and 2–3, a
slower link between regions) with a fake compute model run the plugin; the reference replays
the same workers in one process, driven by the same event order, with the servers' rules of
HALoS's ps.py and exec_halos.py (update, accumulation of K updates, merge)."""

from __future__ import annotations

import pytest
import torch

import frontier_helpers as h
from distributed import run_workers
from dsgd_cli.api import RunLength

WORKERS = 4
PERIOD = 2
STEPS = 9
K = 2
MERGE_WEIGHT = 0.3
SPEED = [1.0, 0.45, 0.7, 0.9]
LPS = {"name": "sgd", "lr": 0.5, "momentum": 0.9, "nesterov": True}
GPS = {"name": "sgd", "lr": 0.6, "momentum": 0.5, "nesterov": True}


def fake_step_seconds(ctx, rank, step):
    return (1.0 + 0.1 * ((step * 7 + rank) % 3)) / SPEED[rank]


class FakeCluster:
    """Two regions of two ranks; 50 ms between regions, nothing inside one."""
    regions = [1, 1]

    def region(self, rank):
        return rank // 2

    def speed(self, rank):
        return 1.0

    def level(self, source, destination):
        return "inter_region" if self.region(source) != self.region(destination) else "intra_node"

    def broadcast_seconds(self, *args, **kwargs):
        return 0.0

    def p2p_seconds(self, source, destination, nbytes):
        return 0.05 if self.region(source) != self.region(destination) else 0.0


def _sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _scenario(rank, n, merge_weight=MERGE_WEIGHT):
    from plugins.aggregators import parameter_servers as ps
    from plugins.aggregators.halos import HALoS

    torch.set_num_threads(1)
    ps.modeled_step_seconds = fake_step_seconds
    ctx = h.context(rank, n, _sgd)
    ctx.comm.cluster = FakeCluster()
    ctx.comm._traffic = ctx.comm._new_traffic()  # counted per link level from now on
    ctx.length = RunLength(steps=STEPS)
    aggregator = HALoS(HALoS.Options(period=PERIOD, lps_optimizer=LPS, gps_optimizer=GPS,
                                     local_updates_accumulation=K, merge_weight=merge_weight))
    aggregator.setup(ctx)
    models, inter_region = [], []
    for step in range(STEPS):
        h.step(aggregator, ctx, step)
        models.append(h.flat(ctx.model))
        inter_region.append(ctx.comm.take_traffic().sent_by_level["inter_region"])
    aggregator.thread is None or aggregator.thread.join()  # the servers' last sends counted
    inter_region[-1] += ctx.comm.take_traffic().sent_by_level["inter_region"]
    ctx.comm.cluster = None  # the final broadcast, on the plain network
    ctx.comm._traffic = ctx.comm._new_traffic()
    aggregator.finish()
    return {"models": models, "final": h.flat(ctx.model), "inter_region": inter_region,
            "events": [(e.kind, e.who, e.round) for e in aggregator.events]}


@pytest.fixture(scope="module")
def scenarios():
    return run_workers(_scenario, WORKERS, preloaded=True)


def reference(events) -> dict:
    """HALoS's servers, replayed in `events`' order."""
    nets = [h.model() for _ in range(WORKERS)]
    optimizers = [_sgd(net.parameters()) for net in nets]
    initial = h.flat(nets[0])
    start = [initial.clone() for _ in nets]

    def server(section):
        model = initial.clone()
        return model, torch.optim.SGD([model], lr=section["lr"], momentum=section["momentum"],
                                      nesterov=True)

    lps = [server(LPS) for _ in range(2)]
    gps = server(GPS)
    merged = [initial.clone() for _ in range(2)]
    version, merged_version = [0, 0], [0, 0]
    to_gps, to_lps = {}, {}
    after_round = {}
    for kind, who, _ in events:
        if kind == "push":
            w, region = who, who // 2
            k = sum(1 for key in after_round if key[0] == w)
            net, optimizer = nets[w], optimizers[w]
            for s in range(PERIOD):
                optimizer.zero_grad()
                for p, g in zip(net.parameters(), h.gradients(net, w, k * PERIOD + s)):
                    p.grad = g
                optimizer.step()
            model, opt = lps[region]
            model.grad = start[w] - h.flat(net)  # ps.py update_model
            opt.step()
            version[region] += 1
            if version[region] == merged_version[region] + K:  # exec_halos.py
                to_gps[region] = merged[region] - model.detach()
            start[w] = model.detach().clone()
            torch.nn.utils.vector_to_parameters(start[w].clone(), net.parameters())
            after_round[(w, k)] = start[w]
        elif kind == "up":
            model, opt = gps
            model.grad = to_gps.pop(who)
            opt.step()
            to_lps[who] = model.detach().clone()
        else:  # merge: ps.py merge_model, the weight on the global model
            model, _ = lps[who]
            with torch.no_grad():
                model.mul_(1 - MERGE_WEIGHT).add_(to_lps.pop(who) * MERGE_WEIGHT)
            merged[who] = model.detach().clone()
            merged_version[who] = version[who]
    return {"after_round": after_round, "final": gps[0].detach().clone()}


def test_every_rank_computes_the_same_event_order(scenarios):
    events = scenarios[0]["events"]
    assert all(result["events"] == events for result in scenarios)
    kinds = [kind for kind, _, _ in events]
    assert kinds.count("push") == WORKERS * (STEPS // PERIOD)
    assert kinds.count("up") == kinds.count("merge") >= 2
    # an accumulated change travels and comes back before the region's next send
    for region in range(2):
        mine = [kind for kind, who, _ in events if kind != "push" and who == region]
        assert mine == ["up", "merge"] * (len(mine) // 2)


def test_halos_equals_the_servers_rules(scenarios):
    want = reference(scenarios[0]["events"])
    for rank, result in enumerate(scenarios):
        for k in range(STEPS // PERIOD):
            got = result["models"][(k + 1) * PERIOD - 1]
            assert torch.allclose(got, want["after_round"][(rank, k)], atol=1e-6, rtol=0), (rank, k)
        assert torch.allclose(result["final"], want["final"], atol=1e-6, rtol=0)


def test_only_the_servers_exchanges_cross_regions(scenarios):
    numel = h.flat(h.model()).numel()
    exchanges = sum(1 for kind, _, _ in scenarios[0]["events"] if kind == "up")
    ups = sum(1 for kind, who, _ in scenarios[0]["events"] if kind == "up" and who == 1)
    assert sum(scenarios[1]["inter_region"]) == 0 and sum(scenarios[3]["inter_region"]) == 0
    assert sum(scenarios[2]["inter_region"]) == ups * numel * 8  # region 1's LPS to the GPS
    assert exchanges > ups
