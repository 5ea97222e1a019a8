"""The device's clock: what every timing in autoprec reads, on a GPU or on the CPU.

On CUDA a point in time is a recorded ``torch.cuda.Event`` (the GPU's own clock; the host is not
stalled between marks), elsewhere ``time.perf_counter()``; :meth:`Clock.seconds` turns marks
into elapsed seconds after one synchronisation. :func:`median_seconds` times a callable after
warm-up calls. Peak memory is the CUDA allocator's (``max_memory_allocated``); the CPU has no
per-process peak that can be reset, so it is None there.

Example:
    >>> clock = Clock("cpu")
    >>> median_seconds(lambda: sum(range(1000)), clock, warmup=1, repeats=3) > 0
    True
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["Clock", "median_seconds"]


class Clock:
    """Marks and elapsed seconds on ``device`` (a ``torch.device`` or its name)."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"

    def mark(self) -> Any:
        """A point in time: a recorded CUDA event, else ``perf_counter()``."""
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def sync(self) -> None:
        """Wait for the device's queued work (nothing to wait for on the CPU)."""
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def seconds(self, marks: Sequence[Any]) -> list[float]:
        """The seconds between consecutive ``marks`` (synchronises first)."""
        self.sync()
        pairs = zip(marks[:-1], marks[1:], strict=True)
        if self.cuda:
            return [a.elapsed_time(b) / 1e3 for a, b in pairs]
        return [b - a for a, b in pairs]

    def reset_peak(self) -> None:
        """Start a new peak-memory window (CUDA only)."""
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def allocated(self) -> int:
        """Bytes allocated now (CUDA), 0 on the CPU."""
        return int(torch.cuda.memory_allocated(self.device)) if self.cuda else 0

    def peak_bytes(self) -> int | None:
        """Peak allocated bytes since :meth:`reset_peak` (CUDA), None on the CPU."""
        if self.cuda:
            return int(torch.cuda.max_memory_allocated(self.device))
        return None


def median_seconds(fn: Callable[[], Any], clock: Clock, warmup: int = 2, repeats: int = 5) -> float:
    """The median seconds of ``repeats`` calls of ``fn`` after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    marks = [clock.mark()]
    for _ in range(repeats):
        fn()
        marks.append(clock.mark())
    return statistics.median(clock.seconds(marks))
