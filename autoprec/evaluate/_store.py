"""On-disk caches of the evaluator: warm-start weights (.pt) and evaluations (SQLite).

Both are caches (:mod:`autoprec.cache`): a damaged file is discarded and recomputed, a disk
that fails (full, read-only) costs one note and the evaluator goes on without that cache.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

import torch

from autoprec._text import excerpt
from autoprec.cache import discard, note, note_failed_write, read_entry, reason, write_entry

T = TypeVar("T")
# the SQLite result codes of a file that is not (or no longer) a database
_DAMAGED_CODES = {getattr(sqlite3, "SQLITE_CORRUPT", 11), getattr(sqlite3, "SQLITE_NOTADB", 26)}
_WHAT_WARM = "warm start"
_WHAT_STORE = "evaluation store"


class DamagedStateError(ValueError):
    """A file of weights that does not hold what autoprec saved."""


def save_state_atomic(path: Path, state: dict[str, torch.Tensor], what: str = _WHAT_WARM) -> bool:
    """``torch.save`` to a temporary file next to ``path``, then ``os.replace`` it in place.

    A failure to write (a full disk) is a note: the caller keeps ``state`` in memory.
    Returns whether the file was written.
    """
    return write_entry(path, lambda fh: torch.save(state, fh), binary=True, what=what)


def load_state(
    path: Path, like: Mapping[str, torch.Tensor] | None = None, what: str = _WHAT_WARM
) -> dict[str, torch.Tensor] | None:
    """Weights saved by :func:`save_state_atomic`, on the CPU; None when the file is missing
    or damaged (then it is discarded, with a note).

    Args:
        path: the file.
        like: the state it must match (e.g. the model's ``state_dict()``): the same names,
            and each tensor of the same shape and dtype, finite where ``like``'s is. None:
            any dict of tensors.
        what: what the file holds, as a note names it.
    """
    return read_entry(path, lambda p: _read_state(p, like), what)


def _read_state(path: Path, like: Mapping[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch's messages suggest weights_only=False: not for a cache
        raise DamagedStateError(
            f"not a weights file saved by autoprec: {type(exc).__name__}"
        ) from None
    if not isinstance(state, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()
    ):
        raise DamagedStateError(f"holds a {type(state).__name__}, not a dict of tensors")
    if like is not None:
        _check_like(state, like)
    return state


def _check_like(state: Mapping[str, torch.Tensor], like: Mapping[str, torch.Tensor]) -> None:
    """Raise :class:`DamagedStateError` unless ``state`` fits ``like`` (see :func:`load_state`)."""
    lacking, extra = like.keys() - state.keys(), state.keys() - like.keys()
    if lacking:
        raise DamagedStateError(
            f"lacks {len(lacking)} of the model's tensors: {excerpt(sorted(lacking))}"
        )
    if extra:
        raise DamagedStateError(
            f"holds {len(extra)} tensor(s) the model lacks: {excerpt(sorted(extra))}"
        )
    for name, want in like.items():
        got = state[name]
        if got.shape != want.shape or got.dtype != want.dtype:
            raise DamagedStateError(
                f"{name} is {got.dtype} {tuple(got.shape)}, the model's is {want.dtype} "
                f"{tuple(want.shape)}"
            )
        if not _all_finite(got) and _all_finite(want):
            raise DamagedStateError(f"{name} holds NaN or infinite values")


def _all_finite(tensor: torch.Tensor) -> bool:
    return not tensor.is_floating_point() or bool(torch.isfinite(tensor).all())


def _create(db: sqlite3.Connection) -> None:
    db.execute(
        "CREATE TABLE IF NOT EXISTS evaluations "
        "(key TEXT PRIMARY KEY, metrics TEXT NOT NULL, created REAL NOT NULL)"
    )


def _damaged(exc: sqlite3.Error) -> bool:
    """Whether ``exc`` says the file is not a readable database (rather than busy or full)."""
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None:
        return code in _DAMAGED_CODES
    text = str(exc)
    return "not a database" in text or "malformed" in text


class EvaluationStore:
    """Metrics by key in one SQLite table (``key TEXT PRIMARY KEY, metrics JSON, created``).

    A connection per call, so that several processes (search workers) can share the file. A
    damaged file is discarded and started again; any other failure of the database (a full
    disk, a read-only folder) turns the store off for this process with a note: ``get``
    finds nothing and ``put`` keeps nothing, and the evaluations are simply run.

    Args:
        path: the SQLite file.
        parse: reads a row's JSON value (e.g. :meth:`Metrics.from_dict`), raising
            ``ValueError`` or ``TypeError`` for a row that does not fit its schema; the
            default returns it as it is.
    """

    def __init__(self, path: Path, parse: Callable[[Any], Any] = lambda row: row) -> None:
        self.path = Path(path)
        self.enabled = True
        self._parse = parse
        self._noted_rows = False
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            self._off(exc)
        self._call(_create)

    @contextlib.contextmanager
    def _connect(self) -> Iterator[sqlite3.Connection]:
        db = sqlite3.connect(self.path, timeout=30.0)
        try:
            with db:  # commits, or rolls back on an error
                yield db
        finally:
            db.close()

    def _call(self, op: Callable[[sqlite3.Connection], T]) -> T | None:
        """``op`` on a connection; None when the store is (or now turns) off."""
        for attempt in range(2):
            if not self.enabled:
                return None
            try:
                with self._connect() as db:
                    if attempt:  # a new file in place of a damaged one
                        _create(db)
                    return op(db)
            except sqlite3.Error as exc:
                if attempt == 0 and _damaged(exc):
                    for side in ("-journal", "-wal", "-shm"):  # would be replayed on a new file
                        with contextlib.suppress(OSError):
                            Path(f"{self.path}{side}").unlink()
                    discard(self.path, reason(exc), _WHAT_STORE)
                    continue
                if attempt == 0 and "no such table" in str(exc):
                    continue  # another worker has just replaced a damaged file
                self._off(exc)
            except OSError as exc:
                self._off(exc)
        return None

    def _off(self, exc: BaseException) -> None:
        if self.enabled:
            self.enabled = False
            note_failed_write(_WHAT_STORE, self.path, exc)

    def get(self, key: str) -> Any | None:
        """The row of ``key`` read by ``parse``; None when there is none, or when it does not
        parse (a row of another version of autoprec, or damaged): then it is deleted, with
        one note per store, and recomputed by the caller."""
        query = "SELECT metrics FROM evaluations WHERE key = ?"
        row = self._call(lambda db: db.execute(query, (key,)).fetchone())
        if row is None:
            return None
        try:
            return self._parse(json.loads(row[0]))
        except (TypeError, ValueError) as exc:
            self._call(lambda db: db.execute("DELETE FROM evaluations WHERE key = ?", (key,)))
            if not self._noted_rows:
                self._noted_rows = True
                note(
                    f"{_WHAT_STORE} {self.path} holds a row that does not fit this autoprec "
                    f"({reason(exc)}); discarded it, recomputing (other rows alike are not "
                    "reported)"
                )
            return None

    def put(self, key: str, metrics: dict[str, Any]) -> None:
        """Store (or replace) the metrics dict under ``key``."""
        text = json.dumps(metrics, sort_keys=True)
        self._call(
            lambda db: db.execute(
                "INSERT OR REPLACE INTO evaluations (key, metrics, created) VALUES (?, ?, ?)",
                (key, text, time.time()),
            )
        )

    def __len__(self) -> int:
        count = self._call(lambda db: db.execute("SELECT COUNT(*) FROM evaluations").fetchone())
        return 0 if count is None else int(count[0])
