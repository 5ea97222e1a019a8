"""The agents without a learner: ``baseline``, ``random`` and ``greedy``."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from autoprec.agents.base import Agent, Session, nearest_allowed
from autoprec.agents.hand_rules import hand_rule_policies
from autoprec.precision import Precision, parse_precision

if TYPE_CHECKING:  # pragma: no cover
    from autoprec.sensitivities.grade import SensitivityTable


def baseline_policies(session: Session) -> list[tuple[str, dict[str, str]]]:
    """``(name, {layer: precision})`` of the rules a user gets without searching.

    Uniform fp32, blanket AMP at bf16 and at fp16 (each only where the target runs it and it
    is in the problem's precisions), the target's default rule
    (:func:`autoprec.hardware.default_policy`, its precisions fitted to the choices) and the
    low-precision rules people write by hand (:mod:`autoprec.agents.hand_rules`: torchao's auto
    filter per recipe, fp8 except the output head, Megatron's first and last blocks in bf16,
    all-NVFP4, torchtitan's NVFP4 with a bf16 tail, Megatron-Bridge's last 4 blocks in bf16,
    Megatron's first and last blocks in bf16 over NVFP4, DeepSeek-V3's fp8 block scaling with
    its keep-list, MXFP8 everywhere); a rule that repeats an earlier one is left out.
    """
    from autoprec.hardware.defaults import default_policy

    problem = session.problem
    layers = problem.layers()
    device = problem.evaluator.device
    out: list[tuple[str, dict[str, str]]] = [("fp32", dict.fromkeys(layers, "fp32"))]
    for low in ("bf16", "fp16"):
        if device.supports(low) and low in problem.precisions:
            out.append((f"amp-{low}", dict.fromkeys(layers, low)))
    rule = default_policy(problem.table, device).resolve(problem.evaluator.spec.module)
    out.append(("hardware-default", {n: rule.get(n, Precision.FP32).value for n in layers}))
    out.extend(hand_rule_policies(problem))
    unique: list[tuple[str, dict[str, str]]] = []
    seen: set[tuple[str, ...]] = set()
    for name, policy in out:
        full = problem.complete(policy)
        key = session.key(full)
        if key not in seen:
            seen.add(key)
            unique.append((name, full))
    return unique


class BaselineAgent(Agent):
    """Evaluates the baselines of :func:`baseline_policies`, in order, up to the budget."""

    name = "baseline"

    def run(self, session: Session) -> None:
        session.prefetch(policy for _, policy in baseline_policies(session))
        for name, policy in baseline_policies(session):
            if session.exhausted:
                return
            session.evaluate(policy, name=name)


class RandomAgent(Agent):
    """Uniform random precision per layer among the supported ones (numpy, seeded).

    Args:
        max_repeats: give up after this many proposals in a row that were already evaluated
            (the search space may be smaller than the budget).
    """

    name = "random"

    def __init__(
        self, max_repeats: int = 1000, *, resume: bool = False, name: str | None = None
    ) -> None:
        super().__init__(resume=resume, name=name)
        self.max_repeats = max_repeats

    def run(self, session: Session) -> None:
        import numpy as np

        rng = np.random.default_rng(session.seed)
        problem = session.problem
        layers = problem.layers()
        choices = {name: problem.choices(name) for name in layers}
        space = math.prod(len(c) for c in choices.values())
        repeats = 0
        while not session.exhausted and session.used < space and repeats < self.max_repeats:
            # the draws up to the budget first (a draw tried before is a repeat), handed to the
            # evaluator's workers at once, then evaluated in the order drawn
            drawn: dict[tuple[str, ...], dict[str, str]] = {}
            while (
                len(drawn) < session.remaining
                and session.used + len(drawn) < space
                and repeats < self.max_repeats
            ):
                policy = {n: choices[n][int(rng.integers(len(choices[n])))] for n in layers}
                key = session.key(problem.complete(policy))
                if key in drawn or session.seen(policy) is not None:
                    repeats += 1
                    continue
                drawn[key], repeats = policy, 0
            session.prefetch(drawn.values())
            for policy in drawn.values():
                session.evaluate(policy)


class GreedyAgent(Agent):
    """Progressive lowering in order of least sensitivity (also the migration tool).

    Starts from uniform fp32 (``start="fp32"``) or the target's default rule
    (``start="default"``) and evaluates it. Layers are then visited from the least to the most
    sensitive: the sensitivity of a layer is ``|loss_delta|`` at the narrowest allowed
    precision in the evaluator's surrogate sensitivity table (``evaluator.surrogate().table``,
    read by :func:`layer_sensitivity`).
    Each layer is lowered one precision at a time (e.g. fp32 -> tf32 -> bf16 -> fp16 -> fp8,
    among the allowed ones); a lowering is kept when the real evaluation neither diverges nor
    exceeds the accuracy tolerance and its reward beats the best so far. A lowering that only
    fails to raise the reward does not stop the walk down (a narrower format may pay off where
    the next one does not); one that breaks the tolerance does. Passes over the layers repeat
    while one changes something, until the budget is spent.

    Args:
        start: ``"fp32"`` or ``"default"``.
        max_passes: most passes over the layers.
    """

    name = "greedy"

    def __init__(
        self,
        start: str = "fp32",
        max_passes: int = 3,
        *,
        resume: bool = False,
        name: str | None = None,
    ) -> None:
        super().__init__(resume=resume, name=name)
        if start not in ("fp32", "default"):
            raise ValueError(f"start must be 'fp32' or 'default', got {start!r}")
        if max_passes < 1:
            raise ValueError(f"max_passes must be >= 1, got {max_passes!r}")
        self.start = start
        self.max_passes = max_passes

    def order(self, session: Session) -> list[str]:
        """Layers from the least to the most sensitive (ties: execution order)."""
        problem = session.problem
        layers = problem.layers()
        table = problem.evaluator.surrogate().table
        scores = {}
        for name in layers:
            allowed = problem.choices(name)
            lowest = min(allowed, key=lambda p: parse_precision(p).width)
            scores[name] = layer_sensitivity(table, name, lowest)[1]
        return sorted(layers, key=lambda n: scores[n])  # stable: ties keep execution order

    def run(self, session: Session) -> None:
        problem = session.problem
        if self.start == "default":
            current = dict(baseline_policies(session))["hardware-default"]
        else:
            current = problem.complete({})
        best = session.evaluate(current, step="start")
        order = self.order(session)
        for _ in range(self.max_passes):
            changed = False
            for name in order:
                narrower = _narrower(current[name], problem.choices(name))
                for precision in narrower:
                    if session.exhausted and session.seen({**current, name: precision}) is None:
                        return
                    trial = session.evaluate({**current, name: precision}, step=name)
                    m = trial.metrics
                    if m.diverged or not m.feasible or m.loss_delta > problem.reward.tolerance:
                        break
                    if trial.reward > best.reward:
                        best, current, changed = trial, dict(trial.policy), True
            if not changed:
                return


def _narrower(precision: str, allowed: list[str]) -> list[str]:
    """Allowed precisions narrower than ``precision``, the widest first."""
    width = parse_precision(precision).width
    lower = [p for p in allowed if parse_precision(p).width < width]
    return sorted(lower, key=lambda p: -parse_precision(p).width)


def layer_sensitivity(
    table: SensitivityTable, layer: str, precision: str | Precision
) -> tuple[float, float]:
    """``(gradient distance, |loss_delta|)`` of ``layer`` at ``precision`` in a sensitivity
    table (or at its nearest wider precision there); infinite when the table does not know the
    layer or a value is not finite."""
    entry = table.entry(layer, nearest_allowed(precision, list(table.precisions)))
    if entry is None:
        return (math.inf, math.inf)
    return (_magnitude(entry.grad_distance), _magnitude(entry.loss_delta))


def _magnitude(value: float) -> float:
    return abs(value) if math.isfinite(value) else math.inf
