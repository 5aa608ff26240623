"""Writes that wait while another process holds an SQLite database's lock.

SQLite lets one writer in at a time; another waits up to the busy timeout
(`database.SQLITE_BUSY_TIMEOUT`) and then fails with "database is locked". A `dsgd run` whose
workers had finished used to give up there and call its run stopped. Its records are safe in
the workers' event files, so a write of the results store instead tries again for as long as
the database stays busy, and says so on one line once it has waited `NOTICE_AFTER_S` (at the
refusal that ends the wait's first SQLite busy timeout past it); only
an interrupt (`ResultsWriter.interrupted`, set by the launcher while its signals are noted)
ends the wait, with the error the launcher reports as a database that cannot be written.
"""

from __future__ import annotations

import functools
import sys
import time

from sqlalchemy.exc import OperationalError

NOTICE_AFTER_S = 5.0


def is_busy(error: OperationalError) -> bool:
    """Whether SQLite refused for another connection's lock (not a read-only file or a full
    disk, which waiting does not cure)."""
    message = str(getattr(error, "orig", error)).lower()
    return "database is locked" in message or "database is busy" in message


def while_busy(write):
    """Decorate a `ResultsWriter` method: run it again while the database is busy. A write
    that is not refused costs nothing more (the launcher writes metrics many times a second);
    each refusal comes after SQLite's own busy wait, so the notice needs no timer."""
    @functools.wraps(write)
    def waiting(writer, *args, **kwargs):
        started, said = time.monotonic(), False
        while True:
            try:
                return write(writer, *args, **kwargs)
            except OperationalError as error:
                if not is_busy(error) or writer.interrupted():
                    raise
                if not said and time.monotonic() - started >= NOTICE_AFTER_S:
                    _say_busy(writer.shown_url)
                    said = True
    return waiting


def _say_busy(shown_url: str) -> None:
    print(f"dsgd: results database {shown_url} is busy (another process holds its lock): "
          "waiting to write", file=sys.stderr, flush=True)
