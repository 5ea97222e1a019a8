"""The check that a stack did what the policy says: walk the converted model and compare, module
by module, what will run (the module's type, its torchao recipe, the autocast format around it)
with the policy.

The two bugs this catches are the ones people file: a filter naming a module the model does
not have (torchtitan's ``output`` where the head is ``lm_head``: the head silently in fp8), and
a filter that matches nothing (accelerate's first/last-linear filter). Both are one-line
:class:`StackMismatchError` naming the module.

Example:
    >>> plan = plan_for(model, policy)          # before the stack converts the model
    >>> convert(model)                          # the stack's own conversion
    >>> check_stack(model, plan, autocast=torch.bfloat16)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from autoprec.precision import FLOAT8_RECIPES, Precision
from autoprec.stacks.plan import StackPlan, plan_for, shown

if TYPE_CHECKING:  # pragma: no cover
    from autoprec.policy.precision_policy import PolicyLike

__all__ = ["AUTOCAST_DTYPES", "Running", "StackMismatchError", "check_stack", "what_runs"]

#: The weight type torchao's MXFP8 training (``quantize_`` with ``MXFP8TrainingOpConfig``) gives
#: a Linear.
_MX_WEIGHT = "MXFP8TrainingWeightWrapperTensor"
#: The autocast dtype of each 16-bit region format.
AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class StackMismatchError(ValueError):
    """A module runs in another format than the policy gives it, or a policy name matches no
    module (one line naming it)."""


@dataclass(frozen=True)
class Running:
    """What one tunable layer runs as after a stack's conversion.

    Attributes:
        module: the module's type name (``Float8Linear``, ``Linear``, ...).
        precision: the precision that program is (a torchao recipe's fp8 precision, mxfp8,
            the autocast region's format, or fp32 without a region).
        recipe: torchao's recipe name for a ``Float8Linear``, else None.
    """

    module: str
    precision: Precision
    recipe: str | None = None

    def __str__(self) -> str:
        recipe = f" {self.recipe}" if self.recipe else ""
        return f"{self.module}{recipe} ({self.precision.value})"


def _recipe_of(module: nn.Module) -> Precision | None:
    """The fp8 precision whose torchao recipe ``module.config`` is, None for another config."""
    from torchao.float8 import Float8LinearConfig

    for precision, recipe in FLOAT8_RECIPES.items():
        if module.config == Float8LinearConfig.from_recipe_name(recipe.name):
            return precision
    return None


def what_runs(
    model: nn.Module, names: list[str], autocast: torch.dtype | None
) -> dict[str, Running]:
    """What each of ``names`` runs as in ``model`` (converted by a stack) under ``autocast``.

    Raises:
        StackMismatchError: a name is not a module of ``model``.
    """
    modules = dict(model.named_modules())
    missing = [n for n in names if n not in modules]
    if missing:
        raise StackMismatchError(f"the model has no module {shown(missing)} after conversion")
    region = {v: k for k, v in AUTOCAST_DTYPES.items()}.get(autocast)
    out = {}
    for name in names:
        module = modules[name]
        kind = type(module).__name__
        if kind == "Float8Linear" and hasattr(module, "config"):
            precision = _recipe_of(module)
            recipe = None if precision is None else precision.recipe.name
            out[name] = Running(kind, precision or Precision.FP8, recipe or "custom config")
        elif kind == "MXFP8Linear":
            out[name] = Running(kind, Precision.MXFP8)
        elif type(getattr(module, "weight", None)).__name__ == _MX_WEIGHT:
            out[name] = Running(kind, Precision.MXFP8, "MXFP8TrainingOpConfig")
        else:
            out[name] = Running(kind, Precision(region or "fp32"))
    return out


def check_stack(
    model: nn.Module, plan: StackPlan | PolicyLike, autocast: torch.dtype | None
) -> dict[str, Running]:
    """Check that ``model``, as a stack converted it, runs what the policy says.

    Args:
        model: the converted model (the stack's wrapper looked through by the caller).
        plan: the :class:`StackPlan` made before conversion, or the policy (read against the
            converted model: its names are the same; a fingerprint it records is not checked,
            as the conversion changes module types).
        autocast: the dtype of the ``torch.autocast`` region the forward runs in (None: none).

    Returns:
        ``{layer name: Running}`` for every tunable layer.

    Raises:
        StackMismatchError: a module runs another format than the policy gives it (one line
            naming the first few), or an ``re:`` pattern of the policy matches no layer.
    """
    if not isinstance(plan, StackPlan):
        plan = _plan_of_policy(model, plan)
    running = what_runs(model, list(plan.precisions), autocast)
    wrong = {
        n: r
        for n, r in running.items()
        if r.precision is not _expected(plan.precisions[n])
        or (r.recipe == "custom config" and r.precision is Precision.FP8)
    }
    if wrong:
        said = plan.precisions
        names = shown(f"{n}: {r} where the policy says {said[n].value}" for n, r in wrong.items())
        raise StackMismatchError(
            f"{len(wrong)} module(s) do not run what the policy says: {names}; fix the stack's "
            "filter or autocast (autoprec export writes both)"
        )
    return running


def _expected(precision: Precision) -> Precision:
    """What a check can see: tf32 is fp32 with a global switch on."""
    return Precision.FP32 if precision is Precision.TF32 else precision


def _plan_of_policy(model: nn.Module, policy: PolicyLike) -> StackPlan:
    from autoprec.policy import PATTERN_PREFIX, PrecisionPolicy

    policy = PrecisionPolicy.coerce(policy).replace(model=None)
    dead = [k for k, _ in policy.validate(model).unmatched if k.startswith(PATTERN_PREFIX)]
    if dead:
        raise StackMismatchError(
            f"policy pattern(s) {shown(dead)} match no layer of the model: a filter that "
            "converts nothing; check them against model.named_modules()"
        )
    return plan_for(model, policy)
