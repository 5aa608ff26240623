"""`async_local_sgd`: asynchronous local SGD with a parameter server, the asynchronous
baseline of HALoS (Kim et al., ICML 2025; utnslab/halos, `exec_async_local_sgd.py`).

Each worker takes `period` (H) steps with the experiment's optimizer from the server's model
θ_s it last received, then sends its pseudo-gradient Δ_w = θ_s − θ_w to the parameter server,
which applies it at once with its own optimizer (`outer_optimizer`, Δ_w as the gradient):

    θ_PS ← outer_optimizer.step(θ_PS, Δ_w)

and answers with θ_PS, from which the worker starts its next round. No barrier: a fast worker
contributes more updates per modeled second (with a length in steps every worker makes the same
number of rounds, the fast ones sooner). The order of the server's updates is the modeled
clock's (plugins/aggregators/parameter_servers.py), so a run is reproducible from its seed.
The server lives on rank 0, beside its training loop, in a background thread; at the end every
worker takes the server's final model (one broadcast), which the run evaluates.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsgd_cli.api import Aggregator, AggregatorOptions, build_optimizer, option

from plugins.aggregators import parameter_servers as ps
from plugins.aggregators.parameter_servers import MERGE, PUSH, UP

# HALoS's asynchronous baseline (utnslab/halos, examples/run_async_local_sgd.sh) runs its
# server with delayed Nesterov (DN, Liu et al. 2024, arXiv 2401.09135; halos/opt.py): GLR 0.05,
# GBETA 0.9, buffer N = 32, passed as lr = GLR × N = 1.6. DN moves the model by lr / N = GLR
# per pseudo-gradient, plain SGD, and once every N of them adds its momentum step. DN is not
# built in; the default is its plain step, SGD with lr GLR = 0.05, what DN does at 31 of every
# 32 updates (and at all of the first 31). Momentum at every update does not translate it:
# Nesterov SGD with lr 0.05 and momentum 0.9 (DN's long-run step, 0.5 per update) made the
# 16 workers of examples/halos_env.yaml diverge (test loss 3.3 to 8.9 and 5.31 at the end of
# 32 steps), and DN's memory (momentum 0.9^(1/32), lr 0.0016) drifted up (3.79), where plain
# SGD with lr 0.05 went down steadily to 3.17 (lr 0.0625 = 1/16: 3.13). On
# examples/noloco.yaml it reaches test accuracy 0.305 (diloco 0.299). (The first default,
# DiLoCo's lr 0.7 with momentum 0.5 at every update, stayed at chance there.)
DEFAULT_SERVER_OPTIMIZER = {"name": "sgd", "lr": 0.05}

REFUSAL = ("the servers' event order is computed from the workers' modeled timelines, which a "
           "failure would change: run without failures")


@dataclass
class AsyncLocalSGDOptions(AggregatorOptions):
    period: int = option(32, min=1, help="local steps per round (H; HALoS's script: 32)")
    outer_optimizer: dict = option(DEFAULT_SERVER_OPTIMIZER, plugin="optimizer",
                                   help="the parameter server's optimizer section, applied at "
                                        "every pseudo-gradient (default: SGD, lr 0.05: the "
                                        "per-update step of HALoS's script's delayed Nesterov, "
                                        "GLR 0.05, without its momentum every 32nd update)")


class AsyncServers(Aggregator):
    """The worker side of servers that apply pseudo-gradients as they arrive; a subclass says
    where servers live (`server_of`) and what they do (`process`)."""

    models_identical = False
    asynchronous = True
    failure_mode = None
    failure_refusal = REFUSAL

    # -- where the servers live ---------------------------------------------------------------

    def region_of(self, rank: int) -> int:
        return 0

    def server_of(self, rank: int) -> int:
        """The rank holding the server that `rank` pushes to."""
        return 0

    def timeline(self, pushes: list[list[float]]) -> ps.Timeline:
        return ps.Timeline(pushes)

    def build_servers(self, initial: torch.Tensor) -> None:
        raise NotImplementedError

    def process(self, event: ps.Event) -> None:
        raise NotImplementedError

    def final_model(self) -> torch.Tensor:
        raise NotImplementedError

    # -- setup ----------------------------------------------------------------------------

    def setup(self, ctx):
        super().setup(ctx)
        n = ctx.world_size
        self.params = ctx.parameters()
        self.start = ps.flat_params(self.params).to("cpu").clone()  # θ_s of this round
        self.nbytes = self.start.numel() * self.start.element_size()
        self.rounds_total = ps.run_rounds(ctx, self.options.period)
        self.rounds = 0
        self.group = ctx.comm.new_group(range(n), backend="gloo") if n > 1 else None
        self.up_group = ctx.comm.new_group(range(n), backend="gloo") if n > 1 else None
        self.pushes = [ps.worker_arrivals(
            ps.round_durations(ctx, w, self.options.period, self.rounds_total),
            ps.transfer_seconds(ctx, w, self.server_of(w), self.nbytes),
            ps.transfer_seconds(ctx, self.server_of(w), w, self.nbytes)) for w in range(n)]
        self.events = self.timeline(self.pushes).events
        self.mine = [e for e in self.events if self.hosts(e)]
        self.inbox = ps.Mailbox()    # to this rank's server, from its own training loop
        self.outbox = ps.Mailbox()   # from this rank's server to its own training loop
        self.thread = None
        if self.mine:
            self.build_servers(self.start)
            self.thread = ps.ServerThread(ctx.comm, self.mine, self.process,
                                          f"{type(self).__name__}-server-{ctx.rank}")
            self.thread.start()

    def hosts(self, event: ps.Event) -> bool:
        """Whether this rank's server thread takes part in `event`."""
        if event.kind == PUSH:
            return self.server_of(event.who) == self.ctx.rank
        return self.ctx.rank in (0, self.region_host(event.who))

    def region_host(self, region: int) -> int:
        return 0

    # -- the training loop --------------------------------------------------------------------

    def after_step(self, step):
        if (step + 1) % self.options.period or self.rounds >= self.rounds_total:
            return
        comm, k = self.ctx.comm, self.rounds
        delta = (self.start - ps.flat_params(self.params).to("cpu")).contiguous()
        server = self.server_of(self.ctx.rank)
        reply = torch.empty_like(delta)
        if server == self.ctx.rank:
            self.inbox.queue.put(delta)
            with comm.blocked():
                reply = self._own_reply()
        else:
            handles = [comm.isend(delta, server, self.group),
                       comm.irecv(reply, server, self.group)]
            for handle in handles:
                handle.wait()
        self.start = reply.clone()
        ps.write_flat(reply, self.params)
        self.rounds += 1
        # The next round starts when the reply arrives on the modeled clock: wait for it there.
        arrival = self.pushes[self.ctx.rank][k] + ps.transfer_seconds(
            self.ctx, server, self.ctx.rank, self.nbytes)
        if self.ctx.experiment is not None and self.ctx.experiment.compute is not None:
            with comm.blocked():
                self.ctx.clock.sleep_until(arrival)
            self.ctx.metrics.log("schedule_lag", self.ctx.clock.elapsed() - arrival)
        self.ctx.metrics.log("server_rounds", self.rounds)

    def _own_reply(self) -> torch.Tensor:
        while True:
            try:
                return self.outbox.queue.get(timeout=0.1)
            except Exception:  # queue.Empty: look whether the server failed meanwhile
                if self.thread is not None:
                    self.thread.check()
                if self.thread is None or not self.thread.is_alive():
                    raise RuntimeError("the server thread ended before answering") from None

    def finish(self):
        if self.thread is not None:
            self.thread.join()
            self.thread.check()
        if self.rounds_total == 0:  # fewer steps than a period: no round, no server's model
            return  # each worker keeps its own, as diloco's workers do without an outer step
        final = self.final_model() if self.ctx.rank == 0 else torch.empty_like(self.start)
        final = final.to(self.ctx.device)
        if self.ctx.world_size > 1:
            self.ctx.comm.broadcast(final, 0)
        ps.write_flat(final, self.params)

    # -- messages of a server thread ----------------------------------------------------------

    def receive_push(self, worker: int) -> torch.Tensor:
        if worker == self.ctx.rank:
            return self.inbox.queue.get()
        buffer = torch.empty_like(self.start)
        self.ctx.comm.irecv(buffer, worker, self.group).wait()
        return buffer

    def answer(self, worker: int, model: torch.Tensor) -> None:
        if worker == self.ctx.rank:
            self.outbox.queue.put(model.clone())
        else:
            self.thread.sends.append(self.ctx.comm.isend(model.clone(), worker, self.group))

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        raise ValueError(f"{type(self).__name__} cannot resume from a checkpoint: its servers' "
                         "state and messages in flight are not saved")


class AsyncLocalSGD(AsyncServers):
    Options = AsyncLocalSGDOptions

    def build_servers(self, initial):
        self.server = ps.Server(initial, self.options.outer_optimizer, build_optimizer)

    def process(self, event):
        assert event.kind == PUSH
        self.server.update(self.receive_push(event.who))
        self.answer(event.who, self.server.model)

    def final_model(self):
        return self.server.model.detach().clone()


__all__ = ["AsyncLocalSGD", "AsyncServers", "MERGE", "UP"]
