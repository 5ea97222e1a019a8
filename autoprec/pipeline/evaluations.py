"""The real evaluations of a search beside the agent's: where they run, the comparisons every
search prints (the target's AMP, the hand-written rules), and, where the target is this
machine's device, the finalists timed as whole steps (:func:`measured_finalists`).

On a CPU the evaluations run side by side in worker processes (``workers``;
:mod:`autoprec.evaluate.pool`): AMP and the hand rules start while the sensitivities are
measured, so that their results are there when the search ends, and the agent hands its
proposals to the workers as it makes them.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from contextlib import AbstractContextManager

    from autoprec.agents import Problem
    from autoprec.agents.result import SearchResult
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


FINALISTS = 3  # the searched policies timed as whole steps, the best by reward first


def measured_finalists(
    problem: Problem,
    result: SearchResult,
    amp: Metrics,
    rules: list[tuple[str, Metrics, float]],
) -> tuple[SearchResult, Metrics, list[tuple[str, Metrics, float]], dict[str, Any]]:
    """Time the finalists as whole steps of the program production runs, on the target (this
    machine's device), and price them by those timings: fp32 (every ratio's base), the
    target's AMP, every hand rule and the :data:`FINALISTS` best distinct searched policies
    (by the per-layer table's reward). The search's choice becomes the finalist with the best
    reward so measured (``result.chosen``); a finalist that cannot run is infeasible.

    Returns:
        The result with the finalists' trials repriced and ``chosen`` set, AMP's and the hand
        rules' metrics repriced, and what was measured (for the export's provenance).
    """
    from autoprec.agents.hand_rules import hand_rule_policies
    from autoprec.agents.result import Trial
    from autoprec.evaluate.costing import cost_fields
    from autoprec.hardware.defaults import amp_policy
    from autoprec.policy import PrecisionPolicy

    evaluator = problem.evaluator
    finalists: list[Trial] = []
    for trial in sorted(result.real_trials, key=lambda t: -t.reward):
        if len(finalists) == FINALISTS:
            break
        if trial.metrics.diverged or any(t.policy == trial.policy for t in finalists):
            continue
        finalists.append(trial)
    rule_maps = dict(hand_rule_policies(problem))
    policies = [PrecisionPolicy.uniform("fp32"), amp_policy(evaluator.device)]
    policies += [problem.to_policy(rule_maps[name]) for name, _, _ in rules]
    policies += [problem.to_policy(t.policy) for t in finalists]
    timings = evaluator.time_steps(policies)
    fp32_t, amp_t, rest = timings[0], timings[1], timings[2:]
    model_fp32_memory = evaluator.costs.fp32[1]
    fp32 = (fp32_t.step_s, fp32_t.memory_bytes or model_fp32_memory)
    amp_cost = (amp_t.step_s, amp_t.memory_bytes or amp.memory_bytes)

    def priced(metrics: Metrics, timing: Any) -> Metrics:
        if not timing.ok:
            return dataclasses.replace(metrics, feasible=False)
        memory = timing.memory_bytes or metrics.memory_bytes
        fields = cost_fields(timing.step_s, memory, fp32, amp_cost)
        return dataclasses.replace(metrics, **fields, source="measured")

    amp = priced(amp, amp_t)
    rules = [
        (name, m := priced(metrics, t), problem.reward(m))
        for (name, metrics, _), t in zip(rules, rest[: len(rules)], strict=True)
    ]
    trials = list(result.trials)
    for trial, timing in zip(finalists, rest[len(rules) :], strict=True):
        metrics = priced(trial.metrics, timing)
        attrs = {**trial.attrs, "measured": "whole step"}
        trials[trial.number] = dataclasses.replace(
            trial, metrics=metrics, reward=problem.reward(metrics), attrs=attrs
        )
    chosen = max((trials[t.number] for t in finalists), key=lambda t: t.reward, default=None)
    result = dataclasses.replace(
        result, trials=trials, chosen=None if chosen is None else chosen.number
    )
    costs = evaluator.costs
    info = {
        "measured_on": costs.store.software.get("device"),
        "measured_device": evaluator.device.name,
        "measured_execution": costs.execution,
        "measured_memory_format": costs.memory_format,
        **{f"measured_{k}": costs.store.software.get(k) for k in ("torch", "torchao", "cuda")},
        "measured_layers": len(costs.layers.sites),
        "measured_finalists": len(finalists),
        "measured_fp32_step_s": fp32_t.step_s,
        "measured_amp_step_s": amp_t.step_s,
    }
    return result, amp, rules, {k: v for k, v in info.items() if v is not None}
