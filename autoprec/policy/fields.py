"""The fields of a policy: its sections (loss scaling, model, target) and the check of each.

:class:`~autoprec.policy.PrecisionPolicy` is built from these and :mod:`autoprec.policy.io`
names file defects with them; keeping them here gives both one home that neither has to import
the other for. Every check raises :class:`PolicyError` carrying the field path, so that a file
reader can add the line where the field was written.
"""

from __future__ import annotations

import dataclasses
import datetime
import difflib
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from autoprec._text import excerpt
from autoprec._values import (  # the checks of one value, which the sections' checks use
    FLOAT32_MAX,
    FLOAT32_TINY,
    INT32_MAX,
    SEED_RANGE,  # noqa: F401 - every command's seeds, imported from here by the commands
    NumberRange,
    finite,
    is_number,
    kind,
    yaml_hint,
)
from autoprec.precision import PRECISION_NAMES, Precision, parse_precision

if TYPE_CHECKING:  # pragma: no cover
    import regex

SCHEMA_VERSIONS = (1,)
PATTERN_PREFIX = "re:"
TOP_LEVEL_KEYS = (
    "autoprec_policy",
    "model",
    "target",
    "default",
    "layers",
    "loss_scaling",
    "metrics",
    "provenance",
    "verification",
    "run_with",
)
LOSS_SCALING_KINDS = ("dynamic", "static", "none")
TARGET_MODES = ("auto", "emulate", "native")
#: The runtime mode that runs native's program under torch.compile (autoprec.runtime.compiled);
#: a way to train, not a policy file's target mode.
COMPILED = "compiled"
#: The programs a training step runs as, which the cost model prices apart (``eager``: one
#: kernel per operation; ``compiled``: under torch.compile) and a policy's ``target.execution``
#: names.
EXECUTION_MODES = ("eager", COMPILED)
REQUIRED_HINT = "a policy needs at least 'autoprec_policy: 1' and 'default: <precision>'"

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


def suggest(word: object, choices: Iterable[str], n: int = 1) -> list[str]:
    """The ``n`` choices closest to ``word``, for a "did you mean"."""
    return difflib.get_close_matches(str(word), list(choices), n=n)


def unknown_key(key: object, allowed: tuple[str, ...], where: str, path: Field) -> PolicyError:
    """The error for a key not in ``allowed``, with the closest allowed key as a hint."""
    hint = suggest(key, allowed)
    did = f"did you mean {hint[0]!r}? " if hint else ""
    return PolicyError(
        f"unknown key {excerpt(key)} in {where}; {did}allowed keys: {', '.join(allowed)}",
        field=(*path, key),
    )


def check_section(cls: type[_T], value: object, name: str) -> _T | None:
    """Build ``cls`` from a mapping (as read from a file), or pass an instance or None through."""
    if value is None or isinstance(value, cls):
        return value
    if not isinstance(value, Mapping):
        raise PolicyError(
            f"{name} must be a mapping of {', '.join(f.name for f in dataclasses.fields(cls))}; "
            f"got {kind(value)}",
            field=(name,),
        )
    allowed = tuple(f.name for f in dataclasses.fields(cls))
    for key in value:
        if key not in allowed:
            raise unknown_key(key, allowed, name, (name,))
    return cls(**value)


def check_precision(value: object, what: str, path: Field) -> Precision:
    """``value`` as a Precision; ``what`` names it in the error (e.g. ``"layer 'fc'"``)."""
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
        if self.kind not in LOSS_SCALING_KINDS:
            raise PolicyError(
                f"loss_scaling.kind must be one of {', '.join(LOSS_SCALING_KINDS)}; got "
                f"{kind(self.kind)}",
                field=("loss_scaling", "kind"),
            )
        for name, bounds in LOSS_SCALING_RANGES.items():
            value = getattr(self, name)
            check_number(value, bounds, f"loss_scaling.{name}", ("loss_scaling", name))
            if not bounds.integer:
                object.__setattr__(self, name, float(value))


def check_number(value: object, bounds: NumberRange, name: str, path: Field) -> None:
    """Raise :class:`PolicyError` at ``path`` unless ``value`` is in ``bounds``."""
    problem = bounds.problem(value)
    if problem is not None:
        raise PolicyError(f"{name} must be {problem}", field=path)


#: The range of each numeric field of ``loss_scaling``: a scale must be a finite, normal float32
#: (the scaler holds it in one), the growth interval an int32 step count.
LOSS_SCALING_RANGES = {
    "init_scale": NumberRange(low=FLOAT32_TINY, high=FLOAT32_MAX, example="32768"),
    "growth_factor": NumberRange(low=1, open_low=True, high=FLOAT32_MAX, example="2.0"),
    "backoff_factor": NumberRange(low=0, high=1, open_low=True, open_high=True, example="0.5"),
    "growth_interval": NumberRange(integer=True, low=1, high=INT32_MAX, example="2000"),
}


def loss_scaling_for(assignment: Mapping[str, Any]) -> LossScalingConfig | None:
    """Dynamic loss scaling (``LossScalingConfig()``) if a layer is fp16, else None.

    This is the rule of :func:`autoprec.hardware.amp_policy`, of the search's policies
    (:func:`autoprec.agents.export.layer_policy`, so that the baselines evaluated as layer maps
    hit the same cache entries as the policies themselves) and of the cost model for a layer map
    (:meth:`autoprec.hardware.CostModel.step` prices the unscaling of the gradients).
    """
    fp16 = any(parse_precision(p) is Precision.FP16 for p in assignment.values())
    return LossScalingConfig() if fp16 else None


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
                    f"model.{name} must be a string; got {kind(value)}", field=("model", name)
                )
        if self.tunable_layers is not None:
            check_number(
                self.tunable_layers,
                NumberRange(integer=True, low=0, high=INT32_MAX),
                "model.tunable_layers",
                ("model", "tunable_layers"),
            )


@dataclass(frozen=True)
class TargetInfo:
    """Where a policy is meant to run.

    Args:
        device: a name from the hardware database (e.g. ``"h100-sxm"``), or None for any.
        mode: ``"native"`` (real low-precision kernels), ``"emulate"`` (fake-quantised fp32) or
            ``"auto"`` (native where the device runs the format, emulated otherwise).
        execution: the program the policy was priced for, ``"eager"`` or ``"compiled"``
            (:data:`EXECUTION_MODES`), or None: not stated (files written before the field).
    """

    device: str | None = None
    mode: str = "auto"
    execution: str | None = None

    def __post_init__(self) -> None:
        if self.device is not None and not isinstance(self.device, str):
            raise PolicyError(
                f"target.device must be a string; got {kind(self.device)}",
                field=("target", "device"),
            )
        if self.mode not in TARGET_MODES:
            raise PolicyError(
                f"target.mode must be one of {', '.join(TARGET_MODES)}; got {kind(self.mode)}",
                field=("target", "mode"),
            )
        if self.execution is not None and self.execution not in EXECUTION_MODES:
            raise PolicyError(
                f"target.execution must be one of {', '.join(EXECUTION_MODES)} (or left out); "
                f"got {kind(self.execution)}",
                field=("target", "execution"),
            )


def check_document(data: object) -> dict[str, Any]:
    """The policy fields of a parsed policy file, its schema version checked and dropped.

    Raises:
        PolicyError: not a mapping, an unknown top-level key, a missing or unsupported
            ``autoprec_policy``, or no ``default``.
    """
    if not isinstance(data, Mapping):
        raise PolicyError(
            f"expected a mapping of policy fields at the top level; got {kind(data)}; "
            + REQUIRED_HINT
        )
    for key in data:
        if key not in TOP_LEVEL_KEYS:
            raise unknown_key(key, TOP_LEVEL_KEYS, "the policy (top level)", ())
    versions = ", ".join(map(str, SCHEMA_VERSIONS))
    if "autoprec_policy" not in data:
        raise PolicyError(
            "missing required key 'autoprec_policy' (the schema version); "
            f"add 'autoprec_policy: {SCHEMA_VERSIONS[-1]}' as the first line"
        )
    version = data["autoprec_policy"]
    if not isinstance(version, int) or isinstance(version, bool) or version not in SCHEMA_VERSIONS:
        raise PolicyError(
            f"unsupported autoprec_policy (schema version) {kind(version)}; this autoprec "
            f"reads version {versions}; upgrade autoprec or rewrite the file",
            field=("autoprec_policy",),
        )
    if "default" not in data:
        raise PolicyError(
            f"missing required key 'default'; add e.g. 'default: fp32' (one of "
            f"{', '.join(PRECISION_NAMES)})"
        )
    fields = {k: v for k, v in data.items() if k not in ("autoprec_policy", "run_with")}
    if "run_with" in data:  # derived from the precisions on every save: its presence is read
        if not isinstance(data["run_with"], Mapping):
            raise PolicyError(
                "run_with must be a mapping (each layer's backend and recipe, which autoprec "
                f"writes from the precisions); got {kind(data['run_with'])}; delete the section "
                "to drop it",
                field=("run_with",),
            )
        fields["state_backends"] = True
    return fields


def run_with_section(default: Precision, layers: Mapping[str, Precision]) -> dict[str, Any]:
    """The ``run_with`` section: the backend and recipe production training runs the default
    and each entry of ``layers`` with (:attr:`~autoprec.precision.Precision.run_with`)."""

    def entry(p: Precision) -> dict[str, str]:
        backend, recipe = p.run_with
        return {"backend": backend, "recipe": recipe}

    out: dict[str, Any] = {"default": entry(default)}
    if layers:
        out["layers"] = {k: entry(p) for k, p in layers.items()}
    return out


def check_layers(
    layers: object,
) -> tuple[dict[str, Precision], tuple[tuple[str, regex.Pattern[str]], ...]]:
    """The ``layers`` mapping with precisions parsed, and its ``re:`` patterns compiled.

    Returns:
        ``(layers, patterns)``; ``patterns`` holds ``(key, compiled regex)`` in mapping order.
    """
    if layers is None:
        return {}, ()
    if not isinstance(layers, Mapping):
        raise PolicyError(
            "layers must be a mapping of module name (or 're:<regex>') to precision; "
            f"got {kind(layers)}",
            field=("layers",),
        )
    out: dict[str, Precision] = {}
    patterns = []
    for key, value in layers.items():
        path = ("layers", key)
        if not isinstance(key, str):  # '' is allowed: the root module (a one-layer model)
            raise PolicyError(
                f"layer name {kind(key)} is not a non-empty string; quote it in YAML "
                f"(e.g. '{excerpt(key, quote=False)}': bf16)",
                field=path,
            )
        out[key] = check_precision(value, f"layer {excerpt(key)}", path)
        if key.startswith(PATTERN_PREFIX):
            patterns.append((key, _compile(key, path)))
    return out, tuple(patterns)


def _compile(key: str, path: Field) -> regex.Pattern[str]:
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


def check_mapping(
    value: object, name: str, check: Callable[[object, Field], Any]
) -> dict[str, Any]:
    """A ``{string: value}`` section (``metrics``, ``provenance``), each value through ``check``."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise PolicyError(f"{name} must be a mapping; got {kind(value)}", field=(name,))
    out = {}
    for key, item in value.items():
        if not isinstance(key, str):
            raise PolicyError(
                f"{name} key {kind(key)} is not a string; quote it", field=(name, key)
            )
        out[key] = check(item, (name, key))
    return out


def check_metric(value: object, path: Field) -> float:
    """A metric value: a finite number, kept as a float."""
    if not finite(value):
        raise PolicyError(
            f"metrics.{excerpt(path[1], quote=False)} must be a finite number; got "
            f"{kind(value)}{yaml_hint(value)}",
            field=path,
        )
    return float(value)


def check_provenance(value: object, path: Field) -> str | int | float:
    """A provenance value: a string, or a number kept as one (``budget: 12``, not ``'12'``); a
    date (YAML reads one unquoted) is written out as text."""
    if isinstance(value, str) or (is_number(value) and finite(value)):
        return value
    if isinstance(value, (datetime.date, datetime.datetime)):
        return value.isoformat()
    if isinstance(value, bool):
        return str(value).lower()
    raise PolicyError(
        f"provenance.{excerpt(path[1], quote=False)} must be a string or a finite number; got "
        f"{kind(value)}; quote the value",
        field=path,
    )


def supported_precisions(device: object) -> frozenset[Precision]:
    """The layer precisions of ``device``: an iterable of format names or an object with
    ``supported_precisions``; names that are not layer precisions (int8, fp4) are skipped."""
    names = getattr(device, "supported_precisions", device)
    if isinstance(names, (str, bytes)) or not isinstance(names, Iterable):
        raise TypeError(
            "device must be an iterable of precision names or an object with "
            f"'supported_precisions'; got {kind(names)}"
        )
    out = set()
    for name in names:
        try:
            out.add(parse_precision(name))
        except ValueError:
            continue  # a format that is not a layer precision (int8, fp4, ...)
    return frozenset(out)
