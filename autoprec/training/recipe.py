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

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, fields, replace
from typing import TYPE_CHECKING, Any

from autoprec._values import NumberRange

if TYPE_CHECKING:  # pragma: no cover - torch is imported where training runs
    import torch

OPTIMIZERS = ("sgd", "adamw")
SCHEDULES = ("constant", "cosine", "linear")

#: The range of each numeric field, checked when a recipe is made.
RANGES = {
    "lr": NumberRange(low=0, open_low=True, example="0.05"),
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

    @property
    def constant_rate(self) -> bool:
        """No warm-up and a constant schedule: the rate stays as the optimizer was made."""
        return self.warmup_steps == 0 and self.schedule == "constant"

    def make_optimizer(
        self, params: Iterable[torch.nn.Parameter], lr: float | None = None
    ) -> torch.optim.Optimizer:
        """The recipe's optimizer over ``params`` at ``lr`` (None: the recipe's ``lr``).

        SGD takes ``momentum`` and ``weight_decay`` (an L2 penalty); AdamW takes ``beta1``,
        ``beta2``, ``eps`` and ``weight_decay`` (decoupled). The default recipe's is
        ``torch.optim.SGD(params, lr=0.05, momentum=0.9)``, as autoprec trained before recipes.
        """
        import torch

        rate = self.lr if lr is None else float(lr)
        if self.optimizer == "adamw":
            return torch.optim.AdamW(
                params,
                lr=rate,
                betas=(self.beta1, self.beta2),
                eps=self.eps,
                weight_decay=self.weight_decay,
            )
        return torch.optim.SGD(
            params, lr=rate, momentum=self.momentum, weight_decay=self.weight_decay
        )

    def rate_factor(self, total_steps: int) -> Callable[[int], float]:
        """The factor of the peak rate at each step (0-based) of a run of ``total_steps``:
        linear warm-up over ``warmup_steps`` (step ``s`` trains at ``(s + 1) / warmup_steps``),
        then 1 (constant), or a cosine or linear decay that reaches 0 after the last step."""
        warmup, schedule = self.warmup_steps, self.schedule
        decay_steps = max(total_steps - warmup, 1)

        def factor(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            if schedule == "constant":
                return 1.0
            done = min((step - warmup) / decay_steps, 1.0)
            if schedule == "linear":
                return 1.0 - done
            return 0.5 * (1.0 + math.cos(math.pi * done))

        return factor

    def make_schedule(
        self, optimizer: torch.optim.Optimizer, total_steps: int, done: int = 0
    ) -> torch.optim.lr_scheduler.LambdaLR:
        """The recipe's rate schedule over ``optimizer`` for a run of ``total_steps`` steps
        (:meth:`rate_factor`), ``done`` of them taken already (a resumed run: the optimizer's
        state is loaded first); call its ``step()`` after every optimizer step."""
        import torch

        factor = self.rate_factor(total_steps)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        if done:
            schedule.last_epoch = done
            for group, base in zip(optimizer.param_groups, schedule.base_lrs, strict=True):
                group["lr"] = base * factor(done)
        return schedule

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


#: The recipe every command trains with unless told otherwise.
DEFAULT_RECIPE = TrainingRecipe()


def differs_from_default(recipe: TrainingRecipe, *known: str) -> dict[str, Any] | None:
    """``recipe``'s fields when it differs from :data:`DEFAULT_RECIPE` in a field besides
    ``known`` (those a key holds already), else None: what a cache key adds, so that the keys
    of the default recipe stay those made before recipes existed."""
    same = {name: getattr(recipe, name) for name in known}
    if replace(recipe, **same) == replace(DEFAULT_RECIPE, **same):
        return None
    return recipe.to_dict()


def fold_aliases(recipe: TrainingRecipe, **aliases: float | None) -> TrainingRecipe:
    """``recipe`` with the alias keywords that were given (not None) as its fields: how a
    config that embeds a recipe keeps its old keywords (``lr=``, ``batch_size=``) working.

    The aliases are ``InitVar`` s defaulting to None, so that ``dataclasses.replace(config,
    lr=x)`` changes the recipe's rate and ``replace(config, recipe=r)`` keeps ``r`` whole; read
    them from the recipe (``config.recipe.lr``): the attribute itself stays None."""
    given = {name: value for name, value in aliases.items() if value is not None}
    return replace(recipe, **given) if given else recipe


#: The prefix of the recipe's fields in a policy file's provenance (``recipe_optimizer:
#: adamw``, ``recipe_lr: 0.0003``, ...): the recipe a policy was searched with.
PROVENANCE_PREFIX = "recipe_"


def to_provenance(
    recipe: TrainingRecipe, *, default_too: bool = False
) -> dict[str, str | int | float]:
    """The recipe as provenance entries (flat: provenance values are strings and numbers);
    none for the default recipe unless ``default_too`` (MLflow params), so that a policy
    searched with it is written as before recipes existed (no entries: the default recipe)."""
    if recipe == DEFAULT_RECIPE and not default_too:
        return {}
    return {PROVENANCE_PREFIX + name: value for name, value in recipe.to_dict().items()}


def from_provenance(provenance: Mapping[str, Any]) -> TrainingRecipe | None:
    """The recipe a policy's provenance names (:func:`to_provenance`; fields it lacks take the
    default recipe's), or None where it names none.

    Raises:
        RecipeError: an entry the recipe refuses (the message names ``provenance.recipe_...``).
    """
    fields_given = {
        key[len(PROVENANCE_PREFIX) :]: value
        for key, value in provenance.items()
        if key.startswith(PROVENANCE_PREFIX)
    }
    if not fields_given:
        return None
    return TrainingRecipe.from_dict(fields_given, f"provenance.{PROVENANCE_PREFIX}*")
