"""Checks that a directory dsgd's workers will write to can be written to, made before
anything launches: a checkpoint directory or a `save_dir` that is a file, lies under a file,
or cannot be created is a one-line error instead of a failed run; and whether an existing
directory can be trusted (`distrust`): a real directory of this user's; and whether a
directory that holds trusted ones lets other users swap them (`shared_problem`)."""

from __future__ import annotations

import os
import pwd
import stat
import tempfile
from pathlib import Path

from dsgd_cli.errors import DsgdError


def blocking_file(directory: Path) -> Path | None:
    """The file (not a directory) at `directory` or at one of its ancestors, which keeps
    the directory from ever being made; None if there is none."""
    for path in (directory, *directory.parents):
        if path.exists() or path.is_symlink():
            return None if path.is_dir() else path
    return None


def unusable_name(directory: Path) -> str | None:
    """Why the system refuses `directory` as a name (a component too long, a NUL byte), or None."""
    if "\x00" in str(directory):
        return "not a usable path: it holds a NUL character"
    try:
        for path in (directory, *directory.parents):
            path.exists()
    except (OSError, ValueError) as error:
        return f"not a usable path: {getattr(error, 'strerror', None) or error}"
    return None


def name_or_file_in_the_way(directory: Path) -> str | None:
    """Why `directory` can never be made, whoever tries: a name the system refuses, or a file
    where it or one of its ancestors should be; None if neither."""
    unusable = unusable_name(directory)
    if unusable:
        return unusable
    blocker = blocking_file(directory)
    if blocker is None:
        return None
    return (f"{blocker} is a file, not a directory" if blocker == directory
            else f"{blocker} is a file, so no directory can be made under it")


def problem_creating(directory: Path) -> str | None:
    """Why files cannot be written in `directory` (None: they can), found by trying: making
    it (with its parents) and a temporary file in it. What the trial made is kept: removed,
    its name would be free for another user to make it theirs before the workers write."""
    in_the_way = name_or_file_in_the_way(directory)
    if in_the_way:
        return in_the_way
    existed = directory.exists()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as error:
        made = existed or directory.exists()
        return f"cannot {'write in' if made else 'create'} it: {error.strerror or error}"
    return None


def problem_without_creating(directory: Path) -> str | None:
    """Why `directory` could not be made and written to, judged without making anything (for
    the spec's `save_dir`, which even `--dry-run` checks): a name the system refuses, a file
    in the way, or a nearest existing directory this user may not write to."""
    in_the_way = name_or_file_in_the_way(directory)
    if in_the_way:
        return in_the_way
    existing = next(path for path in (directory, *directory.parents) if path.exists())
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} is not writable"
    return None


def distrust(path: Path, private: bool = False) -> str | None:
    """Why dsgd must not trust the existing directory `path` with what it writes or reads
    there (None: it may), judged without following a symbolic link: not a real directory,
    owned by another user, or (`private`: checkpoints, which are loaded again) writable by
    other users."""
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode):
        return "is a symbolic link, not a directory"
    if not stat.S_ISDIR(info.st_mode):
        return "is not a directory"
    if info.st_uid != os.getuid():
        return f"is owned by {_user(info.st_uid)}, not by you"
    if private and info.st_mode & 0o022:
        return f"is writable by other users (mode {stat.S_IMODE(info.st_mode):o})"
    return None


def shared_problem(path: Path) -> str | None:
    """Why the directory `path`, which holds directories dsgd trusts (the checkpoint root,
    `save_dir`), would let another user rename or swap what is in it (None: it would not):
    owned by a user other than you or root, or writable by others without the sticky bit
    (a sticky directory such as /tmp lets only an entry's owner rename it). A link is
    followed: the entries live in the directory it points to."""
    info = os.stat(path)
    if not stat.S_ISDIR(info.st_mode):
        return "is not a directory"
    if info.st_uid not in (os.getuid(), 0):
        return f"is owned by {_user(info.st_uid)}, not by you or root"
    if info.st_mode & 0o022 and not info.st_mode & stat.S_ISVTX:
        return (f"is writable by other users without the sticky bit (mode "
                f"{stat.S_IMODE(info.st_mode):o}), so they could swap what is in it")
    return None


def refuse_shared(path: Path, what: str) -> None:
    """Raise UntrustedDirectory, naming `what` it is, when `shared_problem` finds a reason."""
    problem = shared_problem(path)
    if problem is not None:
        raise UntrustedDirectory(f"{what} {path} {problem}: refused")


def _user(uid: int) -> str:
    try:
        return f"user {pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


class UntrustedDirectory(DsgdError):
    """A directory dsgd will not write to or read from: see `distrust`."""


def refuse_untrusted(path: Path, what: str, private: bool = False) -> None:
    """Raise UntrustedDirectory, naming `what` it is, when `distrust` finds a reason."""
    problem = distrust(path, private)
    if problem is not None:
        raise UntrustedDirectory(f"{what} {path} {problem}: refused")


def make_experiment_directory(directory: Path) -> None:
    """Make `directory`, an experiment's directory under `save_dir` (its parent), or take
    the one already there; refused (UntrustedDirectory) when `save_dir` lets other users
    swap what is in it, or the experiment's directory is a link or another user's."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    refuse_shared(directory.parent, "save_dir")
    try:
        os.mkdir(directory)
    except FileExistsError:
        pass  # an earlier run's, or planted: `refuse_untrusted` tells
    refuse_untrusted(directory, "save_dir: the experiment's directory")
