"""How the long-running commands take SIGTERM and Ctrl-C.

- :func:`terminate_as_interrupt`: SIGTERM raises ``KeyboardInterrupt`` like Ctrl-C, at once
  (``autoprec search``: whatever was evaluated so far is exported). A raise that lands in a
  garbage collector's callback is printed as "Exception ignored" and lost (SQLAlchemy's, under
  Optuna, for one); :func:`raise_if_terminated`, called where the work passes often (each
  search trial), raises it again.
- :func:`stop_at_boundary`: SIGTERM and Ctrl-C only ask the work to stop at its next safe
  point (``autoprec train``: the next step boundary, where a checkpoint is whole); a second
  signal raises ``KeyboardInterrupt`` at once, for work that does not reach one.

Signal handlers can only be set in the main thread; elsewhere both are no-ops.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

__all__ = [
    "StopRequest",
    "on_main_thread",
    "raise_if_terminated",
    "stop_at_boundary",
    "terminate_as_interrupt",
]


def on_main_thread() -> bool:
    """Whether this is the main thread (the only one that may set signal handlers)."""
    return threading.current_thread() is threading.main_thread()


class _Termination:
    """SIGTERM's handler in :func:`terminate_as_interrupt`: raises ``KeyboardInterrupt`` and
    remembers that it did, until :func:`raise_if_terminated` has raised it again."""

    def __init__(self) -> None:
        self.pending = False

    def handle(self, signum: int, frame: object) -> None:
        self.pending = True
        raise KeyboardInterrupt


_TERMINATION = _Termination()


@contextlib.contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM behaves like Ctrl-C (``KeyboardInterrupt``) while the block runs."""
    if not on_main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _TERMINATION.handle)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        _TERMINATION.pending = False


def raise_if_terminated() -> None:
    """Raise ``KeyboardInterrupt`` if a SIGTERM inside :func:`terminate_as_interrupt` raised
    one that was lost (or not yet re-raised here); once per signal. The first raise, if it was
    not lost, ends the work before this is reached."""
    if _TERMINATION.pending:
        _TERMINATION.pending = False
        raise KeyboardInterrupt


class StopRequest:
    """Set by the first SIGTERM or SIGINT inside :func:`stop_at_boundary`; call it to poll.

    Attributes:
        signal: the name of the signal that asked (``"SIGTERM"``), or None.
    """

    def __init__(self) -> None:
        self.signal: str | None = None

    def __call__(self) -> bool:
        return self.signal is not None

    def _handle(self, signum: int, frame: object) -> None:
        if self.signal is not None:
            raise KeyboardInterrupt  # the second signal: stop now
        self.signal = signal.Signals(signum).name


@contextlib.contextmanager
def stop_at_boundary() -> Iterator[StopRequest]:
    """While the block runs, SIGTERM and SIGINT set the yielded :class:`StopRequest`.

    Example:
        >>> with stop_at_boundary() as stop:  # doctest: +SKIP
        ...     train(spec, data, policy, stop=stop)  # raises TrainInterrupted on SIGTERM
    """
    stop = StopRequest()
    if not on_main_thread():
        yield stop
        return
    previous = {sig: signal.signal(sig, stop._handle) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield stop
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
