"""Megatron-LM with Transformer Engine: a policy as ``--te-precision-config-file``.

Megatron reads a YAML file of named ``configs`` (each ``transformer_engine_config_type:
TEQuantizationParams`` with a ``training_recipe``: ``fp8_quantization_recipe`` one of
``tensorwise``, ``blockwise``, ``mxfp8``, or ``fp4_quantization_recipe: nvfp4``, or nothing
for bf16) and ordered ``matchers`` (``type: glob``, ``pattern`` matched with ``fnmatch``
against a module's path, ``config``; the first that matches wins), per
``megatron/core/quantization/quant_config.py`` and ``extensions/transformer_engine.py``.

Megatron's GPT names its GEMMs ``decoder.layers.N.self_attention.linear_qkv`` (the query, key
and value projections fused), ``.linear_proj``, ``.mlp.linear_fc1`` (gate and up fused),
``.mlp.linear_fc2`` and ``output_layer``; the zoo's llama uses torchtitan's names, mapped here
(:data:`MEGATRON_NAMES`). Layers Megatron fuses must share a precision. The precisions map to
TE's recipes: ``fp8`` to ``Float8CurrentScaling`` with the HYBRID format (e4m3 forward, e5m2
gradients: torchao's tensorwise), ``fp8_block`` to ``Float8BlockScaling``, ``mxfp8`` to
``MXFP8BlockScaling``, ``nvfp4`` to ``NVFP4BlockScaling``, ``bf16`` to no recipe (under
``--bf16``). TE has no rowwise recipe, and Megatron keeps unquantised layers in one 16-bit
format (``--bf16``): fp8_rowwise, fp32, tf32 and fp16 layers are refused in one line.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import yaml
from torch import nn

from autoprec.precision import Precision
from autoprec.stacks.plan import StackError, plan_for, shown

if TYPE_CHECKING:  # pragma: no cover
    from autoprec.policy.precision_policy import PolicyLike

__all__ = ["MEGATRON_NAMES", "TE_RECIPES", "MegatronExport", "megatron_export", "megatron_name"]

#: torchtitan's (the zoo llama's) layer names -> Megatron GPT's module paths.
MEGATRON_NAMES = (
    (r"layers\.(\d+)\.attention\.(wq|wk|wv)", r"decoder.layers.\1.self_attention.linear_qkv"),
    (r"layers\.(\d+)\.attention\.wo", r"decoder.layers.\1.self_attention.linear_proj"),
    (r"layers\.(\d+)\.feed_forward\.(w1|w3)", r"decoder.layers.\1.mlp.linear_fc1"),
    (r"layers\.(\d+)\.feed_forward\.w2", r"decoder.layers.\1.mlp.linear_fc2"),
    (r"output", "output_layer"),
)

#: Each precision Megatron runs -> (config name, TE ``training_recipe``).
TE_RECIPES: Mapping[Precision, tuple[str, dict[str, Any]]] = {
    Precision.BF16: ("bf16", {}),
    Precision.FP8: ("fp8", {"fp8_quantization_recipe": "tensorwise", "fp8_format": "hybrid"}),
    Precision.FP8_BLOCK: ("fp8_block", {"fp8_quantization_recipe": "blockwise"}),
    Precision.MXFP8: ("mxfp8", {"fp8_quantization_recipe": "mxfp8"}),
    Precision.NVFP4: ("nvfp4", {"fp4_quantization_recipe": "nvfp4"}),
}


def megatron_name(name: str) -> str | None:
    """Megatron GPT's module path of the layer called ``name`` in torchtitan's Llama, None
    for a name without one."""
    for pattern, replacement in MEGATRON_NAMES:
        if re.fullmatch(pattern, name):
            return re.sub(pattern, replacement, name)
    return None


@dataclass(frozen=True)
class MegatronExport:
    """Megatron's per-module precisions: ``{Megatron module path: precision}``."""

    modules: Mapping[str, Precision]

    def config(self) -> dict[str, Any]:
        """The file's content: ``configs`` (the recipes used) and one matcher per module."""
        used = dict.fromkeys(self.modules.values())
        configs = {}
        for precision in used:
            name, recipe = TE_RECIPES[precision]
            if precision is not Precision.BF16:  # quantise where the run's default does not
                recipe = {**recipe, "override_nonquantized_autocast": True}
            configs[name] = {
                "transformer_engine_config_type": "TEQuantizationParams",
                "training_recipe": recipe,
            }
        matchers = {
            path: {
                "type": "glob",
                "enabled": True,
                "pattern": f"*{path}",
                "config": TE_RECIPES[p][0],
            }
            for path, p in self.modules.items()
        }
        return {"configs": configs, "matchers": matchers}

    def yaml(self, source: str) -> str:
        """The file, with a header naming the policy and the flags it goes with."""
        header = (
            f"# Megatron-LM precision config for {source}, written by `autoprec export`.\n"
            "# Run with: --transformer-impl transformer_engine --bf16 "
            "--te-precision-config-file THIS_FILE\n"
        )
        return header + yaml.safe_dump(self.config(), sort_keys=False)


def megatron_export(model: nn.Module, policy: PolicyLike) -> MegatronExport:
    """Megatron's precision config for ``policy`` on ``model`` (torchtitan's Llama names).

    Raises:
        PolicyMismatchError: the policy names a module ``model`` does not have.
        StackError: a layer without a Megatron counterpart, fused layers at different
            precisions, or a precision Megatron with TE does not run per module (one line).
    """
    plan = plan_for(model, policy)
    unnamed = [n for n in plan.precisions if megatron_name(n) is None]
    if unnamed:
        raise StackError(
            f"the Megatron export maps torchtitan's Llama names (layers.N.attention.wq, ..., "
            f"output) onto Megatron's GPT; {shown(unnamed)} has no counterpart there"
        )
    odd = {n: p for n, p in plan.precisions.items() if p not in TE_RECIPES}
    if odd:
        names = shown(f"{n} ({p.value})" for n, p in odd.items())
        raise StackError(
            f"Megatron with Transformer Engine runs bf16, fp8 (tensorwise), fp8_block, mxfp8 "
            f"and nvfp4 per module; {len(odd)} layer(s) are not: {names}; the nearest policy "
            "it runs has the fp8 recipes at fp8 and the wider formats at bf16"
        )
    modules: dict[str, Precision] = {}
    fused: dict[str, list[str]] = {}
    for name, precision in plan.precisions.items():
        path = megatron_name(name)
        fused.setdefault(path, []).append(name)
        if modules.setdefault(path, precision) is not precision:
            parts = ", ".join(f"{n} ({plan.precisions[n].value})" for n in fused[path])
            raise StackError(f"Megatron runs {parts} as one GEMM ({path}); give them one precision")
    return MegatronExport(modules)
