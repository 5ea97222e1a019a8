"""Fine-tuning runs under a policy: from the warm start, on fixed batches, then scored.

A run is every replicate of one fidelity: each fine-tunes a fresh copy of the warm start on
batches of its own, with the policy applied, and is scored with the policy still applied (the
loss over the whole training split, loss and accuracy on the validation split). With
``config.score_examples`` set, the training split's loss of a policy is estimated from a subset
once the fp32 reference's run has measured the pass they share
(:mod:`autoprec.evaluate.split_estimate`). Step
time and peak memory are measured with CUDA events when the evaluator measures (the target is
this machine's GPU). The steps, the divergence rule (the first inf/NaN loss diverges a
fine-tune), the timing and the scoring are the one trainer's (:mod:`autoprec.training.trainer`); the
optimizer is the recipe's at the fine-tuning rate (:meth:`EvaluatorConfig.finetune_recipe`).
Nothing here raises for a bad policy: a non-finite loss, an exception in training or running out
of memory marks the run diverged.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import statistics
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from autoprec.evaluate.config import REPLICATE_SEED_STRIDE, EvaluatorConfig
from autoprec.evaluate.split_estimate import SplitEstimate
from autoprec.policy import PrecisionPolicy
from autoprec.runtime import LossScaler, apply_policy
from autoprec.training.trainer import SCORE_BATCH, Trainer, score_split

if TYPE_CHECKING:  # pragma: no cover
    from autoprec.data import DataBundle
    from autoprec.models import ModelSpec

__all__ = ["SCORE_BATCH", "FineTuneRun", "FineTuner"]

log = logging.getLogger(__name__)


@dataclass
class FineTuneRun:
    """What one fine-tuning run produced (before it is compared with the reference)."""

    loss: float = math.nan
    val_loss: float = math.nan
    accuracy: float = 0.0
    step_time_s: float | None = None  # measured runs only
    memory_bytes: int | None = None
    overflows: int = 0
    underflows: int = 0
    loss_scale: dict[str, Any] = dataclasses.field(default_factory=dict)
    diverged: bool = False
    out_of_memory: bool = False
    wall_time_s: float = 0.0
    split_estimate: SplitEstimate | None = None  # measured by the reference's run


class FineTuner:
    """Runs and scores the fine-tunes of one model on one dataset.

    Args:
        spec: a ModelSpec (``module``, ``loss``, ``logits``); its module is not changed.
        data: a DataBundle (``loader``, ``fixed_batches``).
        config: the evaluator's settings (steps, replicates, batch size, rate, seeds).
        measured: run on the local CUDA device and time it (else on the CPU, untimed).

    Attributes:
        estimates: ``{fidelity: SplitEstimate}``: how a policy's training-split loss is
            estimated at that fidelity (set by the evaluator from its reference's run; a
            fidelity without one scores every example).
    """

    def __init__(
        self, spec: ModelSpec, data: DataBundle, config: EvaluatorConfig, measured: bool
    ) -> None:
        self.spec = spec
        self.data = data
        self.config = config
        self.measured = measured
        self.device = torch.device("cuda") if measured else torch.device("cpu")
        self.estimates: dict[str, SplitEstimate] = {}

    def estimated(self) -> bool:
        """Whether the training split is scored through a subset: ``score_examples`` is set
        and the split is larger."""
        examples = self.config.score_examples
        return examples is not None and len(self.data.split("train")) > examples

    def run(
        self,
        policy: PrecisionPolicy,
        fidelity: str,
        state: dict[str, torch.Tensor],
        mode: str,
        started: float,
        lr_scale: float = 1.0,
        measure_split: bool = False,
    ) -> FineTuneRun:
        """Every replicate of ``fidelity`` from ``state`` in runtime ``mode``: losses and
        accuracy averaged, counts summed, step times pooled; one diverging replicate makes the
        run diverged. ``started`` (a ``perf_counter`` time) begins the run's wall time;
        ``lr_scale`` multiplies the fine-tuning rate (the warm start's back-off).
        ``measure_split`` (the fp32 reference's run, when :meth:`estimated`): the first
        replicate's weights take the pass over the whole split that later runs' estimates
        share (``run.split_estimate``; its loss is that replicate's)."""
        cfg, dev = self.config, self.device
        run = FineTuneRun()
        losses, val_losses, accuracies, times = [], [], [], []
        for replicate in range(cfg.replicates_by_fidelity[fidelity]):
            batch_seed = cfg.resolved_batch_seed + replicate * REPLICATE_SEED_STRIDE
            torch.manual_seed(batch_seed)
            model = copy.deepcopy(self.spec.module)
            model.load_state_dict(state)
            model.to(dev)
            batches = self.data.fixed_batches(
                cfg.steps_by_fidelity[fidelity], cfg.recipe.batch_size, seed=batch_seed
            )
            handle = None
            try:
                handle = apply_policy(model, policy, mode=mode)
                scaler = LossScaler.from_config(policy.loss_scaling, device=dev)
                opt = cfg.finetune_recipe(lr_scale).make_optimizer(model.parameters())
                trainer = Trainer(self.spec, model, opt, scaler, dev, timed=self.measured)
                times += self._fine_tune(trainer, batches, run)
                run.loss_scale = scaler.summary()
                if not run.diverged:
                    losses.append(self._train_loss(model, fidelity, run, measure_split))
                    measure_split = False  # the first replicate's weights only
                    val_loss, accuracy = self.score_split(model, "val")
                    val_losses.append(val_loss)
                    accuracies.append(accuracy)
                if self.measured and times:
                    run.memory_bytes = max(
                        run.memory_bytes or 0, int(torch.cuda.max_memory_allocated(dev))
                    )
            except torch.cuda.OutOfMemoryError:
                log.warning("out of memory evaluating policy %s", policy.digest())
                run.out_of_memory = run.diverged = True
            except Exception:  # noqa: BLE001 - a bad policy must not end a search
                log.exception("training failed for policy %s; counted as diverged", policy.digest())
                run.diverged = True
            finally:
                if handle is not None:
                    totals = handle.totals()
                    run.overflows += totals["overflows"]
                    run.underflows += totals["underflows"]
                    handle.remove()
            if run.diverged:
                break
        if not run.diverged and losses:
            run.loss = statistics.fmean(losses)
            run.val_loss = statistics.fmean(val_losses)
            run.accuracy = statistics.fmean(accuracies)
        if self.measured and times:
            run.step_time_s = statistics.median(times)
        run.wall_time_s = time.perf_counter() - started
        return run

    def _fine_tune(
        self,
        trainer: Trainer,
        batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
        run: FineTuneRun,
    ) -> list[float]:
        """The steps on ``batches``; the timed steps' seconds (measured runs only). An inf/NaN
        loss stops it and marks ``run`` diverged (the trainer's rule, allowing no skip)."""
        if self.measured:
            torch.cuda.reset_peak_memory_stats(self.device)
        for batch in batches:
            if trainer.verdict(trainer.step([batch])) is not None:
                run.diverged = True
                break
        return trainer.step_times

    def _train_loss(
        self, model: nn.Module, fidelity: str, run: FineTuneRun, measure_split: bool
    ) -> float:
        """The fine-tuned ``model``'s loss over the training split: measured whole with the
        shared pass (``measure_split``), estimated from the fidelity's estimate, or scored."""
        if measure_split and self.estimated():
            cfg = self.config
            run.split_estimate = SplitEstimate.measure(
                model, self.spec, self.data, cfg.score_examples, cfg.resolved_batch_seed,
                self.device,
            )  # fmt: skip
            return run.split_estimate.full_loss
        estimate = self.estimates.get(fidelity)
        if estimate is not None:
            return estimate.loss(model, self.spec, self.data, self.device)
        return self.score_split(model, "train")[0]

    def score_split(self, model: nn.Module, split: str) -> tuple[float, float]:
        """Mean loss and accuracy over ``split``, in eval mode, policy applied
        (:func:`autoprec.training.trainer.score_split`)."""
        return score_split(model, self.spec, self.data, split, self.device)
