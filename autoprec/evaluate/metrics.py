"""What one evaluation of a precision policy reports: :class:`Metrics`."""

from __future__ import annotations

import dataclasses
import numbers
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from autoprec._text import excerpt

SOURCES = ("measured", "model")


class MetricsError(ValueError):
    """A dict that does not hold :class:`Metrics` (a field missing, or of another type): from
    another version of autoprec, or damaged."""


@dataclass(frozen=True)
class Metrics:
    """Quality, cost and health of one policy, each against the fp32 reference.

    Attributes:
        accuracy: validation accuracy after fine-tuning under the policy.
        loss: mean loss over the whole training split, with the policy applied (the fine
            signal: small precision effects show here before they move the accuracy).
        val_loss: mean loss over the validation split, with the policy applied.
        fp32_accuracy, fp32_loss: the same for the uniform fp32 policy.
        accuracy_delta: ``accuracy - fp32_accuracy``.
        loss_delta: relative, ``(loss - fp32_loss) / fp32_loss``.
        speedup: fp32 step time / this step time.
        memory_ratio: this step's memory / fp32's.
        speedup_vs_amp, memory_ratio_vs_amp: the same against the target's blanket AMP policy
            (``preferred.low`` on every tunable layer).
        step_time_s, memory_bytes: one training step at the evaluator's batch size.
        source: ``"measured"`` on the local CUDA device, ``"model"`` from the cost model.
        overflows, underflows: counts summed over layers during fine-tuning.
        loss_scale: ``LossScaler.summary()``, or ``{}`` when the run did not get that far.
        diverged: non-finite loss, an error in training, or a final loss over 10x fp32's; the
            quality fields are then penalised but finite (see ``Evaluator``).
        feasible: the target runs every precision of the policy (and it fitted in memory).
        wall_time_s: seconds the evaluation took (fine-tuning and scoring).
        fidelity: ``"short"``, ``"full"`` or ``"surrogate"`` (predicted, no training).
        steps: fine-tuning steps taken from the warm start (0 for ``"surrogate"``).
    """

    accuracy: float
    loss: float
    fp32_accuracy: float
    fp32_loss: float
    accuracy_delta: float
    loss_delta: float
    speedup: float
    memory_ratio: float
    speedup_vs_amp: float
    memory_ratio_vs_amp: float
    step_time_s: float
    memory_bytes: int
    source: str
    overflows: int = 0
    underflows: int = 0
    loss_scale: Mapping[str, Any] = field(default_factory=dict)
    diverged: bool = False
    feasible: bool = True
    wall_time_s: float = 0.0
    fidelity: str = "short"
    steps: int = 0
    val_loss: float = 0.0

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise MetricsError(f"unknown metrics source {self.source!r}; expected one of {SOURCES}")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict of every field."""
        out = dataclasses.asdict(self)
        out["loss_scale"] = dict(self.loss_scale)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Metrics:
        """Inverse of :meth:`to_dict`; unknown keys (from a newer version) are ignored.

        Raises:
            MetricsError: ``data`` is not a dict, lacks a field without a default, or holds a
                field of another type (an int is a float; a bool is no number).
        """
        if not isinstance(data, Mapping):
            raise MetricsError(f"metrics must be a dict; got a {type(data).__name__}")
        missing = [f.name for f in _FIELDS if f.name not in data and _required(f)]
        if missing:
            raise MetricsError(f"metrics lack {len(missing)} field(s): {excerpt(missing)}")
        values = {}
        for f in _FIELDS:
            if f.name not in data:
                continue
            value = data[f.name]
            kind, accepted = _KINDS[f.name]
            if isinstance(value, bool) and kind is not bool or not isinstance(value, accepted):
                raise MetricsError(
                    f"metrics field {f.name} must be {_KIND_NAMES[f.name]}; got {excerpt(value)}"
                )
            values[f.name] = kind(value) if kind in (float, int) else value
        return cls(**values)


def _required(f: dataclasses.Field) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def _kinds(hint: Any) -> tuple[type, type]:
    """``(the field's type, the types a value of it may have)`` for the annotation ``hint``
    (numpy's numbers too)."""
    origin = typing.get_origin(hint) or hint
    return (origin, {float: numbers.Real, int: numbers.Integral}.get(origin, origin))


_FIELDS = dataclasses.fields(Metrics)
_KINDS = {name: _kinds(hint) for name, hint in typing.get_type_hints(Metrics).items()}
_NAMES = {float: "a number", int: "an integer", str: "a string", bool: "true or false"}
_KIND_NAMES = {name: _NAMES.get(k[0], "a dict") for name, k in _KINDS.items()}
