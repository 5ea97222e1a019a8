"""Work done every few seconds while a block runs: a progress heartbeat, an Optuna trial's
heartbeat. One background thread per block, stopped when the block ends however it ends."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

__all__ = ["Progress", "every"]

#: A progress report: ``(stage, done, total)``, e.g. ``("warm start", 40, 200)``; the one
#: shape of every progress callback (warm start, sensitivities, the search's stages).
Progress = Callable[[str, int, int], None]


@contextlib.contextmanager
def every(period: float, action: Callable[[], object], name: str) -> Iterator[None]:
    """While the block runs, call ``action()`` every ``period`` seconds (not at its start) from
    a daemon thread named ``name``; nothing for a block shorter than ``period``. ``action``
    handles its own errors (one that raises ends the beats, not the block)."""
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(period):
            action()

    thread = threading.Thread(target=beat, name=name, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
