"""torchao: a policy as ``convert_to_float8_training`` calls, one per recipe, plus an autocast.

A policy that mixes torchao's float8 recipes converts group by group: for each recipe a
``Float8LinearConfig.from_recipe_name(recipe)`` and a ``module_filter_fn(module, fqn)`` that
matches exactly that group's layer names (the native runtime's conversion,
:class:`autoprec.runtime.native.Float8Swap`, is the same calls). Every other layer runs in one
``torch.autocast`` region of the policy's 16-bit format (none when it has none). The mxfp8
layers are torchao's MXFP8 training (``quantize_`` with ``MXFP8TrainingOpConfig``, RCEIL
scales, the emulated kernel off a GPU: the native runtime's ``MXFP8Linear`` numerics), in a
policy without a 16-bit region (under autocast its GEMM gets a bf16 input and the fp32 weight
and refuses them; torchtitan's FSDP2 hands it bf16 parameters instead). What
that program cannot run is refused in one line before any training: a layer at another format
than the region's (an fp32 layer in a bf16 policy: native mode's per-layer rules), an fp8_block
or nvfp4 layer (export to Megatron), an fp8 or mxfp8 layer torchao rejects (not an
``nn.Linear``, features not multiples of 16, or 32 for mxfp8).

On CUDA torchao's ``Float8Linear`` casts its input to autocast's dtype, as the native runtime
does everywhere; on a CPU it does not (it reads CUDA's autocast state), so a bf16 region with
fp8 or mxfp8 layers runs the same modules and recipes there, but not the same bits.

Example:
    >>> export = apply_torchao(model, "best_policy.yaml")  # converts and checks
    >>> with export.autocast("cuda"):
    ...     loss = loss_fn(model(x), y)
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from autoprec.precision import FLOAT8_RECIPES, Precision
from autoprec.stacks.check import AUTOCAST_DTYPES, Running, check_stack
from autoprec.stacks.plan import StackError, StackPlan, plan_for, shown

if TYPE_CHECKING:  # pragma: no cover
    from autoprec.policy.precision_policy import PolicyLike

__all__ = ["Float8Group", "TorchaoExport", "apply_torchao", "torchao_export"]


@dataclass(frozen=True)
class Float8Group:
    """The layers of one torchao float8 recipe: its config and its module filter."""

    recipe: str
    fqns: frozenset[str]

    def config(self):  # -> torchao.float8.Float8LinearConfig
        """``Float8LinearConfig.from_recipe_name(recipe)``."""
        from torchao.float8 import Float8LinearConfig

        return Float8LinearConfig.from_recipe_name(self.recipe)

    def module_filter_fn(self, module: nn.Module, fqn: str) -> bool:
        """torchao's filter: True for exactly this group's layers."""
        return fqn in self.fqns


@dataclass(frozen=True)
class TorchaoExport:
    """What torchao and autocast do for a policy on one model.

    Attributes:
        plan: the policy read against the model.
        groups: one :class:`Float8Group` per recipe, recipes sorted.
        autocast_dtype: the autocast region's dtype, None for none.
    """

    plan: StackPlan
    groups: tuple[Float8Group, ...]
    autocast_dtype: torch.dtype | None
    mx: frozenset[str] = frozenset()

    def convert(self, model: nn.Module) -> nn.Module:
        """Swap the fp8 layers of ``model`` for torchao ``Float8Linear`` modules, one
        ``convert_to_float8_training`` call per recipe, and give the mxfp8 layers torchao's
        MXFP8 training weights (``quantize_``); returns ``model``."""
        from torchao.float8 import convert_to_float8_training

        for group in self.groups:
            convert_to_float8_training(
                model, config=group.config(), module_filter_fn=group.module_filter_fn
            )
        if self.mx:
            from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig
            from torchao.quantization import quantize_
            from torchao.quantization.quantize_.common.kernel_preference import (
                KernelPreference,
            )

            cuda = next(model.parameters()).device.type == "cuda"
            kernel = KernelPreference.AUTO if cuda else KernelPreference.EMULATED
            config = MXFP8TrainingOpConfig(kernel_preference=kernel)
            quantize_(model, config, filter_fn=lambda module, fqn: fqn in self.mx)
        return model

    def check(self, model: nn.Module) -> dict[str, Running]:
        """:func:`~autoprec.stacks.check.check_stack` of ``model`` (converted) against the
        policy, under this export's autocast."""
        return check_stack(model, self.plan, self.autocast_dtype)

    def autocast(self, device_type: str) -> contextlib.AbstractContextManager:
        """The region the forward runs in: ``torch.autocast(device_type, dtype)`` or nothing."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type, dtype=self.autocast_dtype)

    def convert_source(self) -> str:
        """Python that defines ``FP8_LAYERS``, ``MX_LAYERS`` and ``convert_model(model)``."""
        layers = {g.recipe: sorted(g.fqns) for g in self.groups}
        return f'''\
import torch
from torchao.float8 import Float8LinearConfig, convert_to_float8_training
from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig
from torchao.quantization import quantize_
from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

# torchao recipe -> the layers it converts (every other layer runs under the autocast)
FP8_LAYERS = {json.dumps(layers, indent=4)}
MX_LAYERS = frozenset({json.dumps(sorted(self.mx), indent=4)})


def convert_model(model):
    """Swap the policy's fp8 layers for torchao Float8Linear, one call per recipe, and give
    its mxfp8 layers torchao's MXFP8 training weights."""
    for recipe, fqns in FP8_LAYERS.items():
        convert_to_float8_training(
            model,
            config=Float8LinearConfig.from_recipe_name(recipe),
            module_filter_fn=lambda module, fqn, fqns=frozenset(fqns): fqn in fqns,
        )
    if MX_LAYERS:
        cuda = next(model.parameters()).device.type == "cuda"
        kernel = KernelPreference.AUTO if cuda else KernelPreference.EMULATED
        config = MXFP8TrainingOpConfig(kernel_preference=kernel)
        quantize_(model, config, filter_fn=lambda module, fqn: fqn in MX_LAYERS)
    return model
'''

    def snippet(self, source: str) -> str:
        """Python a user pastes into a training script: :meth:`convert_source`,
        ``AUTOCAST_DTYPE`` and ``autocast(device_type)``; ``source`` names the policy."""
        dtype = "None" if self.autocast_dtype is None else str(self.autocast_dtype)
        return f'''\
# torchao float8 training for {source}, written by `autoprec export --to torchao`.
import contextlib

{self.convert_source()}

AUTOCAST_DTYPE = {dtype}


def autocast(device_type):
    """The region the forward runs in (`with autocast("cuda"): loss = ...`)."""
    if AUTOCAST_DTYPE is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=AUTOCAST_DTYPE)
'''


def torchao_export(model: nn.Module, policy: PolicyLike) -> TorchaoExport:
    """What torchao and autocast must do for ``policy`` on ``model`` (nothing is converted).

    Raises:
        PolicyMismatchError: the policy names a module ``model`` does not have.
        StackError: the policy needs what this program cannot express (module docstring).
        NotRunnableError: an fp8 layer torchao's ``Float8Linear`` rejects.
    """
    plan = plan_for(model, policy)
    refuse_unswappable(plan, "torchao", mx=True)
    plan.refuse_off_region("torchao with torch.autocast", (*FLOAT8_RECIPES, Precision.MXFP8))
    check_fp8_shapes(model, plan)
    groups = tuple(
        Float8Group(recipe, frozenset(fqns)) for recipe, fqns in plan.fp8_groups().items()
    )
    mx = frozenset(plan.layers_at(Precision.MXFP8))
    if mx and plan.region is not None:
        raise StackError(
            f"torchao's MXFP8 training multiplies its input in autocast's {plan.region} against "
            f"an fp32 weight, which it refuses; {len(mx)} mxfp8 layer(s) in a {plan.region} "
            f"policy ({shown(sorted(mx))}): export with --to torchtitan (bf16 parameters) or "
            "--to megatron"
        )
    return TorchaoExport(plan, groups, AUTOCAST_DTYPES.get(plan.region or ""), mx)


def refuse_unswappable(plan: StackPlan, stack: str, mx: bool = False) -> None:
    """Refuse the block-scaled layers the stack has no module for: fp8_block and nvfp4, and
    mxfp8 unless ``mx``.

    Raises:
        StackError: one line naming them and the stacks that run them.
    """
    formats = [Precision.FP8_BLOCK, Precision.NVFP4, *(() if mx else (Precision.MXFP8,))]
    block = plan.layers_at(*formats)
    if block:
        found = sorted({plan.precisions[n].value for n in block})
        what = "float8 recipes and mxfp8" if mx else "float8 recipes"
        raise StackError(
            f"{stack} exports torchao's {what}; {len(block)} layer(s) are block-scaled "
            f"({', '.join(found)}): {shown(block)}; export those with --to megatron "
            "(Transformer Engine), or mxfp8 with --to torchtitan or torchao"
        )


def check_fp8_shapes(model: nn.Module, plan: StackPlan, stack: str = "torchao") -> None:
    """Refuse the fp8 and mxfp8 layers torchao's modules reject: the runnability table's rule
    (an ``nn.Linear`` with features multiples of 16, of 32 for mxfp8), whatever the device.

    Raises:
        NotRunnableError: one line naming the layers and why.
    """
    from autoprec.hardware.runnability import LayerShape, NotRunnableError, unrunnable
    from autoprec.runtime.native import CPU_NATIVE_PRECISIONS

    modules = dict(model.named_modules())
    low = {n: p for n, p in plan.precisions.items() if p.is_fp8 or p.is_mx}
    shapes = {n: LayerShape.of_module(modules[n]) for n in low}
    bad = unrunnable(low, CPU_NATIVE_PRECISIONS, shapes)
    if bad:
        names = shown(f"{n} ({v.precision.value}: {v.reason})" for n, v in bad.items())
        who = "torchao's modules" if stack == "torchao" else f"{stack}'s torchao modules"
        raise NotRunnableError(
            f"{who} cannot run {len(bad)} layer(s): {names}; give them the policy's 16-bit format",
            {n: f"{v.precision.value}: {v.reason}" for n, v in bad.items()},
        )


def apply_torchao(model: nn.Module, policy: PolicyLike) -> TorchaoExport:
    """Convert ``model`` for ``policy`` with torchao and check every module against it.

    Returns:
        The :class:`TorchaoExport`; run the forward in ``export.autocast(device_type)``.

    Raises:
        ValueError: as :func:`torchao_export`, or
            :class:`~autoprec.stacks.check.StackMismatchError` if a module does not run what
            the policy says after the conversion.
    """
    export = torchao_export(model, policy)
    export.convert(model)
    export.check(model)
    return export
