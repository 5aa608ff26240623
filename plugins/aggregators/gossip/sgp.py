"""`sgp`: Stochastic Gradient Push (Assran, Loizou, Ballas, Rabbat, ICML 2019).

Push-sum on a directed, possibly time-varying graph (state and messages: `pushsum.py`). The
model the worker computes with, and reports, is the de-biased z_i = x_i / w_i. Each step:

1. forward and backward at z_i, then the local optimizer step on z_i;
2. the step updates the numerator: x_i += Δz_i, the optimizer's change of z_i (plain SGD:
   x_i -= η g(z_i), the paper's Algorithm 1; see `PushSum.apply_update`);
3. one synchronous push-sum round with the column-stochastic shares `push_weights` of the
   topology's graph for this round; then z_i = x_i / w_i goes back into the model.

A time-varying graph advances by push-sum round, not by step: round r (the r-th round run)
uses the topology's graph r. Alone, sgp runs a round every step, so round r is step r. A
wrapper that replaces some step's round by an exchange of its own (`slowmo`'s slow step) calls
`skip_round` instead of `after_step`; the next round then takes the graph the skipped one
would have had, as the authors' gossiper does (it moves to the next graph inside each round).

Under `failures` (failure_mode "continue", docs/failures.md): the mass (x_i, w_i) a failed
node held is lost with it (its pair becomes (0, 0)); a worker keeps the share it would have
pushed to a down peer, so the live nodes' total mass is conserved from then on, and the
de-biased z_i still converge to the live numerators' average. Messages still travel to and
from a down worker, so every send meets its receive, but carry no mass. A rejoiner takes
half of the (x, w) of the lowest live rank (one message from it), so it starts from that
worker's de-biased model and the total mass is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsgd_cli.api import Aggregator, AggregatorOptions, option
from dsgd_cli.topology import Topology, push_weights

from plugins.aggregators.gossip import graph
from plugins.aggregators.gossip.graph import TopologyName
from plugins.aggregators.gossip.pushsum import PushSum, message_buffer
from plugins.aggregators.gossip.vector import ModelVector


@dataclass
class SGPOptions(AggregatorOptions):
    topology: TopologyName = option("time_varying_exponential",
                                    help="communication graph (directed where it has a variant)")
    peers_per_step: int = option(1, min=1, help="peers per step (time_varying_exponential and "
                                                "the SGP reference's graphs)")


class SGP(Aggregator):
    Options = SGPOptions
    models_identical = False
    failure_mode = "continue"  # push-sum around the down peers

    @classmethod
    def make_topology(cls, options, world_size: int, seed: int = 0) -> Topology:
        """The graph the plugin gossips on; a subclass may return any `Topology`."""
        return graph.build(options.topology, world_size, peers_per_step=options.peers_per_step,
                           seed=seed)

    @classmethod
    def check_world(cls, options, world_size, seed=0):
        graph.check_push_sum(cls.make_topology(options, world_size, seed))

    def setup(self, ctx):
        super().setup(ctx)
        self.rank, n = ctx.rank, ctx.world_size
        self.topology = self.make_topology(self.options, n, ctx.seed)
        self.vector = ModelVector(ctx, self.options.sync_buffers)
        self.state = PushSum(self.vector.read())
        self.group = ctx.comm.new_group(range(n), backend="gloo") if n > 1 else None
        self.inbox: dict[int, torch.Tensor] = {}
        self.before: torch.Tensor | None = None
        self.down: set[int] = set()  # ranks down (failures, continue)
        # Steps whose round a wrapper replaced (`skip_round`); saved in checkpoints. Counting
        # these, not the rounds run, keeps round = step for sgp alone, from any checkpoint.
        self.rounds_skipped = 0

    def before_forward(self, step):
        self.before = self.vector.read()

    def after_step(self, step):
        self.state.apply_update(self.vector.read() - self.before)
        if self.group is not None:
            self.gossip(step)
        if self.rank not in self.down:  # a down worker holds no mass: nothing to de-bias
            self.vector.write(self.state.debiased())

    def skip_round(self, step):
        """`after_step` without the push-sum round, for a wrapper whose own exchange replaces
        this step's round: the optimizer's update of the numerator is kept, and the next round
        takes the graph this one would have had. The wrapper writes the model back itself."""
        self.state.apply_update(self.vector.read() - self.before)
        self.rounds_skipped += 1

    def round_at(self, step: int) -> int:
        """The index of the round of `step`: the rounds run before it, one per step except
        the skipped ones (every worker skips the same steps, so all agree on it)."""
        return step - self.rounds_skipped

    def worker_left(self, rank, step):
        self.down.add(rank)
        if rank == self.rank:  # its mass is lost with it
            self.state.numerator.zero_()
            self.state.weight = 0.0

    def worker_rejoined(self, rank, step, source):
        """The rejoiner takes half of `source`'s (x, w): one message, source to rejoiner."""
        self.down.discard(rank)
        if self.rank == source:
            (message,) = self.state.emit({source: 0.5, rank: 0.5}, source, step, step).values()
            self.ctx.comm.send(message, rank, self.group)
        elif self.rank == rank:
            buffer = message_buffer(self.state.numerator.numel(), self.state.numerator.dtype)
            self.state.absorb(self.ctx.comm.recv(buffer, source, self.group))
            self.vector.write(self.state.debiased())

    def live_shares(self, round_index: int) -> dict[int, float]:
        """The topology's shares in round `round_index`, with those of down peers kept by this
        worker."""
        shares = dict(push_weights(self.topology, self.rank, round_index))
        for peer in self.down & shares.keys() - {self.rank}:
            shares[self.rank] += shares[peer]
            shares[peer] = 0.0
        return shares

    def gossip(self, step: int) -> None:
        """The synchronous push-sum round of `step`, on the topology's graph of that round."""
        comm, rank, state = self.ctx.comm, self.rank, self.state
        round_index = self.round_at(step)
        in_peers = self.topology.in_peers(rank, round_index)
        receives = []
        for peer in in_peers:
            buffer = self.inbox.setdefault(
                peer, message_buffer(state.numerator.numel(), state.numerator.dtype))
            receives.append(comm.irecv(buffer, peer, self.group))
        messages = state.emit(self.live_shares(round_index), rank, round_index, step)
        sends = [comm.isend(message, peer, self.group) for peer, message in messages.items()]
        for handle in receives + sends:
            handle.wait()
        for peer in in_peers:
            state.absorb(self.inbox[peer])
