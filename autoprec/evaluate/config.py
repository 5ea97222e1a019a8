"""The evaluator's settings: :class:`EvaluatorConfig`, and the fidelities' fixed budgets.

Everything here decides an evaluation's result, so :meth:`EvaluatorConfig.canonical` is part of
every evaluation's cache key (:mod:`autoprec.evaluate.cached`). The measurements behind the
defaults (how well one short fine-tune ranks policies, how the fine-tuning rate was chosen) are
in docs/benchmarks.md, "Policy evaluator", written by experiments/bench_evaluator.py and
experiments/study_short_fidelity.py.

Example:
    >>> EvaluatorConfig(steps=6, warm_start_steps=30).steps_by_fidelity
    {'short': 6, 'full': 30}
"""

from __future__ import annotations

from dataclasses import InitVar, dataclass, field, replace
from typing import Any

from autoprec.defaults import PRICINGS
from autoprec.policy.fields import EXECUTION_MODES
from autoprec.training.pretrain import BACKOFF_SETTINGS
from autoprec.training.recipe import (
    DEFAULT_RECIPE,
    TrainingRecipe,
    differs_from_default,
    fold_aliases,
)

FIDELITIES = ("short", "full", "surrogate")
#: The program timed when measuring and ``execution`` is None: production GPU training compiles
#: (fp8 pays only compiled), while on a CPU inductor's compile of each program costs more than
#: the training it would speed up in a search (and CPU training is rarely compiled).
MEASURED_EXECUTION = {"cuda": "compiled", "cpu": "eager"}
SHORT_STEPS = 10
FULL_STEPS = 30
# Fine-tunes per evaluation, each on batches of its own, their losses averaged: one fine-tune
# at "short" (where, on the default task, one batch order already ranks policies as another
# does), several at "full" (longer trajectories drift apart, and averaging lowers the
# batch-order noise); docs/benchmarks.md, "Policy evaluator".
SHORT_REPLICATES = 1
FULL_REPLICATES = 3
REPLICATE_SEED_STRIDE = 10_000  # replicate r of seed s fine-tunes on batches of s + r * stride
# Examples of the training split a fine-tuned policy is scored on, the rest accounted for to
# first order by one pass shared with the fp32 reference (:mod:`autoprec.evaluate.split_estimate`);
# None: every example. Off by default: the weights' part of the estimate is exact to 1e-7, but
# the policy's rounding in the scoring pass is not first order in the weights, and on 512 or 1,024
# examples it adds noise as large as the policies' differences (docs/benchmarks.md, "Where an
# evaluation's time goes").
SCORE_EXAMPLES = None
# Fine-tuning under a policy: the recipe's optimizer at a fifth of the warm start's rate (SGD:
# without momentum). At the warm start's own rate and momentum a few dozen steps are chaotic,
# so that the batch order, not the precision, decides the loss; at this rate without momentum
# formats that barely round (tf32, fp16) stay close to fp32 (experiments/study_short_fidelity.py,
# docs/benchmarks.md). AdamW keeps its betas and takes the same fifth of its rate.
FINETUNE_RATE_DIVISOR = 5
FINETUNE_LR = DEFAULT_RECIPE.lr / FINETUNE_RATE_DIVISOR  # 0.01, the default recipe's
FINETUNE_MOMENTUM = 0.0


def check_fidelity(fidelity: str) -> str:
    """``fidelity`` if it is one of :data:`FIDELITIES`.

    Raises:
        ValueError: any other value (the message lists the fidelities).
    """
    if fidelity not in FIDELITIES:
        raise ValueError(f"unknown fidelity {fidelity!r}; expected one of {', '.join(FIDELITIES)}")
    return fidelity


@dataclass(frozen=True)
class EvaluatorConfig:
    """How an :class:`~autoprec.evaluate.Evaluator` trains, scores and prices a policy.

    Args:
        fidelity: default fidelity, ``"short"`` (``steps`` or 10 steps, ``replicates`` or one
            fine-tune), ``"full"`` (three fine-tunes of 30 steps, averaged) or ``"surrogate"``
            (predicted, no training). The only setting left out of :meth:`canonical`: each
            evaluation's key names the fidelity it ran at.
        steps: fine-tuning steps at ``"short"`` fidelity; None: :data:`SHORT_STEPS`.
        replicates: fine-tunes at ``"short"`` fidelity, each from the warm start on batches of
            its own; the scores are averaged (less dependence on one batch order).
        recipe: the user's training recipe: the warm start trains with it (optimizer, rate,
            weight decay, warm-up and schedule, batch size), the fine-tunes with its optimizer
            and batch size at the fine-tuning rate.
        batch_size: an alias of ``recipe.batch_size`` (examples per fine-tuning and
            warm-start step): given, it replaces the recipe's (read ``recipe.batch_size``; see
            :func:`~autoprec.training.recipe.fold_aliases`).
        lr: an alias of ``recipe.lr`` (the warm start's peak rate), as ``batch_size``.
        finetune_lr: the learning rate while fine-tuning under a policy; None: a fifth of
            ``recipe.lr`` (:data:`FINETUNE_RATE_DIVISOR`; 0.01 for the default recipe).
        momentum: SGD momentum while fine-tuning under a policy (AdamW: not used).
        warm_start_steps: fp32 steps from the spec's weights before any policy is applied.
        seed: seeds the warm-start loader, the fixed batches and torch before each run.
        batch_seed: seeds the fine-tuning batches (and torch) instead of ``seed``, keeping the
            warm start of ``seed``: the same policies on another batch order, to measure how
            much a score depends on it. None: ``seed``.
        cost_batch_size: the production batch size for the cost model; None: ``batch_size``.
        target_mode: ``"native"``: a policy is feasible only if every layer runs natively on
            the target (:mod:`autoprec.hardware.runnability`); ``"emulate"``: a study of
            formats the target lacks, anything the device's format list holds is feasible.
        execution: the program production runs, ``"compiled"`` (``torch.compile``) or
            ``"eager"``: what the cost model prices and what is measured. None: the cost
            model's default when modelled; measured, compiled on a GPU and eager on the CPU
            (:data:`MEASURED_EXECUTION`).
        pricing: where step times and memory come from: ``"model"`` (the cost model),
            ``"measured"`` (timed on this machine's device, which must be the target:
            :mod:`autoprec.evaluate.measured`), or ``"auto"``: measured when the target is
            this machine's device, else the model.
        score_examples: a policy's loss over the training split is its loss over this many
            of its examples (drawn with the batch seed) plus the first-order account of the
            rest, from one pass over the whole split at the fp32 reference's weights
            (:mod:`~autoprec.evaluate.split_estimate`); None, or a split no larger: every
            example scored.

    Raises:
        ValueError: an unknown fidelity or target mode, or a count below 1.
    """

    fidelity: str = "short"
    steps: int | None = None
    replicates: int | None = None
    recipe: TrainingRecipe = field(default_factory=TrainingRecipe)
    batch_size: InitVar[int | None] = None
    lr: InitVar[float | None] = None
    finetune_lr: float | None = None
    momentum: float = FINETUNE_MOMENTUM
    warm_start_steps: int = 200
    seed: int = 0
    batch_seed: int | None = None
    cost_batch_size: int | None = None
    target_mode: str = "native"
    execution: str | None = None
    pricing: str = "auto"
    score_examples: int | None = SCORE_EXAMPLES

    def __post_init__(self, batch_size: int | None, lr: float | None) -> None:
        # the aliases join the recipe (checked there): the recipe is their one home
        object.__setattr__(self, "recipe", fold_aliases(self.recipe, batch_size=batch_size, lr=lr))
        if self.target_mode not in ("native", "emulate"):
            raise ValueError(f"target_mode must be native or emulate, got {self.target_mode!r}")
        check_fidelity(self.fidelity)
        if self.execution is not None and self.execution not in EXECUTION_MODES:
            raise ValueError(
                f"execution must be {' or '.join(EXECUTION_MODES)} (or None), "
                f"got {self.execution!r}"
            )
        if self.pricing not in PRICINGS:
            raise ValueError(f"pricing must be one of {', '.join(PRICINGS)}, got {self.pricing!r}")
        for name in ("steps", "replicates", "score_examples"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.resolved_cost_batch_size < 1:
            raise ValueError(f"cost_batch_size must be >= 1, got {self.cost_batch_size!r}")

    @property
    def steps_by_fidelity(self) -> dict[str, int]:
        """Fine-tuning steps of each real fidelity."""
        return {"short": self.steps or SHORT_STEPS, "full": FULL_STEPS}

    @property
    def replicates_by_fidelity(self) -> dict[str, int]:
        """Fine-tunes averaged at each real fidelity."""
        return {"short": self.replicates or SHORT_REPLICATES, "full": FULL_REPLICATES}

    @property
    def resolved_finetune_lr(self) -> float:
        """The fine-tuning learning rate (a fifth of ``recipe.lr`` when ``finetune_lr`` is
        None)."""
        if self.finetune_lr is None:
            return self.recipe.lr / FINETUNE_RATE_DIVISOR
        return self.finetune_lr

    def finetune_recipe(self, lr_scale: float = 1.0) -> TrainingRecipe:
        """The recipe of a fine-tune under a policy: the recipe's optimizer and batch size at
        :attr:`resolved_finetune_lr` times ``lr_scale`` (the warm start's back-off), SGD's
        momentum :attr:`momentum`, at a constant rate (a fine-tune continues a training that
        is past its warm-up; its few steps are too short for a schedule)."""
        return replace(
            self.recipe,
            lr=self.resolved_finetune_lr * lr_scale,
            momentum=self.momentum,
            warmup_steps=0,
            schedule="constant",
        )

    @property
    def resolved_batch_seed(self) -> int:
        """The seed of the fine-tuning batches (``seed`` when ``batch_seed`` is None)."""
        return self.seed if self.batch_seed is None else int(self.batch_seed)

    @property
    def resolved_cost_batch_size(self) -> int:
        """The cost model's batch size (``batch_size`` when ``cost_batch_size`` is None)."""
        if self.cost_batch_size is None:
            return self.recipe.batch_size
        return int(self.cost_batch_size)

    def warm_start_settings(self) -> dict[str, Any]:
        """What trains the warm start besides the model, the data and the seed (its key). The
        recipe's fields beyond rate and batch size join it only when they differ from the
        default recipe's, so that the keys (and caches) made before recipes stay valid."""
        settings = {
            "steps": self.warm_start_steps,
            "lr": self.recipe.lr,
            "batch_size": self.recipe.batch_size,
            "backoff": BACKOFF_SETTINGS,
        }
        recipe = differs_from_default(self.recipe, "lr", "batch_size")
        if recipe is not None:
            settings["recipe"] = recipe
        return settings

    def canonical(self) -> dict[str, Any]:
        """Every setting that decides a result, resolved (a None and the value it stands for
        are one setting): the configuration's part of the evaluation cache key. ``execution``
        and ``pricing`` join the key through the costs' identity
        (:meth:`~autoprec.evaluate.costing.CostEstimator.identity`), where they decide."""
        return {
            **self.warm_start_settings(),
            "seed": self.seed,
            "finetune": [self.resolved_finetune_lr, self.momentum],
            "steps": self.steps_by_fidelity,
            "replicates": self.replicates_by_fidelity,
            "batch_seed": self.resolved_batch_seed,
            "cost_batch_size": self.resolved_cost_batch_size,
            "target_mode": self.target_mode,
            # only when set: the keys of every example scored stay those made before it
            **({} if self.score_examples is None else {"score_examples": self.score_examples}),
        }
