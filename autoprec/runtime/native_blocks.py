"""Native mode's block-scaled Linears: the torchao modules swapped in for mxfp8, fp8_block and
nvfp4 layers, and the refusal of the formats the local device cannot run natively.

mxfp8 is torchao's ``MXFP8Linear`` on any device (its emulated kernel off CUDA). fp8_block
(``Float8BlockwiseLinear``) and nvfp4 (``NVFP4Linear`` from ``NVFP4TrainingConfig``) are Triton
kernels for CUDA sm90+ and sm100: :func:`refuse_block` refuses them elsewhere in one line
naming the backends and the target (:data:`NATIVE_BLOCK`). The CPU tests cover the refusal and
the mxfp8 module; the fp8_block and nvfp4 modules need a GPU and are not exercised here.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Mapping

import torch
from torch import nn

from autoprec.hardware.runnability import NotRunnableError
from autoprec.precision import Precision

__all__ = ["NATIVE_BLOCK", "block_module", "mx_module", "refuse_block"]


#: The block formats only CUDA runs natively: (the backends that run it, the target, the
#: compute capability autoprec's native module needs, the torchao module it swaps in).
NATIVE_BLOCK = {
    Precision.FP8_BLOCK: (
        "torchao (Float8BlockwiseLinear) or Transformer Engine (Float8BlockScaling)",
        "Hopper or Blackwell (sm90+)",
        (9, 0),
        "torchao.prototype.blockwise_fp8_training",
    ),
    Precision.NVFP4: (
        "Transformer Engine (NVFP4BlockScaling) or torchao (NVFP4TrainingConfig)",
        "Blackwell (sm100)",
        (10, 0),
        "torchao.prototype.moe_training.nvfp4_training",
    ),
}


def refuse_block(layers: Mapping[str, tuple[nn.Module, Precision]], device_type: str) -> None:
    """Refuse the block formats of :data:`NATIVE_BLOCK` where autoprec's native modules cannot
    run them: off CUDA, on an older GPU, without torchao's module, or (nvfp4) with K or N not
    multiples of 128 (torchao's rule)."""
    for precision, (backends, target, capability, module) in NATIVE_BLOCK.items():
        chosen = {n or "<model>": m for n, (m, p) in layers.items() if p is precision}
        if not chosen:
            continue
        runs = (
            device_type == "cuda"
            and torch.cuda.get_device_capability() >= capability
            and importlib.util.find_spec("torchao") is not None
            and importlib.util.find_spec(module) is not None
        )
        if runs and precision is Precision.NVFP4:
            chosen = {n: m for n, m in chosen.items() if not _multiple_of_128(m)}
        elif runs:
            continue
        if chosen:
            names = list(chosen)
            more = f" and {len(names) - 4} more" if len(names) > 4 else ""
            why = f"runs natively with {backends} on {target}"
            if runs:  # a Blackwell GPU, torchao's module: the shapes
                why = (
                    "runs natively here as torchao's NVFP4Linear, "
                    "whose in/out features must be multiples of 128"
                )
            raise NotRunnableError(
                f"{precision.value} {why}; on this machine use --mode emulate (mode='emulate') "
                f"for layer(s) {', '.join(names[:4])}{more}",
                {n: f"{precision.value}: needs {target}" for n in names},
            )


def _multiple_of_128(module: nn.Module) -> bool:
    return all(getattr(module, f, 0) % 128 == 0 for f in ("in_features", "out_features"))


def mx_module(module: nn.Module) -> nn.Module:
    """torchao's ``MXFP8Linear`` (RCEIL scales, e4m3 blocks of 32 in all three GEMMs) running
    ``module``'s very parameters: cuBLAS's MX GEMM on a GPU (``KernelPreference.AUTO``),
    torchao's emulated kernel elsewhere. It multiplies its input with its weight cast to the
    input's dtype, a differentiable cast each step (:func:`~autoprec.precision.mx_io_format`:
    what FSDP2's bf16 ``param_dtype`` hands torchao's module in torchtitan)."""
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

    cuda = module.weight.device.type == "cuda"
    with torch.device("meta"):
        new = _mx_linear_class()(
            module.in_features,
            module.out_features,
            bias=False,
            kernel_preference=KernelPreference.AUTO if cuda else KernelPreference.EMULATED,
            scale_calculation_mode=ScaleCalculationMode.RCEIL,
        )
    new.weight = module.weight
    new.bias = module.bias
    return new


@functools.cache
def _mx_linear_class() -> type[nn.Module]:
    """torchao's ``MXFP8Linear`` reading its weight in its input's dtype (see :func:`mx_module`)."""
    from torchao.prototype.moe_training.mxfp8_linear import (
        MXFP8Linear,
        _to_mxfp8_then_scaled_mm,
    )

    class MXFP8Linear(MXFP8Linear):  # noqa: D101 - the name torchao's users know
        def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: D102
            output = _to_mxfp8_then_scaled_mm(
                input,
                self.weight.to(input.dtype),
                kernel_preference=self.kernel_preference,
                scale_calculation_mode=self.scale_calculation_mode,
                wgrad_with_hp=self.wgrad_with_hp,
            )
            if self.bias is not None:
                output = output + self.bias.to(output.dtype)
            return output

    return MXFP8Linear


def blockwise_module(name: str, module: nn.Module) -> nn.Module:
    """torchao's ``Float8BlockwiseLinear`` (1x128 / 128x128 e4m3, Triton, CUDA sm90+) running
    ``module``'s very weight; the bias (which torchao's module refuses) is added after, in the
    output's dtype, as TE's ``Float8BlockScaling`` Linear does. Untested here (no GPU)."""
    from torchao.prototype.blockwise_fp8_training.linear import Float8BlockwiseLinear

    bias = module.bias
    with torch.device("meta"):
        new = Float8BlockwiseLinear(module.in_features, module.out_features, bias=False)
    new.weight = module.weight
    if bias is None:
        return new

    class _WithBias(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner, self.bias = new, bias
            self.weight = new.weight

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = self.inner(x)
            return out + self.bias.to(out.dtype)

    return _WithBias()


def nvfp4_module(name: str, module: nn.Module) -> nn.Module:
    """torchao's ``NVFP4Linear`` (``NVFP4TrainingConfig``: all three GEMMs in NVFP4, Triton,
    CUDA sm100) running ``module``'s very parameters, with the layer's own Hadamard signs
    (those the emulation draws, :func:`~.block_emulate.rht_signs`). Untested here (no GPU)."""
    from torchao.prototype.moe_training.nvfp4_training.nvfp4_training import NVFP4Linear

    from autoprec.runtime.block_emulate import rht_signs

    return NVFP4Linear.from_linear(module, rht_sign_vector=rht_signs(name, torch.initial_seed()))


def block_module(name: str, module: nn.Module, precision: Precision) -> nn.Module:
    """The native module of block-scaled layer ``name`` (``module``'s very parameters)."""
    if precision is Precision.MXFP8:
        return mx_module(module)
    if precision is Precision.FP8_BLOCK:
        return blockwise_module(name, module)
    return nvfp4_module(name, module)
