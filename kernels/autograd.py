"""Rounding with separate formats for the forward value and the backward gradient.

``fake_quantize(x, forward="fp8_e4m3", backward="fp8_e5m2")`` returns ``x`` rounded to the
forward format; in backward, the incoming gradient is rounded to the backward format and passed
through unchanged otherwise (the straight-through estimator: the rounding itself is treated as
the identity). This is the building block the runtime's emulate mode puts around a layer's
operands: tensor cores read low-precision operands and produce low-precision gradients, while
accumulation stays in fp32.

A side may be a format name, a :class:`Format`, a :class:`ScaledCast` (scale, round, unscale:
delayed scaling for fp8 and fp16), a :class:`DynamicScaledCast` (the same with the tensor's own
amax, as torchao's float8 training) or ``None`` (leave that side in fp32).

Example:
    >>> x = torch.randn(4, requires_grad=True)
    >>> y = fake_quantize(x, "bf16", "fp8_e5m2")
    >>> y.sum().backward()  # x.grad holds ones rounded to e5m2: exactly ones
"""

from __future__ import annotations

import torch
from torch import Tensor

from .formats import Format, get_format
from .quantize import quantize
from .scaling import DynamicScaledCast, ScaledCast

__all__ = ["fake_quantize", "Caster"]

Caster = str | Format | ScaledCast | DynamicScaledCast | None
_Scaled = (ScaledCast, DynamicScaledCast)


def _apply(
    x: Tensor,
    side: Format | ScaledCast | DynamicScaledCast | None,
    rounding: str,
    saturate: bool,
    generator,
) -> Tensor:
    if side is None:
        return x
    if isinstance(side, _Scaled):
        return side(x, generator=generator).dequantize()
    return quantize(x, side, rounding=rounding, saturate=saturate, generator=generator)


def _resolve(side: Caster) -> Format | ScaledCast | DynamicScaledCast | None:
    if side is None or isinstance(side, _Scaled):
        return side
    fmt = get_format(side)
    return None if fmt.name == "fp32" else fmt


class _FakeQuantize(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, forward, backward, rounding, saturate, generator):  # noqa: D102
        ctx.backward_side = backward
        ctx.rounding = rounding
        ctx.saturate = saturate
        ctx.generator = generator
        ctx.input_dtype = x.dtype
        return _apply(x, forward, rounding, saturate, generator).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        g = _apply(grad, ctx.backward_side, ctx.rounding, ctx.saturate, ctx.generator)
        return g.to(ctx.input_dtype), None, None, None, None, None


def fake_quantize(
    x: Tensor,
    forward: Caster = "bf16",
    backward: Caster = None,
    *,
    rounding: str = "nearest",
    saturate: bool = False,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Round ``x`` to ``forward``'s grid and its gradient to ``backward``'s.

    Args:
        x: a float32, float16 or bfloat16 tensor.
        forward: format (or scaled cast) for the value; ``None``/``"fp32"`` leaves it unchanged.
        backward: format (or scaled cast) for the gradient; ``None``/``"fp32"`` passes it through.
        rounding: ``"nearest"`` or ``"stochastic"`` for plain formats (a scaled cast has its own).
        saturate: clamp finite overflows to the largest finite value (plain formats).
        generator: random source for stochastic rounding.

    Returns:
        A tensor of ``x``'s dtype holding the rounded values, differentiable with respect to x.
    """
    fwd, bwd = _resolve(forward), _resolve(backward)
    if fwd is None and bwd is None:
        return x
    return _FakeQuantize.apply(x, fwd, bwd, rounding, saturate, generator)
