"""Checks made before any work: that every output folder can be written."""

from __future__ import annotations

import errno
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

#: Bytes the pre-flight probe writes (and syncs) in each output folder: an empty file can be
#: created on a full disk, a block of data cannot.
PROBE_BYTES = 64 << 10


def check_writable(folders: Iterable[Path], error: type[Exception], prefix: str = "") -> None:
    """Raise ``error`` before any work if :data:`PROBE_BYTES` cannot be written and synced in
    one of ``folders`` (read-only, full, not a folder); one line naming the folder, after
    ``prefix`` (e.g. ``"--csv runs.csv: "``)."""
    for folder in folders:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=folder, prefix=".autoprec-probe-") as probe:
                probe.write(bytes(PROBE_BYTES))
                probe.flush()
                os.fsync(probe.fileno())
        except OSError as err:
            full = err.errno in (errno.ENOSPC, errno.EDQUOT)
            fix = "free some space or choose another folder" if full else "choose another folder"
            why = err.strerror or err
            raise error(f"{prefix}cannot write to {folder}: {why}; {fix}") from None
