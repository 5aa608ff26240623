"""Averaging tensors through a compressor: the communication side of compression.

GRACE (Xu et al., "GRACE: A Compressed Communication Framework for Distributed Machine
Learning", ICDCS 2021) keeps three parts apart: the compressor turns a tensor into a payload
and back, the memory (error feedback) keeps what the payloads left out, and the communicator
moves the payloads. Here the compressor (`dsgd_cli.api.Compressor`) only declares what its
payloads allow, and this module chooses the collective from that:

- `summable`: the payloads of all workers are summed by one all-reduce (one per payload
  dtype) and the sum is decompressed once;
- otherwise they are all-gathered (their lengths first, unless `uniform_payload`) and the
  compressor's `combine` turns them into the average.

The unit of compression is the bucket (as in torch DDP's communication hooks): the tensors
of one dtype and device laid end to end in one flat tensor, described by a `BucketLayout`
(one segment per tensor, computed once per bucket). The compressor turns a bucket into one
payload (`Compressor.compress_bucket`); where an algorithm is defined per tensor the
compressor keeps it so (one QSGD norm per bucket of one tensor, one scale per tensor). By
default a bucket is compressed tensor by tensor with `Compressor.compress`, so compressors
written for tensors work unchanged; the built-in ones do a whole bucket at once. Error
feedback keeps one flat residual per bucket.

Aggregators call `compressed_average`. A compressor that needs several rounds (PowerSGD)
overrides `Compressor.exchange` (it gets the tensors, views of their buckets), and one written
for an earlier dsgd may override `Compressor.average_many`: both overrides are honoured.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any, Callable

import torch

from dsgd_cli.comm.batching import all_gather_flat, all_reduce_flat

if TYPE_CHECKING:  # the plugin API imports this module
    from dsgd_cli.api import Compressor, ErrorFeedback, Payload
    from dsgd_cli.comm.communicator import Comm

Exchanged = list[tuple[torch.Tensor, torch.Tensor | None]]  # per tensor: (average, own)


class BucketLayout:
    """Tensors laid end to end in one flat bucket: segment i is `keys[i]`'s tensor, of shape
    `shapes[i]`, at elements [offsets[i], offsets[i] + sizes[i]) of the bucket. `key` names
    the bucket (its error-feedback residual): the tensor's own key for a bucket of one.

    A layout is made once per bucket (`bucket_layout` caches them) and keeps what compressors
    derive from it once (`cached`): segment tables, output sizes."""

    def __init__(self, keys: list[str], shapes: list[tuple[int, ...]], dtype: torch.dtype,
                 device: torch.device):
        self.keys = list(keys)
        self.shapes = [tuple(shape) for shape in shapes]
        self.sizes = [math.prod(shape) for shape in self.shapes]
        self.offsets = [sum(self.sizes[:i]) for i in range(len(self.sizes))]
        self.numel = sum(self.sizes)
        self.dtype, self.device = dtype, torch.device(device)
        self.key = self.keys[0] if len(self.keys) == 1 else f"{self.keys[0]}..{self.keys[-1]}"
        self._cache: dict = {}
        self._last_views: tuple | None = None

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each segment of `flat` (a bucket of this layout, or its average) as its tensor.
        The views of the last buffer asked for are kept: error feedback's residual is the same
        buffer every step. (They keep its memory alive, so no other tensor can be at its
        address while they are kept.)"""
        address = (flat.data_ptr(), flat.dtype, flat.device)
        if self._last_views is not None and self._last_views[0] == address:
            return self._last_views[1]
        views = [flat[lo:lo + n].view(shape)
                 for lo, n, shape in zip(self.offsets, self.sizes, self.shapes)]
        self._last_views = (address, views)
        return views

    def cached(self, name: Any, make: Callable[[], Any]) -> Any:
        """`make()`, computed once per layout and `name`."""
        if name not in self._cache:
            self._cache[name] = make()
        return self._cache[name]

    def like(self) -> list[torch.Tensor]:
        """Tensors of the segments' shapes (contents undefined): the `like` argument of a
        per-tensor `decompress`, which reads only its shape, dtype and device."""
        return self.cached("like", lambda: self.views(
            torch.empty(self.numel, dtype=self.dtype, device=self.device)))


_LAYOUTS: dict = {}
_MAX_LAYOUTS = 1024


def bucket_layout(keys: list[str], tensors: list[torch.Tensor]) -> BucketLayout:
    """The layout of `tensors` (one dtype and device) laid end to end, made once per keys,
    shapes, dtype and device."""
    first = tensors[0]
    index = (tuple(keys), tuple(tuple(t.shape) for t in tensors), first.dtype, first.device)
    layout = _LAYOUTS.get(index)
    if layout is None:
        if len(_LAYOUTS) >= _MAX_LAYOUTS:
            _LAYOUTS.clear()
        layout = _LAYOUTS[index] = BucketLayout(keys, [t.shape for t in tensors], first.dtype,
                                                first.device)
    return layout


def flat_bucket(layout: BucketLayout, tensors: list[torch.Tensor]) -> torch.Tensor:
    """The tensors laid end to end: a view of a single contiguous tensor, else a copy into a
    buffer kept per bucket (overwritten by the next call)."""
    if len(tensors) == 1 and tensors[0].is_contiguous():
        return tensors[0].view(-1)
    buffer = layout.cached("input", lambda: torch.empty(layout.numel, dtype=layout.dtype,
                                                          device=layout.device))
    return torch.cat([t.reshape(-1) for t in tensors], out=buffer)


def compressed_average(compressor: Compressor, comm: Comm, tensors: list[torch.Tensor],
                       keys: list[str], step: int,
                       memory: ErrorFeedback | None = None) -> list[torch.Tensor]:
    """Each tensor averaged over all workers, compressed; `keys` name the tensors, `step` is
    the training step (for the compressor's seeds). The tensors travel in buckets, one per
    dtype and device, all payloads in one collective.

    With `memory`, error feedback: each bucket is sent compensated with its residual, and the
    residual becomes what this worker's payload left out."""
    if _overridden(compressor, "average_many"):
        return compressor.average_many(tensors, keys, step, comm, memory)
    return average_with_memory(compressor, comm, tensors, keys, step, memory)


def average_with_memory(compressor: Compressor, comm: Comm, tensors: list[torch.Tensor],
                        keys: list[str], step: int,
                        memory: ErrorFeedback | None) -> list[torch.Tensor]:
    """`compressed_average` whatever `average_many` the compressor has."""
    groups: dict = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.dtype, t.device), []).append(i)
    buckets = [[tensors[i] for i in group] for group in groups.values()]
    layouts = [bucket_layout([keys[i] for i in group], bucket)
               for group, bucket in zip(groups.values(), buckets)]
    averages = average_buckets(compressor, comm, buckets, layouts, step, memory)
    results: list = [None] * len(tensors)
    for group, bucket in zip(groups.values(), averages):
        for i, average in zip(group, bucket):
            results[i] = average
    return results


def average_buckets(compressor: Compressor, comm: Comm, buckets: list[list[torch.Tensor]],
                    layouts: list[BucketLayout], step: int,
                    memory: ErrorFeedback | None = None) -> list[list[torch.Tensor]]:
    """The tensors of each bucket (its `layout`) averaged over all workers, compressed, in one
    collective (two for PowerSGD); with `memory`, error feedback with one flat residual per
    bucket."""
    with_local = memory is not None
    if with_local:
        compensated = [_compensate(memory, layout, bucket) for layout, bucket in zip(layouts, buckets)]
        flats = [c.view(-1) for c in compensated]
    else:
        flats = [flat_bucket(layout, bucket) for layout, bucket in zip(layouts, buckets)]
    if _overridden(compressor, "exchange"):
        # each tensor on its own, as views of its bucket: no flat average to make
        views = [layout.views(flat) for layout, flat in zip(layouts, flats)]
        keys = [key for layout in layouts for key in layout.keys]
        pairs = iter(compressor.exchange([v for bucket in views for v in bucket], keys, step,
                                         comm, with_local))
        per_bucket = [[next(pairs) for _ in layout.keys] for layout in layouts]
        if with_local:
            for layout, c, parts, bucket in zip(layouts, compensated, views, per_bucket):
                _update_by_parts(memory, layout, c, parts, [own for _, own in bucket])
        return [[average for average, _ in bucket] for bucket in per_bucket]
    results = exchange_buckets(compressor, comm, flats, layouts, step, with_local)
    if with_local:
        for layout, c, (_, local) in zip(layouts, compensated, results):
            memory.update(layout.key, c, local.view(c.shape))
    return [layout.views(average) for layout, (average, _) in zip(layouts, results)]


def _update_by_parts(memory: ErrorFeedback, layout: BucketLayout, compensated: torch.Tensor,
                     parts: list[torch.Tensor], owns: list[torch.Tensor]) -> None:
    """`memory.update` of a bucket whose own payload came back tensor by tensor (`parts`: the
    views of `compensated`): subtracted part by part where the residual is the compensated
    buffer (every step but the first)."""
    if memory.residuals.get(layout.key) is compensated:
        for part, own in zip(parts, owns):
            part.sub_(own.view_as(part))
    else:
        memory.update(layout.key, compensated, _cat(owns).view(compensated.shape))


def _compensate(memory: ErrorFeedback, layout: BucketLayout,
                tensors: list[torch.Tensor]) -> torch.Tensor:
    """The bucket plus its residual, in the residual's buffer (`ErrorFeedback.compensate`),
    added tensor by tensor: the tensors are not copied into a flat bucket first. Shaped as
    its tensor for a bucket of one, as before buckets. Residuals kept per tensor (a
    checkpoint of an earlier dsgd) become the bucket's flat residual first."""
    residuals = memory.residuals
    if (layout.key not in residuals and len(layout.keys) > 1
            and all(key in residuals for key in layout.keys)):
        residuals[layout.key] = torch.cat([residuals.pop(key).reshape(-1).to(layout.device)
                                           for key in layout.keys])
    residual = residuals.get(layout.key)
    if residual is None:  # the first step: the bucket itself (update makes the residual)
        flat = flat_bucket(layout, tensors)
        return flat.view(layout.shapes[0]) if len(tensors) == 1 else flat
    if residual.device != layout.device:
        residual = residuals[layout.key] = residual.to(layout.device)
    if len(tensors) == 1:
        return residual.add_(tensors[0].view_as(residual))
    for part, tensor in zip(layout.views(residual), tensors):
        part.add_(tensor)  # the layout has the tensors' shapes
    return residual


def compressed_exchange(compressor: Compressor, comm: Comm, tensors: list[torch.Tensor],
                        keys: list[str], step: int, with_local: bool = False) -> Exchanged:
    """Per tensor: its average over all workers and, when `with_local`, what this worker's own
    payload decompresses to."""
    if _overridden(compressor, "exchange"):
        return compressor.exchange(tensors, keys, step, comm, with_local)
    return exchange_in_one_collective(compressor, comm, tensors, keys, step, with_local)


def exchange_buckets(compressor: Compressor, comm: Comm, flats: list[torch.Tensor],
                     layouts: list[BucketLayout], step: int, with_local: bool = False) -> Exchanged:
    """Per bucket: its average over all workers and, when `with_local`, what this worker's own
    payload decompresses to, for a compressor of one round (`compress_bucket`)."""
    # An empty bucket has nothing to send; every worker skips it alike.
    live = [i for i, layout in enumerate(layouts) if layout.numel > 0]
    results = [(flat.clone(), flat.clone() if with_local else None) for flat in flats]
    payloads = [compressor.compress_bucket(flats[i], layouts[i], step) for i in live]
    sent = [t for payload in payloads for t in payload.tensors]
    if compressor.summable:  # one "worker": the sum of everyone's payloads
        workers = [iter(all_reduce_flat(sent, comm))]
    else:
        workers = [iter(w) for w in all_gather_flat(sent, comm, compressor.uniform_payload)]
    for payload, i in zip(payloads, live):
        theirs = [dataclasses.replace(payload, tensors=[next(w) for _ in payload.tensors])
                  for w in workers]
        layout = layouts[i]
        average = (compressor.decompress_bucket(theirs[0], layout) / comm.world_size
                   if compressor.summable else compressor.combine_bucket(theirs, layout))
        own = None
        if with_local:
            own = compressor.decompress_bucket(payload, layout)
            if _shares_memory(own, [flats[i]] + list(payload.tensors)):
                own = own.clone()  # error feedback writes the residual into the input's buffer
        results[i] = (average, own)
    return results


def exchange_in_one_collective(compressor: Compressor, comm: Comm, tensors: list[torch.Tensor],
                               keys: list[str], step: int, with_local: bool = False) -> Exchanged:
    """`compressed_exchange` for a compressor of one round: the tensors in buckets (one per
    dtype and device), all payloads in one collective (one per payload dtype when summable)."""
    groups: dict = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.dtype, t.device), []).append(i)
    layouts = [bucket_layout([keys[i] for i in group], [tensors[i] for i in group])
               for group in groups.values()]
    flats = [flat_bucket(layout, [tensors[i] for i in group])
             for layout, group in zip(layouts, groups.values())]
    exchanged = exchange_buckets(compressor, comm, flats, layouts, step, with_local)
    results: list = [None] * len(tensors)
    for layout, group, (average, own) in zip(layouts, groups.values(), exchanged):
        owns = layout.views(own) if own is not None else [None] * len(group)
        for i, view, own_view in zip(group, layout.views(average), owns):
            results[i] = (view, own_view)
    return results


def _cat(tensors: list[torch.Tensor]) -> torch.Tensor:
    if len(tensors) == 1:
        return tensors[0].reshape(-1)
    return torch.cat([t.reshape(-1) for t in tensors])


def _shares_memory(t: torch.Tensor, others: list[torch.Tensor]) -> bool:
    storage = t.untyped_storage().data_ptr()
    return any(o.untyped_storage().data_ptr() == storage for o in others)


# -- the default bucket methods: one tensor at a time, through the per-tensor API ------------

@dataclasses.dataclass
class SegmentPayloads:
    """The context of a bucket's payload made tensor by tensor: each tensor's own payload
    (None for an empty tensor, which sends nothing)."""

    payloads: list

    def tensors(self) -> list[torch.Tensor]:
        return [t for p in self.payloads if p is not None for t in p.tensors]


def compress_segments(compressor: Compressor, flat: torch.Tensor, layout: BucketLayout,
                      step: int) -> SegmentPayloads:
    """What `Compressor.compress_bucket` sends by default: `compress` of each tensor (None for
    an empty one), whose tensors travel end to end as the bucket's payload."""
    return SegmentPayloads([compressor.compress(view, key, step) if view.numel() else None
                            for view, key in zip(layout.views(flat), layout.keys)])


def _split(payload: Payload) -> list:
    """Each tensor's payload in a bucket's payload made by `compress_segments` (this worker's
    or, with its tensors, another's)."""
    tensors = iter(payload.tensors)
    return [None if own is None else
            dataclasses.replace(own, tensors=[next(tensors) for _ in own.tensors])
            for own in payload.context.payloads]


def decompress_segments(compressor: Compressor, payload: Payload,
                        layout: BucketLayout) -> torch.Tensor:
    """`Compressor.decompress_bucket` by default: `decompress` of each tensor's payload."""
    out = torch.zeros(layout.numel, dtype=layout.dtype, device=layout.device)
    for part, like, view in zip(_split(payload), layout.like(), layout.views(out)):
        if part is not None:
            view.copy_(compressor.decompress(part, like).view_as(view))
    return out


def combine_segments(compressor: Compressor, payloads: list[Payload],
                     layout: BucketLayout) -> torch.Tensor:
    """`Compressor.combine_bucket` by default: `combine` of each tensor's payloads."""
    out = torch.zeros(layout.numel, dtype=layout.dtype, device=layout.device)
    per_worker = [_split(payload) for payload in payloads]
    for i, (like, view) in enumerate(zip(layout.like(), layout.views(out))):
        parts = [parts[i] for parts in per_worker]
        if parts and parts[0] is not None:
            view.copy_(compressor.combine(parts, like).view_as(view))
    return out


def delegated(method: Callable) -> Callable:
    """Marks a `Compressor` method that only calls this module: a compressor that overrides
    it is asked instead."""
    method.delegated_to_comm = True
    return method


def _overridden(compressor: Compressor, name: str) -> bool:
    return not getattr(getattr(compressor, name), "delegated_to_comm", False)
