"""Emulate mode's fp8 recipes and mxfp8 on ``nn.Linear``: each of the three GEMMs with its own
casts.

torchao's rowwise recipes cast the same tensor differently for each GEMM it enters (the input
per token for the output, per input feature for the weight gradient; :data:`FLOAT8_RECIPES`),
so rounding a layer's operands once before its own computation (what :mod:`.casting` does for
tensorwise fp8 and the 16-bit formats) cannot reproduce them. An fp8-recipe Linear is therefore
swapped, like natively for torchao's ``Float8Linear`` (:class:`~.native.Float8Swap`), for an
:class:`EmulatedFloat8Linear` that shares its parameters and runs :class:`_Float8Matmul`:

- forward: ``output = cast(input) @ cast(weight).T`` with the recipe's output-GEMM casts;
- backward: ``grad_input = cast(grad_output) @ cast(weight)`` and ``grad_weight =
  cast(grad_output).T @ cast(input)``, each with its GEMM's casts; an operand the recipe keeps
  in high precision (``rowwise_with_gw_hp``'s weight gradient) enters unrounded.

Each cast is :class:`~autoprec.kernels.DynamicScaledCast` (torchao's
``hp_tensor_to_float8_dynamic`` bit for bit, per tensor or per row, power-of-two scales where
the recipe rounds them), the dequantised operands are multiplied in fp32, as CPU
``torch._scaled_mm`` does, and a GEMM with an operand scaled per row writes bf16, as
torchao has ``torch._scaled_mm`` do (:meth:`RecipeCasts.result`). Inside the
policy's autocast region (``stored``: bf16 or fp16) the layer reads its input in that format
and writes its output and both gradients in it, as ``Float8Linear`` does under autocast; the
bias is added after the GEMM in the output's format.

mxfp8 is :class:`EmulatedMXLinear`: :func:`autoprec.kernels.mx_linear`, which reproduces torchao's
``MXFP8Linear`` (its emulated kernel) bit for bit: e4m3 blocks of 32 along each GEMM's reduction
dimension, RCEIL scales; input and weight in :func:`~autoprec.precision.mx_io_format`'s dtype
(bf16 in a bf16 region, else fp32), as the native runtime hands them over.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from autoprec.kernels import DynamicScaledCast, fake_quantize, get_format, mx_linear, quantize
from autoprec.precision import GEMM_OPERANDS, MX_BLOCK, Precision, mx_io_format

__all__ = ["EmulatedFloat8Linear", "EmulatedMXLinear", "MXCasts", "RecipeCasts", "share_linear"]


@dataclass
class RecipeCasts:
    """The casters of one fp8-recipe Linear: one per (GEMM, operand), counting what they lose.

    Quacks like :class:`~.casting.LayerCasts` for :class:`~.layer.ManagedLayer`: ``active`` is
    False because the swapped module casts by itself (the layer's hooks round nothing).

    Args:
        precision: an fp8 precision (its :attr:`~autoprec.precision.Precision.recipe`).
        count: keep overflow/underflow counts.
        output_format: the autocast region's format the layer reads and writes (None: fp32).
    """

    precision: Precision
    count: bool = True
    output_format: str | None = None
    _casts: dict[tuple[str, str], DynamicScaledCast] = field(default_factory=dict, repr=False)

    active = False

    def __post_init__(self) -> None:
        recipe = self.precision.recipe
        for gemm, casts in recipe.gemms().items():
            for operand, spec in zip(GEMM_OPERANDS[gemm], casts, strict=True):
                if spec.fmt is not None:
                    self._casts[gemm, operand] = DynamicScaledCast(
                        spec.fmt, recipe.power_of_two, count=self.count, axis=spec.axis
                    )

    def cast(self, gemm: str, operand: str, x: Tensor) -> Tensor:
        """``x`` as ``gemm`` reads it: dequantised fp8 (float32), or ``x`` itself in high
        precision."""
        caster = self._casts.get((gemm, operand))
        return x if caster is None else caster(x).dequantize()

    def result(self, gemm: str, out: Tensor) -> Tensor:
        """``gemm``'s result as torchao writes it: an fp8 GEMM with an operand scaled per row
        runs the rowwise ``torch._scaled_mm`` (a per-tensor scale of the other operand is
        repeated into a row of scales, ``preprocess_addmm``) and leaves it in bf16 (torchao's
        workaround for its missing fp32 output, ``addmm_float8_unwrapped``; the power-of-two
        scales applied after it are exact), then goes to the layer's dtype."""
        a, b = self.precision.recipe.gemms()[gemm]
        rowwise = a.fmt is not None and (a.axis is not None or b.axis is not None)
        if rowwise and self.output_format != "bf16":
            out = quantize(out, "bf16")
        return self.stored(out)

    def stored(self, x: Tensor) -> Tensor:
        """``x`` rounded to the format the layer writes (unchanged outside a region)."""
        return x if self.output_format is None else quantize(x, self.output_format)

    def counts(self) -> tuple[int, int]:
        """(overflows, underflows) over every cast since creation."""
        over = sum(int(c.overflows) for c in self._casts.values())
        return over, sum(int(c.underflows) for c in self._casts.values())


def share_linear(cls: type[nn.Linear], module: nn.Linear, casts: object) -> nn.Linear:
    """A ``cls`` (an ``nn.Linear`` subclass) holding ``module``'s very parameters and
    ``casts`` (built on the meta device: no weights allocated)."""
    with torch.device("meta"):
        new = cls(module.in_features, module.out_features, bias=False)
    new.weight = module.weight
    new.bias = module.bias
    new.casts = casts
    return new


class _Float8Matmul(torch.autograd.Function):
    """``input @ weight.T`` with a recipe's casts per GEMM (see the module docstring)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, casts: RecipeCasts) -> Tensor:  # noqa: D102
        ctx.casts = casts
        ctx.save_for_backward(x, weight)
        x2 = x.detach().float().reshape(-1, x.shape[-1])
        w = weight.detach().float()
        out = casts.cast("output", "input", x2) @ casts.cast("output", "weight", w).t()
        out = casts.result("output", out)
        return out.reshape(*x.shape[:-1], out.shape[-1]).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None]:  # noqa: D102
        x, weight = ctx.saved_tensors
        casts: RecipeCasts = ctx.casts
        g2 = casts.stored(grad.float().reshape(-1, grad.shape[-1]))  # as the next op stored it
        x2 = x.detach().float().reshape(-1, x.shape[-1])
        w = weight.detach().float()
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            gx = casts.cast("grad_input", "grad_output", g2) @ casts.cast("grad_input", "weight", w)
            grad_x = casts.result("grad_input", gx).reshape(x.shape).to(x.dtype)
        if ctx.needs_input_grad[1]:
            gw = casts.cast("grad_weight", "grad_output", g2).t() @ casts.cast(
                "grad_weight", "input", x2
            )
            grad_w = casts.result("grad_weight", gw).to(weight.dtype)
        return grad_x, grad_w, None


class EmulatedFloat8Linear(nn.Linear):
    """An ``nn.Linear`` whose GEMMs run an fp8 recipe in emulation (built by
    :meth:`from_linear`, sharing the original's parameters)."""

    casts: RecipeCasts

    @classmethod
    def from_linear(cls, module: nn.Linear, casts: RecipeCasts) -> EmulatedFloat8Linear:
        """A module running ``module``'s very parameters under ``casts``."""
        return share_linear(cls, module, casts)

    def forward(self, input: Tensor) -> Tensor:  # noqa: D102
        stored = self.casts.output_format
        x = fake_quantize(input, stored, None)  # Float8Linear: input.to(autocast dtype)
        out = _Float8Matmul.apply(x, self.weight, self.casts)
        if self.bias is not None:  # Float8Linear: output + bias.to(output.dtype)
            # in the stored dtype: the bias rounded, the add and the bias gradient's sum too
            out = fake_quantize(out + fake_quantize(self.bias, stored, stored), stored, None)
        return out


@dataclass
class MXCasts:
    """A block-scaled layer's casting state (mxfp8 here, nvfp4 and fp8_block in
    :mod:`.block_emulate`) for :class:`~.layer.ManagedLayer`: its module casts by itself
    (``active`` False). Blocks scale to their own amax, so nothing overflows; flushes to zero
    are not counted (``counts()`` is zeros)."""

    precision: Precision = Precision.MXFP8
    count: bool = False
    output_format: str | None = None

    active = False

    def counts(self) -> tuple[int, int]:
        """(0, 0): see the class docstring."""
        return 0, 0


class EmulatedMXLinear(nn.Linear):
    """An ``nn.Linear`` whose GEMMs run MXFP8 in emulation (built by :meth:`from_linear`,
    sharing the original's parameters)."""

    casts: MXCasts

    @classmethod
    def from_linear(cls, module: nn.Linear, region: str | None = None) -> EmulatedMXLinear:
        """A module running ``module``'s very parameters in mxfp8, inside an autocast region
        of format ``region`` (None: none)."""
        return share_linear(cls, module, MXCasts(output_format=region))

    def forward(self, input: Tensor) -> Tensor:  # noqa: D102
        # as natively (runtime.native_blocks.mx_module): input and weight in mx_io_format's dtype,
        # the GEMMs' result in it, handed on in the input's dtype (emulate mode's fp32)
        io = get_format(mx_io_format(self.casts.output_format)).torch_dtype
        dtype = self.weight.dtype if io == torch.float32 else io
        x, weight = input.to(dtype), self.weight.to(dtype)
        out = mx_linear(x, weight, self.bias, elem="fp8_e4m3", block_size=MX_BLOCK, scaling="rceil")
        return out.to(input.dtype)
