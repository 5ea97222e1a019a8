"""The user's cache folder and atomic file writes, shared by everything that keeps results.

Sensitivity tables, warm starts, the evaluation store and calibrations live under
``$AUTOPREC_CACHE_DIR`` (default ``~/.cache/autoprec``). Files are written to a temporary file
in the same folder and moved into place, so an interrupted write never leaves a broken file.

A cache entry only saves time, so a fault in one never stops the work: an entry that cannot
be read (truncated, junk, from another program) is discarded and recomputed
(:func:`read_entry`), one that cannot be written (a full disk) is skipped
(:func:`write_entry`), each with a one-line :class:`CacheNote` naming the file. The command
line prints these notes as ``autoprec: note: ...``.

Every output the user asks for is written by :func:`write_output`: atomically, replacing a link
at its path rather than writing through it, and where it cannot be written, kept in the cache's
``recovered`` folder with a one-line :class:`OutputError` saying where. A name that becomes a
path (a search's name, a kept file's) goes through :func:`path_in`, which keeps it inside its
folder.
"""

from __future__ import annotations

import contextlib
import csv
import errno
import hashlib
import io
import json
import os
import secrets
import sqlite3
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, TypeVar

from autoprec._text import excerpt

T = TypeVar("T")
REASON_CHARS = 120  # at most this much of an error's text in a note


class CacheDirError(ValueError):
    """``$AUTOPREC_CACHE_DIR`` (or ``~/.cache/autoprec``) exists and is not a folder."""


class CacheNote(UserWarning):
    """A cache entry was damaged and is recomputed, or a cache could not be written."""


class UnsafeNameError(ValueError):
    """A name that would become a path outside its folder (``..``, ``a/b``, ``/etc``, empty)."""


class OutputError(ValueError):
    """An output cannot be written (a full disk, a read-only folder); the message says where
    its content was kept instead."""


def path_in(folder: Path, name: str, what: str = "name") -> Path:
    """``folder / name``, where ``name`` must be one plain entry of ``folder``: the one way a
    name given by a user (a search's, a model's) becomes a path.

    Example:
        >>> path_in(Path("cache"), "tinycnn-seed0")
        PosixPath('cache/tinycnn-seed0')

    Raises:
        UnsafeNameError: ``name`` is empty, ``.`` or ``..``, holds a path separator or a NUL, or
            is not a string (``what`` names it in the one-line message).
    """
    separators = {"/", os.sep, os.altsep} - {None}
    if (
        not isinstance(name, str)
        or name in ("", ".", "..")
        or "\0" in name
        or any(sep in name for sep in separators)
    ):
        raise UnsafeNameError(
            f"{what} {excerpt(name)} cannot name an entry of {folder}: expected one plain name "
            "(not empty, not '.' or '..', no '/'), so that nothing outside the folder is touched; "
            f"choose another {what}"
        )
    return folder / name


def cache_dir() -> Path:
    """``$AUTOPREC_CACHE_DIR``, else ``~/.cache/autoprec``.

    Raises:
        CacheDirError: the path exists and is not a folder.
    """
    root = os.environ.get("AUTOPREC_CACHE_DIR")
    path = Path(root) if root else Path.home() / ".cache" / "autoprec"
    if path.exists() and not path.is_dir():
        name = "AUTOPREC_CACHE_DIR" if root else "the cache folder"
        raise CacheDirError(
            f"{name} {path} is a file, not a folder; point AUTOPREC_CACHE_DIR at a folder "
            "(or move the file away)"
        )
    return path


def digest(obj: Any) -> str:
    """SHA-256 (hex, 32 characters) of ``obj``'s canonical JSON (sorted keys, ``str`` for the
    rest): the form every cache key is made of."""
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def reason(exc: BaseException) -> str:
    """An error in a few words: its first line, shortened, else its type."""
    lines = str(exc).strip().splitlines()
    text = getattr(exc, "strerror", None) or (lines[0] if lines else "") or type(exc).__name__
    if isinstance(exc, KeyError):  # its text is the bare key
        text = f"no {text} in it"
    return text if len(text) <= REASON_CHARS else text[: REASON_CHARS - 3] + "..."


_FAILED: set[str] = set()  # reasons of failed cache writes already noted (in this process)


def note(message: str) -> None:
    """Say ``message`` (one line) as a :class:`CacheNote`."""
    warnings.warn(message, CacheNote, stacklevel=3)


def note_failed_write(what: str, path: Path, exc: BaseException) -> None:
    """Note that the cache ``path`` cannot be written and the work goes on without it; once
    per reason, so that a full disk costs one line, not one per cache."""
    why = reason(exc)
    full = getattr(exc, "errno", None) == errno.ENOSPC or (
        getattr(exc, "sqlite_errorcode", None) == getattr(sqlite3, "SQLITE_FULL", 13)
    )
    if (key := "full" if full else why) not in _FAILED:
        _FAILED.add(key)
        note(
            f"cannot write {what} {path} ({why}); going on without caching (other cache "
            "files that fail alike are not reported)"
        )


def discard(path: Path, why: str, what: str = "cache entry") -> None:
    """Delete the damaged cache file ``path`` and say so; the caller recomputes it."""
    with contextlib.suppress(OSError):
        path.unlink()
    note(f"{what} {path} is damaged ({why}); discarded it, recomputing")


def read_entry(path: Path, read: Callable[[Path], T], what: str = "cache entry") -> T | None:
    """``read(path)``; None when the file is missing, or damaged (then discarded, with a note).

    Any error of ``read`` counts as damage: the entry is only a saved result, computing it
    again is always correct.
    """
    if not path.exists():
        return None
    try:
        return read(path)
    except Exception as exc:  # noqa: BLE001 - whatever is wrong with it, it is recomputed
        discard(path, reason(exc), what)
        return None


def write_entry(
    path: Path, write: Callable[[IO[Any]], None], binary: bool = False, what: str = "cache entry"
) -> bool:
    """:func:`write_atomic`, but a failure (a full disk, a read-only folder) is a note, not an
    error: the work goes on without this entry. Returns whether it was written."""
    try:
        write_atomic(path, write, binary)
    except OSError as exc:
        note_failed_write(what, path, exc)
        return False
    return True


def write_atomic(path: Path, write: Callable[[IO[Any]], None], binary: bool = False) -> None:
    """Call ``write(file)`` on a temporary file next to ``path``, then replace ``path`` with it.

    The new file keeps the mode of the one it replaces (a new one gets the umask's), text is
    UTF-8, and the rename is synced, so a crash leaves the old file or the new one.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = str(path.parent / f".{path.name}.{secrets.token_hex(6)}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies
        opened = os.fdopen(fd, "wb") if binary else open(fd, "w", encoding="utf-8")
        with opened as fh:
            if path.exists():
                os.fchmod(fh.fileno(), path.stat().st_mode & 0o777)
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, OSError) and exc.errno is not None and exc.filename in (None, tmp):
            exc.filename = str(path)  # name the file the caller asked for, not ours
        raise
    with contextlib.suppress(OSError):  # make the rename itself durable (POSIX)
        dirfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dirfd)
        finally:
            os.close(dirfd)


def write_output(
    path: str | os.PathLike[str],
    write: Callable[[IO[Any]], None],
    binary: bool = False,
    what: str = "output",
) -> Path:
    """:func:`write_atomic` for an output the user asked for; returns its path.

    A link at ``path`` is replaced, never written through. Where the file cannot be written
    (a full disk, a read-only folder), ``write`` is called again into the recovered folder
    (:func:`keep`) and an :class:`OutputError` says where the content is.

    Raises:
        OutputError: ``path`` cannot be written (one line: the file, the reason, where it is
            kept and how to get it back).
    """
    target = Path(path)
    try:
        write_atomic(target, write, binary)
    except OSError as exc:
        kept = keep(target.name, write, binary)
        where = (
            f"kept it in {kept}: copy it to {target} once there is room"
            if kept is not None
            else "it could not be kept anywhere else either"
        )
        raise OutputError(f"cannot write {what} {target}: {reason(exc)}; {where}") from None
    return target


def csv_text(rows: Iterable[Mapping[str, Any]], fields: Sequence[str] | None = None) -> str:
    """``rows`` as CSV text.

    ``fields``: the columns, in order (keys outside them are left out, missing or None values
    are empty); None takes every key of the rows in order of first appearance.
    """
    rows = list(rows)
    if fields is None:
        fields = []
        for row in rows:
            fields += [k for k in row if k not in fields]
    columns = list(fields)
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=columns, extrasaction="ignore")
    writer.writeheader()
    writer.writerows({k: ("" if r.get(k) is None else r[k]) for k in columns} for r in rows)
    return out.getvalue()


def write_csv(
    path: str | os.PathLike[str],
    rows: Iterable[Mapping[str, Any]],
    fields: Sequence[str] | None = None,
) -> Path:
    """Write ``rows`` as CSV (:func:`csv_text`), atomically (:func:`write_atomic`); returns
    the path."""
    text = csv_text(rows, fields)
    target = Path(path)
    write_atomic(target, lambda fh: fh.write(text))
    return target


def keep(name: str, write: Callable[[IO[Any]], None], binary: bool = False) -> Path | None:
    """Save what ``write`` writes where it can be recovered when its real destination failed:
    a new file ``recovered/<stem>-<time><suffix>`` in the cache folder, else in the temporary
    folder. Returns its path, or None when neither can be written."""
    stem, suffix = Path(name).stem, Path(name).suffix
    stamp = time.strftime("%Y%m%d-%H%M%S")
    folders: list[Callable[[], Path]] = [
        lambda: cache_dir() / "recovered",
        lambda: Path(tempfile.gettempdir()),
    ]
    for folder in folders:
        try:
            path = path_in(folder(), f"{stem}-{stamp}-{os.getpid()}{suffix}", "kept file")
            write_atomic(path, write, binary)
        except (OSError, CacheDirError, UnsafeNameError):
            continue
        return path
    return None


def keep_text(name: str, text: str) -> Path | None:
    """:func:`keep` for ``text``."""
    return keep(name, lambda fh: fh.write(text))
