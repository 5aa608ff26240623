"""Checkpoints: every worker's state every `checkpoint_every` steps, so a run resumes.

A run's checkpoints live in one directory (the database row points to it), one folder per step
and one file per rank: `step-0000000040/rank-1.pt`. Each file is written to a temporary name
and renamed into place, so a file that exists is whole: a worker killed while writing leaves
only a temporary file, which nothing reads. A step is *complete* when every rank's file is
there; a run resumes from its latest complete step.

Beside each file, `rank-1.pt.sum` records its size and SHA-256 when written (the sum is put
in place before the file, so every file has one). Before a run resumes, the files of the
step it resumes from are checked against their sums: a file damaged since (truncated,
overwritten) makes it fall back to the step before, when that one is complete and sound.

Each rank deletes its own files of steps older than the two latest complete ones, so a
complete step always exists once one was written, even when asynchronous workers drift many
checkpoints apart, and one to fall back to once two were.
"""

from __future__ import annotations

import hashlib
import os
import random
import re
import uuid
from pathlib import Path

from dsgd_cli.spec.directories import problem_creating
from dsgd_cli.errors import DsgdError

ENV_ROOT = "DSGD_CHECKPOINTS"
KEEP_COMPLETE = 2  # complete steps each rank keeps: the latest, and one to fall back to
_STEP = re.compile(r"^step-(\d+)$")


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
    """A new, unique directory under `root` for one run's checkpoints (created by the
    workers)."""
    safe = re.sub(r"[^A-Za-z0-9._=-]+", "_", experiment)[:80]
    return str(root / f"{safe}-{uuid.uuid4().hex[:12]}")


def step_directory(directory: str | Path, step: int) -> Path:
    return Path(directory) / f"step-{step:010d}"


def rank_file(directory: str | Path, step: int, rank: int) -> Path:
    return step_directory(directory, step) / f"rank-{rank}.pt"


def steps(directory: str | Path) -> list[int]:
    """The steps that have a folder, in increasing order."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    return sorted(int(m.group(1)) for m in map(_STEP.match, names) if m)


def sum_file(path: Path) -> Path:
    """Where the size and checksum of the checkpoint file `path` are recorded."""
    return path.with_name(path.name + ".sum")


def complete_steps(directory: str | Path | None, workers: int) -> list[int]:
    """The steps with every rank's file, in increasing order."""
    if directory is None:
        return []
    return [step for step in steps(directory)
            if all(rank_file(directory, step, rank).is_file() for rank in range(workers))]


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
    """What is wrong with the checkpoint file `path` (None: it is as written, or it was
    written by a dsgd that recorded no checksum)."""
    try:
        size, digest = sum_file(path).read_text().split()
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as error:
        return f"{sum_file(path)} cannot be read ({error})"
    actual = path.stat().st_size
    if actual != int(size):
        return f"{path} is damaged ({actual} bytes, {size} when written)"
    if _sha256(path) != digest:
        return f"{path} is damaged (its checksum differs from the one recorded when written)"
    return None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def save(directory: str | Path, step: int, rank: int, state: dict, workers: int) -> None:
    """Write this rank's `state` for `step` atomically, then drop its superseded files."""
    import torch

    target = rank_file(directory, step, rank)
    target.parent.mkdir(parents=True, exist_ok=True)
    temporary = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    with open(temporary, "wb") as file:
        torch.save(state, file)
        file.flush()
        os.fsync(file.fileno())
    _write_atomically(sum_file(target), f"{temporary.stat().st_size} {_sha256(temporary)}\n")
    os.replace(temporary, target)  # after its sum: a file in place always has one
    _prune(directory, rank, workers)


def _write_atomically(path: Path, text: str) -> None:
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(temporary, "w") as file:
        file.write(text)
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, path)


def load(directory: str | Path, step: int, rank: int) -> dict:
    """This rank's state at `step`, on the CPU (the model and optimizer copy it to theirs)."""
    import torch

    return torch.load(rank_file(directory, step, rank), map_location="cpu", weights_only=False)


def keep_only(directory: str | Path, step: int) -> None:
    """Remove every step but `step`: what a resumed run writes must not mix with files that an
    earlier attempt wrote for a later step, and older steps are of no more use."""
    for other in steps(directory):
        if other != step:
            _remove_tree(step_directory(directory, other))


def _prune(directory: str | Path, rank: int, workers: int) -> None:
    kept = complete_steps(directory, workers)[-KEEP_COMPLETE:]
    if len(kept) < KEEP_COMPLETE:
        return
    for old in steps(directory):
        if old >= kept[0]:
            break
        mine = rank_file(directory, old, rank)
        for path in (mine, sum_file(mine)):
            try:
                path.unlink()
            except FileNotFoundError:
                pass
        try:
            mine.parent.rmdir()  # the last rank out removes the folder
        except OSError:
            pass


def _remove_tree(path: Path) -> None:
    for child in path.iterdir():
        child.unlink()
    path.rmdir()


def rng_state(device) -> dict:
    """The random generators' states a run's numbers depend on: torch (and CUDA), NumPy,
    Python."""
    import numpy
    import torch

    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": numpy.random.get_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device) -> None:
    import numpy
    import torch

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    numpy.random.set_state(state["numpy"])
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)
