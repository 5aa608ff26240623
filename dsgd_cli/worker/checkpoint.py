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

What is loaded can be trusted no further than the directory it is in (docs/security.md):
the first worker to save makes the run's directory itself, mode 0700, and one that another
user made, or that others may write to, is refused, on saving and on loading; so is a run
directory in a root where another user could swap it for theirs (a root of another user's,
or writable by others without the sticky bit). The run's directory is then opened once,
without following a link, and checked again as opened; every file is made, read, renamed
and deleted relative to it. Entries named like a step that are not real folders (symbolic
links, files) are never read, followed or deleted. Files are loaded with torch's `weights_only`, which builds tensors and plain data
only and never runs code, so a checkpoint holds nothing else (`storable`).

Each rank deletes its own files of steps older than the two latest complete ones up to the
step it just wrote, so a complete step always exists once one was written, even when
asynchronous workers drift many checkpoints apart, and one to fall back to once two were.
"""

from __future__ import annotations

import errno
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

from dsgd_cli.spec.directories import distrust, problem_creating, shared_problem
from dsgd_cli.errors import DsgdError

ENV_ROOT = "DSGD_CHECKPOINTS"
KEEP_COMPLETE = 2  # complete steps each rank keeps: the latest, and one to fall back to
_STEP = re.compile(r"step-([0-9]+)")  # fullmatch: "\d" and "$" let more through
# The files a rank writes in a step folder, and their temporary names: what deleting removes.
_RANK_FILE = re.compile(r"\.?rank-[0-9]+\.pt(\.sum)?(\.[0-9]+\.tmp)?")


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
    problem = shared_problem(root)
    if problem is not None:
        raise DsgdError(f"{source} {root} {problem}: refused")
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
    """Refuse (CheckpointRefused) a run directory this user did not make for itself, or in
    a root where another user could swap it for theirs (`shared_problem`)."""
    root = Path(directory).parent
    problem = shared_problem(root)
    if problem is not None:
        raise CheckpointRefused(f"checkpoint root {root} {problem}: refused")
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
    for match in filter(None, map(_STEP.fullmatch, names)):
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
    return _differs_from_sum(path, size, digest, lambda: _read(sum_file(path)).decode())


def _differs_from_sum(path: Path, size: int, digest: str, read_sum) -> str | None:
    """What is wrong with `path`, whose content has `size` and `digest`, by its sum file (its
    text, from `read_sum()`); a missing sum is damage too: nothing says the file is what
    dsgd wrote."""
    try:
        recorded_size, recorded_digest = read_sum().split()
        recorded = int(recorded_size)
    except FileNotFoundError:
        return f"{path} has no recorded checksum ({sum_file(path).name} is missing)"
    except (OSError, ValueError) as error:  # UnicodeDecodeError is a ValueError
        return f"{sum_file(path)} cannot be read ({getattr(error, 'strerror', None) or error})"
    if size != recorded:
        return f"{path} is damaged ({size} bytes, {recorded} when written)"
    if digest != recorded_digest:
        return f"{path} is damaged (its checksum differs from the one recorded when written)"
    return None


def _no_follow(path, flags: int) -> int:
    """An `open` opener that refuses a symbolic link in place of the file."""
    return os.open(path, flags | os.O_NOFOLLOW)


def _read(name: str | Path, folder: int | None = None) -> bytes:
    """The content of the file `name` (relative to the open directory `folder`, when given),
    never through a symbolic link."""
    with os.fdopen(os.open(name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=folder), "rb") as file:
        return file.read()


def _open_folder(name: str | Path, parent: int | None = None) -> int:
    """The directory `name` (relative to the open directory `parent`, when given), opened
    without following a link: what is then done relative to it is done in that directory,
    whatever is renamed or swapped in its place since."""
    return os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=parent)


def _open_run_directory(directory: str | Path) -> int:
    """The run's directory, checked (`check_directory`) and opened once; checked again as
    opened (its owner and mode), so that a directory swapped in between is refused."""
    check_directory(directory)
    try:
        run = _open_folder(directory)
    except OSError as error:
        raise CheckpointRefused(f"checkpoint directory {directory} cannot be opened "
                                f"({error.strerror or error}): refused") from None
    info = os.fstat(run)
    if info.st_uid != os.getuid() or info.st_mode & 0o022:
        os.close(run)
        raise CheckpointRefused(f"checkpoint directory {directory} changed since it was "
                                "checked: refused")
    return run


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
    temporary = f".{target.name}.{os.getpid()}.tmp"
    run = _open_run_directory(directory)
    try:
        folder = _make_step_directory(run, target.parent)
        try:
            with _create(folder, temporary, "wb") as file:
                torch.save(state, file)
                file.flush()
                os.fsync(file.fileno())
            with os.fdopen(os.open(temporary, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=folder),
                           "rb") as file:
                size, digest = _size_and_digest(file)
            _write_atomically(folder, sum_file(target).name, f"{size} {digest}\n")
            # After its sum: a file in place always has one.
            os.replace(temporary, target.name, src_dir_fd=folder, dst_dir_fd=folder)
        finally:
            os.close(folder)
        _prune(run, directory, rank, workers, written=step)
    finally:
        os.close(run)


def _make_run_directory(directory: str | Path) -> None:
    """Make the run's directory, private to this user, unless a rank made it already; either
    way refuse one that is not this user's own (another user may have made it first)."""
    Path(directory).parent.mkdir(parents=True, exist_ok=True)  # the root, shared by runs
    try:
        os.mkdir(directory, 0o700)
    except FileExistsError:
        pass  # another rank made it; or someone else did, which the check refuses
    check_directory(directory)


def _make_step_directory(run: int, path: Path) -> int:
    """The step folder `path` in the open run directory `run`, made unless a rank made it,
    opened; an entry there that is not a real folder is refused."""
    try:
        os.mkdir(path.name, 0o700, dir_fd=run)
    except FileExistsError:
        pass
    try:
        return _open_folder(path.name, run)
    except OSError:
        info = os.stat(path.name, dir_fd=run, follow_symlinks=False)
        if stat.S_ISDIR(info.st_mode):
            raise
        raise CheckpointRefused(f"{path} is {_kind(info)}, not a checkpoint folder: "
                                "refused") from None


def _create(folder: int, name: str, mode: str):
    """A new file `name` in the open directory `folder` (a stale one of a killed writer is
    replaced), never through a symbolic link."""
    try:
        os.unlink(name, dir_fd=folder)
    except FileNotFoundError:
        pass
    return os.fdopen(os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600,
                             dir_fd=folder), mode)


def _write_atomically(folder: int, name: str, text: str) -> None:
    temporary = f".{name}.{os.getpid()}.tmp"
    with _create(folder, temporary, "w") as file:
        file.write(text)
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, name, src_dir_fd=folder, dst_dir_fd=folder)


def load(directory: str | Path, step: int, rank: int) -> dict:
    """This rank's state at `step`, on the CPU (the model and optimizer copy it to theirs):
    from a directory of this user's, checked against its sum, and built from tensors and
    plain data only (torch's `weights_only`), so that a planted file runs no code."""
    import torch

    path = rank_file(directory, step, rank)
    run = _open_run_directory(directory)
    try:
        folder = _open_folder(path.parent.name, run)
    finally:
        os.close(run)
    try:
        content = _read(path.name, folder)
        problem = _differs_from_sum(path, len(content), hashlib.sha256(content).hexdigest(),
                                    lambda: _read(sum_file(path).name, folder).decode())
    finally:
        os.close(folder)
    if problem is not None:
        raise CheckpointRefused(problem)
    try:
        state = torch.load(io.BytesIO(content), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        raise CheckpointRefused(f"{path} holds more than tensors and plain data "
                                f"({_why_unpickling_failed(error)}): refused, as loading it "
                                "could run code") from None
    except Exception as error:  # a truncated or foreign file, whatever torch says of it
        first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise CheckpointRefused(f"{path} is damaged: it cannot be loaded ({first_line})") from None
    if not isinstance(state, dict):
        raise CheckpointRefused(f"{path} is damaged: it holds a {type(state).__name__}, not "
                                "a worker's state")
    return state


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
                    "tuples and dicts of these (docs/writing-plugins.md, \"State and resume\")")


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
    later_steps = [later for later in steps(directory) if later > step]
    if not later_steps:
        return
    run = _open_run_directory(directory)
    try:
        for later in later_steps:
            try:
                _remove_tree(step_directory(directory, later).name, parent=run)
            except OSError as error:
                raise CheckpointRefused(f"cannot remove the later checkpoint "
                                        f"{step_directory(directory, later)}: "
                                        f"{error.strerror or error}") from None
    finally:
        os.close(run)


def _prune(run: int, directory: str | Path, rank: int, workers: int, written: int) -> None:
    """Delete this rank's files of the steps older than the two latest complete ones, among
    the steps up to `written` (the step this rank just wrote): a later step is none of this
    run's doing. `run`: the run's directory, open; what is deleted is deleted in it."""
    kept = [step for step in complete_steps(directory, workers) if step <= written][-KEEP_COMPLETE:]
    if len(kept) < KEEP_COMPLETE:
        return
    for old in steps(directory):
        if old >= kept[0]:
            break
        mine = rank_file(directory, old, rank)
        try:
            folder = _open_folder(mine.parent.name, run)
        except OSError:
            continue  # gone since listed, or swapped for a link: not ours
        try:
            for name in (mine.name, sum_file(mine).name):
                try:
                    os.unlink(name, dir_fd=folder)  # never follows a link: removes the link
                except FileNotFoundError:
                    pass
        finally:
            os.close(folder)
        try:
            os.rmdir(mine.parent.name, dir_fd=run)  # the last rank out removes the folder
        except OSError:
            pass


def _remove_tree(path: Path, parent: int | None = None) -> None:
    """Remove the step folder `path` and the rank files in it, never following a link: `path`
    (relative to the open directory `parent`, when given) is opened as a directory that must
    not be a link, and its entries unlinked relative to it. An OSError other than a missing
    or not-real folder is raised."""
    try:
        folder = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=parent)
    except (FileNotFoundError, NotADirectoryError):
        return  # gone, or not a real folder (a file)
    except OSError as error:
        if error.errno == errno.ELOOP:
            return  # a link: not ours to remove
        raise
    try:
        for name in os.listdir(folder):
            if _RANK_FILE.fullmatch(name) and not stat.S_ISDIR(
                    os.stat(name, dir_fd=folder, follow_symlinks=False).st_mode):
                os.unlink(name, dir_fd=folder)
    finally:
        os.close(folder)
    try:
        os.rmdir(path, dir_fd=parent)
    except OSError:
        pass  # something left in it that dsgd did not write


def remove_run(directory: str | Path) -> str | None:
    """Delete a run's checkpoint directory, as recorded in the database: its step folders'
    rank files, then the folders and the directory if nothing else is left. Never follows a
    link and never deletes anything else; a directory that is not this user's own is left.
    Returns why something was left (None: all gone, or there was nothing)."""
    try:
        run = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError as error:
        try:
            info = os.lstat(directory)
        except OSError:
            return f"left {directory}: {error.strerror or error}"
        if stat.S_ISDIR(info.st_mode):
            return f"left {directory}: {error.strerror or error}"
        return f"left {directory}: it is {_kind(info)}, not a checkpoint directory"
    try:
        if os.fstat(run).st_uid != os.getuid():
            return f"left {directory}: it is not your own"
        for name in filter(_STEP.fullmatch, os.listdir(run)):
            _remove_tree(name, parent=run)
    except OSError as error:
        return f"left part of {directory}: {error.strerror or error}"
    finally:
        os.close(run)
    try:
        os.rmdir(directory)
    except OSError as error:
        return f"left {directory}: {error.strerror or error}"
    return None


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
