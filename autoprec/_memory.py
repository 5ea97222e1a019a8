"""Sizes checked before they are allocated: a setting that would need more memory than the
machine has (``image_size: 100000``, ``num_classes: 1000000000``, a huge batch) is one line
naming it, not the allocator's traceback (or the kernel's OOM killer) minutes later.

Example:
    >>> check_fits(2**20, "one batch of inputs", "lower the batch size")  # 1 MiB: fits
    >>> fmt_bytes(40_000_000_000)
    '37.3 GiB'
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable

__all__ = ["SizeError", "check_fits", "elements", "fmt_bytes", "machine_memory"]


class SizeError(ValueError):
    """A setting that would make a run allocate more memory than the machine has."""


def machine_memory() -> int | None:
    """The machine's physical memory in bytes (psutil's if installed, else ``os.sysconf``);
    None where neither can tell."""
    try:
        import psutil
    except ImportError:
        pass
    else:
        return int(psutil.virtual_memory().total)
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not a POSIX system
        return None


def elements(shape: Iterable[int]) -> int:
    """The number of elements of a tensor of ``shape`` (exact, however large)."""
    return math.prod(int(d) for d in shape)


def fmt_bytes(nbytes: int) -> str:
    """``nbytes`` in binary units, e.g. ``'37.3 GiB'``."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if value < 1024 or unit == "PiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} PiB"  # pragma: no cover


def check_fits(nbytes: int, what: str, fix: str) -> None:
    """Raise :class:`SizeError` if ``nbytes`` exceeds the machine's memory.

    Args:
        nbytes: what the allocation would take.
        what: what would be allocated, e.g. ``"one input of shape (1, 100000, 100000)"``.
        fix: the setting to change, e.g. ``"lower image_size"``.
    """
    limit = machine_memory()
    if limit is not None and nbytes > limit:
        raise SizeError(
            f"{what} would take {fmt_bytes(nbytes)}, more than this machine's "
            f"{fmt_bytes(limit)} of memory; {fix}"
        )
