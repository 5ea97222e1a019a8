"""The measured search's own phases: where the target is this machine's device.

Before the search, :func:`measure_layers` times the per-layer table (and fp32's whole step);
after it, :func:`time_finalists` times the finalists as whole steps of the program production
runs and reprices them, AMP and the hand rules by those timings, and :func:`keep_steps` adds
those steps to the device's measurement file, which ``autoprec hardware calibrate --from FILE``
fits the cost model to (:mod:`autoprec.evaluate.measured`, :mod:`autoprec.timing`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from autoprec.agents import Problem
    from autoprec.agents.result import SearchResult
    from autoprec.evaluate import Metrics
    from autoprec.pipeline.callbacks import SearchCallbacks
    from autoprec.pipeline.config import SearchConfig


def measure_layers(problem: Problem, tell: SearchCallbacks) -> None:
    """The per-layer table on this machine's device (the target), for every precision each
    layer may take, and fp32's whole step; said in one line."""
    evaluator = problem.evaluator
    choices = {name: problem.choices(name) for name in problem.layers()}
    with tell.stage_progress("per-layer timings") as (progress, _):
        taken = evaluator.measure_costs(choices, progress)
    costs = evaluator.costs
    stored = "measured now" if taken else "all stored from an earlier search"
    tell.line(
        f"measuring on this {costs.torch_device.type} ({costs.store.software['device']}): "
        f"{len(costs.layers.sites)} unique layers, {costs.execution}, "
        f"{costs.memory_format}; {taken} layer timings {stored}; fp32 step "
        f"{costs.fp32_step.step_s * 1e3:.2f} ms"
    )


FINALISTS = 3  # the searched policies timed as whole steps, the best by reward first


@dataclasses.dataclass
class Finalists:
    """What :func:`time_finalists` found.

    Attributes:
        result: the search's result, its finalists repriced and ``chosen`` set.
        amp: AMP's metrics, repriced.
        rules: ``(name, metrics, reward)`` of the hand rules, repriced.
        provenance: what was measured, for the export (``measured_*``).
        timed: ``(label, policy, timing)`` of every whole step timed (fp32 and AMP first).
    """

    result: SearchResult
    amp: Metrics
    rules: list[tuple[str, Metrics, float]]
    provenance: dict[str, Any]
    timed: list[tuple[str, Any, Any]]


def time_finalists(
    problem: Problem,
    result: SearchResult,
    amp: Metrics,
    rules: list[tuple[str, Metrics, float]],
) -> Finalists:
    """Time the finalists as whole steps of the program production runs, on the target (this
    machine's device), and price them by those timings: fp32 (every ratio's base), the
    target's AMP, every hand rule and the :data:`FINALISTS` best distinct searched policies
    (by the per-layer table's reward). The search's choice becomes the finalist with the best
    reward so measured (``result.chosen``); a finalist that cannot run is infeasible.

    Returns:
        :class:`Finalists`: unchanged but for the provenance when fp32 or AMP could not be
        timed (the table's ranking stands; ``measured_error`` says why).
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
    labels = ["fp32", "AMP", *(name for name, _, _ in rules)]
    labels += [f"searched (trial {t.number})" for t in finalists]
    timed = list(zip(labels, policies, timings, strict=True))
    fp32_t, amp_t, rest = timings[0], timings[1], timings[2:]
    if not (fp32_t.ok and amp_t.ok):  # nothing to price by: the table's ranking stands
        why = fp32_t.error or amp_t.error
        return Finalists(result, amp, rules, {"measured_finalists": 0, "measured_error": why}, [])
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
    provenance = {k: v for k, v in info.items() if v is not None}
    return Finalists(result, amp, rules, provenance, [t for t in timed if t[2].ok])


def finalists_line(m: dict[str, Any]) -> str:
    """What the finalists' whole steps said (``m``: :attr:`Finalists.provenance`), in one
    line."""
    if "measured_error" in m:
        why = m["measured_error"]
        return f"finalists not timed as whole steps ({why}): ranked by the table"
    return (
        f"finalists timed as whole steps on {m.get('measured_on', 'this device')} "
        f"({m['measured_execution']}): fp32 {m['measured_fp32_step_s'] * 1e3:.2f} ms, AMP "
        f"{m['measured_amp_step_s'] * 1e3:.2f} ms; {m['measured_finalists']} searched "
        "policies and every hand rule repriced by them"
    )


def keep_steps(
    problem: Problem,
    config: SearchConfig,
    timed: list[tuple[str, Any, Any]],
    echo: Callable[[str], None],
) -> None:
    """Add the finalists' whole steps to this device's measurement file (in the cache folder),
    which ``autoprec hardware calibrate --from FILE`` fits the cost model to; said in one line.
    A damaged file is started anew; one that cannot be written is a note, not an error."""
    from autoprec.cache import cache_dir, note_failed_write
    from autoprec.hardware.measurements import (
        CalibrationError,
        MeasuredStep,
        read_measurements,
        write_measurements,
    )

    if not timed:
        return
    evaluator, c = problem.evaluator, config
    shape = tuple(evaluator.cost_spec.input_shape)
    build: dict[str, Any] = {"num_classes": c.num_classes}
    if c.train_shape:
        build = {"shape": c.train_shape}
    elif len(shape) == 3:
        build["image_size"] = shape[-1]
    costs = evaluator.costs
    rows = [
        MeasuredStep(
            label=f"{c.model} / {label}",
            model=c.model,
            build=build,
            batch_size=c.train_batch_size,
            policy=policy,
            execution=timing.execution,
            step_s=timing.seconds,
            memory_format=timing.memory_format,
            optimizer=costs.optimizer,
            source=f"autoprec search, {costs.store.software}",
        )  # fmt: skip
        for label, policy, timing in timed
    ]
    path = cache_dir() / "timing" / f"{evaluator.device.name}-steps.json"
    kept: list[MeasuredStep] = []
    if path.exists():
        try:
            kept = read_measurements(path)[1]
        except CalibrationError:
            kept = []  # damaged: started anew
    try:
        write_measurements(path, evaluator.device.name, kept + rows, "autoprec search")
    except OSError as err:
        note_failed_write("measurement file", path, err)
        return
    echo(
        f"{len(rows)} whole steps added to {path} ({len(kept) + len(rows)} in all; "
        f"`autoprec hardware calibrate --from {path}` fits the cost model to them)"
    )
