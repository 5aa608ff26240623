"""Compressors: payloads, their guarantees, the per-tensor and bucket methods, error feedback."""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from dsgd_cli.comm.compressed import (average_with_memory, combine_segments, compress_segments,
                                      decompress_segments, delegated,
                                      exchange_in_one_collective)
from dsgd_cli.comm.communicator import Comm
from dsgd_cli.plugin_base.base import Plugin
from dsgd_cli.plugin_base.state import default_state, load_default_state

if TYPE_CHECKING:
    from dsgd_cli.comm.compressed import BucketLayout
    from dsgd_cli.plugin_base.context import WorkerContext


@dataclass
class Payload:
    """A compressed tensor: `tensors` travel over the network, `context` stays local."""

    tensors: list[torch.Tensor]
    context: Any = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)


@dataclass(frozen=True)
class Guarantee:
    """What a compressor Q promises about E‖Q(x) − x‖² for a tensor x of d elements, the
    expectation taken over Q's random draws (a deterministic Q's bound holds for every x):

    * `omega` (unbiased compressors): E[Q(x)] = x and E‖Q(x) − x‖² ≤ ω‖x‖²;
    * `delta` (contractive compressors, 0 < δ ≤ 1): E‖Q(x) − x‖² ≤ (1 − δ)‖x‖².

    A compressor may be both (`none`: ω = 0, δ = 1). An unbiased Q rescaled by 1/(1 + ω) is
    contractive with δ = 1/(1 + ω) (Koloskova, Stich, Jaggi, 2019, Remark 2): `qsgd` with
    `rescale: true` and `randomk` with `unbiased: false` are such rescaled compressors.
    """

    omega: float | None = None
    delta: float | None = None

    def __post_init__(self):
        if self.omega is None and self.delta is None:
            raise ValueError("a Guarantee needs omega (unbiased) or delta (contractive)")
        if self.omega is not None and self.omega < 0:
            raise ValueError(f"omega must be >= 0, got {self.omega}")
        if self.delta is not None and not 0 < self.delta <= 1:
            raise ValueError(f"delta must be in (0, 1], got {self.delta}")

    @property
    def unbiased(self) -> bool:
        return self.omega is not None

    @property
    def contractive(self) -> bool:
        return self.delta is not None


class Compressor(Plugin):
    """Turns a tensor into a `Payload` and back. Aggregators average through
    `compressed_average(compressor, comm, tensors, keys, step, memory)`, which lays the
    tensors end to end in buckets (`BucketLayout`: one segment per tensor), compresses each
    bucket into one payload (`compress_bucket`: by default `compress` on each tensor) and
    chooses the collective from what the compressor declares:
    `summable = True`: the payload tensors of all workers may be summed elementwise (an
    all-reduce) and the sum decompressed once, giving the sum of the workers' values.
    Otherwise the payloads are all-gathered and `combine` turns them into the average.
    `uniform_payload = False` (only with `summable = False`): the payload tensors' lengths may
    differ between workers (dqsgd picks its bits per worker), so they must be 1-D and their
    lengths are all-gathered first.
    A compressor that needs several rounds of communication (PowerSGD) overrides `exchange`.
    A payload's `context` must not depend on the worker's data: it is used to decompress
    every worker's payload.
    `requires_error_feedback = True`: the method is defined with error feedback (ef_sign,
    onebit, powersgd); the aggregator then keeps residuals whatever its `error_feedback` says.
    `guarantee(d)` declares what the compressor is (unbiased with ω, contractive with δ, see
    `Guarantee`); algorithms that rely on a bound (CHOCO-SGD needs δ) refuse a compressor
    that declares none, which is the default.
    """

    summable: ClassVar[bool] = True
    requires_error_feedback: ClassVar[bool] = False
    uniform_payload: ClassVar[bool] = True
    identity: ClassVar[bool] = False  # only `none`: aggregators may skip compression entirely
    # Whether it calls numba_kernels (numba.cuda on a GPU): checked before a CUDA launch.
    uses_numba_kernels: ClassVar[bool] = False

    def setup(self, ctx: "WorkerContext") -> None:
        """Called once per worker before the aggregator's setup."""
        self.ctx = ctx

    def guarantee(self, numel: int) -> Guarantee | None:
        """The bound the compressor keeps for a tensor of `numel` elements with its options,
        or None when it promises none (`sign`: sign(x) has no scale, so ‖Q(x) − x‖ is not
        bounded by ‖x‖). Whether it is unbiased or contractive must not depend on `numel`
        (validation asks with one size); only ω and δ may. Called before `setup`."""
        return None

    def state_dict(self) -> dict[str, Any]:
        """What the compressor keeps between steps (warm starts, generators), for checkpoints.
        The default saves its plain-data attributes (docs/writing-plugins.md, "State and resume")."""
        return default_state(self, getattr(self, "ctx", None))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()`'s output; called after `setup`."""
        load_default_state(self, state, getattr(getattr(self, "ctx", None), "device", None))

    @abstractmethod
    def compress(self, tensor: torch.Tensor, key: str, step: int) -> Payload:
        """`tensor`'s payload; `key` names the tensor, `step` the training step (for seeds)."""

    @abstractmethod
    def decompress(self, payload: Payload, like: torch.Tensor) -> torch.Tensor:
        """The tensor a payload stands for, shaped like `like`."""

    def combine(self, payloads: list[Payload], like: torch.Tensor) -> torch.Tensor:
        """The average of the workers' values, from their gathered payloads."""
        total = torch.zeros_like(like)
        for payload in payloads:
            total += self.decompress(payload, like)
        return total.div_(len(payloads))

    # A bucket: `flat` holds the tensors `layout` describes end to end (`layout.keys`,
    # `layout.shapes`, `layout.views(flat)`). These defaults call the per-tensor methods on
    # each segment; a compressor that does a whole bucket at once overrides all three.

    def compress_bucket(self, flat: torch.Tensor, layout: BucketLayout, step: int) -> Payload:
        """One payload for the whole bucket."""
        parts = compress_segments(self, flat, layout, step)
        return Payload(parts.tensors(), context=parts)

    def decompress_bucket(self, payload: Payload, layout: BucketLayout) -> torch.Tensor:
        """The flat bucket a bucket's payload stands for."""
        return decompress_segments(self, payload, layout)

    def combine_bucket(self, payloads: list[Payload], layout: BucketLayout) -> torch.Tensor:
        """The flat average of the workers' buckets, from their gathered payloads."""
        return combine_segments(self, payloads, layout)

    @delegated
    def average_many(self, tensors: list[torch.Tensor], keys: list[str], step: int, comm: Comm,
                     memory: ErrorFeedback | None = None) -> list[torch.Tensor]:
        """Kept for compatibility (aggregators call `compressed_average`, which uses an
        override of this method): each tensor averaged over all workers, compressed, with
        error feedback when `memory` is given."""
        return average_with_memory(self, comm, tensors, keys, step, memory)

    @delegated
    def exchange(self, tensors: list[torch.Tensor], keys: list[str], step: int, comm: Comm,
                 with_local: bool = False) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Per tensor: its average over all workers and, when `with_local`, what this worker's
        own payload decompresses to. By default all payloads travel in one collective;
        compressors that need several rounds (PowerSGD) override this."""
        return exchange_in_one_collective(self, comm, tensors, keys, step, with_local)


class ErrorFeedback:
    """Keeps per-key residuals: e <- (g + e) - decompress(compress(g + e))."""

    def __init__(self):
        self.residuals: dict[str, torch.Tensor] = {}

    def compensate(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        """g + e, in the residual's own buffer (`update` turns it back into the residual):
        no allocation per step, which for large tensors costs more than the addition."""
        residual = self.residuals.get(key)
        if residual is None:
            return tensor
        if residual.device != tensor.device:
            residual = self.residuals[key] = residual.to(tensor.device)
        return residual.add_(tensor)

    def update(self, key: str, compensated: torch.Tensor, transmitted: torch.Tensor) -> None:
        if self.residuals.get(key) is compensated:
            compensated.sub_(transmitted)
        else:
            self.residuals[key] = compensated - transmitted

    def state_dict(self) -> dict[str, Any]:
        return {"residuals": {key: r.clone() for key, r in self.residuals.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.residuals = {key: r.clone() for key, r in state["residuals"].items()}
