"""The search's reward: one scalar from a policy's evaluated metrics (torch-free).

``reward = w_speedup * log(speedup) - w_memory * log(memory_ratio) - w_accuracy * max(0,
loss_delta)``, minus a tolerance penalty once ``loss_delta`` exceeds the tolerance; a diverged or
infeasible policy gets :data:`FAILURE_PENALTY`. This module is the only place the formula and
its defaults are written: the environment, the agents, the tracker and the CLI take a
:class:`RewardConfig`.

Example:
    >>> RewardConfig({"accuracy": 20.0}, tolerance=0.02).weights["speedup"]
    1.0
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from autoprec.evaluate.metrics import Metrics

#: The reward's default weights (``--w-speedup``, ``--w-memory``, ``--w-accuracy``).
DEFAULT_WEIGHTS: Mapping[str, float] = MappingProxyType(
    {"speedup": 1.0, "memory": 0.5, "accuracy": 10.0}
)
#: The default ``loss_delta`` above which the tolerance penalty applies (``--accuracy-tolerance``).
DEFAULT_TOLERANCE = 0.05
FAILURE_PENALTY = -5.0  # diverged or infeasible
TOLERANCE_PENALTY = 1.0  # paid once loss_delta exceeds the tolerance ...
TOLERANCE_SLOPE = 10.0  # ... plus this much per unit of excess


@dataclass(frozen=True)
class RewardConfig:
    """How evaluated metrics are scored: the weights and the accuracy tolerance.

    Args:
        weights: ``{"speedup", "memory", "accuracy"}``; missing keys keep
            :data:`DEFAULT_WEIGHTS`; None is all defaults.
        tolerance: the ``loss_delta`` above which the tolerance penalty applies (and which
            ``greedy`` and ``migrate`` never accept).

    Raises:
        ValueError: an unknown or non-finite weight, or a negative or non-finite tolerance.
    """

    weights: Mapping[str, float] | None = None
    tolerance: float = DEFAULT_TOLERANCE

    def __post_init__(self) -> None:
        given = dict(self.weights or {})
        unknown = sorted(set(given) - set(DEFAULT_WEIGHTS))
        if unknown:
            raise ValueError(
                f"unknown reward weight(s) {unknown}; expected keys {', '.join(DEFAULT_WEIGHTS)}"
            )
        merged = {**DEFAULT_WEIGHTS, **{k: float(v) for k, v in given.items()}}
        bad = sorted(k for k, v in merged.items() if not math.isfinite(v))
        if bad:
            raise ValueError(f"reward weight(s) {bad} must be finite numbers")
        tolerance = float(self.tolerance)
        if not (math.isfinite(tolerance) and tolerance >= 0):
            raise ValueError(f"accuracy_tolerance must be >= 0, got {self.tolerance!r}")
        object.__setattr__(self, "weights", MappingProxyType(merged))
        object.__setattr__(self, "tolerance", tolerance)

    def __call__(self, metrics: Metrics) -> float:
        """The reward of evaluated ``metrics``, always finite.

        ``metrics`` is an :class:`~autoprec.evaluate.Metrics` (or anything with ``diverged``,
        ``feasible``, ``loss_delta``, ``speedup`` and ``memory_ratio``).
        """
        if metrics.diverged or not metrics.feasible:
            return FAILURE_PENALTY
        w = self.weights
        loss_delta = metrics.loss_delta
        if not math.isfinite(loss_delta):
            return FAILURE_PENALTY
        value = (
            w["speedup"] * math.log(max(metrics.speedup, 1e-9))
            - w["memory"] * math.log(max(metrics.memory_ratio, 1e-9))
            - w["accuracy"] * max(0.0, loss_delta)
        )
        if loss_delta > self.tolerance:
            value -= TOLERANCE_PENALTY + TOLERANCE_SLOPE * (loss_delta - self.tolerance)
        return float(value) if math.isfinite(value) else FAILURE_PENALTY

    def params(self) -> dict[str, float]:
        """Flat parameters for a tracking run: ``accuracy_tolerance`` and ``w_<name>``."""
        return {"accuracy_tolerance": self.tolerance} | {
            f"w_{k}": v for k, v in self.weights.items()
        }

    def __reduce__(self) -> tuple[Any, ...]:  # MappingProxyType does not pickle
        return (RewardConfig, (dict(self.weights), self.tolerance))


def reward(
    metrics: Metrics,
    weights: Mapping[str, float] | None = None,
    accuracy_tolerance: float = DEFAULT_TOLERANCE,
) -> float:
    """``RewardConfig(weights, accuracy_tolerance)(metrics)``: the reward of ``metrics``."""
    return RewardConfig(weights, accuracy_tolerance)(metrics)


#: Chinchilla's fitted loss of a model of ``N`` parameters trained on ``D`` tokens,
#: ``L(N, D) = E + A / N**alpha + B / D**beta`` (Hoffmann et al. 2022, arXiv 2203.15556,
#: eq. 10, "approach 3": E 1.69, A 406.4, B 410.7, alpha 0.34, beta 0.28).
CHINCHILLA = MappingProxyType({"E": 1.69, "A": 406.4, "B": 410.7, "alpha": 0.34, "beta": 0.28})


def chinchilla_accuracy_weight(params: float, tokens: float) -> float:
    """The accuracy weight that prices a relative loss increase as the extra training it costs.

    At ``tokens`` tokens a model of ``params`` parameters that ends ``delta`` (relative) above
    its loss needs ``exp(w * delta)`` times the tokens to catch up, to first order in ``delta``,
    by Chinchilla's fit (:data:`CHINCHILLA`): ``w = L / (-dL/dlnD) = L / (beta * B * D**-beta)``.
    With ``w`` as ``--w-accuracy`` the reward's ``w_speedup * log(speedup)`` and its accuracy
    term are in the same unit (log compute); the longer the run, the more a loss increase costs.

    Example:
        >>> round(chinchilla_accuracy_weight(8e9, 15e12), 1)  # Llama 3 8B's 15T tokens
        82.9

    Raises:
        ValueError: ``params`` or ``tokens`` not a positive finite number.
    """
    _check_positive(params=params, tokens=tokens)
    c = CHINCHILLA
    data = c["B"] / tokens ** c["beta"]
    loss = c["E"] + c["A"] / params ** c["alpha"] + data
    return loss / (c["beta"] * data)


def chinchilla_tokens(params: float, weight: float) -> float:
    """The training length (tokens) at which :func:`chinchilla_accuracy_weight` is ``weight``:
    from ``w = 1 / beta + (E + A / N**alpha) * D**beta / (beta * B)``; 0 when every length
    exceeds it (``weight`` at most ``1 / beta``, the limit of a run of no tokens).

    Example:
        >>> round(chinchilla_tokens(8e9, chinchilla_accuracy_weight(8e9, 1e12)) / 1e12, 6)
        1.0
    """
    _check_positive(params=params, weight=weight)
    c = CHINCHILLA
    excess = weight - 1.0 / c["beta"]
    if excess <= 0:
        return 0.0
    fixed = c["E"] + c["A"] / params ** c["alpha"]
    return (excess * c["beta"] * c["B"] / fixed) ** (1.0 / c["beta"])


def _check_positive(**values: float) -> None:
    for name, value in values.items():
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be a positive finite number, got {value!r}")
