"""Per-layer casting state for the emulate mode: which format each operand takes, and the
overflow/underflow counts the guard reads.

A layer has three tensor streams: its input(s) and its weight(s) in forward, the gradient with
respect to its output in backward. Plain formats round with :func:`autoprec.kernels.quantize`;
fp8 streams each own a :class:`~autoprec.kernels.ScaledCast` (delayed scaling per tensor), as
Transformer Engine keeps one scale per tensor.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from autoprec.kernels import (
    Format,
    ScaledCast,
    fake_quantize,
    get_format,
    quantize,
    quantize_with_counts,
)
from autoprec.precision import Precision

STREAMS = ("input", "weight", "grad_output")


class _Counter:
    """Overflow and underflow counts kept as device tensors, read (synchronising) on demand."""

    def __init__(self) -> None:
        self.overflows: Tensor | int = 0
        self.underflows: Tensor | int = 0

    def read(self) -> tuple[int, int]:
        return int(self.overflows), int(self.underflows)


class _CountedCast:
    """A plain-format cast that also counts what it saturated, turned to inf or flushed."""

    def __init__(self, fmt: Format, counter: _Counter) -> None:
        self.fmt = fmt
        self.counter = counter

    def __call__(self, x: Tensor) -> Tensor:
        rounded, overflows, underflows = quantize_with_counts(x.detach(), self.fmt)
        self.counter.overflows = self.counter.overflows + overflows
        self.counter.underflows = self.counter.underflows + underflows
        return rounded


@dataclass
class LayerCasts:
    """The casters of one layer at one precision.

    Args:
        precision: the layer's precision; fp32 means no casting at all.
        count: keep overflow/underflow counts (costs two reductions per cast).
    """

    precision: Precision
    count: bool = True
    _counters: dict[str, _Counter] = field(default_factory=dict, repr=False)
    _scaled: dict[str, ScaledCast] = field(default_factory=dict, repr=False)
    _base: dict[str, tuple[int, int]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        for stream in STREAMS:
            self._counters[stream] = _Counter()
        if self.precision.scaled:
            self._scaled = {
                "input": ScaledCast(self.precision.forward_format),
                "weight": ScaledCast(self.precision.forward_format),
                "grad_output": ScaledCast(self.precision.backward_format),
            }

    @property
    def active(self) -> bool:
        return self.precision is not Precision.FP32

    def _caster(self, stream: str):
        if stream in self._scaled:
            return self._scaled[stream]
        fmt_name = (
            self.precision.backward_format
            if stream == "grad_output"
            else self.precision.forward_format
        )
        fmt = get_format(fmt_name)
        return _CountedCast(fmt, self._counters[stream]) if self.count else fmt

    def forward_operand(self, x: Tensor, stream: str) -> Tensor:
        """``x`` rounded for the forward matmul; its gradient passes straight through."""
        if not self.active or not torch.is_floating_point(x):
            return x
        caster = self._caster(stream)
        if isinstance(caster, _CountedCast):
            return _RoundForward.apply(x, caster)
        return fake_quantize(x, caster, None)

    def backward_gradient(
        self, out: Tensor, scale: Callable[[Tensor], Tensor] | None = None
    ) -> Tensor:
        """``out`` itself; the gradient arriving at it is rounded to the backward format.

        ``scale``, if given, maps the arriving gradient to a power-of-two factor: the gradient
        is multiplied by it before the rounding and divided by it after (both exact), which
        moves it into the format's range (per-layer scaling, :mod:`.layer_scaling`).

        A tensor hook rather than an autograd function: a function returning its input would
        hand back a view, and the in-place activation that often follows a layer
        (``nn.ReLU(inplace=True)`` in torchvision's MobileNet, EfficientNet, VGG) may not modify
        a view made by a custom function. The hook sees the gradient of ``out`` as the layer
        produced it, before any later in-place change.
        """
        if not self.active or not torch.is_floating_point(out) or not out.requires_grad:
            return out
        caster = self._caster("grad_output")
        out.register_hook(lambda grad: _round_gradient(caster, grad, scale))
        return out

    def counts(self) -> tuple[int, int]:
        """(overflows, underflows) over all streams since creation."""
        over = under = 0
        for stream in STREAMS:
            if stream in self._scaled:
                cast = self._scaled[stream]
                o, u = cast.overflows, cast.underflows
            else:
                o, u = self._counters[stream].read()
            over, under = over + o, under + u
        return over, under


class _RoundForward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, caster):  # noqa: D102
        ctx.dtype = x.dtype
        return caster(x).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        return grad, None


def _round_gradient(
    caster: Format | ScaledCast | _CountedCast,
    grad: Tensor,
    scale: Callable[[Tensor], Tensor] | None = None,
) -> Tensor:
    """``grad`` rounded by ``caster`` (scaled, counted or plain), in ``grad``'s dtype; with
    ``scale``, rounded as ``grad * s`` and divided by ``s`` again."""
    factor = None if scale is None else scale(grad).to(grad.dtype)
    x = grad if factor is None else grad * factor
    if isinstance(caster, ScaledCast):
        rounded = caster(x).dequantize()
    elif isinstance(caster, _CountedCast):
        rounded = caster(x)
    else:
        rounded = quantize(x, caster)
    rounded = rounded.to(grad.dtype)
    return rounded if factor is None else rounded / factor
