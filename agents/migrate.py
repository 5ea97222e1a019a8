"""Progressive migration of a model's training to a lower precision, validated step by step.

Three stages, each step one real evaluation (:meth:`autoprec.evaluate.Evaluator.evaluate`,
cached, so running a migration again is cheap):

1. ``"model"``: every tunable layer at the low precision (normalisation stays fp32, as the
   runtime keeps it). Within the tolerance (not diverged, feasible, ``loss_delta <=
   tolerance``): done, the model migrated without intervention.
2. ``"blocks"``: from fp32, the blocks of :func:`layer_blocks` are lowered one at a time, the
   least sensitive first; a block stays low when the policy stays within the tolerance, else it
   is reverted.
3. ``"layers"``: inside each reverted block of more than one layer, its layers are lowered one
   at a time (least sensitive first) the same way. A reverted one-layer block is not tried
   again: it was its own step.

The sensitivity of a layer comes from the evaluator's surrogate table
(``evaluator.surrogate().table``) at the low precision: the gradient distance (``1 -
grad_cosine``, the table's primary score), ties broken by ``|loss_delta|`` (the greedy agent's
score); a block's is the sum over its layers.

Example:
    >>> from autoprec.data import load_dataset_for
    >>> from autoprec.evaluate import Evaluator
    >>> from autoprec.models import load_model
    >>> spec = load_model("tinycnn", num_classes=10)
    >>> evaluator = Evaluator(spec, load_dataset_for(spec, "digits"), target="h100-sxm")
    >>> result = migrate(evaluator, "bf16", tolerance=0.05)  # doctest: +SKIP
    >>> result.migrated_without_intervention, result.lowered_share  # doctest: +SKIP
    (True, 1.0)
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from autoprec.agents.export import export_policy, layer_policy, loss_scaling_for, policy_metrics
from autoprec.agents.simple import layer_sensitivity
from autoprec.evaluate.reward import DEFAULT_TOLERANCE
from autoprec.policy import PrecisionPolicy, TargetInfo
from autoprec.precision import Precision, parse_precision

if TYPE_CHECKING:  # pragma: no cover
    from autoprec.evaluate import Evaluator, Metrics
    from autoprec.hardware import DeviceSpec
    from autoprec.sensitivities import SensitivityTable

STAGES = ("model", "blocks", "layers")
#: The :class:`~autoprec.evaluate.Metrics` fields a :class:`MigrationStep` carries as its own.
STEP_METRICS = ("loss_delta", "accuracy_delta", "speedup", "memory_ratio", "diverged", "feasible")
PLAN_VERSION = 1
__all__ = ["MigrationError", "check_precision", "layer_blocks", "layer_sensitivity", "migrate"]


class MigrationError(ValueError):
    """A migration cannot run as asked (precision, tolerance, fidelity, model)."""


@dataclass(frozen=True)
class MigrationStep:
    """One evaluated step of a migration.

    Attributes:
        number: position in the migration, from 1.
        stage: ``"model"``, ``"blocks"`` or ``"layers"``.
        item: what was tried: ``"model"``, a block name or a layer name.
        layers: the layers this step lowered (on top of those kept before).
        precision: the low precision.
        loss_delta, accuracy_delta, speedup, memory_ratio: of the policy tried.
        diverged: the run diverged (its loss delta is then the evaluator's penalty).
        feasible: the target runs the policy (and it fitted in memory).
        accepted: the layers stayed low: within the tolerance and paying (faster than before
            the step, or as fast with less memory); False: reverted.
        pays: the step was faster (or as fast and smaller) than the assignment before it.
        metrics: the evaluator's full :class:`~autoprec.evaluate.Metrics`.
    """

    number: int
    stage: str
    item: str
    layers: tuple[str, ...]
    precision: str
    loss_delta: float
    accuracy_delta: float
    speedup: float
    memory_ratio: float
    diverged: bool
    feasible: bool
    accepted: bool
    pays: bool
    metrics: Metrics = field(repr=False, compare=False)

    def to_dict(self) -> dict[str, Any]:
        """Plain data for the plan file (the full metrics left out)."""
        return {
            "number": self.number,
            "stage": self.stage,
            "item": self.item,
            "layers": list(self.layers),
            "precision": self.precision,
            "loss_delta": float(self.loss_delta),
            "accuracy_delta": float(self.accuracy_delta),
            "speedup": float(self.speedup),
            "memory_ratio": float(self.memory_ratio),
            "diverged": bool(self.diverged),
            "feasible": bool(self.feasible),
            "accepted": bool(self.accepted),
            "pays": bool(self.pays),
        }


@dataclass(frozen=True)
class MigrationResult:
    """What a migration did and the policy it ends with.

    Attributes:
        policy: the final policy (model info, target, loss scaling, metrics, provenance); the
            uniform low precision when the whole model migrated, else default fp32 with every
            tunable layer named.
        precision: the low precision.
        tolerance: the largest ``loss_delta`` accepted.
        steps: every step in order.
        blocks: ``{block: [layers]}`` as the blocks stage groups them (in execution order).
        migrated_without_intervention: the whole model at the low precision was accepted.
        lowered: the layers at the low precision in the final policy, in execution order.
        total_layers: the model's tunable layers.
        metrics: the final policy's metrics (the fp32 reference's when nothing was lowered).
        wall_time_s: seconds the migration took (cache hits make this small).
    """

    policy: PrecisionPolicy
    precision: str
    tolerance: float
    steps: list[MigrationStep]
    blocks: dict[str, list[str]]
    migrated_without_intervention: bool
    lowered: list[str]
    total_layers: int
    metrics: Metrics = field(repr=False)
    wall_time_s: float = 0.0

    @property
    def lowered_share(self) -> float:
        """Share of the tunable layers at the low precision (0 to 1)."""
        return len(self.lowered) / max(self.total_layers, 1)

    def to_plan(self) -> dict[str, Any]:
        """The plan file's content: settings, outcome, blocks and steps as plain data."""
        model = self.policy.model
        target = self.policy.target
        return {
            "autoprec_migration": PLAN_VERSION,
            "model": None if model is None else model.name,
            "target": None if target is None else target.device,
            "precision": self.precision,
            "accuracy_tolerance": float(self.tolerance),
            "migrated_without_intervention": self.migrated_without_intervention,
            "lowered_layers": len(self.lowered),
            "total_layers": self.total_layers,
            "lowered_share": self.lowered_share,
            "metrics": policy_metrics(self.metrics),
            "wall_time_s": self.wall_time_s,
            "blocks": {name: list(layers) for name, layers in self.blocks.items()},
            "steps": [step.to_dict() for step in self.steps],
        }


def check_precision(
    device: DeviceSpec | str, precision: str | Precision | None = None
) -> Precision:
    """The low precision a migration to ``device`` uses, checked.

    Args:
        device: a :class:`~autoprec.hardware.DeviceSpec` or a name from the database.
        precision: a precision name; None means the device's ``preferred.low``.

    Raises:
        ValueError: an unknown device or precision; :class:`MigrationError` when the device
            cannot run it or it is fp32 (nothing to lower).
    """
    from autoprec.hardware import get_device

    spec = get_device(device)
    low = parse_precision(spec.preferred.low if precision is None else precision)
    if low is Precision.FP32:
        raise MigrationError(
            "precision fp32 leaves nothing to migrate; choose a lower one such as "
            f"{spec.preferred.low}"
        )
    if not spec.supports(low):
        runs = [p for p in spec.supported_precisions if p != Precision.FP32.value]
        raise MigrationError(
            f"{spec.name} cannot run {low.value} (it supports "
            f"{', '.join(spec.supported_precisions)}); choose one of {', '.join(runs)} "
            "or another target"
        )
    return low


def layer_blocks(layers: Sequence[str]) -> dict[str, list[str]]:
    """Group tunable layers (in execution order) into blocks by module-name prefix.

    The first and the last layer are blocks of their own. The others are grouped by the first
    component of their name (``layer1.0.conv1`` -> ``layer1``); a group holding more than half
    of all the layers is split by the next component, and so on (``features.3.conv.0.0`` ->
    ``features.3`` in torchvision's VGG and MobileNet, ``layers.0.linear1`` -> ``layers.0``).
    A flat model gets one block per layer.

    Args:
        layers: tunable layer names, in execution order.

    Returns:
        ``{block name: [layer names]}``, blocks in the order of their first layer.

    Example:
        >>> layer_blocks(["conv1", "layer1.0.conv1", "layer1.1.conv1", "fc"])
        {'conv1': ['conv1'], 'layer1': ['layer1.0.conv1', 'layer1.1.conv1'], 'fc': ['fc']}
    """
    names = list(layers)
    if len(names) != len(set(names)):
        raise ValueError("layer names must be unique")
    if len(names) <= 2:
        return {name: [name] for name in names}
    middle = names[1:-1]
    groups = [(names[0], [names[0]])]
    groups += _split(middle, 0, len(names))
    groups.append((names[-1], [names[-1]]))
    out: dict[str, list[str]] = {}
    for key, members in groups:
        unique, n = key, 1
        while unique in out:  # a block named like a layer that is its own block
            n += 1
            unique = f"{key}#{n}"
        out[unique] = members
    return out


def _split(names: list[str], depth: int, total: int) -> list[tuple[str, list[str]]]:
    """Group ``names`` by their first ``depth + 1`` name components; split again the groups
    holding more than half of the model's ``total`` layers."""
    groups: dict[str, list[str]] = {}
    for name in names:
        groups.setdefault(".".join(name.split(".")[: depth + 1]), []).append(name)
    out: list[tuple[str, list[str]]] = []
    for key, members in groups.items():
        deeper = any(len(m.split(".")) > depth + 1 for m in members)
        if len(members) > 1 and 2 * len(members) > total and deeper:
            out += _split(members, depth + 1, total)
        else:
            out.append((key, members))
    return out


def _block_sensitivity(
    table: SensitivityTable, layers: Sequence[str], precision: str | Precision
) -> tuple[float, float]:
    scores = [layer_sensitivity(table, name, precision) for name in layers]
    return (sum(s[0] for s in scores), sum(s[1] for s in scores))


def migrate(
    evaluator: Evaluator,
    precision: str | Precision | None = None,
    tolerance: float = DEFAULT_TOLERANCE,
    *,
    fidelity: str | None = None,
    on_step: Callable[[MigrationStep], None] | None = None,
) -> MigrationResult:
    """Migrate the evaluator's model to ``precision`` as far as ``tolerance`` allows.

    Args:
        evaluator: the :class:`~autoprec.evaluate.Evaluator` of the model, data and target.
        precision: the low precision; None means the target's ``preferred.low``.
        tolerance: the largest relative training-loss increase over fp32 (``loss_delta``)
            accepted.
        fidelity: ``"short"`` or ``"full"``; None: the evaluator's (unless that is the
            surrogate, then ``"short"``).
        on_step: called with each :class:`MigrationStep` as soon as it is evaluated.

    Returns:
        The :class:`MigrationResult`.

    Raises:
        MigrationError: the target cannot run ``precision``, it is fp32, a negative tolerance,
            or the surrogate fidelity.
        NoTunableLayerError: a model without tunable layers.
    """
    from autoprec.layers import NoTunableLayerError, tunable_layers

    start = time.perf_counter()
    low = check_precision(evaluator.device, precision)
    if not (isinstance(tolerance, (int, float)) and tolerance >= 0):
        raise MigrationError(f"the tolerance must be a number >= 0, got {tolerance!r}")
    fid = fidelity or (evaluator.fidelity if evaluator.fidelity != "surrogate" else "short")
    if fid not in ("short", "full"):
        raise MigrationError(f"fidelity must be 'short' or 'full', got {fid!r}")
    layers = [name for name, _ in tunable_layers(evaluator.spec.module)]
    if not layers:
        raise NoTunableLayerError.of(evaluator.spec.name)
    run = _Migration(evaluator, low, float(tolerance), fid, layers, on_step)
    if low.is_block and hasattr(evaluator, "grade"):  # no default column stands in for it
        evaluator.grade([low.value])
    # only the layers the target runs at `low` (no fp8 convolution natively): the others
    # stay fp32 and are not tried
    unrunnable = getattr(evaluator, "unrunnable", lambda precisions: {})
    movable = [name for name in layers if not unrunnable({name: low})]
    if not movable:
        raise MigrationError(
            f"no layer of {evaluator.spec.name!r} runs at {low.value} natively on "
            f"{evaluator.device.name}; choose another precision"
        )
    blocks = layer_blocks(movable)
    layers = movable
    whole = run.attempt("model", "model", layers)
    if not whole.accepted:
        run.reset()
        table = evaluator.surrogate().table
        order = sorted(blocks, key=lambda b: _block_sensitivity(table, blocks[b], low))
        reverted = [b for b in order if not run.attempt("blocks", b, blocks[b]).accepted]
        for block in reverted:
            members = blocks[block]
            if len(members) < 2:
                continue  # its block step already tried exactly this layer
            for name in sorted(members, key=lambda n: layer_sensitivity(table, n, low)):
                run.attempt("layers", name, [name])
    everything = whole.accepted and len(movable) == len(run.layers)
    return run.result(blocks, everything, time.perf_counter() - start)


@dataclass
class _Migration:
    """The state of one migration: the current assignment, its metrics, the steps so far."""

    evaluator: Evaluator
    low: Precision
    tolerance: float
    fidelity: str
    layers: list[str]
    on_step: Callable[[MigrationStep], None] | None
    steps: list[MigrationStep] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.current = dict.fromkeys(self.layers, Precision.FP32.value)
        self.metrics: Metrics = self.evaluator.reference(self.fidelity)

    def reset(self) -> None:
        """Back to uniform fp32 (the reference)."""
        self.current = dict.fromkeys(self.layers, Precision.FP32.value)
        self.metrics = self.evaluator.reference(self.fidelity)

    def attempt(self, stage: str, item: str, lowered: Sequence[str]) -> MigrationStep:
        """Evaluate the current assignment with ``lowered`` at the low precision; keep it if
        it is within the tolerance."""
        trial = {**self.current, **dict.fromkeys(lowered, self.low.value)}
        m = self.evaluator.evaluate(layer_policy(trial), self.fidelity)
        # kept only within the tolerance and where lowering pays: faster, or as fast and
        # smaller (on small layers the casts can cost more than the narrower matmul saves)
        pays = m.speedup > self.metrics.speedup or (
            m.speedup >= self.metrics.speedup and m.memory_ratio < self.metrics.memory_ratio
        )
        within = math.isfinite(m.loss_delta) and m.loss_delta <= self.tolerance
        accepted = bool(not m.diverged and m.feasible and within and pays)
        step = MigrationStep(
            number=len(self.steps) + 1,
            stage=stage,
            item=item,
            layers=tuple(lowered),
            precision=self.low.value,
            **{name: getattr(m, name) for name in STEP_METRICS},
            accepted=accepted,
            pays=pays,
            metrics=m,
        )
        if accepted:
            self.current, self.metrics = trial, m
        self.steps.append(step)
        if self.on_step is not None:
            self.on_step(step)
        return step

    def result(self, blocks: dict[str, list[str]], whole: bool, wall: float) -> MigrationResult:
        metrics = self.metrics
        lowered = [n for n in self.layers if self.current[n] == self.low.value]
        if len(lowered) == len(self.layers):
            base = PrecisionPolicy.uniform(self.low, loss_scaling=loss_scaling_for(self.current))
        else:
            base = layer_policy(self.current)
        policy = export_policy(
            base,
            self.evaluator.spec,
            target=TargetInfo(device=self.evaluator.device.name, mode="auto"),
            metrics=policy_metrics(metrics),
            provenance={
                "agent": "migrate",
                "precision": self.low.value,
                "accuracy_tolerance": str(self.tolerance),
                "fidelity": self.fidelity,
                "steps": str(len(self.steps)),
                "migrated_without_intervention": str(whole).lower(),
            },
        )
        return MigrationResult(
            policy=policy,
            precision=self.low.value,
            tolerance=self.tolerance,
            steps=list(self.steps),
            blocks=blocks,
            migrated_without_intervention=whole,
            lowered=lowered,
            total_layers=len(self.layers),
            metrics=metrics,
            wall_time_s=wall,
        )
