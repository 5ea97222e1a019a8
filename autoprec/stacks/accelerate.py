"""Hugging Face accelerate: a policy as ``Accelerator`` keyword arguments.

accelerate's torchao path (``mixed_precision="fp8"`` with ``AORecipeKwargs(config=...,
module_filter_func=...)``) converts the model it prepares with one ``convert_to_float8_training``
call and runs the forward under bf16 autocast (``mixed_precision="fp8"`` is bf16 autocast plus
the fp8 modules). So a policy it runs has its fp8 layers at one torchao recipe and every other
layer at bf16; without fp8 layers, ``mixed_precision`` is the policy's one 16-bit format
(``"bf16"``, ``"fp16"``) or ``"no"``. Anything else is refused in one line with the nearest
policy accelerate runs.

Example:
    >>> export = accelerate_export(model, policy)
    >>> accelerator = Accelerator(**export.kwargs())
    >>> model, optimizer = accelerator.prepare(model, optimizer)
    >>> export.check(accelerator.unwrap_model(model))  # every module as the policy says
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn

from autoprec.precision import FLOAT8_RECIPES
from autoprec.stacks.check import AUTOCAST_DTYPES, Running, check_stack
from autoprec.stacks.plan import StackError, StackPlan, plan_for
from autoprec.stacks.torchao import Float8Group, check_fp8_shapes, refuse_unswappable

if TYPE_CHECKING:  # pragma: no cover
    from autoprec.policy.precision_policy import PolicyLike

__all__ = ["AccelerateExport", "accelerate_export"]

_MIXED = {None: "no", "bf16": "bf16", "fp16": "fp16"}


@dataclass(frozen=True)
class AccelerateExport:
    """accelerate's settings for a policy.

    Attributes:
        plan: the policy read against the model.
        mixed_precision: ``Accelerator(mixed_precision=...)``.
        group: the fp8 layers and their recipe, None without fp8 layers.
    """

    plan: StackPlan
    mixed_precision: str
    group: Float8Group | None

    def kwargs(self) -> dict[str, Any]:
        """``Accelerator(**kwargs)``: ``mixed_precision`` and, with fp8 layers, the
        ``AORecipeKwargs`` handler (the recipe's config, a filter of exactly those layers)."""
        if self.group is None:
            return {"mixed_precision": self.mixed_precision}
        from accelerate.utils import AORecipeKwargs

        handler = AORecipeKwargs(
            config=self.group.config(), module_filter_func=self.group.module_filter_fn
        )
        return {"mixed_precision": self.mixed_precision, "kwargs_handlers": [handler]}

    def check(self, model: nn.Module) -> dict[str, Running]:
        """:func:`~autoprec.stacks.check.check_stack` of the prepared (unwrapped) model."""
        region = "bf16" if self.mixed_precision == "fp8" else self.plan.region
        return check_stack(model, self.plan, AUTOCAST_DTYPES.get(region or ""))

    def snippet(self, source: str) -> str:
        """Python a user pastes: ``accelerator_kwargs()`` for ``Accelerator(**...)``."""
        if self.group is None:
            body = f'    return {{"mixed_precision": "{self.mixed_precision}"}}\n'
            recipe, layers = None, []
        else:
            recipe, layers = self.group.recipe, sorted(self.group.fqns)
            body = (
                "    from accelerate.utils import AORecipeKwargs\n"
                "    from torchao.float8 import Float8LinearConfig\n\n"
                "    handler = AORecipeKwargs(\n"
                "        config=Float8LinearConfig.from_recipe_name(FP8_RECIPE),\n"
                "        module_filter_func=lambda module, fqn: fqn in FP8_LAYERS,\n"
                "    )\n"
                '    return {"mixed_precision": "fp8", "kwargs_handlers": [handler]}\n'
            )
        listed = "".join(f'    "{n}",\n' for n in layers)
        return (
            f"# accelerate settings for {source}, written by `autoprec export --to accelerate`.\n"
            f"FP8_RECIPE = {recipe!r}  # torchao's recipe name\n"
            f"FP8_LAYERS = frozenset([\n{listed}])\n\n\n"
            "def accelerator_kwargs():\n"
            '    """Accelerator(**accelerator_kwargs()): fp8 layers by torchao, the rest bf16."""\n'
            f"{body}"
        )


def accelerate_export(model: nn.Module, policy: PolicyLike) -> AccelerateExport:
    """accelerate's settings for ``policy`` on ``model`` (the module ``prepare`` gets).

    Raises:
        PolicyMismatchError: the policy names a module ``model`` does not have.
        NearestPolicyError: fp8 recipes mixed (one line naming the nearest policy).
        StackError: another format than accelerate's program runs (one line).
        NotRunnableError: an fp8 layer torchao's ``Float8Linear`` rejects.
    """
    plan = plan_for(model, policy)
    refuse_unswappable(plan, "accelerate")
    groups = plan.fp8_groups()
    fp8 = {n: p for n, p in plan.precisions.items() if p.is_fp8}
    plan.refuse_mixed("accelerate", fp8, lambda p: p.recipe.name)
    if groups and plan.region != "bf16":
        other = plan.region or "fp32"
        raise StackError(
            f"accelerate's fp8 mode runs every layer but the fp8 ones under bf16 autocast; "
            f"the policy has them at {other}: the nearest policy it runs puts them at bf16"
        )
    plan.refuse_off_region("accelerate", FLOAT8_RECIPES)
    check_fp8_shapes(model, plan, "accelerate")
    if not groups:
        return AccelerateExport(plan, _MIXED[plan.region], None)
    (recipe, fqns), *_ = groups.items()
    return AccelerateExport(plan, "fp8", Float8Group(recipe, frozenset(fqns)))
