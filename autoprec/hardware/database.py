"""The accelerator database: dense peak rates, memory and the preferred precision rule per device.

The figures live in ``devices.yaml`` next to this module (every number with its source); the file
is read once and checked entry by entry, so a broken edit fails loudly with the entry's name.

Example:
    >>> from autoprec.hardware import get_device
    >>> spec = get_device("NVIDIA A100-SXM4-80GB")
    >>> spec.name, spec.peak_flops("bf16") / 1e12, spec.supports("fp8")
    ('a100-80gb-sxm', 312.0, False)
"""

from __future__ import annotations

import difflib
import functools
import math
import os
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from types import MappingProxyType
from typing import Any

import yaml

from autoprec.precision import HARDWARE_PRECISIONS, PRECISION_NAMES, Precision, parse_precision

_REQUIRED = ("name", "vendor", "full_name", "supported_precisions", "peak_tflops")
_REQUIRED += ("memory_bandwidth_gbs", "memory_gb", "preferred", "sources")
_OPTIONAL = ("aliases", "logical_devices", "local_estimate", "matmul_tflops")
_EXPLANATIONS = ("supported_precisions", "preferred")  # optional, non-figure source keys
_SLUG = re.compile(r"^[a-z0-9][a-z0-9-]*$")
_PREFIXES = ("nvidia", "tesla", "amd", "instinct", "intelr", "intel")
_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's parser: ~10x faster


class UnknownDeviceError(ValueError):
    """A device name that is not in the database; ``suggestions`` holds close matches."""

    def __init__(self, message: str, suggestions: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.suggestions = suggestions


class DeviceDatabaseError(ValueError):
    """``devices.yaml`` is malformed; the message names the entry and the problem."""


@dataclass(frozen=True)
class PreferredMode:
    """A device's usual mixed-precision rule.

    Attributes:
        low: The 16-bit format autocast uses (``bf16`` or ``fp16``).
        wide: What the remaining fp32 matmuls use (``tf32`` or ``fp32``).
        loss_scaling: Whether training needs dynamic loss scaling (fp16).
    """

    low: str
    wide: str
    loss_scaling: bool

    def __post_init__(self) -> None:
        _require(
            self.low in ("bf16", "fp16"), f"preferred.low must be bf16 or fp16, got {self.low!r}"
        )
        _require(
            self.wide in ("tf32", "fp32"), f"preferred.wide must be tf32 or fp32, got {self.wide!r}"
        )
        scaling = self.loss_scaling
        _require(
            isinstance(scaling, bool), f"preferred.loss_scaling must be a bool, got {scaling!r}"
        )


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator: dense peak rates per precision, memory, and where each figure comes from.

    Attributes:
        name: Slug such as ``h100-sxm``.
        vendor: ``nvidia``, ``amd``, ``intel`` or ``generic``.
        full_name: Marketing name.
        aliases: Names the device reports (``torch.cuda.get_device_name()``) or is known by.
        peak_tflops: Dense peak TFLOP/s per precision (a supported precision may be unrated).
        memory_bandwidth_gbs: Peak memory bandwidth in GB/s (NaN when unknown).
        memory_gb: Memory capacity in GB.
        supported_precisions: Formats the tensor cores run, in fp32, tf32, bf16, fp16, fp8,
            mxfp8, nvfp4 order (:data:`~autoprec.precision.HARDWARE_PRECISIONS`; an fp8 recipe
            and fp8_block run where fp8 does).
        preferred: The device's usual mixed-precision rule.
        sources: Source of every figure (``peak_tflops.<precision>``, ``matmul_tflops.<precision>``,
            ``memory_bandwidth_gbs``, ``memory_gb``), optionally the reasoning behind
            ``supported_precisions``/``preferred``.
        logical_devices: torch devices per package (2 for MI250X); the figures are per package.
        matmul_tflops: Published measurements of the TFLOP/s a large square ``torch.mm``
            reaches on this device, per precision (the quantity ``autoprec hardware calibrate``
            measures); the cost model's default efficiency is this over the peak rate.
    """

    name: str
    vendor: str
    full_name: str
    aliases: tuple[str, ...]
    peak_tflops: Mapping[str, float]
    memory_bandwidth_gbs: float
    memory_gb: float
    supported_precisions: tuple[str, ...]
    preferred: PreferredMode
    sources: Mapping[str, str]
    logical_devices: int = 1
    matmul_tflops: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        supported = [parse_precision(p).value for p in self.supported_precisions]
        listed = ", ".join(supported)
        recipes = [p for p in supported if p not in HARDWARE_PRECISIONS]
        _require(
            not recipes,
            f"supported_precisions lists {', '.join(recipes)}, a software recipe; list the "
            f"formats of the tensor cores ({', '.join(HARDWARE_PRECISIONS)})",
        )
        once = "fp32" in supported and len(set(supported)) == len(supported)
        _require(once, f"supported_precisions must hold fp32, each name once; got [{listed}]")
        rates = {parse_precision(p).value: v for p, v in self.peak_tflops.items()}
        rates = {p: _positive(v, f"peak_tflops.{p}") for p, v in rates.items()}
        for p in rates:
            _require(p in supported, f"peak_tflops has {p}, not in supported_precisions [{listed}]")
        for p in (self.preferred.low, self.preferred.wide):
            _require(p in supported, f"preferred uses {p}, not in supported_precisions [{listed}]")
        if not math.isnan(self.memory_bandwidth_gbs):  # NaN: unknown (undetected GPU)
            _positive(self.memory_bandwidth_gbs, "memory_bandwidth_gbs")
        _positive(self.memory_gb, "memory_gb")
        n = self.logical_devices
        _require(isinstance(n, int) and n >= 1, f"logical_devices must be an int >= 1, got {n!r}")
        measured = {parse_precision(p).value: v for p, v in self.matmul_tflops.items()}
        for p, v in measured.items():
            v = measured[p] = _positive(v, f"matmul_tflops.{p}")
            peak = rates.get(p)
            _require(peak is not None, f"matmul_tflops has {p}, which has no peak_tflops")
            _require(v <= peak, f"matmul_tflops.{p} = {v:g} exceeds peak_tflops.{p} = {peak:g}")
        figures = {"memory_bandwidth_gbs", "memory_gb", *(f"peak_tflops.{p}" for p in rates)}
        figures |= {f"matmul_tflops.{p}" for p in measured}
        for key in sorted(figures):
            has_source = str(self.sources.get(key) or "").strip() != ""
            _require(has_source, f"{key} has no source; add sources.{key}")
        stray = sorted(set(self.sources) - figures - set(_EXPLANATIONS))
        _require(not stray, f"sources has {', '.join(stray)}, which name no figure of this entry")
        rank = {p: i for i, p in enumerate(PRECISION_NAMES)}.__getitem__
        freeze = object.__setattr__
        freeze(self, "supported_precisions", tuple(sorted(supported, key=rank)))
        ordered = {p: rates[p] for p in sorted(rates, key=rank)}
        freeze(self, "peak_tflops", MappingProxyType(ordered))
        measured = {p: measured[p] for p in sorted(measured, key=rank)}
        freeze(self, "matmul_tflops", MappingProxyType(measured))
        freeze(self, "sources", MappingProxyType({k: str(v) for k, v in self.sources.items()}))
        freeze(self, "aliases", tuple(self.aliases))

    def __hash__(self) -> int:
        return hash(self.name)

    def supports(self, precision: str | Precision) -> bool:
        """Whether the hardware runs ``precision`` (raises ValueError for an unknown name); an
        fp8 recipe runs where fp8 does (:attr:`~autoprec.precision.Precision.hardware`)."""
        return parse_precision(precision).hardware in self.supported_precisions

    def peak_flops(self, precision: str | Precision) -> float:
        """Dense peak rate for ``precision`` in FLOP/s.

        Raises:
            ValueError: unknown precision, one the device does not support, or one without a
                published dense rate.
        """
        p = parse_precision(precision).value
        if p not in self.peak_tflops:
            why = (
                "does not support"
                if p not in self.supported_precisions
                else "has no published dense rate for"
            )
            rated = ", ".join(self.peak_tflops) or "none"
            raise ValueError(f"device {self.name!r} {why} {p}; rated precisions: {rated}")
        return self.peak_tflops[p] * 1e12

    @property
    def memory_bandwidth(self) -> float:
        """Peak memory bandwidth in bytes/s."""
        return self.memory_bandwidth_gbs * 1e9


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _positive(value: Any, what: str) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    _require(ok and math.isfinite(value) and value > 0, f"{what} must be > 0, got {value!r}")
    return float(value)


def _normalise(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


def _keys(name: str) -> list[str]:
    """Lookup keys for a name: normalised, then again without each leading vendor prefix."""
    keys = [_normalise(name)]
    for prefix in _PREFIXES:
        if keys[-1].startswith(prefix) and len(keys[-1]) > len(prefix):
            keys.append(keys[-1][len(prefix) :])
    return keys


def _local_value(entry: Mapping[str, Any], what: str, sources: dict[str, str]) -> float:
    """Fill a ``local`` figure from this machine; its source records the estimate."""
    key = what if what == "memory_gb" else f"peak_tflops.{what}"
    if what == "memory_gb":
        try:
            value = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
            note = f" = {value:.1f} GB"
        except (AttributeError, ValueError, OSError):
            value, note = 16.0, " (os.sysconf unavailable: assumed 16 GB)"
    else:
        per_cpu = (entry.get("local_estimate") or {}).get("fp32_gflops_per_cpu")
        per_cpu = _positive(per_cpu, "local_estimate.fp32_gflops_per_cpu")
        cpus = os.cpu_count() or 1
        value, note = cpus * per_cpu / 1000.0, f" = {cpus} x {per_cpu:g} GFLOP/s"
    sources[key] = sources.get(key, "estimated") + note
    return value


def _parse_entry(raw: Any) -> DeviceSpec:
    """One ``devices.yaml`` entry as a DeviceSpec; ValueError says what is wrong with it."""
    _require(isinstance(raw, Mapping), f"expected a mapping of fields, got {raw!r}")
    missing = [k for k in _REQUIRED if k not in raw]
    unknown = sorted(set(raw) - set(_REQUIRED) - set(_OPTIONAL))
    _require(not missing and not unknown, f"missing fields {missing}, unknown fields {unknown}")
    name = raw["name"]
    _require(
        isinstance(name, str) and bool(_SLUG.match(name)), f"bad slug {name!r}, e.g. 'h100-sxm'"
    )
    for key in ("vendor", "full_name"):
        _require(isinstance(raw[key], str) and raw[key].strip() != "", f"{key} is empty")
    aliases, supported = raw.get("aliases") or [], raw["supported_precisions"]
    _require(isinstance(aliases, list) and all(isinstance(a, str) for a in aliases), "bad aliases")
    _require(isinstance(supported, list), f"supported_precisions must be a list, got {supported!r}")
    rates, preferred, sources = raw["peak_tflops"], raw["preferred"], raw["sources"]
    for key, value in (("peak_tflops", rates), ("preferred", preferred), ("sources", sources)):
        _mapping(value, key)
    sources = {str(k): str(v) for k, v in sources.items() if v is not None}
    peak = {p: _local_value(raw, p, sources) if v == "local" else v for p, v in rates.items()}
    memory_gb = raw["memory_gb"]
    memory_gb = _local_value(raw, "memory_gb", sources) if memory_gb == "local" else memory_gb
    fields = sorted(preferred)
    _require(
        fields == ["loss_scaling", "low", "wide"],
        f"preferred needs low, wide, loss_scaling; got {fields}",
    )
    return DeviceSpec(
        name=name,
        vendor=raw["vendor"],
        full_name=raw["full_name"],
        aliases=tuple(aliases),
        peak_tflops=peak,
        memory_bandwidth_gbs=_positive(raw["memory_bandwidth_gbs"], "memory_bandwidth_gbs"),
        memory_gb=_positive(memory_gb, "memory_gb"),
        supported_precisions=tuple(supported),
        preferred=PreferredMode(**preferred),
        sources=sources,
        logical_devices=raw.get("logical_devices", 1),
        matmul_tflops=_mapping(raw.get("matmul_tflops") or {}, "matmul_tflops"),
    )


def _mapping(value: Any, what: str) -> Mapping[str, Any]:
    _require(isinstance(value, Mapping), f"{what} must be a mapping, got {value!r}")
    return value


def _database_text() -> str:
    return resources.files("autoprec.hardware").joinpath("devices.yaml").read_text(encoding="utf-8")


@functools.cache
def _database() -> tuple[tuple[DeviceSpec, ...], dict[str, DeviceSpec]]:
    """Parse and check ``devices.yaml`` once: the devices in file order, and the lookup index."""
    try:
        data = yaml.load(_database_text(), Loader=_YAML_LOADER)
    except yaml.YAMLError as exc:
        raise DeviceDatabaseError(f"devices.yaml is not valid YAML: {exc}") from None
    entries = data.get("devices") if isinstance(data, Mapping) else None
    if not isinstance(entries, list) or not entries:
        raise DeviceDatabaseError("devices.yaml must be a mapping with a non-empty 'devices' list")
    devices: list[DeviceSpec] = []
    index: dict[str, DeviceSpec] = {}
    for i, raw in enumerate(entries):
        label = f"entry {i}" + (
            f" ({raw['name']!r})" if isinstance(raw, Mapping) and "name" in raw else ""
        )
        try:
            spec = _parse_entry(raw)
            for alias in (spec.name, spec.full_name, *spec.aliases):
                for key in _keys(alias):
                    other = index.setdefault(key, spec)
                    _require(other is spec, f"name {alias!r} also matches {other.name!r}")
        except (ValueError, TypeError) as exc:
            raise DeviceDatabaseError(f"devices.yaml {label}: {exc}") from None
        devices.append(spec)
    return tuple(devices), index


def _lookup(name: str) -> DeviceSpec | None:
    index = _database()[1]
    return next((index[k] for k in _keys(name) if k in index), None)


def list_devices() -> list[DeviceSpec]:
    """All devices in the database, the ``cpu`` entry included, in file order."""
    return list(_database()[0])


def get_device(name: str | DeviceSpec) -> DeviceSpec:
    """The device called ``name``: its slug, full name or an alias, ignoring case and punctuation.

    Raises:
        UnknownDeviceError: no such device; the message and ``suggestions`` list close matches.
    """
    if isinstance(name, DeviceSpec):
        return name
    spec = _lookup(name) if isinstance(name, str) else None
    if spec is not None:
        return spec
    devices, index = _database()
    key = _keys(str(name))[-1]
    near = [d.name for d in devices if key and key in _normalise(d.name)]
    near += [index[k].name for k in difflib.get_close_matches(key, list(index), n=5, cutoff=0.6)]
    suggestions = tuple(dict.fromkeys(near))[:5]
    hint = ", ".join(suggestions) + "?" if suggestions else "none close; list_devices() names all"
    raise UnknownDeviceError(f"unknown device {name!r}; did you mean {hint}", suggestions)


def supported_precisions(device: str | DeviceSpec) -> tuple[str, ...]:
    """Precisions ``device`` (a name or DeviceSpec) runs, in fp32, tf32, bf16, fp16, fp8 order."""
    return get_device(device).supported_precisions


def detect() -> DeviceSpec:
    """The entry of the local accelerator.

    CUDA (and ROCm) devices, then Intel XPUs, are matched by ``get_device_name()`` against the
    database. Without an accelerator (or without torch) this is the ``cpu`` entry. An accelerator
    the database does not know gives a warning and a generic ``unknown-gpu`` entry built from
    ``get_device_properties``: its memory and the precisions its capability implies, no peak
    rates and unknown (NaN) bandwidth; if even the properties are unreadable, the ``cpu`` entry.
    """
    try:
        import torch
    except ImportError:
        return get_device("cpu")
    for backend in ("cuda", "xpu"):
        module = getattr(torch, backend, None)
        if module is None or not module.is_available():
            continue
        reported = str(module.get_device_name())
        spec = _lookup(reported)
        if spec is None:
            warnings.warn(
                f"{reported!r} is not in autoprec's device database; using its torch properties "
                "without peak rates (name a known device to use datasheet figures)",
                stacklevel=2,
            )
            spec = _generic_device(torch, module, backend, reported)
        return spec
    return get_device("cpu")


def _generic_device(torch: Any, module: Any, backend: str, reported: str) -> DeviceSpec:
    try:
        props = module.get_device_properties(module.current_device())
        memory_gb = props.total_memory / 1e9
    except Exception as exc:  # noqa: BLE001 - whatever fails, there is nothing to build on
        warnings.warn(f"cannot read properties of {reported!r} ({exc}); using cpu", stacklevel=3)
        return get_device("cpu")
    major, minor = getattr(props, "major", 0), getattr(props, "minor", 0)
    if backend == "xpu" or getattr(torch.version, "hip", None):
        supported, preferred = ("fp32", "bf16", "fp16"), PreferredMode("bf16", "fp32", False)
    else:  # NVIDIA: tf32/bf16 from Ampere (8.0), fp8 from Ada (8.9)
        modern = (major, minor) >= (8, 0)
        supported = ("fp32", "fp16") + (("tf32", "bf16") if modern else ())
        supported += ("fp8",) if (major, minor) >= (8, 9) else ()
        # Blackwell (10.0 on): tensor cores that read MX block scales, and FP4 (NVFP4)
        supported += ("mxfp8", "nvfp4") if major >= 10 else ()
        preferred = PreferredMode(*(("bf16", "tf32") if modern else ("fp16", "fp32")), not modern)
    vendor = (
        "intel" if backend == "xpu" else "amd" if getattr(torch.version, "hip", None) else "nvidia"
    )
    return DeviceSpec(
        name="unknown-gpu",
        vendor=vendor,
        full_name=reported,
        aliases=(reported,),
        peak_tflops={},
        memory_bandwidth_gbs=math.nan,
        memory_gb=memory_gb,
        supported_precisions=supported,
        preferred=preferred,
        sources={
            "memory_gb": f"torch.{backend}.get_device_properties().total_memory",
            "memory_bandwidth_gbs": "unknown: the device is not in the database",
            "supported_precisions": f"derived from {backend} capability {major}.{minor}",
        },
    )
