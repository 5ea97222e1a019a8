"""The user's training recipe: optimizer, learning rate, weight decay, warm-up and schedule,
batch size.

One frozen :class:`TrainingRecipe` says how the model is trained wherever autoprec trains it:
the fp32 warm start, the fine-tunes that score each policy, ``autoprec train`` and the arms of
``autoprec verify``. ``EvaluatorConfig`` and ``VerifyConfig`` embed it; the commands build it
from ``--optimizer``, ``--lr``, ``--momentum``, ``--weight-decay``, ``--warmup-steps``,
``--schedule`` and the batch size, and a search's ``--config`` YAML from a ``recipe:`` section.

The default is what autoprec trained with before recipes existed: SGD at 0.05 with momentum
0.9, constant rate, batch 32.

Example:
    >>> TrainingRecipe(optimizer="adamw", lr=3e-4, weight_decay=0.1).optimizer
    'adamw'
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from autoprec._values import NumberRange

OPTIMIZERS = ("sgd", "adamw")
SCHEDULES = ("constant", "cosine", "linear")

#: The range of each numeric field, checked when a recipe is made.
RANGES = {
    "lr": NumberRange(low=0, high=10, open_low=True, example="0.05"),
    "momentum": NumberRange(low=0, high=1, open_high=True, example="0.9"),
    "weight_decay": NumberRange(low=0, high=10, example="0.01"),
    "beta1": NumberRange(low=0, high=1, open_high=True, example="0.9"),
    "beta2": NumberRange(low=0, high=1, open_high=True, example="0.999"),
    "eps": NumberRange(low=0, high=1, open_low=True, example="1e-8"),
    "warmup_steps": NumberRange(integer=True, low=0, high=10**9, example="100"),
    "batch_size": NumberRange(integer=True, low=1, high=2**20, example="32"),
}


class RecipeError(ValueError):
    """A recipe field of the wrong type or out of range (one line naming the field)."""


@dataclass(frozen=True)
class TrainingRecipe:
    """How a model is trained.

    Args:
        optimizer: ``"sgd"`` (``torch.optim.SGD``) or ``"adamw"`` (``torch.optim.AdamW``).
        lr: the peak learning rate.
        momentum: SGD's momentum (not used by AdamW).
        weight_decay: SGD's L2 penalty, or AdamW's decoupled weight decay.
        beta1, beta2, eps: AdamW's moment coefficients and denominator term.
        warmup_steps: steps of linear warm-up from 0 to ``lr``.
        schedule: the rate after the warm-up: ``"constant"``, ``"cosine"`` (to 0 at the last
            step) or ``"linear"`` (to 0 at the last step).
        batch_size: examples per step (per process under ``torchrun``).

    Raises:
        RecipeError: an unknown optimizer or schedule, a value of the wrong type or range.
    """

    optimizer: str = "sgd"
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    warmup_steps: int = 0
    schedule: str = "constant"
    batch_size: int = 32

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise RecipeError(
                f"optimizer must be one of {', '.join(OPTIMIZERS)}; got {self.optimizer!r}"
            )
        if self.schedule not in SCHEDULES:
            raise RecipeError(
                f"schedule must be one of {', '.join(SCHEDULES)}; got {self.schedule!r}"
            )
        for name, allowed in RANGES.items():
            allowed.check(getattr(self, name), name, RecipeError)

    def to_dict(self) -> dict[str, Any]:
        """The fields as plain data (a YAML section, an MLflow params dict, a cache key)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "recipe") -> TrainingRecipe:
        """A recipe from a mapping of its fields (a YAML section); an unknown key is refused.

        Raises:
            RecipeError: an unknown key, or a field the recipe refuses (the message names
                ``where``).
        """
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise RecipeError(
                f"{where}: unknown key {unknown[0]!r}; expected some of {', '.join(sorted(known))}"
            )
        try:
            return cls(**dict(data))
        except RecipeError as exc:
            raise RecipeError(f"{where}: {exc}") from None
