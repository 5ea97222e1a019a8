"""SQLite database URLs as MLflow and Optuna take them: the file one names, and a lock per file
for the processes of this host (what SQLite's own locking leaves to its users)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["sqlite_file", "sqlite_lock"]


def sqlite_file(uri: Any) -> Path | None:
    """The database file of a ``sqlite:///`` URI (a driver may be named, ``sqlite+pysqlite``);
    None for other stores, in-memory ones and anything not a string."""
    match = re.match(r"sqlite(\+\w+)?:///", uri) if isinstance(uri, str) else None
    if match is None:
        return None
    name = uri[match.end() :].split("?")[0]
    return None if name in ("", ":memory:") else Path(name)


@contextlib.contextmanager
def sqlite_lock(uri: Any, purpose: str) -> Iterator[None]:
    """An exclusive lock, per SQLite database file and ``purpose``, held by one process of this
    host at a time for the block (a ``flock`` on a file in the temporary folder, released if the
    process dies); a no-op for other URIs, without fcntl, or where the lock file cannot be made.
    """
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        fcntl = None  # type: ignore[assignment]
    database = sqlite_file(uri)
    if fcntl is None or database is None:
        yield
        return
    key = hashlib.sha256(str(database.resolve()).encode()).hexdigest()[:16]
    try:
        # never through a link planted at the predictable name (O_NOFOLLOW)
        lock = Path(tempfile.gettempdir()) / f"autoprec-{purpose}-{key}.lock"
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | getattr(os, "O_NOFOLLOW", 0)
        handle = os.fdopen(os.open(lock, flags, 0o600), "a")
    except OSError:
        yield
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
