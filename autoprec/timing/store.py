"""Measured timings kept on disk, per device and software version.

A timing is only valid for the device and the software that measured it: a new torch, torchao
or CUDA (or, on the CPU, another thread count) can change a kernel's speed. :func:`software`
says what that is here; :class:`TimingStore` keeps one JSON file per device and software under
``$AUTOPREC_CACHE_DIR/timing/`` (``{device}-{digest}.json``), entries keyed by the caller. A
damaged file is discarded with a note (its timings are measured again); a file that cannot be
written is a note too (the work goes on without caching).

Example:
    >>> store = TimingStore("cpu")  # doctest: +SKIP
    >>> store.get("layer:abc|bf16|eager") is None  # doctest: +SKIP
    True
"""

from __future__ import annotations

import functools
import json
import platform
from pathlib import Path
from typing import Any

import torch

from autoprec.cache import cache_dir, digest, read_entry, write_entry

__all__ = ["TIMING_VERSION", "TimingStore", "software"]

TIMING_VERSION = 1  # bumped when what a stored timing means changes


@functools.cache
def _torchao_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("torchao")
    except Exception:  # noqa: BLE001 - not installed (or unreadable): no version
        return None


@functools.cache
def _cpu_name() -> str:
    """The CPU's model name (Linux's ``/proc/cpuinfo``), else what ``platform`` says."""
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def software(device: torch.device | str = "cpu") -> dict[str, Any]:
    """What a timing on ``device`` depends on besides the program: the device as torch reports
    it, the versions of torch, torchao, CUDA and cuDNN, and on the CPU the thread count."""
    dev = torch.device(device)
    out: dict[str, Any] = {
        "timing": TIMING_VERSION,
        "torch": str(torch.__version__),
        "torchao": _torchao_version(),
    }
    if dev.type == "cuda":
        out |= {
            "device": torch.cuda.get_device_name(dev),
            "cuda": str(torch.version.cuda),
            "cudnn": torch.backends.cudnn.version(),
        }
    else:
        out |= {"device": _cpu_name(), "threads": torch.get_num_threads()}
    return out


class TimingStore:
    """Timings measured on this machine's ``device`` (a database name, e.g. ``"h200"``,
    ``"cpu"``), with the local software (:func:`software` of ``torch_device``).

    Args:
        device: the device's database name (the file's prefix).
        torch_device: where the timings are taken.
        folder: where the file lives; None: ``$AUTOPREC_CACHE_DIR/timing``.
    """

    def __init__(
        self,
        device: str,
        torch_device: torch.device | str = "cpu",
        folder: str | Path | None = None,
    ) -> None:
        self.software = software(torch_device)
        base = Path(folder) if folder is not None else cache_dir() / "timing"
        self.path = base / f"{device}-{digest(self.software)[:16]}.json"
        self._entries: dict[str, Any] | None = None

    def _read(self) -> dict[str, Any]:
        if self._entries is None:

            def read(path: Path) -> dict[str, Any]:
                data = json.loads(path.read_text(encoding="utf-8"))
                if not isinstance(data, dict) or not isinstance(data.get("entries"), dict):
                    raise ValueError("not a timing file (no 'entries' mapping)")
                return data["entries"]

            self._entries = read_entry(self.path, read, "timing file") or {}
        return self._entries

    def get(self, key: str) -> Any:
        """The stored value of ``key``, else None."""
        return self._read().get(key)

    def __contains__(self, key: str) -> bool:
        return key in self._read()

    def __len__(self) -> int:
        return len(self._read())

    def put(self, key: str, value: Any) -> None:
        """Keep ``value`` (JSON-ready) under ``key`` and write the file (atomically, merged
        with what another process wrote meanwhile)."""
        self._entries = None  # reread: another search may have added entries
        merged = {**self._read(), key: value}
        self._entries = merged
        payload = {"software": self.software, "entries": merged}
        write_entry(
            self.path,
            lambda fh: json.dump(payload, fh, sort_keys=True, indent=1),
            what="timing file",
        )
