"""On-disk caches of the evaluator: warm-start weights (.pt) and evaluations (SQLite)."""

from __future__ import annotations

import contextlib
import json
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from autoprec.cache import write_atomic


def save_state_atomic(path: Path, state: dict[str, torch.Tensor]) -> None:
    """``torch.save`` to a temporary file next to ``path``, then ``os.replace`` it in place."""
    write_atomic(path, lambda fh: torch.save(state, fh), binary=True)


def load_state(path: Path) -> dict[str, torch.Tensor]:
    """Weights saved by :func:`save_state_atomic`, on the CPU."""
    return torch.load(path, map_location="cpu", weights_only=True)


class EvaluationStore:
    """Metrics by key in one SQLite table (``key TEXT PRIMARY KEY, metrics JSON, created``).

    A connection per call, so that several processes (search workers) can share the file.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._connect() as db:
            db.execute(
                "CREATE TABLE IF NOT EXISTS evaluations "
                "(key TEXT PRIMARY KEY, metrics TEXT NOT NULL, created REAL NOT NULL)"
            )

    @contextlib.contextmanager
    def _connect(self) -> Iterator[sqlite3.Connection]:
        db = sqlite3.connect(self.path, timeout=30.0)
        try:
            with db:  # commits, or rolls back on an error
                yield db
        finally:
            db.close()

    def get(self, key: str) -> dict[str, Any] | None:
        """The stored metrics dict, or None."""
        with self._connect() as db:
            row = db.execute("SELECT metrics FROM evaluations WHERE key = ?", (key,)).fetchone()
        return None if row is None else json.loads(row[0])

    def put(self, key: str, metrics: dict[str, Any]) -> None:
        """Store (or replace) the metrics dict under ``key``."""
        with self._connect() as db:
            db.execute(
                "INSERT OR REPLACE INTO evaluations (key, metrics, created) VALUES (?, ?, ?)",
                (key, json.dumps(metrics, sort_keys=True), time.time()),
            )

    def __len__(self) -> int:
        with self._connect() as db:
            return int(db.execute("SELECT COUNT(*) FROM evaluations").fetchone()[0])
