"""The user's cache folder and atomic file writes, shared by everything that keeps results.

Sensitivity tables, warm starts, the evaluation store and calibrations live under
``$AUTOPREC_CACHE_DIR`` (default ``~/.cache/autoprec``). Files are written to a temporary file
in the same folder and moved into place, so an interrupted write never leaves a broken file.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any


def cache_dir() -> Path:
    """``$AUTOPREC_CACHE_DIR``, else ``~/.cache/autoprec``."""
    root = os.environ.get("AUTOPREC_CACHE_DIR")
    return Path(root) if root else Path.home() / ".cache" / "autoprec"


def write_atomic(path: Path, write: Callable[[IO[Any]], None], binary: bool = False) -> None:
    """Call ``write(file)`` on a temporary file next to ``path``, then replace ``path`` with it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb" if binary else "w") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
