"""Precision policies: which precision each layer of a model trains in.

A policy maps fully qualified module names, or ``re:<regex>`` patterns, to precisions. Precedence
for a layer: its exact name, then the first pattern (in mapping order) that fully matches it, then
``default``. Patterns are Python ``re`` syntax, matched by the ``regex`` package so that one that
backtracks catastrophically (``(.*.*)*X``) is stopped after :data:`PATTERN_TIMEOUT_S` with a
:class:`PolicyError` instead of hanging. Files are read and written by :mod:`autoprec.policy_io`.

Example:
    >>> p = PrecisionPolicy(default="bf16", layers={"fc": "fp32", "re:.*downsample.*": "fp16"})
    >>> p.precision_for("fc"), p.precision_for("layer1.0.downsample.0"), p.precision_for("conv1")
    (<Precision.FP32: 'fp32'>, <Precision.FP16: 'fp16'>, <Precision.BF16: 'bf16'>)
"""

from __future__ import annotations

import dataclasses
import datetime
import difflib
import hashlib
import json
import math
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from autoprec._text import excerpt
from autoprec.precision import PRECISION_NAMES, Precision, parse_precision

if TYPE_CHECKING:  # pragma: no cover
    from torch import nn

SCHEMA_VERSIONS = (1,)
PATTERN_PREFIX = "re:"
LOSS_SCALING_KINDS = ("dynamic", "static", "none")
TARGET_MODES = ("auto", "emulate", "native")
PATTERN_TIMEOUT_S = 0.1  # per match; a sane pattern takes microseconds on a module name

Field = tuple[Any, ...]
_T = TypeVar("_T")


class PolicyError(ValueError):
    """A defect in a policy or a policy file; the message says what was expected and got.

    Attributes:
        field: path of the offending field, e.g. ``("layers", "fc")``; ``()`` for the whole.
    """

    def __init__(self, message: str, *, field: Field = ()) -> None:
        super().__init__(message)
        self.field = field


class _FrozenMap(Mapping):
    """A read-only, hashable, insertion-ordered mapping; equality is order-sensitive."""

    __slots__ = ("_data",)

    def __init__(self, items: Mapping | Iterable[tuple[Any, Any]] = ()) -> None:
        self._data = dict(items)

    def __getitem__(self, key: Any) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Mapping):
            return NotImplemented
        return list(self._data.items()) == list(other.items())

    def __hash__(self) -> int:
        return hash(tuple(self._data.items()))

    def __repr__(self) -> str:
        return repr(self._data)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (tuple(self._data.items()),))


def _kind(value: object) -> str:
    return f"{excerpt(value)} ({type(value).__name__})"


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _finite(value: object) -> bool:
    """A number (not a bool) that a float holds finitely; ``10**400`` is not."""
    if not _is_number(value):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int beyond the largest float
        return False


def _yaml_hint(value: object) -> str:
    """A hint for '1e5'-style strings, which YAML 1.1 reads as text, and for huge integers."""
    if _is_number(value) and not _finite(value) and isinstance(value, int):
        return "; it is beyond the largest float (about 1.8e308)"
    if isinstance(value, str):
        try:
            float(value)
        except ValueError:
            return ""
        return "; it is a string (YAML 1.1 needs a dot and a signed exponent: 1.0e+5)"
    return ""


def _suggest(word: object, choices: Iterable[str], n: int = 1) -> list[str]:
    return difflib.get_close_matches(str(word), list(choices), n=n)


def _unknown_key(key: object, allowed: tuple[str, ...], where: str, path: Field) -> PolicyError:
    hint = _suggest(key, allowed)
    did = f"did you mean {hint[0]!r}? " if hint else ""
    return PolicyError(
        f"unknown key {excerpt(key)} in {where}; {did}allowed keys: {', '.join(allowed)}",
        field=(*path, key),
    )


def _section(cls: type[_T], value: object, name: str) -> _T | None:
    """Build ``cls`` from a mapping (as read from a file), or pass an instance or None through."""
    if value is None or isinstance(value, cls):
        return value
    if not isinstance(value, Mapping):
        raise PolicyError(
            f"{name} must be a mapping of {', '.join(f.name for f in dataclasses.fields(cls))}; "
            f"got {_kind(value)}",
            field=(name,),
        )
    allowed = tuple(f.name for f in dataclasses.fields(cls))
    for key in value:
        if key not in allowed:
            raise _unknown_key(key, allowed, name, (name,))
    return cls(**value)


def _precision(value: object, what: str, path: Field) -> Precision:
    try:
        return parse_precision(value)
    except ValueError:
        raise PolicyError(
            f"unknown precision {excerpt(value)} for {what}; expected one of "
            f"{', '.join(PRECISION_NAMES)}",
            field=path,
        ) from None


@dataclass(frozen=True)
class LossScalingConfig:
    """How the loss is scaled so that fp16 gradients do not underflow.

    Args:
        kind: ``"dynamic"`` (grow/back off, like ``torch.amp.GradScaler``), ``"static"`` (keep
            ``init_scale``) or ``"none"``.
        init_scale: the starting (or, for static, the fixed) scale; > 0.
        growth_factor: multiplier after ``growth_interval`` finite steps; > 1.
        backoff_factor: multiplier after an overflow; between 0 and 1.
        growth_interval: finite steps between growths; >= 1.
    """

    kind: str = "dynamic"
    init_scale: float = 2.0**15
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000

    def __post_init__(self) -> None:
        def bad(name: str, expected: str, value: object) -> PolicyError:
            return PolicyError(
                f"loss_scaling.{name} must be {expected}; got {_kind(value)}{_yaml_hint(value)}",
                field=("loss_scaling", name),
            )

        if self.kind not in LOSS_SCALING_KINDS:
            raise bad("kind", f"one of {', '.join(LOSS_SCALING_KINDS)}", self.kind)
        checks = {
            "init_scale": ("a number > 0, e.g. 32768", lambda v: v > 0),
            "growth_factor": ("a number > 1, e.g. 2.0", lambda v: v > 1),
            "backoff_factor": ("a number between 0 and 1, e.g. 0.5", lambda v: 0 < v < 1),
        }
        for name, (expected, ok) in checks.items():
            value = getattr(self, name)
            if not _finite(value) or not ok(value):
                raise bad(name, expected, value)
            object.__setattr__(self, name, float(value))
        interval = self.growth_interval
        if not isinstance(interval, int) or isinstance(interval, bool) or interval < 1:
            raise bad("growth_interval", "an integer >= 1, e.g. 2000", interval)


@dataclass(frozen=True)
class ModelInfo:
    """What model a policy was made for; every field is optional."""

    name: str | None = None
    fingerprint: str | None = None
    tunable_layers: int | None = None

    def __post_init__(self) -> None:
        for name in ("name", "fingerprint"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise PolicyError(
                    f"model.{name} must be a string; got {_kind(value)}", field=("model", name)
                )
        count = self.tunable_layers
        if count is not None and (
            not isinstance(count, int) or isinstance(count, bool) or count < 0
        ):
            raise PolicyError(
                f"model.tunable_layers must be an integer >= 0; got {_kind(count)}",
                field=("model", "tunable_layers"),
            )


@dataclass(frozen=True)
class TargetInfo:
    """Where a policy is meant to run.

    Args:
        device: a name from the hardware database (e.g. ``"h100-sxm"``), or None for any.
        mode: ``"native"`` (real low-precision kernels), ``"emulate"`` (fake-quantised fp32) or
            ``"auto"`` (native where the device runs the format, emulated otherwise).
    """

    device: str | None = None
    mode: str = "auto"

    def __post_init__(self) -> None:
        if self.device is not None and not isinstance(self.device, str):
            raise PolicyError(
                f"target.device must be a string; got {_kind(self.device)}",
                field=("target", "device"),
            )
        if self.mode not in TARGET_MODES:
            raise PolicyError(
                f"target.mode must be one of {', '.join(TARGET_MODES)}; got {_kind(self.mode)}",
                field=("target", "mode"),
            )


@dataclass(frozen=True)
class PolicyReport:
    """What :meth:`PrecisionPolicy.validate` found; ``ok`` when nothing."""

    unmatched: list[tuple[str, list[str]]] = field(default_factory=list)
    fingerprint: tuple[str, str] | None = None
    unsupported: dict[str, Precision] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not (self.unmatched or self.fingerprint or self.unsupported)

    @property
    def problems(self) -> list[str]:
        """One readable line per problem."""
        lines = []
        for key, hints in self.unmatched:
            what = "pattern" if key.startswith(PATTERN_PREFIX) else "layer"
            fix = (
                "did you mean " + " or ".join(excerpt(h) for h in hints) + "?"
                if hints
                else "check it against the names in model.named_modules()"
            )
            lines.append(f"{what} {excerpt(key)} matches no tunable or normalisation layer; {fix}")
        if self.fingerprint:
            expected, actual = self.fingerprint
            lines.append(
                f"model fingerprint is {actual}, the policy was made for {expected}; the "
                "architecture changed: search again, or remove model.fingerprint to accept it"
            )
        for name, precision in self.unsupported.items():
            lines.append(
                f"layer {excerpt(name)} is {precision.value}, which the device cannot run; "
                "choose a precision it supports or another target"
            )
        return lines


@dataclass(frozen=True)
class PrecisionPolicy:
    """A precision per layer; immutable and hashable.

    Precisions may be given as strings (``"bf16"``); sections (``loss_scaling``, ``model``,
    ``target``) as their dataclass or as a mapping of its fields.

    Args:
        default: precision of every tunable layer that no entry of ``layers`` names.
        layers: exact qualified module names or ``"re:<regex>"`` patterns -> precision; the
            order matters for patterns (the first that matches wins).
        loss_scaling: None when the policy does not say (the runtime chooses).
        model: the model the policy was made for.
        target: the device and mode the policy was made for.
        metrics: measured outcomes, e.g. ``{"speedup": 2.1}``.
        provenance: who made it and how, e.g. ``{"agent": "ppo"}``.
    """

    default: Precision = Precision.FP32
    layers: Mapping[str, Precision] = field(default_factory=_FrozenMap)
    loss_scaling: LossScalingConfig | None = None
    model: ModelInfo | None = None
    target: TargetInfo | None = None
    metrics: Mapping[str, float] = field(default_factory=_FrozenMap)
    provenance: Mapping[str, str] = field(default_factory=_FrozenMap)

    def __post_init__(self) -> None:
        put = object.__setattr__
        put(self, "default", _precision(self.default, "default", ("default",)))
        layers, patterns = _check_layers(self.layers)
        put(self, "layers", _FrozenMap(layers))
        put(self, "_patterns", patterns)
        put(self, "loss_scaling", _section(LossScalingConfig, self.loss_scaling, "loss_scaling"))
        model = _section(ModelInfo, self.model, "model")
        put(self, "model", None if model == ModelInfo() else model)
        put(self, "target", _section(TargetInfo, self.target, "target"))
        put(self, "metrics", _check_mapping(self.metrics, "metrics", _metric))
        put(self, "provenance", _check_mapping(self.provenance, "provenance", _provenance))

    @classmethod
    def uniform(cls, precision: Precision | str, **kwargs: Any) -> PrecisionPolicy:
        """A policy that runs every tunable layer in ``precision``."""
        return cls(default=precision, **kwargs)

    @classmethod
    def coerce(cls, policy: object) -> PrecisionPolicy:
        """``policy`` as a PrecisionPolicy: the one reading of what the runtime, the cost model
        and the evaluator accept.

        A PrecisionPolicy is returned as is; one precision (``"bf16"``) is the uniform policy;
        a ``{name or "re:<pattern>": precision}`` mapping is a policy whose default is fp32
        (layers it does not name stay fp32).

        Raises:
            TypeError: anything else.
            PolicyError: an unknown precision or a malformed pattern in the mapping.
        """
        if isinstance(policy, PrecisionPolicy):
            return policy
        if isinstance(policy, (str, Precision)):
            return cls.uniform(_precision(policy, "policy", ()))
        if isinstance(policy, Mapping):
            return cls(default=Precision.FP32, layers=dict(policy))
        raise TypeError(
            "policy must be a PrecisionPolicy, a precision name such as 'bf16', or a "
            f"{{layer name: precision}} mapping; got {type(policy).__name__}"
        )

    def replace(self, **changes: Any) -> PrecisionPolicy:
        """A copy with some fields changed (``dataclasses.replace``)."""
        return dataclasses.replace(self, **changes)

    def with_layers(self, layers: Mapping[str, Precision | str]) -> PrecisionPolicy:
        """A copy with ``layers`` added; existing keys keep their place, new ones go last."""
        return self.replace(layers={**self.layers, **layers})

    def precision_for(self, name: str) -> Precision:
        """The precision of the module called ``name`` (exact, then first pattern, then default)."""
        return self._explicit(name) or self.default

    def _explicit(self, name: str) -> Precision | None:
        if name in self.layers:
            return self.layers[name]
        for key, pattern in self._patterns:
            if _fullmatch(key, pattern, name):
                return self.layers[key]
        return None

    def resolve(self, model: nn.Module, named_only: bool = False) -> dict[str, Precision]:
        """The precision of every tunable layer of ``model``, in ``named_modules`` order.

        Normalisation layers are listed only when an exact name or a pattern names them
        (otherwise they stay fp32); note that a catch-all pattern such as ``re:.*`` does.
        ``named_only`` leaves out the tunable layers that only the default covers.
        """
        from autoprec.layers import is_norm, tunable_layers

        tunable = {name for name, _ in tunable_layers(model)}
        out: dict[str, Precision] = {}
        for name, module in model.named_modules():
            if name in tunable and not named_only:
                out[name] = self.precision_for(name)
            elif (name in tunable or is_norm(module, name)) and (
                precision := self._explicit(name)
            ) is not None:
                out[name] = precision
            elif is_norm(module, name) and (precision := self._explicit(name)) is not None:
                out[name] = precision
        return out

    def validate(self, model: nn.Module, device: object = None) -> PolicyReport:
        """Check the policy against a model and, optionally, a device.

        Args:
            model: the model the policy is to be applied to.
            device: None (skip the device check), an iterable of precision names, or an object
                with a ``supported_precisions`` attribute holding one. Names that are not layer
                precisions (e.g. ``"int8"``) are ignored.
        """
        from autoprec.layers import is_norm, model_fingerprint, tunable_layers

        names = [name for name, _ in tunable_layers(model)]
        names += [name for name, module in model.named_modules() if is_norm(module, name)]
        present = set(names)
        patterns = dict(self._patterns)
        unmatched = []
        for key in self.layers:
            if key in patterns:
                if not any(_fullmatch(key, patterns[key], n) for n in names):
                    unmatched.append((key, _suggest(key[len(PATTERN_PREFIX) :], names, n=3)))
            elif key not in present:
                unmatched.append((key, _suggest(key, names, n=3)))
        mismatch = None
        expected = self.model.fingerprint if self.model else None
        if expected and expected != (actual := model_fingerprint(model)):
            mismatch = (expected, actual)
        unsupported: dict[str, Precision] = {}
        if device is not None:
            supported = _supported_precisions(device)
            resolved = self.resolve(model)
            unsupported = {n: p for n, p in resolved.items() if p not in supported}
        return PolicyReport(unmatched=unmatched, fingerprint=mismatch, unsupported=unsupported)

    def to_dict(self) -> dict[str, Any]:
        """The file format as plain data (key order as in files, empty sections left out)."""
        out: dict[str, Any] = {"autoprec_policy": SCHEMA_VERSIONS[-1]}
        if self.model is not None:
            info = dataclasses.asdict(self.model)
            out["model"] = {k: v for k, v in info.items() if v is not None}
        if self.target is not None:
            info = dataclasses.asdict(self.target)
            out["target"] = {k: v for k, v in info.items() if v is not None}
        out["default"] = self.default.value
        if self.layers:
            out["layers"] = {k: v.value for k, v in self.layers.items()}
        if self.loss_scaling is not None:
            ls = self.loss_scaling
            out["loss_scaling"] = {
                "kind": ls.kind,
                "init_scale": ls.init_scale,
                "growth_interval": ls.growth_interval,
                "backoff_factor": ls.backoff_factor,
                "growth_factor": ls.growth_factor,
            }
        if self.metrics:
            out["metrics"] = dict(self.metrics)
        if self.provenance:
            out["provenance"] = dict(self.provenance)
        return out

    @classmethod
    def from_dict(cls, data: object, source: str = "<dict>") -> PrecisionPolicy:
        """Build a policy from the file format as plain data (see :meth:`to_dict`).

        Raises:
            PolicyError: any defect; the message starts with ``source``.
        """
        from autoprec.policy_io import policy_from_data

        return policy_from_data(data, source)

    def digest(self) -> str:
        """``"sha256:<hex>"`` of what changes training: default, layers and loss scaling.

        Metrics, provenance, model and target do not count. Two policies that resolve alike
        but are written differently get different digests.
        """
        ls = self.loss_scaling
        payload = {
            "default": self.default.value,
            "layers": [[k, v.value] for k, v in self.layers.items()],
            "loss_scaling": None if ls is None else dataclasses.asdict(ls),
        }
        text = json.dumps(payload, sort_keys=True, separators=(",", ":"))
        return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def resolve_mode(mode: str, device_type: str) -> str:
    """The runtime mode a run uses: ``"auto"`` is ``native`` on a CUDA device and ``emulate``
    elsewhere; ``"emulate"`` and ``"native"`` are kept.

    Raises:
        ValueError: a mode not in :data:`TARGET_MODES`.
    """
    if mode not in TARGET_MODES:
        known = ", ".join(TARGET_MODES)
        raise ValueError(f"unknown runtime mode {mode!r}; expected one of {known}")
    if mode == "auto":
        return "native" if device_type == "cuda" else "emulate"
    return mode


def _check_layers(layers: object) -> tuple[dict[str, Precision], tuple[tuple[str, Any], ...]]:
    if layers is None:
        return {}, ()
    if not isinstance(layers, Mapping):
        raise PolicyError(
            "layers must be a mapping of module name (or 're:<regex>') to precision; "
            f"got {_kind(layers)}",
            field=("layers",),
        )
    out: dict[str, Precision] = {}
    patterns = []
    for key, value in layers.items():
        path = ("layers", key)
        if not isinstance(key, str):  # '' is allowed: the root module (a one-layer model)
            raise PolicyError(
                f"layer name {_kind(key)} is not a non-empty string; quote it in YAML "
                f"(e.g. '{excerpt(key, quote=False)}': bf16)",
                field=path,
            )
        out[key] = _precision(value, f"layer {excerpt(key)}", path)
        if key.startswith(PATTERN_PREFIX):
            patterns.append((key, _compile(key, path)))
    return out, tuple(patterns)


def _compile(key: str, path: Field) -> Any:
    """The ``regex`` pattern of ``re:<body>``; the syntax accepted is Python's ``re``."""
    import regex

    body = key[len(PATTERN_PREFIX) :]
    try:
        re.compile(body)  # the file format's syntax, whichever engine matches it
    except re.error as exc:
        raise PolicyError(
            f"pattern {excerpt(key)} is not a valid regular expression: {exc}; fix the regex "
            "(Python 're' syntax, matched against the whole module name)",
            field=path,
        ) from None
    if not body:
        raise PolicyError(f"pattern {excerpt(key)} is empty; write e.g. 're:.*fc'", field=path)
    return regex.compile(body)


def _fullmatch(key: str, pattern: Any, name: str) -> bool:
    try:
        return pattern.fullmatch(name, timeout=PATTERN_TIMEOUT_S) is not None
    except TimeoutError:
        raise PolicyError(
            f"pattern {excerpt(key)} took over {PATTERN_TIMEOUT_S} s to match layer "
            f"{excerpt(name)}: it backtracks catastrophically, as a repeat of a repeat such as "
            "'(a+)+' or '(.*.*)*' can; write it without nested repeats (e.g. 're:layer1\\..*')",
            field=("layers", key),
        ) from None


def _check_mapping(value: object, name: str, check: Callable[[object, Field], Any]) -> _FrozenMap:
    if value is None:
        return _FrozenMap()
    if not isinstance(value, Mapping):
        raise PolicyError(f"{name} must be a mapping; got {_kind(value)}", field=(name,))
    out = {}
    for key, item in value.items():
        if not isinstance(key, str):
            raise PolicyError(
                f"{name} key {_kind(key)} is not a string; quote it", field=(name, key)
            )
        out[key] = check(item, (name, key))
    return _FrozenMap(out)


def _metric(value: object, path: Field) -> float:
    if not _finite(value):
        raise PolicyError(
            f"metrics.{excerpt(path[1], quote=False)} must be a finite number; got "
            f"{_kind(value)}{_yaml_hint(value)}",
            field=path,
        )
    return float(value)


def _provenance(value: object, path: Field) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (datetime.date, datetime.datetime)):
        return value.isoformat()
    if _is_number(value):
        return str(value)
    raise PolicyError(
        f"provenance.{excerpt(path[1], quote=False)} must be a string; got {_kind(value)}; "
        "quote the value",
        field=path,
    )


def _supported_precisions(device: object) -> frozenset[Precision]:
    names = getattr(device, "supported_precisions", device)
    if isinstance(names, (str, bytes)) or not isinstance(names, Iterable):
        raise TypeError(
            "device must be an iterable of precision names or an object with "
            f"'supported_precisions'; got {_kind(names)}"
        )
    out = set()
    for name in names:
        try:
            out.add(parse_precision(name))
        except ValueError:
            continue  # a format that is not a layer precision (int8, fp4, ...)
    return frozenset(out)
