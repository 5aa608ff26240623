"""The default `state_dict()` / `load_state_dict()` of aggregators and compressors.

A plugin's state is what it keeps between steps in its own attributes: counters, residuals,
momentum, warm starts, random generators. The default saves every attribute whose value is
plain data, recursively: numbers, strings, None, tensors, `random.Random` generators, objects
with their own `state_dict()` (such as `ErrorFeedback`), and lists, tuples and dicts of these.
Left out: anything else (threads, locks, process groups, the worker context), and tensors
that share memory with the model, whose values the checkpoint holds already.

Loading writes the saved values back: into the existing tensor where the attribute holds one
of the same shape (so references other objects hold, a background thread's included, see the
loaded value), otherwise by assignment. A plugin whose state needs more than this overrides
both methods.
"""

from __future__ import annotations

import random
from typing import Any

import torch

SKIPPED = frozenset({"ctx", "options", "plugin_name"})


class _NotPlain(Exception):
    pass


def default_state(plugin: Any, ctx: Any) -> dict[str, Any]:
    """`plugin`'s plain-data attributes; `ctx` is its worker context, whose model, optimizer
    and compressor are saved on their own."""
    model = getattr(ctx, "model", None)
    shared = _storages(model)
    owned_elsewhere = [getattr(ctx, name, None) for name in ("model", "optimizer", "compressor")]
    state = {}
    for name, value in vars(plugin).items():
        if name in SKIPPED or any(value is other for other in owned_elsewhere if other is not None):
            continue
        try:
            state[name] = _capture(value, shared)
        except _NotPlain:
            continue
    return state


def load_default_state(plugin: Any, state: dict[str, Any], device: torch.device | None) -> None:
    """Write `state` back into `plugin`; a tensor with no counterpart goes to `device`."""
    for name, saved in state.items():
        setattr(plugin, name, _restore(getattr(plugin, name, None), saved, device))


def _storages(model: torch.nn.Module | None) -> set[int]:
    if model is None:
        return set()
    tensors = list(model.parameters()) + list(model.buffers())
    return {t.untyped_storage().data_ptr() for t in tensors}


def _capture(value: Any, shared: set[int]) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Tensor):
        if value.untyped_storage().data_ptr() in shared:
            raise _NotPlain  # part of the model: saved with it
        return value.detach().clone()
    if isinstance(value, random.Random):
        return {"__random__": value.getstate()}
    if isinstance(value, (list, tuple)):
        return type(value)(_capture(item, shared) for item in value)
    if isinstance(value, dict):
        return {key: _capture(item, shared) for key, item in value.items()}
    if callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None)):
        if isinstance(value, torch.nn.Module) and any(
                p.untyped_storage().data_ptr() in shared for p in value.parameters()):
            raise _NotPlain
        return {"__state_dict__": value.state_dict()}
    raise _NotPlain


def _restore(current: Any, saved: Any, device: torch.device | None) -> Any:
    if isinstance(saved, torch.Tensor):
        if (isinstance(current, torch.Tensor) and current.shape == saved.shape
                and current.dtype == saved.dtype):
            with torch.no_grad():
                current.copy_(saved)
            return current
        if isinstance(current, torch.Tensor):
            device = current.device
        return saved.to(device) if device is not None else saved
    if isinstance(saved, dict) and "__random__" in saved and len(saved) == 1:
        generator = current if isinstance(current, random.Random) else random.Random()
        generator.setstate(saved["__random__"])
        return generator
    if isinstance(saved, dict) and "__state_dict__" in saved and len(saved) == 1:
        current.load_state_dict(saved["__state_dict__"])
        return current
    if isinstance(saved, dict):  # in place: other objects may hold the same dict
        current = current if isinstance(current, dict) else {}
        restored = {key: _restore(current.get(key), item, device) for key, item in saved.items()}
        current.clear()
        current.update(restored)
        return current
    if isinstance(saved, (list, tuple)):
        current = current if isinstance(current, (list, tuple)) and len(current) == len(saved) else [None] * len(saved)
        return type(saved)(_restore(c, s, device) for c, s in zip(current, saved))
    return saved
