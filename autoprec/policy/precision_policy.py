"""Precision policies: which precision each layer of a model trains in.

A policy maps fully qualified module names, or ``re:<regex>`` patterns, to precisions. Precedence
for a layer: its exact name, then the first pattern (in mapping order) that fully matches it, then
``default``. Patterns are Python ``re`` syntax, matched by the ``regex`` package so that one that
backtracks catastrophically (``(.*.*)*X``) is stopped after :data:`PATTERN_TIMEOUT_S` with a
:class:`PolicyError` instead of hanging. The sections (loss scaling, model, target) and the check
of every field live in :mod:`autoprec.policy.fields`; files are read and written by
:mod:`autoprec.policy.io`.

Example:
    >>> p = PrecisionPolicy(default="bf16", layers={"fc": "fp32", "re:.*downsample.*": "fp16"})
    >>> p.precision_for("fc"), p.precision_for("layer1.0.downsample.0"), p.precision_for("conv1")
    (<Precision.FP32: 'fp32'>, <Precision.FP16: 'fp16'>, <Precision.BF16: 'bf16'>)
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from autoprec._text import excerpt
from autoprec._values import kind
from autoprec.policy.fields import (
    PATTERN_PREFIX,
    SCHEMA_VERSIONS,
    TARGET_MODES,
    LossScalingConfig,
    ModelInfo,
    PolicyError,
    TargetInfo,
    check_document,
    check_layers,
    check_mapping,
    check_metric,
    check_precision,
    check_provenance,
    check_section,
    run_with_section,
    suggest,
    supported_precisions,
)
from autoprec.policy.verification import VerificationInfo, check_verification
from autoprec.precision import Precision

if TYPE_CHECKING:  # pragma: no cover
    import regex
    from torch import nn

    from autoprec._datafile import LineFinder

__all__ = [
    "PATTERN_TIMEOUT_S",
    "PolicyLike",
    "PolicyMismatchError",
    "PolicyReport",
    "PrecisionPolicy",
    "policy_from_data",
    "resolve_mode",
]

PATTERN_TIMEOUT_S = 0.1  # per match; a sane pattern takes microseconds on a module name
#: Unmatched layer names a report quotes (with a hint each); the rest are counted, so that a
#: policy of 100,000 unknown names costs one short line, not a message of megabytes.
QUOTED_PROBLEMS = 3


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


class PolicyMismatchError(ValueError):
    """The policy does not fit the model (or the device): it was made for something else."""


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
        for key, hints in self.unmatched[:QUOTED_PROBLEMS]:
            what = "pattern" if key.startswith(PATTERN_PREFIX) else "layer"
            fix = (
                "did you mean " + " or ".join(excerpt(h) for h in hints) + "?"
                if hints
                else "check it against the names in model.named_modules()"
            )
            lines.append(f"{what} {excerpt(key)} matches no tunable or normalisation layer; {fix}")
        if len(self.unmatched) > QUOTED_PROBLEMS:
            lines.append(
                f"and {len(self.unmatched) - QUOTED_PROBLEMS:,} more of the policy's "
                f"{len(self.unmatched):,} unmatched layer names and patterns"
            )
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

    def error(self, policy: PrecisionPolicy, model: str, where: str = "") -> PolicyMismatchError:
        """The one-line error of a policy that does not fit ``model`` (its name), saying which
        model the policy was made for and each problem; ``where`` adds e.g. the device."""
        made_for = policy.model.name if policy.model is not None else None
        origin = f"it was made for model {made_for!r}" if made_for else "it names no model"
        problems = "; ".join(f"({i}) {p}" for i, p in enumerate(self.problems, 1))
        return PolicyMismatchError(
            f"the policy does not fit model {model!r}{where} ({origin}): {problems}"
        )


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
        verification: what ``autoprec verify`` measured (:class:`VerificationInfo`), or None.
        state_backends: write the ``run_with`` section: the backend and recipe to run the
            default and each layer with, derived from their precisions on every save (an
            exported policy states them; a file that has the section reads back True).
    """

    default: Precision = Precision.FP32
    layers: Mapping[str, Precision] = field(default_factory=_FrozenMap)
    loss_scaling: LossScalingConfig | None = None
    model: ModelInfo | None = None
    target: TargetInfo | None = None
    metrics: Mapping[str, float] = field(default_factory=_FrozenMap)
    provenance: Mapping[str, str | int | float] = field(default_factory=_FrozenMap)
    verification: VerificationInfo | None = None
    state_backends: bool = False

    def __post_init__(self) -> None:
        put = object.__setattr__
        put(self, "default", check_precision(self.default, "default", ("default",)))
        layers, patterns = check_layers(self.layers)
        put(self, "layers", _FrozenMap(layers))
        put(self, "_patterns", patterns)
        put(
            self,
            "loss_scaling",
            check_section(LossScalingConfig, self.loss_scaling, "loss_scaling"),
        )
        model = check_section(ModelInfo, self.model, "model")
        put(self, "model", None if model == ModelInfo() else model)
        put(self, "target", check_section(TargetInfo, self.target, "target"))
        put(self, "metrics", _FrozenMap(check_mapping(self.metrics, "metrics", check_metric)))
        put(
            self,
            "provenance",
            _FrozenMap(check_mapping(self.provenance, "provenance", check_provenance)),
        )
        put(self, "verification", check_verification(self.verification))
        if not isinstance(self.state_backends, bool):
            raise TypeError(f"state_backends must be a bool, got {kind(self.state_backends)}")

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
            return cls.uniform(check_precision(policy, "policy", ()))
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
            hint = len(unmatched) < QUOTED_PROBLEMS  # only the quoted ones need a hint
            if key in patterns:
                if not any(_fullmatch(key, patterns[key], n) for n in names):
                    body = key[len(PATTERN_PREFIX) :]
                    unmatched.append((key, suggest(body, names, n=3) if hint else []))
            elif key not in present:
                unmatched.append((key, suggest(key, names, n=3) if hint else []))
        mismatch = None
        expected = self.model.fingerprint if self.model else None
        if expected and expected != (actual := model_fingerprint(model)):
            mismatch = (expected, actual)
        unsupported: dict[str, Precision] = {}
        if device is not None:
            supported = supported_precisions(device)
            resolved = self.resolve(model)
            # an fp8 recipe or fp8_block runs where fp8 does (DeviceSpec.supports's rule)
            unsupported = {
                n: p for n, p in resolved.items() if not {p, Precision(p.hardware)} & supported
            }
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
        if self.state_backends:
            out["run_with"] = run_with_section(self.default, self.layers)
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
        if self.verification is not None:
            out["verification"] = self.verification.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: object, source: str = "<dict>") -> PrecisionPolicy:
        """Build a policy from the file format as plain data (see :meth:`to_dict`).

        Raises:
            PolicyError: any defect; the message starts with ``source``.
        """
        return policy_from_data(data, source)

    def digest(self) -> str:
        """``"sha256:<hex>"`` of what changes training: default, layers and loss scaling.

        Metrics, provenance, model, target and verification do not count. Two policies that
        resolve alike but are written differently get different digests.
        """
        # The verification section is a measurement *of* this policy, like metrics: writing it
        # into the file must not change the policy's identity, or `autoprec train` would refuse
        # to resume its checkpoints (their config holds this digest) and a verified file would
        # no longer match the trials, the evaluator's cache and the MLflow runs of its search.
        ls = self.loss_scaling
        payload = {
            "default": self.default.value,
            "layers": [[k, v.value] for k, v in self.layers.items()],
            "loss_scaling": None if ls is None else dataclasses.asdict(ls),
        }
        text = json.dumps(payload, sort_keys=True, separators=(",", ":"))
        return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


#: What :meth:`PrecisionPolicy.coerce` reads as a policy (and so what the runtime, the cost model
#: and the evaluator accept): a policy, a ``{name or "re:<pattern>": precision}`` mapping, or one
#: precision for every layer.
PolicyLike = PrecisionPolicy | Mapping[str, str | Precision] | str | Precision


def policy_from_data(
    data: object, source: str, line_of: LineFinder | None = None
) -> PrecisionPolicy:
    """Build a policy from parsed file data; errors start with ``source`` (and the line).

    Args:
        data: the parsed document.
        source: the file path (or ``"<dict>"``) to name in errors.
        line_of: maps a field path to its 1-based line in the file, or None.
    """
    try:
        return PrecisionPolicy(**check_document(data))
    except PolicyError as exc:
        line = line_of(exc.field) if line_of and exc.field else None
        where = f"{source}, line {line}" if line else source
        raise PolicyError(f"{where}: {exc}", field=exc.field) from None


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


def _fullmatch(key: str, pattern: regex.Pattern[str], name: str) -> bool:
    try:
        return pattern.fullmatch(name, timeout=PATTERN_TIMEOUT_S) is not None
    except TimeoutError:
        raise PolicyError(
            f"pattern {excerpt(key)} took over {PATTERN_TIMEOUT_S} s to match layer "
            f"{excerpt(name)}: it backtracks catastrophically, as a repeat of a repeat such as "
            "'(a+)+' or '(.*.*)*' can; write it without nested repeats (e.g. 're:layer1\\..*')",
            field=("layers", key),
        ) from None
