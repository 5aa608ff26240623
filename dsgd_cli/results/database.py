"""Where a results database is and how it is opened: `--db` paths and URLs, and the SQLAlchemy
engines that read or write it.

A path names exactly that file, whatever characters it holds; a URL is recognised by its
scheme. SQLAlchemy is imported only when an engine is made: the reading commands over an
SQLite file never make one (`dsgd_cli.results.reader` reads it through Python's sqlite3).
"""

from __future__ import annotations

import os
import re
import sqlite3
import time
from pathlib import Path
from urllib.parse import quote, unquote

from dsgd_cli.errors import StoreError
from dsgd_cli.results import strictjson

DEFAULT_DB = "dsgd.db"
# Seconds a writer waits for another's lock before SQLite says "database is locked"; the
# results store's writes then try again (busy.py).
SQLITE_BUSY_TIMEOUT = 5

# A URL starts with its scheme (`postgresql+psycopg://`, `sqlite://`); anything else is a path.
_URL_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def resolve_url(db: str | None) -> str:
    """The database `--db` names (else $DSGD_DB, else ./dsgd.db) as an SQLAlchemy URL. A path
    names exactly that file: its characters are percent-encoded in the URL, which SQLAlchemy
    decodes (`q%41.db` is not `qA.db`, and a `?` or `#` starts no query)."""
    db = given_db(db)
    if _URL_SCHEME.match(db):
        return db
    return "sqlite:///" + quote(str(Path(db).expanduser()), safe="/")


def given_db(db: str | None) -> str:
    return db or os.environ.get("DSGD_DB") or DEFAULT_DB


def shown_db(db: str | None) -> str:
    """The database for messages: a URL without its password, a path as `sqlite:///PATH`."""
    db = given_db(db)
    if _URL_SCHEME.match(db):
        return without_password(db)
    return f"sqlite:///{Path(db).expanduser()}"


# -- files and engines ---------------------------------------------------------------------------

_SQLITE_FILE = re.compile(r"^sqlite:///([^?]+)$")


def sqlite_path(url: str) -> str | None:
    """The file of a plain `sqlite:///PATH` URL (percent-decoded, as SQLAlchemy does), else
    None (another database, an in-memory one, or options that SQLAlchemy should interpret)."""
    match = _SQLITE_FILE.match(url)
    path = unquote(match.group(1)) if match else None
    return None if path in (None, ":memory:") else path


def read_only_uri(path: str) -> str:
    """The SQLite URI filename that opens the database file at `path` read-only (for
    `sqlite3.connect(..., uri=True)`); a StoreError when there is no such file."""
    if not Path(path).is_file():
        raise StoreError(f"no results database at {path} (`dsgd run` creates one)")
    # A database in WAL mode needs its shared-memory file even to read; in a directory
    # nobody may write to, no writer can exist either, so the file is opened as immutable.
    mode = "mode=ro" if os.access(Path(path).parent, os.W_OK) else "immutable=1"
    return f"file:{quote(str(Path(path).resolve()))}?{mode}"


def read_only_engine(url: str):
    """An engine that cannot change the database (for `Results.engine`)."""
    return make_engine(url, readonly=True)


def make_engine(url: str, readonly: bool):
    """An engine for the database at `url`; `readonly`: one that cannot change it."""
    from sqlalchemy import create_engine, event
    from sqlalchemy.engine import make_url

    if make_url(url).get_backend_name() == "postgresql":
        # A reading command's sessions are read-only transactions: it cannot change anything.
        options = {"options": "-c default_transaction_read_only=on"} if readonly else {}
        # UTF-8 whatever the database's encoding: in a SQL_ASCII database (the default of
        # clusters initialised without a locale) psycopg would otherwise return bytes.
        options["client_encoding"] = "utf8"
        return create_engine(url, connect_args=options, json_serializer=strictjson.dumps)
    if not url.startswith("sqlite"):
        return create_engine(url, json_serializer=strictjson.dumps)
    path = make_url(url).database
    in_memory = path in (None, "", ":memory:")
    if readonly and not in_memory:
        # The reader's own read-only connection: an SQLite URI inside an SQLAlchemy URL would
        # be decoded twice, and a file name with `#`, `?` or `%` would open another file.
        uri = read_only_uri(path)
        engine = create_engine("sqlite://", creator=lambda: sqlite3.connect(uri, uri=True))
        event.listen(engine, "connect", _sqlite_pragmas(journal=False))
        return engine
    # A writer waits for another's lock instead of failing at once.
    engine = create_engine(url, connect_args={"timeout": SQLITE_BUSY_TIMEOUT},
                           json_serializer=strictjson.dumps)
    event.listen(engine, "connect", _sqlite_pragmas(journal=not readonly))
    return engine


def _sqlite_pragmas(journal: bool):
    def on_connect(connection, _record) -> None:
        cursor = connection.cursor()
        cursor.execute("PRAGMA foreign_keys=ON")
        if journal:  # changing the journal mode writes to the file
            _use_wal(cursor)
        cursor.close()
    return on_connect


def _use_wal(cursor) -> None:
    """Switch the database to WAL, which it then keeps, unless it is in WAL already (asking
    writes nothing). Processes creating a database at once all try to switch it; SQLite tells
    all but one `database is locked` at once, without waiting (waiting could deadlock), and
    those try again: by then it has switched."""
    deadline = time.monotonic() + SQLITE_BUSY_TIMEOUT
    while True:
        try:
            if cursor.execute("PRAGMA journal_mode").fetchone()[0].lower() != "wal":
                cursor.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as error:
            if "locked" not in str(error) or time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def missing_driver_error(shown_url: str, error: ModuleNotFoundError) -> StoreError:
    hint = "; pip install 'dsgd[postgres]'" if shown_url.startswith("postgres") else ""
    return StoreError(f"cannot open results database {shown_url}: driver not installed "
                      f"({error.name}{hint})")


def without_password(url: str) -> str:
    if url.startswith("sqlite"):
        return url  # no user, no password
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        parsed = make_url(url)
    except ArgumentError:
        return url
    return parsed.render_as_string(hide_password=True) if parsed.password else url


def one_line(reason: Exception | str) -> str:
    """A driver's message on one line (PostgreSQL's add DETAIL and HINT lines)."""
    return " ".join(str(reason).split())
