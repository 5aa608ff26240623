"""`lsgd`: Leader SGD (Teng, Gao, Huang, Liu, Choromanska, NeurIPS 2019).

Workers train on their own and are pulled towards a leader, the worker with the lowest recent
training loss, instead of being averaged:

    x_i <- x_i - λ (x_i - x_leader)

Two levels, as in the paper: workers form groups of `group_size` consecutive ranks (a node);
every `period` steps each group elects its local leader and its members are pulled towards it
with strength `pull`; every `global_period` steps all workers elect the global leader and are
pulled towards it with strength `global_pull`. A leader is not pulled (it would move towards
itself). "Recent training loss" is the mean training loss of a worker's steps since that
level's previous election; losses are exchanged with an all-gather and the leader's model
reaches its followers with a broadcast.

Where both levels elect at the same step the pulls apply in order, local then global, as in
the authors' code: x' = x - λ (x - x_l), then x'' = x' - λ_G (x' - x'_g). The paper writes the
sum x - λ (x - x_l) - λ_G (x - x_g); the two differ by λ·λ_G·(x - x_l).

`pull: 0` is independent SGD; `pull: 1` copies the leader. Logs `leader_rank` (the local
leader of this worker's group) and `global_leader_rank` at the steps where they are elected.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsgd_cli.api import Aggregator, AggregatorOptions, Group, flatten, option, unflatten_into


@dataclass
class LSGDOptions(AggregatorOptions):
    period: int = option(4, min=1, help="steps between local leader elections and pulls")
    pull: float = option(0.1, min=0.0, max=1.0, help="pulling strength towards the local leader (λ)")
    group_size: int | None = option(None, min=1, help="workers per local group (default: all)")
    global_period: int = option(16, min=1, help="steps between global leader elections and pulls")
    global_pull: float = option(0.1, min=0.0, max=1.0, help="pulling strength towards the global leader")


class _Level:
    """One level of leadership: a group of workers, how often it elects, how hard it pulls."""

    def __init__(self, ranks: tuple[int, ...], group: Group | None, period: int, pull: float,
                 metric: str):
        self.ranks, self.group = ranks, group
        self.period, self.pull, self.metric = period, pull, metric
        self.loss_sum, self.loss_steps = 0.0, 0

    def recent_loss(self) -> float:
        return self.loss_sum / self.loss_steps if self.loss_steps else float("inf")


class LSGD(Aggregator):
    Options = LSGDOptions
    models_identical = False

    @classmethod
    def check_world(cls, options, world_size):
        if options.group_size is not None and options.group_size > world_size:
            raise ValueError(f"group_size {options.group_size} is larger than the "
                             f"{world_size} workers")

    def setup(self, ctx):
        super().setup(ctx)
        n, size = ctx.world_size, self.options.group_size or ctx.world_size
        self.tensors = [t.detach() for t in ctx.parameters()]
        if self.options.sync_buffers:
            self.tensors += ctx.buffers()
        local_ranks, local_group = tuple(range(n)), None
        if size < n:
            for start in range(0, n, size):  # every rank creates every group, in order
                ranks = tuple(range(start, min(start + size, n)))
                group = ctx.comm.new_group(ranks)
                if ctx.rank in ranks:
                    local_ranks, local_group = ranks, group
        self.levels = [
            _Level(local_ranks, local_group, self.options.period, self.options.pull, "leader_rank"),
            _Level(tuple(range(n)), None, self.options.global_period, self.options.global_pull,
                   "global_leader_rank")]

    def state_dict(self) -> dict:
        """Each level's losses since its last election."""
        return {"losses": [(level.loss_sum, level.loss_steps) for level in self.levels]}

    def load_state_dict(self, state: dict) -> None:
        for level, (loss_sum, loss_steps) in zip(self.levels, state["losses"]):
            level.loss_sum, level.loss_steps = loss_sum, loss_steps

    def after_step(self, step):
        loss = float(self.ctx.loss)
        for level in self.levels:
            level.loss_sum += loss
            level.loss_steps += 1
            if (step + 1) % level.period == 0:
                self._follow_leader(level)

    def leader(self, level: _Level) -> int:
        """The rank with the lowest recent loss in the level's group (ties: the lowest rank)."""
        comm = self.ctx.comm
        mine = torch.tensor([level.recent_loss()], dtype=torch.float64, device=comm.device)
        losses = torch.cat(comm.all_gather(mine, group=level.group))
        return level.ranks[int(torch.argmin(losses))]  # argmin returns the first minimum

    def _follow_leader(self, level: _Level) -> None:
        leader = self.leader(level)
        level.loss_sum, level.loss_steps = 0.0, 0
        self.ctx.metrics.log(level.metric, leader)
        if len(level.ranks) == 1:
            return
        model = flatten(self.tensors)
        leader_model = model.clone()
        self.ctx.comm.broadcast(leader_model, src=leader, group=level.group)
        if self.ctx.rank != leader:
            # lerp is exact at both ends: pull 0 keeps x_i, pull 1 gives x_leader bit for bit.
            unflatten_into(torch.lerp(model, leader_model, level.pull), self.tensors)
