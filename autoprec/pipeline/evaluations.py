"""The real evaluations of a search beside the agent's: where they run, and the
comparisons every search prints (the target's AMP, the hand-written rules).

On a CPU the evaluations run side by side in worker processes (``workers``;
:mod:`autoprec.evaluate.pool`): AMP and the hand rules start while the sensitivities are
measured, so that their results are there when the search ends, and the agent hands its
proposals to the workers as it makes them.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from contextlib import AbstractContextManager

    from autoprec.agents import Problem
    from autoprec.evaluate import Evaluator, Metrics

AUTO_WORKERS = 2  # worker processes by default, on a machine of at least that many cores
MIN_REFERENCE_S = 5.0  # by default, workers only for models whose fp32 reference takes this long


def chosen_workers(asked: int | None, reference_wall_s: float) -> int:
    """``workers`` as asked, else :data:`AUTO_WORKERS` on a machine of that many cores or more
    for a model whose fp32 reference run took at least :data:`MIN_REFERENCE_S` seconds
    (``reference_wall_s``), else 0 (one at a time)."""
    if asked is not None:
        return asked
    if (os.cpu_count() or 1) < AUTO_WORKERS or reference_wall_s < MIN_REFERENCE_S:
        return 0
    return AUTO_WORKERS


def start_workers(evaluator: Evaluator, asked: int | None, echo: Callable[[str], None]) -> int:
    """Start the evaluator's worker processes as ``--workers`` says, saying so in one line;
    returns how many evaluations now run at a time (1 without workers)."""
    workers = chosen_workers(asked, evaluator.reference().wall_time_s)
    if workers < 2:
        return 1
    why_not = evaluator.start_workers(workers)
    if why_not is None:
        threads = evaluator.worker_threads
        echo(f"evaluating {workers} policies at a time, {threads} thread(s) each")
        return workers
    if asked is not None:
        echo(f"--workers {asked}: {why_not}")
    return 1


def prefetch_comparisons(problem: Problem) -> None:
    """Let the workers start on AMP and the hand rules now (evaluated when the search ends)."""
    from autoprec.agents.hand_rules import hand_rule_policies
    from autoprec.hardware.defaults import amp_policy

    policies = [amp_policy(problem.evaluator.device)]
    policies += [problem.to_policy(p) for _, p in hand_rule_policies(problem)]
    problem.evaluator.prefetch(policies, problem.fidelity)


def comparisons(
    problem: Problem, phase: Callable[[str], AbstractContextManager[None]]
) -> tuple[Metrics, list[tuple[str, Metrics, float]]]:
    """The real metrics of the target's blanket AMP policy, and ``(name, metrics, reward)`` of
    each hand-written rule that applies (:mod:`autoprec.agents.hand_rules`), for the
    comparison printed beside the searched policy; each is cached if the agent tried it. They
    run as ``phase("AMP comparison")`` and ``phase("hand rules")`` (which time them and say
    they are working while they run)."""
    from autoprec.agents.hand_rules import hand_rule_policies
    from autoprec.hardware.defaults import amp_policy

    with phase("AMP comparison"):
        amp = problem.evaluate(amp_policy(problem.evaluator.device))
    out = []
    rules = hand_rule_policies(problem)
    if rules:
        with phase("hand rules"):
            for name, policy in rules:
                metrics = problem.evaluate(policy)
                out.append((name, metrics, problem.reward(metrics)))
    return amp, out
