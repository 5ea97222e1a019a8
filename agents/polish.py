"""Coordinate ascent on the surrogate reward: a proposal that improves on a starting policy one
layer at a time.

PPO's own proposals on a model of many layers and choices are samples of a policy trained for a
few hundred surrogate episodes; the rules people write by hand (``agents/hand_rules.py``) are
good starting points a sampler rarely hits. :func:`polish` starts from the best of those
(ranked by the surrogate) and from the best proposal so far, and changes one layer's precision
at a time wherever the surrogate reward (the cost model's speed and memory, the surrogate's
loss) rises, in passes over the layers, until a pass changes nothing. Milliseconds per
evaluation: a few hundred evaluations per start. Deterministic given the surrogate, so a
resumed search polishes as the interrupted one did.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from autoprec.agents.result import SURROGATE

if TYPE_CHECKING:
    from autoprec.agents.base import Problem, Session

__all__ = ["MAX_PASSES", "polish", "polish_starts", "polished"]

MAX_PASSES = 2  # passes over the layers per start


def polish(problem: Problem, start: Mapping[str, str], max_passes: int = MAX_PASSES) -> tuple:
    """``(policy, metrics, reward)``: ``start`` improved layer by layer on the surrogate.

    Each pass visits the layers in execution order and tries every other precision the layer
    may take, keeping a change when the surrogate reward rises.
    """
    layers = problem.layers()
    choices = {name: problem.choices(name) for name in layers}
    best = dict(problem.complete(start))
    metrics = problem.evaluate(best, SURROGATE)
    reward = problem.reward(metrics)
    for _ in range(max_passes):
        changed = False
        for name in layers:
            for precision in choices[name]:
                if precision == best[name]:
                    continue
                trial = {**best, name: precision}
                m = problem.evaluate(trial, SURROGATE)
                r = problem.reward(m)
                if r > reward:
                    best, metrics, reward, changed = trial, m, r, True
        if not changed:
            break
    return best, metrics, reward


def polish_starts(
    problem: Problem, baselines: Sequence[Mapping[str, str]], proposals: Sequence[Mapping[str, str]]
) -> list[dict[str, str]]:
    """The starting points: the baseline with the best surrogate reward and the best of
    ``proposals`` (already ranked best first), without repeats."""
    starts: list[dict[str, str]] = []
    if baselines:
        rewards = [problem.reward(problem.evaluate(b, SURROGATE)) for b in baselines]
        starts.append(dict(baselines[max(range(len(baselines)), key=rewards.__getitem__)]))
    if proposals and dict(proposals[0]) not in starts:
        starts.append(dict(proposals[0]))
    return starts


def polished(
    session: Session, proposals: Sequence[tuple[float, Mapping[str, str]]]
) -> list[tuple[dict, Any]]:
    """``(policy, surrogate metrics)`` of the polished starts (:func:`polish_starts`) for a
    search ``session``: its baselines, hand rules included, and its best proposal
    (``proposals``: ``(surrogate reward, policy)``)."""
    from autoprec.agents.simple import baseline_policies

    baselines = [policy for _, policy in baseline_policies(session)]
    ranked = [policy for _, policy in sorted(proposals, key=lambda item: -item[0])]
    out = []
    for start in polish_starts(session.problem, baselines, ranked):
        policy, metrics, _ = polish(session.problem, start)
        out.append((policy, metrics))
    return out
