"""Calibration: the efficiency factors of one device, measured here or fitted to step times.

The cost model's efficiency factors (achieved / peak) default to documented values; a
calibration replaces them for its device. Two kinds, one file per device in the user's cache
(``$AUTOPREC_CACHE_DIR/calibration/<device>.json``, default ``~/.cache/autoprec``), written
atomically, which :func:`load_efficiency` hands to :class:`~autoprec.hardware.CostModel`:

- measured (:func:`calibrate`): the local device's matmul rate per format and its copy
  bandwidth;
- fitted (:func:`save_fitted`): every factor, the execution modes' included, fitted to training
  steps measured on the device (:mod:`autoprec.hardware.fit`; ``autoprec hardware calibrate
  --from FILE``); its file holds the :class:`Efficiency` and what it was fitted to.

A damaged file is ignored with a warning (the published factors apply).
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from autoprec.cache import cache_dir, note, reason, write_atomic, write_entry
from autoprec.hardware.database import DeviceSpec, detect, get_device
from autoprec.hardware.factors import Efficiency, fill_compute

__all__ = [
    "FITTED",
    "Calibration",
    "calibrate",
    "calibration_path",
    "load_calibration",
    "load_efficiency",
    "save_fitted",
]

#: The ``kind`` of a fitted calibration's file (a measured one has none).
FITTED = "fitted"


@dataclass(frozen=True)
class Calibration:
    """What one calibration measured, and the efficiency factors derived from it."""

    device: str
    torch_device: str
    matmul_size: int
    achieved_tflops: dict[str, float]  # per precision
    bandwidth_gbs: float
    compute_efficiency: dict[str, float]  # achieved / the database's peak
    bandwidth_efficiency: float
    created: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def calibration_path(device_name: str) -> Path:
    return cache_dir() / "calibration" / f"{device_name}.json"


def _median_time(fn: Callable[[], Any], sync: Callable[[], None], repeats: int) -> float:
    fn()  # warm-up (allocations, library initialisation)
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _matmul_rate(precision: str, size: int, device: str, repeats: int) -> float | None:
    """Achieved FLOP/s of a size x size matmul in ``precision``; None when it cannot run."""
    import torch

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    dtype = {
        "fp32": torch.float32,
        "tf32": torch.float32,
        "bf16": torch.bfloat16,
        "fp16": torch.float16,
    }.get(precision)
    if dtype is None:  # fp8 needs scaled matmul kernels; not measured here
        return None
    if precision == "tf32" and device != "cuda":
        return None
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    # the fp32_precision settings, as the runtime sets them (torch refuses a mix with the
    # older allow_tf32 switch)
    previous = torch.backends.cuda.matmul.fp32_precision
    torch.backends.cuda.matmul.fp32_precision = "tf32" if precision == "tf32" else "ieee"
    try:
        seconds = _median_time(lambda: a @ b, sync, repeats)
    except RuntimeError:
        return None
    finally:
        torch.backends.cuda.matmul.fp32_precision = previous
    return 2 * size**3 / seconds


def _copy_bandwidth(device: str, repeats: int, numel: int = 1 << 25) -> float:
    """Bytes/s of a device-to-device copy (read + write)."""
    import torch

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    src = torch.randn(numel, device=device)
    dst = torch.empty_like(src)
    seconds = _median_time(lambda: dst.copy_(src), sync, repeats)
    return 2 * src.numel() * src.element_size() / seconds


def calibrate(
    spec: DeviceSpec | str | None = None,
    size: int | None = None,
    repeats: int = 5,
    save: bool = True,
) -> Calibration:
    """Measure the local device and (by default) store the result for the cost model.

    Args:
        spec: the database entry the measurements stand for; default: :func:`detect`.
        size: matmul size (default 4096 on CUDA, 1024 on CPU).
        repeats: timed repetitions per measurement (the median is kept).
        save: write the calibration into the user's cache.

    Raises:
        ValueError: ``repeats`` below 1 (no median to keep) or a size out of range.
    """
    import torch

    from autoprec.policy.fields import NumberRange

    NumberRange(integer=True, low=1, high=10_000, example="5").check(repeats, "repeats")
    if size is not None:
        NumberRange(integer=True, low=1, high=65_536, example="1024").check(size, "size")
    spec = detect() if spec is None else get_device(spec)
    device = "cuda" if torch.cuda.is_available() and spec.name != "cpu" else "cpu"
    size = size or (4096 if device == "cuda" else 1024)
    achieved, efficiency = {}, {}
    for precision in spec.supported_precisions:
        # CPU bf16 matmuls are emulated in software on most CPUs: a smaller problem suffices
        n = size if device == "cuda" or precision == "fp32" else max(256, size // 4)
        rate = _matmul_rate(precision, n, device, repeats)
        if rate is None:
            continue
        achieved[precision] = rate / 1e12
        try:
            efficiency[precision] = rate / spec.peak_flops(precision)
        except ValueError:  # no published peak for that format
            pass
    bandwidth = _copy_bandwidth(device, repeats)
    result = Calibration(
        device=spec.name,
        torch_device=torch.cuda.get_device_name() if device == "cuda" else "cpu",
        matmul_size=size,
        achieved_tflops=achieved,
        bandwidth_gbs=bandwidth / 1e9,
        compute_efficiency=efficiency,
        bandwidth_efficiency=bandwidth / spec.memory_bandwidth,
        created=time.strftime("%Y-%m-%dT%H:%M:%S"),
    )
    if save:
        # a cache entry: a disk that cannot take it costs a note, not the measurement
        write_entry(
            calibration_path(spec.name),
            lambda fh: json.dump(result.to_dict(), fh, indent=2),
            what="calibration",
        )
    return result


def load_calibration(device_name: str) -> Calibration | None:
    """The stored measured calibration of a device, or None (none, a fitted one, or an
    unreadable file)."""
    doc = _read(calibration_path(device_name))
    if doc is None or doc.get("kind") == FITTED:
        return None
    try:
        return Calibration(**doc)
    except TypeError:
        return None


def save_fitted(
    device: str, efficiency: Efficiency, fit: Mapping[str, object], path: Path | None = None
) -> Path:
    """Store ``efficiency`` fitted to measured steps as ``device``'s calibration (``path``:
    elsewhere), with ``fit`` (what it was fitted to, its errors) beside it; returns the path.

    Raises:
        OSError: the file cannot be written (the user asked for it: not a cache note).
    """
    path = calibration_path(get_device(device).name) if path is None else Path(path)
    doc = {
        "kind": FITTED,
        "device": device,
        "efficiency": efficiency.to_dict(),
        "fit": dict(fit),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    write_atomic(path, lambda fh: json.dump(doc, fh, indent=2))
    return path


def load_efficiency(device_name: str, path: Path | None = None) -> Efficiency | None:
    """Efficiency factors from a stored calibration (None without one), for the cost model.

    A fitted calibration gives its factors as fitted. For a measured one, precisions it could
    not measure (fp8, tf32 on a CPU) take their default scaled as the nearest wider measured
    precision is (:func:`~autoprec.hardware.factors.fill_compute`). A damaged file (not JSON,
    wrong fields, factors out of range) is ignored with a warning.

    Args:
        device_name: the database entry.
        path: read this file instead of the device's calibration in the cache.
    """
    path = calibration_path(device_name) if path is None else Path(path)
    doc = _read(path)
    if doc is None:
        return None
    try:
        if doc.get("kind") == FITTED:
            return Efficiency.from_dict(doc["efficiency"])
        calibration = Calibration(**doc)
        try:
            supported = get_device(device_name).supported_precisions
        except ValueError:  # a calibration of a device the database no longer knows
            supported = tuple(calibration.compute_efficiency)
        return Efficiency(
            compute=fill_compute(calibration.compute_efficiency, supported),
            bandwidth=calibration.bandwidth_efficiency,
            kernel_overhead_s=Efficiency().kernel_overhead_s,
        )
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        _damaged(path, exc)
        return None


def _read(path: Path) -> dict | None:
    """The JSON object of a calibration file; None when there is none, or (with a warning)
    when it cannot be read as one."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as exc:
        _damaged(path, exc)
        return None
    try:
        doc = json.loads(text)
    except ValueError as exc:
        _damaged(path, exc)
        return None
    if not isinstance(doc, dict):
        _damaged(path, ValueError(f"expected a JSON object, got {type(doc).__name__}"))
        return None
    return doc


def _damaged(path: Path, exc: BaseException) -> None:
    note(
        f"ignoring the calibration {path} ({reason(exc)}): the cost model uses the published "
        "factors; run `autoprec hardware calibrate` again or delete the file"
    )
