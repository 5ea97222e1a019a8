"""torchtitan: a policy as the TOML section of its float8 or mx converter.

torchtitan converts with one recipe for the whole model: ``[quantize.linear.float8]``
(``recipe_name``: ``tensorwise``, ``rowwise``, ``rowwise_with_gw_hp``) or
``[quantize.linear.mx]`` (``recipe_name = "mxfp8_cublas"``), each turning every ``nn.Linear``
whose weight dimensions are multiples of 16 into the low-precision module unless one of its
``filter_fqns`` is a *substring* of the layer's name (torchtitan's ``module_filter_fn``:
``any(f in fqn for f in filter_fqns)``, so ``experts.w1`` also leaves out
``shared_experts.w1``, and ``proj`` leaves out ``out_proj``). The other layers run at
``[training] mixed_precision_param`` (FSDP's parameter dtype: ``bfloat16`` or ``float32``).

This is torchtitan 0.2's TOML job config (``--job.config_file``); torchtitan 0.3 configures
the same converter in Python (``Float8LinearConverter.Config(recipe_name=..., filter_fqns=...)``,
the rowwise recipes only), which the TOML's header names.

The exporter writes the exclude list (a name's block suffix, such as ``attention.wk``, where
every block leaves it out; else the exact names), replays torchtitan's rule over the model,
and refuses, in one line, what the rule cannot express: recipes mixed per layer (with the
nearest policy it can run, every low-precision layer at the recipe most of them have), a
layer the substring rule would leave out or convert against the policy, a 16-bit format other
than bf16, a layer at another format than the rest.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from torch import nn

from autoprec.precision import FLOAT8_RECIPES, Precision
from autoprec.stacks.plan import StackError, StackPlan, plan_for, shown

if TYPE_CHECKING:  # pragma: no cover
    from autoprec.policy.precision_policy import PolicyLike

__all__ = ["MX_RECIPE", "TorchtitanExport", "converted_by", "torchtitan_export"]

#: torchtitan's MXFP8 recipe for dense Linears (torchao's ``MXLinearConfig`` recipe name).
MX_RECIPE = "mxfp8_cublas"
_PARAM_DTYPES = {None: "float32", "bf16": "bfloat16"}
_BLOCK = re.compile(r"^(?:.*\.)?layers\.\d+\.")


@dataclass(frozen=True)
class TorchtitanExport:
    """torchtitan's settings for a policy.

    Attributes:
        converter: ``"quantize.linear.float8"``, ``"quantize.linear.mx"`` or None (no layer
            in low precision).
        recipe_name: the converter's recipe.
        filter_fqns: the substrings of the names it must leave out.
        param_dtype: ``[training] mixed_precision_param``.
    """

    converter: str | None
    recipe_name: str | None
    filter_fqns: tuple[str, ...] = field(default_factory=tuple)
    param_dtype: str = "bfloat16"

    def toml(self, source: str) -> str:
        """The TOML a user merges into the job's config; ``source`` names the policy."""
        lines = [f"# torchtitan settings for {source}, written by `autoprec export`."]
        fqns = ", ".join(f'"{f}"' for f in self.filter_fqns)
        if self.converter == "quantize.linear.float8" and self.recipe_name != "tensorwise":
            lines.append(
                f'# torchtitan >= 0.3: Float8LinearConverter.Config(recipe_name="'
                f'{self.recipe_name}", filter_fqns=[{fqns}])'
            )
        if self.converter is not None:
            lines += [
                "[model]",
                f'converters = ["{self.converter}"]',
                "",
                f"[{self.converter}]",
                f'recipe_name = "{self.recipe_name}"',
                f"filter_fqns = [{fqns}]",
                "",
            ]
        lines += ["[training]", f'mixed_precision_param = "{self.param_dtype}"', ""]
        return "\n".join(lines)


def converted_by(model: nn.Module, filter_fqns: tuple[str, ...]) -> list[str]:
    """The layers torchtitan's converter turns low-precision with ``filter_fqns``: every
    ``nn.Linear`` with both weight dimensions multiples of 16 whose name contains none."""
    return [
        name
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear)
        and m.weight.shape[0] % 16 == 0
        and m.weight.shape[1] % 16 == 0
        and not any(f in name for f in filter_fqns)
    ]


def _recipe(precision: Precision) -> str:
    return precision.recipe.name if precision.is_fp8 else MX_RECIPE


def _filters(model: nn.Module, plan: StackPlan, low: set[str]) -> tuple[str, ...]:
    """The exclude list: block suffixes every block leaves out, then the exact names."""
    keep = [n for n in converted_by(model, ()) if n not in low]
    suffixes = Counter(_BLOCK.sub("", n) for n in plan.precisions if _BLOCK.match(n))
    left_out = Counter(_BLOCK.sub("", n) for n in keep if _BLOCK.match(n))
    whole = sorted(s for s, k in left_out.items() if k == suffixes[s])
    rest = [n for n in keep if not any(s in n for s in whole)]
    return (*whole, *rest)


def torchtitan_export(model: nn.Module, policy: PolicyLike) -> TorchtitanExport:
    """torchtitan's converter section for ``policy`` on ``model`` (torchtitan's module names:
    the zoo's llama has them).

    Raises:
        PolicyMismatchError: the policy names a module ``model`` does not have.
        NearestPolicyError: the policy mixes recipes (one line naming the nearest policy).
        StackError: anything else torchtitan's one converter cannot express (one line).
    """
    plan = plan_for(model, policy)
    other = plan.layers_at(Precision.FP8_BLOCK, Precision.NVFP4)
    if other:
        raise StackError(
            f"torchtitan's float8 and mx converters do not run fp8_block or nvfp4 layers: "
            f"{shown(other)}; export them with --to megatron (Transformer Engine)"
        )
    low = {n: p for n, p in plan.precisions.items() if p.is_fp8 or p.is_mx}
    plan.refuse_mixed("torchtitan", low, _recipe)
    plan.refuse_off_region("torchtitan", (*FLOAT8_RECIPES, Precision.MXFP8))
    if plan.region not in _PARAM_DTYPES:
        raise StackError(
            f"torchtitan trains in bf16 or fp32 (mixed_precision_param), not {plan.region}; "
            "the nearest policy it runs has the 16-bit layers at bf16"
        )
    param_dtype = _PARAM_DTYPES[plan.region]
    if not low:
        return TorchtitanExport(None, None, (), param_dtype)
    filters = _filters(model, plan, set(low))
    converted = set(converted_by(model, filters))
    wrong = [n for n in plan.precisions if (n in converted) != (n in low)]
    if wrong:
        raise StackError(
            f"torchtitan's converter cannot give {shown(wrong)} the policy's format: it "
            "converts every nn.Linear with dimensions % 16 unless a filter_fqns entry is a "
            "substring of its name; keep those layers at the policy's other format or rename"
        )
    precision = next(iter(low.values()))
    converter = "quantize.linear.mx" if precision.is_mx else "quantize.linear.float8"
    return TorchtitanExport(converter, _recipe(precision), filters, param_dtype)
