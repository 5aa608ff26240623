"""A local cache of generated data sets (`TaskData`), shared by every worker of every run.

A task whose data takes long to make wraps its generation in `cached(name, options, make)`:
the first call makes the data and stores it, later calls (in any process) load it.

Key: the SHA-256 of the canonical JSON (sorted keys, no spaces) of the cache format version,
`name` and `options`. `options` must hold everything that changes the data: sizes, seeds,
generation parameters and the versions of the packages that make it, so an upgrade never
reuses stale data.

Location: `$DSGD_CACHE_DIR`, else `$XDG_CACHE_HOME/dsgd`, else `~/.cache/dsgd`; one file per
key, `<name>[-<label>]-<first 32 hex digits of the key>.pt`. `DSGD_NO_DATA_CACHE=1` turns the
cache off (every call makes the data).

File layout: a header line `dsgd-datacache <format>`, a line with the SHA-256 (hex) of the
payload, then the payload: `torch.save` of `{"key": <canonical JSON>, "tensors": {train_x,
train_y, test_x, test_y}}`, loaded with `weights_only=True`.

Safety: a file is written to a temporary file in the same directory and moved into place
with `os.replace` (atomic), so a reader sees the whole old file, the whole new one, or none.
Two processes missing at once both make the data and both write; the last rename wins and
both files are valid. A file that fails any check (header, checksum, load, key, tensors) is
never trusted: the data is made again and the file replaced. A cache directory that cannot be
written costs one warning line on stderr and the data is made without caching.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch

from dsgd_cli.api import TaskData

FORMAT_VERSION = 1
_MAGIC = f"dsgd-datacache {FORMAT_VERSION}\n".encode()
_FIELDS = ("train_x", "train_y", "test_x", "test_y")

_warned_unwritable = False  # one warning per process is enough


def enabled() -> bool:
    """False when `DSGD_NO_DATA_CACHE` is set to anything but empty, 0, false or no."""
    value = os.environ.get("DSGD_NO_DATA_CACHE", "").strip().lower()
    return value in ("", "0", "false", "no")


def cache_dir() -> Path:
    """`$DSGD_CACHE_DIR`, else `$XDG_CACHE_HOME/dsgd` (if absolute, as XDG asks), else
    `~/.cache/dsgd`."""
    explicit = os.environ.get("DSGD_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg and os.path.isabs(xdg):
        return Path(xdg) / "dsgd"
    return Path.home() / ".cache" / "dsgd"


def canonical_key(name: str, options: dict[str, Any]) -> str:
    """The canonical JSON that identifies a data set (raises TypeError/ValueError for options
    JSON cannot represent exactly)."""
    return json.dumps({"format": FORMAT_VERSION, "name": name, "options": options},
                      sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def cache_path(name: str, options: dict[str, Any], label: str | None = None) -> Path:
    """Where the data set `name` with `options` is stored; `label` only makes the file name
    easier to read (it is not part of the key)."""
    digest = hashlib.sha256(canonical_key(name, options).encode()).hexdigest()
    prefix = name if not label else f"{name}-{label}"
    prefix = re.sub(r"[^A-Za-z0-9._-]+", "_", prefix).strip("._")[:80] or "data"
    return cache_dir() / f"{prefix}-{digest[:32]}.pt"


def cached(name: str, options: dict[str, Any], make: Callable[[], TaskData],
           label: str | None = None) -> TaskData:
    """The data set `name` with `options`: loaded from the cache when a valid file is there,
    else `make()`, stored for next time (when the cache directory can be written)."""
    if not enabled():
        return make()
    key = canonical_key(name, options)
    path = cache_path(name, options, label)
    data = _read(path, key)
    if data is not None:
        return data
    data = make()
    if not isinstance(data, TaskData):
        raise TypeError(f"the data cache stores TaskData, got {type(data).__name__}")
    _write(path, key, data)
    return data


def _read(path: Path, key: str) -> TaskData | None:
    """The data stored at `path` for `key`, or None when missing, unreadable or damaged."""
    try:
        blob = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError:  # unreadable: treat as a miss (writing may still work, or warn)
        return None
    data = _decode(blob, key)
    if data is None:
        print(f"dsgd: ignoring damaged data cache file {path}; making the data again",
              file=sys.stderr)
    return data


def _decode(blob: bytes, key: str) -> TaskData | None:
    if not blob.startswith(_MAGIC):
        return None
    digest_end = len(_MAGIC) + 65
    digest, payload = blob[len(_MAGIC): digest_end], blob[digest_end:]
    if digest != hashlib.sha256(payload).hexdigest().encode() + b"\n":
        return None
    try:
        stored = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    except Exception:  # noqa: BLE001 — whatever a damaged payload raises, it is a miss
        return None
    if not isinstance(stored, dict) or stored.get("key") != key:
        return None
    tensors = stored.get("tensors")
    if not isinstance(tensors, dict) or not all(
            isinstance(tensors.get(f), torch.Tensor) for f in _FIELDS):
        return None
    return TaskData(*(tensors[f] for f in _FIELDS))


def _encode(key: str, data: TaskData) -> bytes:
    # Clones own their storage: torch.save writes a view's whole storage otherwise.
    tensors = {f: getattr(data, f).detach().cpu().contiguous().clone() for f in _FIELDS}
    buffer = io.BytesIO()
    torch.save({"key": key, "tensors": tensors}, buffer)
    payload = buffer.getvalue()
    return _MAGIC + hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload


def _write(path: Path, key: str, data: TaskData) -> None:
    """Store atomically: a temporary file in the same directory, renamed into place."""
    global _warned_unwritable
    blob = _encode(key, data)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        if hasattr(os, "fchmod"):
            os.fchmod(fd, 0o644)  # mkstemp's 0600 would hide a shared cache from others
        with os.fdopen(fd, "wb") as file:
            file.write(blob)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
        tmp = None
    except OSError as error:
        if not _warned_unwritable:
            _warned_unwritable = True
            print(f"dsgd: data cache {path.parent} not writable ({error.strerror or error}); "
                  f"data is made without caching", file=sys.stderr)
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
