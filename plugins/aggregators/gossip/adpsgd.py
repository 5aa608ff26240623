"""`adpsgd`: asynchronous decentralized parallel SGD (Lian, Zhang, Zhang, Liu, ICML 2018).

Each worker computes a gradient on its current model x̂_i and, independently of the others,
averages its model with one neighbour, x_i, x_j <- (x_i + x_j) / 2, atomically for the pair,
then applies its gradient: x_i <- (x_i + x_j) / 2 - η g(x̂_i). No barrier of any kind.

Deadlock is avoided with the paper's bipartite split (`graph.bipartite_split`): active workers
start every averaging, each with a passive neighbour drawn at random per step; passive workers
never start one. A passive worker serves requests on a background thread, from a master copy of
its model, so it answers at once whatever its training loop is doing:

* active i, in `before_forward`: sends x̂_i to the chosen passive j and posts the receive of the
  reply; forward and backward run meanwhile; in `after_backward`: sets
  x_i = (x̂_i + x_j) / 2 (x_i has not changed since it was sent, only i writes it);
* passive j, on a request: replies with its master x_j and sets it to (x_j + x̂_i) / 2 in the
  same critical section, so both end with the same average;
* passive j's loop computes its gradient on a snapshot of the master taken at the start of the
  step and adds the optimizer's change to the master at the end (x_j += Δ), so averages that
  happened in between are kept.

Shutdown: an active worker sends a stop message (a header, no model) to each of its passive
neighbours after its last step; a passive worker's server ends when all its active neighbours
have stopped.

Per-step metrics: `peer_step_lag` (this worker's step count minus the peer's, over the
averagings of the step; positive when the peer lags behind) and `gossip_averages`.
"""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass

import torch

from dsgd_cli.api import Aggregator, AggregatorOptions, option
from dsgd_cli.topology import Topology

from plugins.aggregators.gossip import graph
from plugins.aggregators.gossip.graph import TopologyName
from plugins.aggregators.gossip.vector import ModelVector, to_wire

HEADER = 3  # kind (1: average, 0: stop), sender rank, sender's step count
AVERAGE, STOP = 1.0, 0.0


@dataclass
class ADPSGDOptions(AggregatorOptions):
    topology: TopologyName = option("ring", help="graph whose active-passive edges are used")


class ADPSGD(Aggregator):
    Options = ADPSGDOptions
    models_identical = False
    asynchronous = True
    steps_may_differ = True  # an active and a passive worker need not stop together

    @classmethod
    def make_topology(cls, options, world_size: int, seed: int = 0) -> Topology:
        return graph.build(options.topology, world_size, seed=seed, undirected=True)

    @classmethod
    def check_world(cls, options, world_size, seed=0):
        graph.bipartite_split(cls.make_topology(options, world_size, seed))

    def setup(self, ctx):
        super().setup(ctx)
        self.rank, n = ctx.rank, ctx.world_size
        active, neighbours = graph.bipartite_split(self.make_topology(self.options, n, ctx.seed))
        self.active = active[self.rank]
        self.neighbours = neighbours[self.rank]
        self.vector = ModelVector(ctx, self.options.sync_buffers)
        self.group = ctx.comm.new_group(range(n), backend="gloo") if n > 1 else None
        self.rng = random.Random(f"adpsgd:{ctx.seed}:{self.rank}")
        self.lock = threading.Lock()
        self.lag_sum, self.lag_count, self.averages = 0.0, 0, 0  # guarded by lock
        self.steps = 0
        self.server: threading.Thread | None = None
        self.error: BaseException | None = None
        if self.group is None:
            return
        if self.active:
            self.reply = torch.empty(HEADER + self.vector.numel, dtype=self.vector.dtype)
        else:
            self.master = self.vector.read()
            self.server = threading.Thread(target=self._serve, daemon=True,
                                           name=f"adpsgd-server-{self.rank}")
            self.server.start()

    # -- the training loop ----------------------------------------------------------------------

    def before_forward(self, step):
        if self.group is None:
            return
        if self.active:
            comm = self.ctx.comm
            self.sent = self.vector.read()
            self.peer = self.rng.choice(self.neighbours)
            request = torch.empty(HEADER + self.vector.numel, dtype=self.vector.dtype)
            request[:HEADER] = torch.tensor([AVERAGE, self.rank, self.steps])
            request[HEADER:] = to_wire(self.sent)
            self.handles = [comm.irecv(self.reply, self.peer, self.group),
                            comm.isend(request, self.peer, self.group)]
        else:
            self._check()
            with self.lock:
                self.snapshot = self.master.clone()
            self.vector.write(self.snapshot)

    def after_backward(self, step):
        if self.group is None or not self.active:
            return
        for handle in self.handles:
            handle.wait()
        peer_model = self.reply[HEADER:].to(self.sent.device)
        # For parameters `current - sent` is exactly zero; for buffers it keeps what forward
        # changed since the request was sent.
        mixed = (self.sent + peer_model) * 0.5 + (self.vector.read() - self.sent)
        self.vector.write(mixed)
        with self.lock:
            self.lag_sum += self.steps - int(self.reply[2])
            self.lag_count += 1
            self.averages += 1

    def after_step(self, step):
        if self.group is None:
            return
        if not self.active:
            delta = self.vector.read() - self.snapshot
            with self.lock:
                self.master.add_(delta)
                current = self.master.clone()
            self.vector.write(current)
        with self.lock:
            self.steps += 1
            lag_sum, lag_count, averages = self.lag_sum, self.lag_count, self.averages
            self.lag_sum, self.lag_count, self.averages = 0.0, 0, 0
        self.ctx.metrics.log("gossip_averages", averages)
        if lag_count:
            self.ctx.metrics.log("peer_step_lag", lag_sum / lag_count)

    def finish(self):
        if self.group is None:
            return
        if self.active:
            # A header only: gloo delivers it into the passive worker's larger request buffer.
            stop = torch.tensor([STOP, self.rank, self.steps], dtype=self.vector.dtype)
            for peer in self.neighbours:
                self.ctx.comm.isend(stop, peer, self.group).wait()
        else:
            while self.server.is_alive():
                self.server.join(timeout=0.1)
                self._check()
            self._check()
            self.vector.write(self.master)

    # -- the passive worker's server ------------------------------------------------------------

    def _serve(self) -> None:
        try:
            with self.ctx.comm.background():
                self._serve_requests()
        except BaseException as error:  # raised in the training loop by _check
            self.error = error

    def _serve_requests(self) -> None:
        comm = self.ctx.comm
        request = torch.empty(HEADER + self.vector.numel, dtype=self.vector.dtype)
        reply = torch.empty_like(request)
        running = len(self.neighbours)  # every neighbour of a passive worker is active
        while running:
            comm.irecv(request, None, self.group,  # a stop is a header only
                       length=lambda m: HEADER if float(m[0]) == STOP else m.numel()).wait()
            kind, sender, sender_steps = (int(v) for v in request[:HEADER].tolist())
            if kind == STOP:
                running -= 1
                continue
            model = request[HEADER:].to(self.master.device)
            with self.lock:
                reply[:HEADER] = torch.tensor([AVERAGE, self.rank, self.steps])
                reply[HEADER:] = to_wire(self.master)
                self.master.add_(model).mul_(0.5)
                self.lag_sum += self.steps - sender_steps
                self.lag_count += 1
                self.averages += 1
            comm.isend(reply, sender, self.group).wait()

    def _check(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"adpsgd server thread failed: {self.error!r}") from self.error
