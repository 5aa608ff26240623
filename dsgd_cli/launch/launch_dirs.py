"""Where a launch's directory is made ($TMPDIR), which TMPDIR dsgd refuses, and the
directories of launchers that died without removing theirs.

A launch's directory (`dsgd-launch-*`, mode 0700) holds the plan, the workers' events, the
fork server's socket and the store's: everything another user must not reach. Its 0700 mode
keeps them out of it, but not out of its parent: in a directory that others may write to
without the sticky bit (which /tmp has), another user can rename the launch's directory as it
appears and put their own in its place, with a socket of theirs inside. Such a TMPDIR is
refused, as a checkpoint root is.

A launcher writes its pid and the process's start time into its directory; a `dsgd run`
that is SIGKILLed leaves the directory behind, and the next `dsgd run` of the same user
removes those whose launcher is gone and which no process still uses.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from pathlib import Path

from dsgd_cli.spec.directories import refuse_shared

PREFIX = "dsgd-launch-"
OWNER_FILE = "launcher"  # "PID START_TIME" of the `dsgd run` that made the directory
RUN_MARKER = "DSGD_RUN_DIR"  # set in the environment of a launch's processes


def launch_root() -> Path:
    """The directory launches are made in, refused (UntrustedDirectory, exit 2) when another
    user could swap what is in it."""
    root = Path(tempfile.gettempdir())
    refuse_shared(root, "TMPDIR (where dsgd makes each launch's directory)")
    return root


def make_launch_dir() -> Path:
    """A new launch directory (0700), marked with this process as its launcher."""
    directory = Path(tempfile.mkdtemp(prefix=PREFIX, dir=launch_root()))
    (directory / OWNER_FILE).write_text(_identity(os.getpid()) or "")
    return directory


def remove_stale(root: Path | None = None) -> list[Path]:
    """Remove this user's launch directories in `root` (default: TMPDIR) whose launcher has
    gone and which no live process names as its launch; the removed ones."""
    root = root or Path(tempfile.gettempdir())
    orphans = [directory for directory in root.glob(f"{PREFIX}*")
               if _is_own_directory(directory) and _launcher_gone(directory)]
    if not orphans:
        return []  # the common case: no process's environment is read
    in_use = _directories_in_use()
    removed = [directory for directory in orphans if directory not in in_use]
    for directory in removed:
        shutil.rmtree(directory, ignore_errors=True)
    return removed


def _is_own_directory(path: Path) -> bool:
    try:
        info = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid()


def _launcher_gone(directory: Path) -> bool:
    """Whether the process that made `directory` is gone (a process that took over its pid
    has another start time). A directory without the mark is a launcher's from before it, or
    is being made this instant: left alone."""
    try:
        mark = (directory / OWNER_FILE).read_text().split()
    except OSError:
        return False
    if len(mark) != 2 or not mark[0].isdigit():
        return False
    return _identity(int(mark[0])) != " ".join(mark)


def _identity(pid: int) -> str | None:
    """"PID START_TIME" of a live process (the start time in clock ticks since boot, from
    /proc/PID/stat), None if there is none under `pid`."""
    try:
        stat_line = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name, in parentheses, may hold spaces: the fields after it are fixed.
    fields = stat_line.rpartition(")")[2].split()
    return f"{pid} {fields[19]}"


def _directories_in_use() -> set[Path]:
    """The launch directories named in the environment of this user's live processes."""
    prefix = f"{RUN_MARKER}=".encode()
    in_use = set()
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if entry.stat().st_uid != os.getuid():
                continue
            variables = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for variable in variables:
            if variable.startswith(prefix):
                in_use.add(Path(variable[len(prefix):].decode(errors="replace")))
    return in_use
