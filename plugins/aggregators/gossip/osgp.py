"""`osgp`: Overlap SGP (Assran et al., ICML 2019, the overlap variant of `sgp`).

The same push-sum as `sgp`, but the rounds run on background threads (`overlap.py`): a
worker sends its shares without blocking and adds what it receives when it arrives, so
communication hides behind computation. The delay is bounded: the model a worker has after
step s must have gone through a complete push-sum round (sent, and this round's shares from all
in-peers added) by the end of step s + tau, else the worker waits (with tau = 1, each round
overlaps one step of computation). Rounds are driven by the peers' threads, never by their
training loops, so a fast worker never waits for a slow worker's computation.

Per-step metrics: `gossip_wait_seconds` (time the loop blocked on the bound),
`gossip_rounds` (rounds completed during the step), `gossip_staleness` (steps whose state has
not been through a complete round yet, at most tau) and `peer_step_lag` (this worker's step
count minus the sender's, averaged over the messages added during the step: positive when the
peers lag behind, negative when they are ahead).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsgd_cli.api import Aggregator, option

from plugins.aggregators.gossip import graph
from plugins.aggregators.gossip.overlap import OverlapGossip
from plugins.aggregators.gossip.pushsum import PushSum
from plugins.aggregators.gossip.sgp import SGP, SGPOptions
from plugins.aggregators.gossip.vector import ModelVector


@dataclass
class OSGPOptions(SGPOptions):
    tau: int = option(1, min=1, help="each step's model must finish a round within tau steps")


class OSGP(Aggregator):
    Options = OSGPOptions
    models_identical = False
    asynchronous = True

    @classmethod
    def make_topology(cls, options, world_size: int, seed: int = 0):
        """SGP's graphs; `check_world` also requires rounds to balance."""
        return SGP.make_topology(options, world_size, seed)

    @classmethod
    def check_world(cls, options, world_size, seed=0):
        graph.check_push_sum(cls.make_topology(options, world_size, seed), balanced_rounds=True)

    def setup(self, ctx):
        super().setup(ctx)
        n = ctx.world_size
        self.topology = self.make_topology(self.options, n, ctx.seed)
        self.vector = ModelVector(ctx, self.options.sync_buffers)
        self.state = PushSum(self.vector.read())
        self.gossip: OverlapGossip | None = None
        if n > 1:
            group = ctx.comm.new_group(range(n), backend="gloo")
            self.gossip = OverlapGossip(ctx.comm, group, self.topology, ctx.rank, self.state)
        self.before: torch.Tensor | None = None

    def before_forward(self, step):
        # Take in whatever arrived since the last step.
        with self._locked():
            z = self.state.debiased()
        self.vector.write(z)
        self.before = z

    def after_step(self, step):
        delta = self.vector.read() - self.before
        with self._locked():
            self.state.apply_update(delta)
        if self.gossip is not None:
            self.gossip.stepped()  # the sender may start a round with the updated state
            waited = self.gossip.wait_for_bound(self.options.tau)
            with self.gossip.lock:
                stats = self.gossip.stats.take()
                staleness = self.gossip.steps - self.gossip.covered
            metrics = self.ctx.metrics
            metrics.log("gossip_wait_seconds", self.ctx.clock.to_modeled(waited))
            metrics.log("gossip_rounds", stats.rounds)
            metrics.log("gossip_staleness", staleness)
            if stats.lag_count:
                metrics.log("peer_step_lag", stats.lag_sum / stats.lag_count)
        with self._locked():
            z = self.state.debiased()
        self.vector.write(z)

    def finish(self):
        if self.gossip is not None:
            self.gossip.close()
            self.vector.write(self.state.debiased())

    def _locked(self):
        return self.gossip.lock if self.gossip is not None else _NoLock()


class _NoLock:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
