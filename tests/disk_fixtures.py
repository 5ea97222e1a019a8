"""Files and folders that tests build on disk: an image folder, and a real tmpfs (full, or
read-only) where one can be mounted (it needs root; elsewhere the test is skipped)."""

from __future__ import annotations

import contextlib
import errno
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest


def image_folder(
    root: Path, classes: tuple[str, ...], per_class: int = 4, suffix: str = "jpg", size: int = 24
) -> Path:
    """``root/<class>/<i>.<suffix>``: random ``size`` x ``size`` RGB images."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for name in classes:
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            pixels = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / name / f"{i}.{suffix}")
    return root


@contextlib.contextmanager
def tmpfs(folder: Path, options: str = "size=1m") -> Iterator[Path]:
    """A tmpfs mounted on ``folder`` (made if missing) with ``options`` for the block; skips the
    test where none can be mounted."""
    folder.mkdir(parents=True, exist_ok=True)
    mount = ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)]
    try:
        proc = subprocess.run(mount, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"cannot mount a tmpfs: {exc}")
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs (needs root): {proc.stderr.strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], capture_output=True, timeout=10)


def fill(folder: Path) -> Path:
    """Fill the disk ``folder`` is on (a file ``filler`` grown until it is full); returns
    ``folder``."""
    try:
        with open(folder / "filler", "ab", buffering=0) as fh:
            while True:
                fh.write(b"\0" * 4096)
    except OSError as exc:
        assert exc.errno == errno.ENOSPC, exc
    return folder
