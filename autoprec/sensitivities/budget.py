"""Sensitivity at a cost chosen by a time budget: predict each method's cost, pick one.

The unit of every prediction is one fp32 forward and backward pass at the analysis batch, timed
on the model being graded (:attr:`autoprec.sensitivities.measure.Measurer.pass_s`). From it:

- ``sweep``: layers x lowered precisions emulated passes, each :data:`SWEEP_PASS_FACTOR` times
  the fp32 pass (the rounding the emulate runtime adds);
- ``taylor``: one pass that keeps every layer's tensors, :data:`TAYLOR_PASS_FACTOR` times the
  fp32 pass, plus the float64 roundings of those tensors, :data:`TAYLOR_ROUNDING_FACTOR` of a
  pass per lowered precision;
- ``focused``: the sweep of ``k`` layers, ``k`` as large as the budget allows, taken in turn
  from each role in the model's repeated blocks and spread over the depth (:func:`priority`);
  the others interpolated between the swept layers of their role (:func:`fill`).

Before any of them the model trains a few fp32 steps; with a budget, fewer steps when the
learning-rate back-off's worst case would take more than :data:`WARM_UP_SHARE` of it
(:func:`warm_up_steps`).

:func:`plan` picks the most accurate method that fits what is left of the budget (``auto``):
the sweep if it fits, else the focused sweep if :data:`FOCUSED_MIN_LAYERS` layers fit, else
the estimate. The factors were measured on resnet18, resnet50 and a ViT-tiny on a 2-core CPU;
a wrong guess costs accuracy or a little time, never the budget's bound: a budgeted sweep stops
measuring when the next layer would end past the deadline (:func:`autoprec.graph.sensitivity`).

Example:
    >>> costs = Costs(layers=54, lowered=4, pass_s=0.5)
    >>> plan("auto", costs, left_s=30.0, budget_s=45.0).method
    'focused'
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

Row = tuple[tuple[float, ...], tuple[float, ...]]  # (loss deltas, cosines) of one layer

METHODS = ("auto", "sweep", "focused", "taylor")
DEFAULT_TIME_BUDGET_S = 40.0  # with the imports and the model, `analyze` ends within a minute
SWEEP_PASS_FACTOR = 1.3  # one emulated pass (one layer lowered) / the fp32 pass
TAYLOR_PASS_FACTOR = 1.2  # the Taylor estimate's kept pass / the fp32 pass
TAYLOR_ROUNDING_FACTOR = 1.2  # its roundings (in float64), per lowered precision / the fp32 pass
FOCUSED_MIN_LAYERS = 2  # fewer layers than this: no interpolation over depth, the estimate
WARM_UP_SHARE = 0.4  # of a budget, at most, for the fp32 warm-up, every back-off attempt included
_FLOOR = 1e-16  # gradient distances are interpolated in log space from here up


def check_method(method: str) -> str:
    """``method`` if it is one of :data:`METHODS`.

    Raises:
        ValueError: any other value (the message lists the methods).
    """
    if method not in METHODS:
        raise ValueError(
            f"unknown sensitivity method {method!r}; expected one of {', '.join(METHODS)}"
        )
    return method


def check_budget(budget_s: float) -> float:
    """``budget_s`` if it is a positive, finite number of seconds.

    Raises:
        ValueError: zero, negative, NaN or infinite.
    """
    if not (isinstance(budget_s, int | float) and math.isfinite(budget_s) and budget_s > 0):
        raise ValueError(
            f"the sensitivity time budget must be a positive number of seconds, got {budget_s!r}"
        )
    return float(budget_s)


@dataclass(frozen=True)
class Costs:
    """Predicted seconds of each method for ``layers`` layers and ``lowered`` precisions, from
    ``pass_s``, one timed fp32 forward and backward pass at the analysis batch."""

    layers: int
    lowered: int
    pass_s: float

    @property
    def layer_s(self) -> float:
        """Sweeping one layer at every lowered precision."""
        return self.lowered * SWEEP_PASS_FACTOR * self.pass_s

    @property
    def sweep_s(self) -> float:
        return self.layers * self.layer_s

    @property
    def taylor_s(self) -> float:
        return (TAYLOR_PASS_FACTOR + TAYLOR_ROUNDING_FACTOR * self.lowered) * self.pass_s

    def focused_s(self, k: int) -> float:
        """A sweep of ``k`` layers (the interpolation costs nothing)."""
        return k * self.layer_s

    def affordable(self, seconds: float) -> int:
        """How many layers a sweep can measure in ``seconds`` (at most all of them)."""
        if self.layer_s <= 0:
            return self.layers
        return max(0, min(self.layers, math.floor(seconds / self.layer_s)))


@dataclass(frozen=True)
class SensitivityPlan:
    """The method chosen for one sensitivity table, and why.

    Attributes:
        requested: what was asked (:data:`METHODS`).
        method: what runs: ``sweep``, ``focused`` or ``taylor``.
        costs: the predictions it was chosen from.
        measured: layers to sweep (all for ``sweep``, none for ``taylor``); a budgeted sweep
            measures more or fewer if the passes run faster or slower than predicted.
        budget_s: the time budget; None without one.
        left_s: what was left of it when planning (after the fp32 warm-up and the reference
            pass); None without a budget.
        predicted_s: the chosen method's predicted seconds.
    """

    requested: str
    method: str
    costs: Costs
    measured: int
    budget_s: float | None
    left_s: float | None
    predicted_s: float

    def describe(self) -> str:
        """One line: the method, how much of it, and why."""
        c = self.costs
        if self.method == "sweep":
            what = f"sweep of all {c.layers} layers x {c.lowered} precisions"
        elif self.method == "taylor":
            what = "Taylor estimate (one pass)"
        else:
            what = (
                f"focused sweep of {self.measured} of {c.layers} layers spread over the roles "
                "and the depth, the rest interpolated"
            )
        why = f"predicted {_seconds(self.predicted_s)}"
        if self.requested == "auto" and self.method != "sweep":
            why += f"; a full sweep would take ~{_seconds(c.sweep_s)}"
        if self.left_s is not None and self.budget_s is not None:
            left = _seconds(max(self.left_s, 0.0))
            why += f"; {left} of the {_seconds(self.budget_s)} budget left"
        if self.requested != "auto":
            why += f"; asked for {self.requested}"
        return f"{what} ({why})"


def warm_up_steps(steps: int, step_s: float, budget_s: float, attempts: int) -> int:
    """``steps`` fp32 warm-up steps, or fewer (at least one) so that ``attempts`` runs of them
    (the learning-rate back-off's worst case) at ``step_s`` each fit :data:`WARM_UP_SHARE` of
    ``budget_s``.

    Example:
        >>> warm_up_steps(30, 0.4, 40.0, attempts=4), warm_up_steps(30, 0.01, 40.0, attempts=4)
        (10, 30)
    """
    if steps <= 0 or step_s <= 0:
        return steps
    return max(1, min(steps, math.floor(WARM_UP_SHARE * budget_s / (attempts * step_s))))


def _seconds(s: float) -> str:
    return f"{s:.0f} s" if s >= 10 else f"{s:.2g} s"


def plan(
    requested: str, costs: Costs, left_s: float | None, budget_s: float | None
) -> SensitivityPlan:
    """Choose the method for ``requested`` (:data:`METHODS`) with ``left_s`` seconds left.

    ``sweep`` and ``taylor`` are taken as asked. ``focused`` measures as many layers as fit
    (at least :data:`FOCUSED_MIN_LAYERS`). ``auto`` sweeps if the whole sweep fits, else
    focuses if :data:`FOCUSED_MIN_LAYERS` layers fit, else estimates. Without a budget
    (``left_s`` None), ``auto`` and ``focused`` sweep everything.
    """
    check_method(requested)
    if requested in ("sweep", "taylor"):
        method = requested
        measured = costs.layers if requested == "sweep" else 0
    elif left_s is None or (requested == "auto" and costs.sweep_s <= left_s):
        method, measured = "sweep", costs.layers
    else:
        measured = costs.affordable(left_s)
        if requested == "focused":
            measured = min(max(measured, FOCUSED_MIN_LAYERS), costs.layers)
        elif measured < FOCUSED_MIN_LAYERS:
            measured = 0
        method = "taylor" if measured == 0 else "focused"
    predicted = {
        "sweep": costs.sweep_s,
        "taylor": costs.taylor_s,
        "focused": costs.focused_s(measured),
    }[method]
    return SensitivityPlan(requested, method, costs, measured, budget_s, left_s, predicted)


def role(name: str) -> str:
    """A layer's role in the model's repeated blocks: its name with each run of digits as
    ``#`` (``blocks.3.mlp.fc1`` and ``blocks.7.mlp.fc2`` are both ``blocks.#.mlp.fc#``)."""
    return re.sub(r"\d+", "#", name)


def _spread(indexes: Sequence[int]) -> list[int]:
    """``indexes`` reordered: the first, the last, then always the middle of the widest gap
    left (the earliest of equal ones), so that every prefix covers them evenly."""
    if len(indexes) <= 2:
        return list(indexes)
    order, gaps = [0, len(indexes) - 1], [(0, len(indexes) - 1)]
    while gaps:
        gaps.sort(key=lambda gap: (gap[0] - gap[1], gap[0]))
        low, high = gaps.pop(0)
        if high - low >= 2:
            middle = (low + high) // 2
            order.append(middle)
            gaps += [(low, middle), (middle, high)]
    return [indexes[i] for i in order]


def priority(names: Sequence[str], params: Sequence[int]) -> list[int]:
    """Layer indexes (execution order) in the order a focused sweep measures them.

    Layers are grouped by :func:`role`; the roles are taken in turn and each role's layers
    spread over its depth (first, last, middle, ...), so that every prefix covers each role
    evenly for :func:`fill` to interpolate. The layers alone in their role come first (the
    stem, the embedding, the output head: :func:`fill` has no layer of their kind to
    interpolate them from, and they are the layers the hand rules single out), then the
    repeated roles, those with the most parameters first.

    Example:
        >>> names = ["embed", "b.0.attn", "b.0.mlp", "b.1.attn", "b.1.mlp", "b.2.attn", "b.2.mlp"]
        >>> priority([*names, "head"], [4, 2, 8, 2, 8, 2, 8, 1])
        [0, 7, 2, 1, 6, 5, 4, 3]
    """
    groups: dict[str, list[int]] = {}
    for i, name in enumerate(names):
        groups.setdefault(role(name), []).append(i)
    ranked = sorted(groups.values(), key=lambda g: (len(g) > 1, -sum(params[i] for i in g), g[0]))
    queues = [_spread(g) for g in ranked]
    order: list[int] = []
    while len(order) < len(names):
        order += [queue.pop(0) for queue in queues if queue]
    return order


def fill(swept: Mapping[int, Row], names: Sequence[str]) -> list[Row]:
    """Every layer's row: the swept ones as measured, the others interpolated over depth.

    A layer that was not swept gets, per precision, the linear interpolation (by execution
    index) of the gradient distances (in log space) and of the loss changes of the nearest
    swept layers of its :func:`role` before and after it (of any role when none of its own was
    swept); beyond the first or the last of them, that layer's values. Non-finite swept values
    are left out of the interpolation. On resnet18 and a ViT-tiny this ranks the layers against
    the full sweep far better than the Taylor estimate does (docs/benchmarks.md, "Sensitivity
    analysis").

    Args:
        swept: ``{layer index: (loss deltas, cosines)}`` of the measured layers (at least one).
        names: every layer of the table, in execution order.

    Raises:
        ValueError: no swept layer to interpolate from.
    """
    if not swept:
        raise ValueError("fill needs at least one swept layer")
    known = sorted(swept)
    columns = len(swept[known[0]][0])
    rows = []
    for i, name in enumerate(names):
        if i in swept:
            rows.append(swept[i])
            continue
        kin = [k for k in known if role(names[k]) == role(name)] or known
        changes, cosines = [], []
        for j in range(columns):
            changes.append(_between(i, [(k, swept[k][0][j]) for k in kin], log=False))
            distance = _between(i, [(k, 1.0 - swept[k][1][j]) for k in kin], log=True)
            cosines.append(1.0 - distance)
        rows.append((tuple(changes), tuple(cosines)))
    return rows


def _between(i: int, points: Sequence[tuple[int, float]], log: bool) -> float:
    """The value at ``i`` interpolated linearly between the nearest finite ``points``
    (``(index, value)``, sorted), in log space (of values floored at 1e-16) if ``log``."""
    usable = [(k, v) for k, v in points if math.isfinite(v)]
    if not usable:
        return points[0][1]
    if log:
        usable = [(k, math.log(max(v, _FLOOR))) for k, v in usable]
    before = [(k, v) for k, v in usable if k < i]
    after = [(k, v) for k, v in usable if k > i]
    if before and after:
        (k0, v0), (k1, v1) = before[-1], after[0]
        value = v0 + (v1 - v0) * (i - k0) / (k1 - k0)
    else:
        value = before[-1][1] if before else after[0][1]
    return math.exp(value) if log else value
