"""`allreduce`: synchronous data-parallel SGD, g = (1/n) Σ g_i, models identical.

Like torch DDP, gradients are grouped into buckets (in the order backward produces them) and
each bucket's all-reduce starts as soon as its last gradient is accumulated, so communication
overlaps with the rest of backward. With a compressor, each bucket is compressed before it is
sent: summable payloads are all-reduced and decompressed once, the others are all-gathered and
decompressed one by one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsgd_cli.api import Aggregator, AggregatorOptions, ErrorFeedback, Handle, Payload, option


@dataclass
class AllReduceOptions(AggregatorOptions):
    bucket_mb: float = option(25.0, min=0.0, help="gradient bucket size in MiB (DDP's default)")
    overlap: bool = option(True, help="start each bucket's all-reduce during backward")


class _Bucket:
    """Consecutive parameters whose gradients travel together in one flat buffer."""

    def __init__(self, index: int, params: list[torch.nn.Parameter]):
        self.key = f"bucket{index}"
        self.params = params
        numel = sum(p.numel() for p in params)
        self.buffer = torch.zeros(numel, dtype=params[0].dtype, device=params[0].device)
        self.views = []
        offset = 0
        for p in params:
            self.views.append(self.buffer[offset: offset + p.numel()].view_as(p))
            offset += p.numel()
        self.pending = len(params)
        self.handles: list[Handle] = []
        self.payload: Payload | None = None


class AllReduce(Aggregator):
    Options = AllReduceOptions
    supports_compression = True

    def setup(self, ctx):
        super().setup(ctx)
        self.compressor = ctx.compressor
        self.memory = ErrorFeedback() if self.options.error_feedback else None
        # Backward produces gradients roughly from the last layer to the first.
        params = list(reversed(ctx.parameters()))
        limit = self.options.bucket_mb * 2**20
        groups, current, size = [], [], 0
        for p in params:
            if current and (size + p.numel() * p.element_size() > limit or p.dtype != current[0].dtype):
                groups.append(current)
                current, size = [], 0
            current.append(p)
            size += p.numel() * p.element_size()
        if current:
            groups.append(current)
        self.buckets = [_Bucket(i, group) for i, group in enumerate(groups)]
        self.bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self.next_to_launch = 0
        self.step = 0
        if self.options.overlap:
            for p in params:
                p.register_post_accumulate_grad_hook(self._on_grad_ready)

    def _on_grad_ready(self, param: torch.nn.Parameter) -> None:
        bucket = self.bucket_of[id(param)]
        bucket.pending -= 1
        # Launch strictly in bucket order so every worker issues the same collectives in
        # the same order, whatever order its hooks fire in.
        while (self.next_to_launch < len(self.buckets)
               and self.buckets[self.next_to_launch].pending == 0):
            self._launch(self.buckets[self.next_to_launch])
            self.next_to_launch += 1

    def _launch(self, bucket: _Bucket) -> None:
        for p, view in zip(bucket.params, bucket.views):
            if p.grad is None:  # a parameter this step did not use
                view.zero_()
            else:
                view.copy_(p.grad)
        comm, tensor = self.ctx.comm, bucket.buffer
        if self.memory is not None:
            tensor = self.memory.compensate(bucket.key, tensor)
        payload = self.compressor.compress(tensor, bucket.key, self.step)
        if self.memory is not None:
            # Before the collective: it may reduce the payload tensors in place.
            transmitted = self.compressor.decompress(payload, bucket.buffer)
            self.memory.update(bucket.key, tensor, transmitted)
        bucket.payload = payload
        if self.compressor.summable:
            bucket.handles = [comm.all_reduce(t, "sum", async_op=True) for t in payload.tensors]
        else:
            bucket.handles = [comm.all_gather(t, async_op=True) for t in payload.tensors]

    def before_forward(self, step):
        self.step = step
        self.next_to_launch = 0
        for bucket in self.buckets:
            bucket.pending = len(bucket.params)

    def after_backward(self, step):
        while self.next_to_launch < len(self.buckets):  # no overlap, or unused parameters
            self._launch(self.buckets[self.next_to_launch])
            self.next_to_launch += 1
        n = self.ctx.world_size
        for bucket in self.buckets:
            results = [h.wait() for h in bucket.handles]
            average = self._combine(bucket, results).div_(n)
            for p, view in zip(bucket.params, average.split([p.numel() for p in bucket.params])):
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                p.grad.copy_(view.view_as(p))

    def _combine(self, bucket: _Bucket, results: list) -> torch.Tensor:
        """The sum over workers of the decompressed payloads (and update error feedback)."""
        compressor, payload = self.compressor, bucket.payload
        if compressor.summable:
            return compressor.decompress(Payload(results, payload.context), bucket.buffer)
        total = torch.zeros_like(bucket.buffer)
        for worker in range(self.ctx.world_size):
            tensors = [gathered[worker] for gathered in results]
            total += compressor.decompress(Payload(tensors, payload.context), bucket.buffer)
        return total
