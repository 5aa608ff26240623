"""`allreduce`: synchronous data-parallel SGD, g = (1/n) Σ g_i, models identical.

Uncompressed, it works like torch DDP: gradients are grouped into buckets in the order backward
produces them, and each bucket's all-reduce starts as soon as its last gradient is accumulated,
so communication overlaps with the rest of backward.

With a compressor, the gradients are averaged after backward through
`compressed_average`: they are laid end to end in one flat bucket (per dtype), the compressor
turns the bucket into one payload, keeping per parameter what its algorithm defines per tensor
(QSGD's norms, ef_sign's scale, top-k's k; PowerSGD gets each gradient with its shape), and
all payloads travel together in one collective (two for PowerSGD and dqsgd). Error feedback
applies when the spec asks for it or the compressor requires it, with one flat residual per
bucket.

`hierarchical: true` averages each bucket in three collectives over the nodes of the spec's
`cluster` (as NCCL and Horovod do on clusters of multi-GPU nodes): a reduce-scatter inside
each node, an all-reduce of each slice across nodes among the members holding that slice, and
an all-gather inside the node. Only the across-node all-reduce crosses a node's link, with
1/w of the bucket per member (w workers per node): 2(N-1)/N of a model leaves each node per
step (N nodes) where a flat ring sends 2(p-1)/p. The sum is the flat one, added in another
order. Without a cluster every worker counts as one node's: it is the flat all-reduce.

`momentum_before_compression` moves momentum in front of the compressor (Zheng et al., 2019):
each worker keeps m <- beta m + g and compresses m, and the optimizer, without momentum of its
own, applies the average. Sign compressors with error feedback need it: behind the compressor,
momentum re-applies the delayed residuals for many steps and training stalls.
"""

from __future__ import annotations

import math
import time

from dataclasses import dataclass

import torch

from dsgd_cli.api import (Aggregator, AggregatorOptions, ErrorFeedback, Handle,
                          compressed_average, flatten, option, unflatten_into)


@dataclass
class AllReduceOptions(AggregatorOptions):
    bucket_mb: float = option(25.0, min=0.0, help="gradient bucket size in MiB (DDP's default)")
    overlap: bool = option(True, help="start each bucket's all-reduce during backward")
    momentum_before_compression: float = option(
        0.0, min=0.0, max=0.999,
        help="momentum kept on each worker and compressed instead of the gradient (use an "
             "optimizer without momentum)")
    hierarchical: bool = option(
        False, help="reduce-scatter inside each node of the cluster, all-reduce the slices "
                    "across nodes, all-gather inside the node; after backward, no overlap "
                    "(each collective needs the previous one's result: overlapping would "
                    "wait inside backward's hooks, in one order on every rank)")

    def __post_init__(self):
        if self.hierarchical and self.momentum_before_compression > 0:
            raise ValueError("hierarchical: true averages gradients uncompressed; it does not "
                             "take momentum_before_compression")


class _Bucket:
    """Consecutive parameters whose gradients travel together in one flat buffer."""

    def __init__(self, index: int, params: list[torch.nn.Parameter]):
        self.index = index
        self.params = params
        self.buffer = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype,
                                  device=params[0].device)
        self.views = list(self.buffer.split([p.numel() for p in params]))
        self.pending = len(params)
        self.handle: Handle | None = None


FIRST_BUCKET_BYTES = 2**20  # as DDP: a small first bucket starts communication early


def _bucket_params(params: list[torch.nn.Parameter], limit_bytes: float) -> list[list]:
    groups, current, size = [], [], 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        limit = min(limit_bytes, FIRST_BUCKET_BYTES) if not groups else limit_bytes
        if current and (size + nbytes > limit or p.dtype != current[0].dtype):
            groups.append(current)
            current, size = [], 0
        current.append(p)
        size += nbytes
    return groups + [current] if current else groups


class _Hierarchy:
    """The groups of a hierarchical all-reduce: this worker's node, and the members of every
    node with its own place in its node (they hold the same slice). Every rank makes every
    group, in the same order."""

    def __init__(self, comm):
        n = comm.world_size
        cluster = comm.cluster
        self.comm = comm
        self.per_node = per_node = cluster.workers_per_node if cluster is not None else n
        nodes = n // per_node
        node_groups = [comm.new_group(range(k * per_node, (k + 1) * per_node))
                       for k in range(nodes)] if per_node > 1 else []
        slice_groups = [comm.new_group(range(i, n, per_node))
                        for i in range(per_node)] if nodes > 1 else []
        self.node = node_groups[comm.rank // per_node] if node_groups else None
        self.across = slice_groups[comm.rank % per_node] if slice_groups else None

    def all_reduce(self, buffer: torch.Tensor) -> None:
        """Sum `buffer` over every worker, in place."""
        comm, per_node = self.comm, self.per_node
        if self.node is None:  # one worker per node: the flat ring across nodes
            comm.all_reduce(buffer, "sum", group=self.across)
            return
        # Pad to a multiple of the node's size: member i of each node holds slice i.
        length = math.ceil(buffer.numel() / per_node) * per_node
        padded = torch.zeros(length, dtype=buffer.dtype, device=buffer.device)
        padded[:buffer.numel()] = buffer
        part = comm.reduce_scatter(padded, group=self.node)
        if self.across is not None:
            # The node's members send their slices across at once: they share its link.
            comm.all_reduce(part, "sum", group=self.across, concurrent=per_node)
        gathered = comm.all_gather(part, group=self.node)
        buffer.copy_(torch.cat(gathered)[:buffer.numel()])


class AllReduce(Aggregator):
    Options = AllReduceOptions
    supports_compression = True

    @classmethod
    def check_compressor(cls, options, compressor):
        if options.hierarchical and not compressor.identity:
            raise ValueError("hierarchical: true averages gradients uncompressed; remove the "
                             "compressor")

    def setup(self, ctx):
        super().setup(ctx)
        self.compressor = ctx.compressor
        self.momentum: dict[str, torch.Tensor] = {}
        self.compressed = (not self.compressor.identity
                           or self.options.momentum_before_compression > 0)
        use_memory = self.options.error_feedback or self.compressor.requires_error_feedback
        self.memory = ErrorFeedback() if use_memory else None
        self.params = ctx.parameters()
        self.buffers = ctx.buffers() if self.options.sync_buffers else []
        if self.compressed:
            self.keys = [f"param{index}" for index in range(len(self.params))]
            return
        self.hierarchy = _Hierarchy(ctx.comm) if self.options.hierarchical else None
        self.next_to_launch = 0
        if ctx.world_size == 1:
            # A world of one: its gradient is the average, its buffers are everyone's. No
            # bucket, no collective, no hook (DDP at world size 1 still all-reduces each).
            self.buckets, self.buffers = [], []
            return
        # Backward produces gradients roughly from the last layer to the first.
        ordered = list(reversed(self.params))
        self.buckets = [_Bucket(i, group) for i, group in
                        enumerate(_bucket_params(ordered, self.options.bucket_mb * 2**20))]
        self.bucket_of = {id(p): b for b in self.buckets for p in b.params}
        # With one bucket there is nothing to overlap: it can only go once backward is done.
        # Skipping the per-parameter Python hooks then saves their cost on every step. The
        # hierarchical all-reduce is three collectives in a row: it goes after backward.
        if self.options.overlap and len(self.buckets) > 1 and self.hierarchy is None:
            for p in ordered:
                p.register_post_accumulate_grad_hook(self._on_grad_ready)

    # -- uncompressed: bucketed, overlapped with backward -------------------------------------

    def _on_grad_ready(self, param: torch.nn.Parameter) -> None:
        bucket = self.bucket_of[id(param)]
        if bucket.index < self.next_to_launch:
            raise RuntimeError("a parameter received a second gradient after its bucket was "
                               "sent (two backward passes in one step?); use overlap: false")
        bucket.pending -= 1
        # Launch strictly in bucket order so every worker issues the same collectives in
        # the same order, whatever order its hooks fire in.
        while (self.next_to_launch < len(self.buckets)
               and self.buckets[self.next_to_launch].pending == 0):
            self._launch(self.buckets[self.next_to_launch])

    def _launch(self, bucket: _Bucket) -> None:
        n = self.ctx.world_size
        for p, view in zip(bucket.params, bucket.views):
            if p.grad is None:  # a parameter this step did not use
                view.zero_()
            else:  # divide on the way in: the sum that comes back is the average
                torch.div(p.grad.reshape(-1), n, out=view)
        self.next_to_launch += 1
        if self.hierarchy is not None:
            self.hierarchy.all_reduce(bucket.buffer)
            bucket.handle = None
            return
        bucket.handle = self.ctx.comm.all_reduce(bucket.buffer, "sum", async_op=True)

    def before_forward(self, step):
        if not self.compressed:
            self.next_to_launch = 0
            for bucket in self.buckets:
                bucket.pending = len(bucket.params)

    def after_backward(self, step):
        if self.compressed:
            self._average_compressed(step)
            return
        while self.next_to_launch < len(self.buckets):  # no overlap, or unused parameters
            self._launch(self.buckets[self.next_to_launch])
        for bucket in self.buckets:
            if bucket.handle is not None:
                bucket.handle.wait()
            # The averaged gradients stay in the bucket; .grad becomes a view of it (the
            # runtime's zero_grad(set_to_none=True) detaches it again before the next step).
            for p, view in zip(bucket.params, bucket.views):
                p.grad = view.view_as(p)

    def after_step(self, step):
        if self.buffers:
            # Batch-norm statistics come from each worker's own batches: averaged after every
            # step, so that the models, buffers included, stay identical (torch DDP copies
            # rank 0's instead). One small all-reduce; models without buffers skip it.
            flat = flatten(self.buffers)
            self.ctx.comm.all_reduce(flat, "avg")
            unflatten_into(flat, self.buffers)

    # -- compressed: all gradients in one call ------------------------------------------------

    def _average_compressed(self, step: int) -> None:
        # compress_seconds: this step's time in compression arithmetic (error feedback,
        # compress, decompress, combine), that is, all of it but the communication.
        started, blocked_before = time.perf_counter(), self.ctx.comm.blocked_seconds()
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        if self.options.momentum_before_compression > 0:
            grads = [self._momentum(key, grad) for key, grad in zip(self.keys, grads)]
        averages = compressed_average(self.compressor, self.ctx.comm, grads, self.keys, step,
                                      self.memory)
        for p, average in zip(self.params, averages):
            p.grad = average.view_as(p)
        blocked = self.ctx.comm.blocked_seconds() - blocked_before
        self.ctx.metrics.log("compress_seconds",  # modeled, as every recorded time
                             self.ctx.clock.to_modeled(time.perf_counter() - started - blocked))

    def _momentum(self, key: str, grad: torch.Tensor) -> torch.Tensor:
        """m <- beta * m + g, as torch's SGD keeps it (the first m is g)."""
        buffer = self.momentum.get(key)
        if buffer is None:
            buffer = self.momentum[key] = grad.detach().clone()
        else:
            buffer.mul_(self.options.momentum_before_compression).add_(grad)
        return buffer
