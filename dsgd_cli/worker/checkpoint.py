"""Checkpoints: every worker's state every `checkpoint_every` steps, so a run resumes.

A run's checkpoints live in one directory (the database row points to it), one folder per step
and one file per rank: `step-0000000040/rank-1.pt`. Each file is written to a temporary name
and renamed into place, so a file that exists is whole: a worker killed while writing leaves
only a temporary file, which nothing reads. A step is *complete* when every rank's file is
there; a run resumes from its latest complete step.

Beside each file, `rank-1.pt.sum` records its size and SHA-256 when written (the sum is put
in place before the file, so every file has one). Before a run resumes, the files of the
step it resumes from are checked against their sums: a file damaged since (truncated,
overwritten) or without a sum makes it fall back to the step before, when that one is
complete and sound.

What is loaded can be trusted no further than the directory it is in (README, "Security"):
the first worker to save makes the run's directory itself, mode 0700, and one that another
user made, or that others may write to, is refused, on saving and on loading. Entries named
like a step that are not real folders (symbolic links, files) are never read, followed or
deleted. Files are loaded with torch's `weights_only`, which builds tensors and plain data
only and never runs code, so a checkpoint holds nothing else (`storable`).

Each rank deletes its own files of steps older than the two latest complete ones up to the
step it just wrote, so a complete step always exists once one was written, even when
asynchronous workers drift many checkpoints apart, and one to fall back to once two were.
"""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import random
import re
import stat
import uuid
from collections import OrderedDict
from pathlib import Path

from dsgd_cli.spec.directories import distrust, problem_creating
from dsgd_cli.errors import DsgdError

ENV_ROOT = "DSGD_CHECKPOINTS"
KEEP_COMPLETE = 2  # complete steps each rank keeps: the latest, and one to fall back to
_STEP = re.compile(r"^step-(\d+)$")


class CheckpointRefused(DsgdError):
    """A checkpoint directory or file that dsgd does not trust: it is not loaded."""


def default_root(db_url: str) -> Path:
    """`dsgd-checkpoints` beside an SQLite file; in the working directory for a server."""
    from dsgd_cli.results.database import sqlite_path

    path = sqlite_path(db_url)
    if path and not path.startswith("file:"):
        return Path(path).resolve().parent / "dsgd-checkpoints"
    return Path.cwd() / "dsgd-checkpoints"


def usable_root(option: str | Path | None, db_url: str) -> Path:
    """The directory that holds runs' checkpoint directories: `--checkpoint-dir` (`option`),
    else $DSGD_CHECKPOINTS, else the default; checked, by trying, that it can be made and
    written in, so that a bad one is a DsgdError naming it before anything launches."""
    if option:
        root, source = Path(option), "--checkpoint-dir"
    elif os.environ.get(ENV_ROOT):
        root, source = Path(os.environ[ENV_ROOT]), f"${ENV_ROOT}"
    else:
        root, source = default_root(db_url), "checkpoint directory"
    root = root.expanduser().resolve()
    problem = problem_creating(root)
    if problem is not None:
        raise DsgdError(f"{source} {root}: {problem}")
    return root


def run_directory(root: Path, experiment: str) -> str:
    """A new, unique name under `root` for one run's checkpoints (the directory is made by
    the first worker to save, `_make_run_directory`)."""
    safe = re.sub(r"[^A-Za-z0-9._=-]+", "_", experiment)[:80]
    return str(root / f"{safe}-{uuid.uuid4().hex[:12]}")


def step_directory(directory: str | Path, step: int) -> Path:
    return Path(directory) / f"step-{step:010d}"


def rank_file(directory: str | Path, step: int, rank: int) -> Path:
    return step_directory(directory, step) / f"rank-{rank}.pt"


def check_directory(directory: str | Path) -> None:
    """Refuse (CheckpointRefused) a run directory this user did not make for itself."""
    problem = distrust(Path(directory), private=True)
    if problem is not None:
        raise CheckpointRefused(f"checkpoint directory {directory} {problem}: refused")


def _step_entries(directory: str | Path) -> list[tuple[int, Path, os.stat_result]]:
    """Every entry named like a step, with its step and what it is (not following a link)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    entries = []
    for match in filter(None, map(_STEP.match, names)):
        path = Path(directory) / match.group(0)
        try:
            entries.append((int(match.group(1)), path, os.lstat(path)))
        except OSError:  # gone since listed
            continue
    return sorted(entries, key=lambda entry: entry[0])


def steps(directory: str | Path) -> list[int]:
    """The steps that have a folder (a real one: not a link), in increasing order."""
    return [step for step, _, info in _step_entries(directory) if stat.S_ISDIR(info.st_mode)]


def strays(directory: str | Path | None) -> list[str]:
    """The entries named like a step that are not real folders, each described: they are
    skipped, never followed."""
    if directory is None:
        return []
    return [f"{path} is {_kind(info)}, not a checkpoint folder"
            for _, path, info in _step_entries(directory) if not stat.S_ISDIR(info.st_mode)]


def _kind(info: os.stat_result) -> str:
    if stat.S_ISLNK(info.st_mode):
        return "a symbolic link"
    return "a file" if stat.S_ISREG(info.st_mode) else "not a directory"


def _is_regular_file(path: Path) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def sum_file(path: Path) -> Path:
    """Where the size and checksum of the checkpoint file `path` are recorded."""
    return path.with_name(path.name + ".sum")


def complete_steps(directory: str | Path | None, workers: int) -> list[int]:
    """The steps with every rank's file, in increasing order."""
    if directory is None:
        return []
    return [step for step in steps(directory)
            if all(_is_regular_file(rank_file(directory, step, rank)) for rank in range(workers))]


def latest_complete(directory: str | Path | None, workers: int) -> int | None:
    """The latest step with every rank's file, or None."""
    complete = complete_steps(directory, workers)
    return complete[-1] if complete else None


def latest_sound(directory: str | Path | None, workers: int) -> tuple[int | None, list[str]]:
    """The latest complete step whose files all match their recorded size and checksum (or
    None), and what is wrong with each later complete step, newest first."""
    damaged = []
    for step in reversed(complete_steps(directory, workers)):
        problems = filter(None, (damage(rank_file(directory, step, rank)) for rank in range(workers)))
        problem = next(problems, None)
        if problem is None:
            return step, damaged
        damaged.append(problem)
    return None, damaged


def damage(path: Path) -> str | None:
    """What is wrong with the checkpoint file `path` (None: it is as written)."""
    try:
        with open(path, "rb", opener=_no_follow) as file:
            size, digest = _size_and_digest(file)
    except OSError as error:
        return f"{path} cannot be read ({error.strerror or error})"
    return _differs_from_sum(path, size, digest)


def _differs_from_sum(path: Path, size: int, digest: str) -> str | None:
    """What is wrong with `path`, whose content has `size` and `digest`, by its sum file; a
    missing sum is damage too: nothing says the file is what dsgd wrote."""
    try:
        with open(sum_file(path), opener=_no_follow) as file:
            recorded_size, recorded_digest = file.read().split()
        recorded = int(recorded_size)
    except FileNotFoundError:
        return f"{path} has no recorded checksum ({sum_file(path).name} is missing)"
    except (OSError, ValueError) as error:
        return f"{sum_file(path)} cannot be read ({getattr(error, 'strerror', None) or error})"
    if size != recorded:
        return f"{path} is damaged ({size} bytes, {recorded} when written)"
    if digest != recorded_digest:
        return f"{path} is damaged (its checksum differs from the one recorded when written)"
    return None


def _no_follow(path, flags: int) -> int:
    """An `open` opener that refuses a symbolic link in place of the file."""
    return os.open(path, flags | os.O_NOFOLLOW)


def _size_and_digest(file) -> tuple[int, str]:
    digest, size = hashlib.sha256(), 0
    for block in iter(lambda: file.read(1 << 20), b""):
        digest.update(block)
        size += len(block)
    return size, digest.hexdigest()


def save(directory: str | Path, step: int, rank: int, state: dict, workers: int) -> None:
    """Write this rank's `state` for `step` atomically, then drop its superseded files."""
    import torch

    state = storable(state, "state")
    _make_run_directory(directory)
    target = rank_file(directory, step, rank)
    _make_step_directory(target.parent)
    temporary = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    with _create(temporary, "wb") as file:
        torch.save(state, file)
        file.flush()
        os.fsync(file.fileno())
    with open(temporary, "rb") as file:
        size, digest = _size_and_digest(file)
    _write_atomically(sum_file(target), f"{size} {digest}\n")
    os.replace(temporary, target)  # after its sum: a file in place always has one
    _prune(directory, rank, workers, written=step)


def _make_run_directory(directory: str | Path) -> None:
    """Make the run's directory, private to this user, unless a rank made it already; either
    way refuse one that is not this user's own (another user may have made it first)."""
    Path(directory).parent.mkdir(parents=True, exist_ok=True)  # the root, shared by runs
    try:
        os.mkdir(directory, 0o700)
    except FileExistsError:
        pass  # another rank made it; or someone else did, which the check refuses
    check_directory(directory)


def _make_step_directory(path: Path) -> None:
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            raise CheckpointRefused(f"{path} is {_kind(os.lstat(path))}, not a checkpoint "
                                    f"folder: refused") from None


def _create(path: Path, mode: str):
    """A new file at `path` (a stale one of a killed writer is replaced), never through a
    symbolic link."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600),
                     mode)


def _write_atomically(path: Path, text: str) -> None:
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with _create(temporary, "w") as file:
        file.write(text)
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, path)


def load(directory: str | Path, step: int, rank: int) -> dict:
    """This rank's state at `step`, on the CPU (the model and optimizer copy it to theirs):
    from a directory of this user's, checked against its sum, and built from tensors and
    plain data only (torch's `weights_only`), so that a planted file runs no code."""
    import torch

    check_directory(directory)
    path = rank_file(directory, step, rank)
    with open(path, "rb", opener=_no_follow) as file:
        content = file.read()
    problem = _differs_from_sum(path, len(content), hashlib.sha256(content).hexdigest())
    if problem is not None:
        raise CheckpointRefused(problem)
    try:
        return torch.load(io.BytesIO(content), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        raise CheckpointRefused(f"{path} holds more than tensors and plain data "
                                f"({_why_unpickling_failed(error)}): refused, as loading it "
                                "could run code") from None


def _why_unpickling_failed(error: Exception) -> str:
    """The line of torch's message that names what was refused."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    named = [line for line in lines if "GLOBAL" in line or "Unsupported" in line]
    return (named or lines or ["not a checkpoint"])[-1].rstrip(".")


def storable(value, where: str):
    """`value` as `weights_only` loads it back: tensors, numbers, strings, bytes, None, and
    lists, tuples, sets and dicts of these; numbers of other types (NumPy's, enums) become
    Python's. Anything else is a TypeError naming where it is (`where`, a key path)."""
    import numpy
    import torch

    if value is None or type(value) in (bool, int, float, complex, str, bytes):
        return value
    if isinstance(value, (torch.Tensor, torch.Size, torch.dtype, torch.device)):
        return value
    if isinstance(value, numpy.generic) and isinstance(value.item(), (bool, int, float, complex)):
        return value.item()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return int(value) if isinstance(value, int) else float(value)
    if isinstance(value, (list, tuple, set)):
        items = [storable(item, f"{where}[{index}]") for index, item in enumerate(value)]
        if type(value) in (list, tuple, set) and all(a is b for a, b in zip(items, value)):
            return value
        return set(items) if isinstance(value, set) else (
            list(items) if isinstance(value, list) else tuple(items))
    if isinstance(value, dict):
        return _storable_dict(value, where)
    raise TypeError(f"a checkpoint cannot hold {where}, a {type(value).__module__}."
                    f"{type(value).__qualname__}: only tensors, numbers, strings, and lists, "
                    "tuples and dicts of these (README, \"Writing a plugin\")")


def _storable_dict(value: dict, where: str) -> dict:
    """A dict, or an OrderedDict (a model's state dict, whose `_metadata` is kept), as it is
    unless one of its keys or values must change."""
    pairs = [(storable(key, f"{where} key {key!r}"), storable(item, f"{where}[{key!r}]"))
             for key, item in value.items()]
    unchanged = all(new_key is key and new_item is item
                    for (new_key, new_item), (key, item) in zip(pairs, value.items()))
    if unchanged and type(value) in (dict, OrderedDict):
        return value
    copy = OrderedDict(pairs) if isinstance(value, OrderedDict) else dict(pairs)
    if hasattr(value, "_metadata"):
        copy._metadata = value._metadata
    return copy


def remove_later(directory: str | Path, step: int) -> None:
    """Remove the steps after `step`: a resumed run goes on from `step`, and what it writes
    must not mix with files that an earlier attempt wrote for a later step. (The steps
    before go only once the resumed run has written a newer complete one: `_prune`.)"""
    for later in steps(directory):
        if later > step:
            _remove_tree(step_directory(directory, later))


def _prune(directory: str | Path, rank: int, workers: int, written: int) -> None:
    """Delete this rank's files of the steps older than the two latest complete ones, among
    the steps up to `written` (the step this rank just wrote): a later step is none of this
    run's doing."""
    kept = [step for step in complete_steps(directory, workers) if step <= written][-KEEP_COMPLETE:]
    if len(kept) < KEEP_COMPLETE:
        return
    for old in steps(directory):
        if old >= kept[0]:
            break
        mine = rank_file(directory, old, rank)
        for path in (mine, sum_file(mine)):
            try:
                path.unlink()  # never follows a link: it would remove the link
            except FileNotFoundError:
                pass
        try:
            mine.parent.rmdir()  # the last rank out removes the folder
        except OSError:
            pass


def _remove_tree(path: Path) -> None:
    """Remove the step folder `path` and the files in it, never following a link: `path` is
    opened as a directory that must not be one, and its entries unlinked relative to it."""
    try:
        folder = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return  # gone, or not a real folder (a link, a file): not ours to remove
    try:
        for name in os.listdir(folder):
            if not stat.S_ISDIR(os.stat(name, dir_fd=folder, follow_symlinks=False).st_mode):
                os.unlink(name, dir_fd=folder)
    finally:
        os.close(folder)
    try:
        path.rmdir()
    except OSError:
        pass  # something left in it that dsgd did not write


def rng_state(device) -> dict:
    """The random generators' states a run's numbers depend on: torch (and CUDA), NumPy,
    Python; in the plain data that a checkpoint holds."""
    import numpy
    import torch

    name, keys, position, has_gauss, cached_gaussian = numpy.random.get_state()
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": (name, keys.tolist(), position, has_gauss, cached_gaussian)}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device) -> None:
    import numpy
    import torch

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    name, keys, position, has_gauss, cached_gaussian = state["numpy"]
    numpy.random.set_state((name, numpy.asarray(keys, dtype=numpy.uint32), position, has_gauss,
                            cached_gaussian))
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)
