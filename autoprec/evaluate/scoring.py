"""From a run (or a prediction) to :class:`Metrics`: deltas against the fp32 reference, the
divergence penalties, the cost ratios.

A run diverged when it says so (a non-finite loss, an exception, out of memory), when its loss
is not finite, or when its final loss is above :data:`DIVERGENCE_FACTOR` times fp32's. Its
metrics stay finite but are penalised: ``accuracy = 0``, ``loss`` and ``val_loss`` at ``1 +``
:data:`PENALTY_LOSS_DELTA` times fp32's, so that ``loss_delta`` ranks it below any run that did
not diverge (those have at most :data:`PENALTY_LOSS_DELTA` ``- 1``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from autoprec.evaluate.costing import cost_fields
from autoprec.evaluate.finetune import FineTuneRun
from autoprec.evaluate.metrics import Metrics

DIVERGENCE_FACTOR = 10.0  # a final loss above this many times fp32's counts as diverged
PENALTY_LOSS_DELTA = 10.0  # loss_delta of a diverged run
PREDICTED_LOSS_DELTA_FLOOR = -0.99  # a prediction never promises more than this


def relative_loss_delta(loss: float, reference: float) -> float:
    """``loss`` relative to ``reference`` minus 1: the ``loss_delta`` of every comparison with
    fp32 (the evaluator's, ``autoprec verify``'s)."""
    return (loss - reference) / max(reference, 1e-12)


class ReferenceDivergedError(ValueError):
    """The fp32 reference run diverged, so there is nothing to measure policies against."""


@dataclass(frozen=True)
class Baseline:
    """The fp32 reference's quality and cost: what every delta and ratio is against."""

    loss: float
    val_loss: float
    accuracy: float
    step_time_s: float
    memory_bytes: int

    @classmethod
    def of_metrics(cls, reference: Metrics) -> Baseline:
        """The baseline of the reference's metrics."""
        return cls(
            reference.loss,
            reference.val_loss,
            reference.accuracy,
            reference.step_time_s,
            reference.memory_bytes,
        )

    @classmethod
    def of_reference_run(cls, run: FineTuneRun, cost: tuple[float, int]) -> Baseline:
        """The baseline of the fp32 reference's own run (``cost``: its step time and memory).

        Raises:
            ReferenceDivergedError: the run diverged (nothing can be compared with it).
        """
        if run.diverged or not math.isfinite(run.loss):
            raise ReferenceDivergedError(
                "the fp32 reference run diverged; lower lr or check the model and data"
            )
        return cls(run.loss, run.val_loss, run.accuracy, *cost)


def score_run(
    run: FineTuneRun,
    baseline: Baseline,
    *,
    cost: tuple[float, int],
    amp: tuple[float, int],
    runnable: bool,
    measured: bool,
    fidelity: str,
    steps: int,
) -> Metrics:
    """The metrics of ``run`` (its step time and memory ``cost``) against ``baseline``.

    Args:
        amp: step time and memory of the target's blanket AMP policy.
        runnable: whether the target runs every layer of the policy.
        measured: whether the costs were measured (``source``).
    """
    ref_loss = baseline.loss
    diverged = (
        run.diverged or not math.isfinite(run.loss) or run.loss > DIVERGENCE_FACTOR * ref_loss
    )
    if diverged:
        loss = (1.0 + PENALTY_LOSS_DELTA) * ref_loss
        val_loss, accuracy = (1.0 + PENALTY_LOSS_DELTA) * baseline.val_loss, 0.0
    else:
        loss, val_loss, accuracy = run.loss, run.val_loss, run.accuracy
    loss_delta = PENALTY_LOSS_DELTA if diverged else relative_loss_delta(loss, ref_loss)
    return Metrics(
        accuracy=accuracy,
        loss=loss,
        val_loss=val_loss,
        fp32_accuracy=baseline.accuracy,
        fp32_loss=ref_loss,
        accuracy_delta=accuracy - baseline.accuracy,
        loss_delta=loss_delta,
        **cost_fields(*cost, (baseline.step_time_s, baseline.memory_bytes), amp),
        source="measured" if measured else "model",
        overflows=run.overflows,
        underflows=run.underflows,
        loss_scale=run.loss_scale,
        diverged=diverged,
        feasible=runnable and not run.out_of_memory,
        wall_time_s=run.wall_time_s,
        fidelity=fidelity,
        steps=steps,
    )


def predicted_metrics(
    predicted: float,
    reference: Metrics,
    *,
    cost: tuple[float, int],
    fp32: tuple[float, int],
    amp: tuple[float, int],
    runnable: bool,
    wall_time_s: float,
) -> Metrics:
    """The ``"surrogate"`` fidelity's metrics of a predicted ``loss_delta`` (clipped to
    [-0.99, :data:`PENALTY_LOSS_DELTA` - 1]; a non-finite prediction is the top) around the
    real ``reference``, with modelled costs (see :meth:`Evaluator.evaluate`)."""
    top = PENALTY_LOSS_DELTA - 1.0
    if not math.isfinite(predicted):
        predicted = top
    loss_delta = min(max(predicted, PREDICTED_LOSS_DELTA_FLOOR), top)
    return Metrics(
        accuracy=reference.accuracy,
        loss=reference.loss * (1.0 + loss_delta),
        val_loss=reference.val_loss * (1.0 + loss_delta),
        fp32_accuracy=reference.accuracy,
        fp32_loss=reference.loss,
        accuracy_delta=0.0,
        loss_delta=loss_delta,
        **cost_fields(*cost, fp32, amp),
        source="model",
        diverged=False,
        feasible=runnable,
        wall_time_s=wall_time_s,
        fidelity="surrogate",
        steps=0,
    )
