"""`halos`: HALoS, hierarchical asynchronous local SGD (Kim et al., "Hierarchical Asynchronous
Local SGD over Slow Networks for Geo-Distributed Large Language Model Training", ICML 2025;
the servers' rules as in utnslab/halos, `ps.py` and `simulation/exec_halos.py`).

One local parameter server (LPS) per region; one global server (GPS). Workers run
`async_local_sgd`'s rounds against their region's LPS. The LPS of region r, on each arrival:

    θ_L ← lps_optimizer.step(θ_L, Δ_w);  version += 1
    if version == merged_version + K:  send U = θ_merged − θ_L to the GPS
    answer the worker with θ_L

The GPS, on U's arrival: θ_G ← gps_optimizer.step(θ_G, U), and answers the LPS with θ_G. The
LPS, on θ_G's arrival (it may have applied more updates meanwhile):

    θ_L ← (1 − merge_weight) θ_L + merge_weight · θ_G;  θ_merged ← θ_L;  merged_version ← version

(ps.py's `merge_model`: the weight is on the global model, so merge_weight 1 takes it whole;
the authors' help text describes the opposite side, their code does this.) K is
`local_updates_accumulation`; an LPS never has two sends in flight. Every event, the GPS's
included, is ordered on the modeled clock (parameter_servers.py). The LPS of a region lives
on its first rank, the GPS on rank 0 (region 0's first), each in that rank's server thread;
their messages cross the links between those ranks. At the end every worker takes the GPS's
model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsgd_cli.api import AggregatorOptions, build_optimizer, option

from plugins.aggregators import parameter_servers as ps
from plugins.aggregators.async_local_sgd import AsyncServers
from plugins.aggregators.parameter_servers import MERGE, PUSH, UP

# examples/run_halos.sh runs both servers with delayed Nesterov (halos/opt.py; see
# async_local_sgd.py): the local ones with LLR 0.2, LBETA 0.9, buffer 16, the global one with
# GLR 0.15, GBETA 0.5, buffer 2 (passed as lr = LLR × 16 and GLR × 2). It moves lr / N per
# update and adds a momentum step every N-th. A local server's default is that plain step, SGD
# with lr 0.2 (what it does at 15 of every 16 updates): Nesterov momentum 0.9 at every update
# made examples/halos_env.yaml's 16 workers oscillate (test loss up to 6.7 within 32 steps,
# 3.43 at the end) where plain SGD went to 3.22. The global server's buffer of 2 is close to
# momentum at every update: Nesterov SGD with lr 0.15 and momentum 0.5 (without it: 3.46).
LPS_OPTIMIZER = {"name": "sgd", "lr": 0.2}
GPS_OPTIMIZER = {"name": "sgd", "lr": 0.15, "momentum": 0.5, "nesterov": True}


@dataclass
class HALoSOptions(AggregatorOptions):
    period: int = option(8, min=1, help="local steps per round (H; HALoS's script: 8)")
    lps_optimizer: dict = option(LPS_OPTIMIZER, plugin="optimizer",
                                 help="each local server's optimizer section (default: "
                                      "SGD, lr 0.2: the per-update step of HALoS's delayed "
                                      "Nesterov, LLR, without its momentum every 16th update)")
    gps_optimizer: dict = option(GPS_OPTIMIZER, plugin="optimizer",
                                 help="the global server's optimizer section (default: "
                                      "Nesterov SGD, lr 0.15, momentum 0.5: HALoS's GLR and "
                                      "GBETA, whose delayed Nesterov's buffer is 2)")
    local_updates_accumulation: int = option(32, min=1, help="K: local updates between two "
                                             "sends of a local server to the global one")
    merge_weight: float = option(0.25, min=0.0, max=1.0,
                                 help="weight of the global model when a local server merges "
                                      "it with its own (HALoS's alpha)")


class HALoS(AsyncServers):
    Options = HALoSOptions

    def setup(self, ctx):
        cluster = ctx.comm.cluster
        n = ctx.world_size
        self.regions = [cluster.region(r) if cluster is not None and cluster.regions else 0
                        for r in range(n)]
        firsts: dict[int, int] = {}
        for rank, region in enumerate(self.regions):
            firsts.setdefault(region, rank)
        self.hosts_of = firsts
        self.index = {region: i for i, region in enumerate(sorted(firsts))}
        super().setup(ctx)

    def region_of(self, rank):
        return self.index[self.regions[rank]]

    def region_host(self, region: int) -> int:
        return self.hosts_of[sorted(self.hosts_of)[region]]

    def server_of(self, rank):
        return self.region_host(self.region_of(rank))

    def timeline(self, pushes):
        count = len(self.hosts_of)
        up = [ps.transfer_seconds(self.ctx, self.region_host(r), 0, self.nbytes)
              for r in range(count)]
        down = [ps.transfer_seconds(self.ctx, 0, self.region_host(r), self.nbytes)
                for r in range(count)]
        return ps.Timeline(pushes, [self.region_of(w) for w in range(self.ctx.world_size)],
                           self.options.local_updates_accumulation, up, down)

    def hosts(self, event):
        if event.kind == PUSH:
            return self.server_of(event.who) == self.ctx.rank
        return self.ctx.rank in (0, self.region_host(event.who))

    def build_servers(self, initial):
        self.local = {}
        for region in range(len(self.hosts_of)):
            if self.region_host(region) == self.ctx.rank:
                self.local[region] = ps.Server(initial, self.options.lps_optimizer,
                                               build_optimizer)
        self.merged = {region: initial.clone() for region in self.local}
        self.version = dict.fromkeys(self.local, 0)
        self.merged_version = dict.fromkeys(self.local, 0)
        self.to_global: dict[int, list[torch.Tensor]] = {}   # in-process, host 0's own LPS
        self.to_local: dict[int, list[torch.Tensor]] = {}
        self.global_ = (ps.Server(initial, self.options.gps_optimizer, build_optimizer)
                        if self.ctx.rank == 0 else None)

    def process(self, event):
        rank, comm = self.ctx.rank, self.ctx.comm
        if event.kind == PUSH:
            region = self.region_of(event.who)
            lps = self.local[region]
            lps.update(self.receive_push(event.who))
            self.version[region] += 1
            if event.sends_up:  # the K-th update since the last merge (the timeline's rule)
                change = (self.merged[region] - lps.model).contiguous()
                if rank == 0:
                    self.to_global.setdefault(region, []).append(change)
                else:
                    self.thread.sends.append(comm.isend(change, 0, self.up_group))
            self.answer(event.who, lps.model)
        elif event.kind == UP and rank == 0:  # the global server
            host = self.region_host(event.who)
            if host == 0:
                change = self.to_global[event.who].pop(0)
            else:
                change = torch.empty_like(self.start)
                comm.irecv(change, host, self.up_group).wait()
            self.global_.update(change)
            model = self.global_.model.detach().clone()
            if host == 0:
                self.to_local.setdefault(event.who, []).append(model)
            else:
                self.thread.sends.append(comm.isend(model, host, self.up_group))
        elif event.kind == MERGE and event.who in self.local:
            if rank == 0:
                model = self.to_local[event.who].pop(0)
            else:
                model = torch.empty_like(self.start)
                comm.irecv(model, 0, self.up_group).wait()
            lps = self.local[event.who]
            lps.merge(model, self.options.merge_weight)
            self.merged[event.who] = lps.model.detach().clone()
            self.merged_version[event.who] = self.version[event.who]

    def final_model(self):
        return self.global_.model.detach().clone()
