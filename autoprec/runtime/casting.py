"""Per-layer casting state for the emulate mode: the formats a layer's tensors take, at the
boundaries where the native program casts them, and the overflow/underflow counts the guard reads.

Emulation reproduces the native program of each precision (docs/architecture.md): the layer's own
fp32 computation runs on operands rounded as native hardware reads them, and its results are
rounded to the dtype native code stores them in. Per precision:

| precision | operands (input, weight) | output stored | operand gradients | output gradient |
|-----------|--------------------------|---------------|-------------------|-----------------|
| tf32      | tf32                     | fp32          | fp32              | tf32            |
| bf16/fp16 | bf16/fp16                | bf16/fp16     | bf16/fp16         | bf16/fp16       |
| fp8       | e4m3, current scaling    | input's dtype | input's dtype     | e5m2, current scaling |

- bf16/fp16 follow ``torch.autocast``: the layer's GEMM reads 16-bit operands, accumulates in
  fp32 and writes its output in 16 bits (so activations flow at low precision to the next op);
  in backward the GEMMs write the gradients with respect to input and weight in 16 bits too,
  which the cast back to the fp32 master weight only widens.
- fp8 follows torchao's ``Float8Linear`` with its default ``Float8LinearConfig`` (tensorwise,
  dynamic): input and weight are cast to e4m3, the output gradient to e5m2, each scaled by its
  own current amax (:class:`~autoprec.kernels.DynamicScaledCast`), no history kept; both
  backward GEMMs reuse the e4m3 operands of forward (torchao recasts the saved high-precision
  tensors with the same amax, hence the same bits). The GEMMs write the input's dtype, fp32
  here, unless ``output_format`` says the native program runs the layer under autocast.
- tf32 rounds the operands of every GEMM, forward and backward, to 10 mantissa bits; results
  stay fp32.

The bias is the caller's to hand over: autocast rounds a 16-bit layer's bias to bf16/fp16
before adding it (the runtime passes it through ``forward_operand(bias, "bias")``), and
torchao adds an fp8 layer's bias after its fp8 GEMM, so that its gradient sums the unrounded
output gradient (the runtime adds it after :meth:`LayerCasts.backward_gradient`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from autoprec.kernels import DynamicScaledCast, Format, get_format, quantize, quantize_counted
from autoprec.precision import Precision

STREAMS = (
    "input",
    "weight",
    "bias",
    "output",
    "grad_output",
    "grad_input",
    "grad_weight",
    "grad_bias",
)
_OPERANDS = ("input", "weight", "bias")
_AUTO = "auto"
# the dtype autocast stores a 16-bit layer's results in; other precisions store fp32
_STORED = {Precision.BF16: "bf16", Precision.FP16: "fp16"}


class _Cast:
    """One stream's cast: ``x`` onto the format's grid as float32 (dequantised when scaled),
    counting what overflowed or flushed to zero.

    Args:
        fmt: the format.
        scaled: current per-tensor scaling (fp8), else a plain rounding.
        count: keep overflow/underflow counts.
        fresh_only: count only overflows this cast causes, not non-finite values that arrive
            (results of a layer, whose infinities the operand casts counted already).
    """

    def __init__(self, fmt: Format, *, scaled: bool, count: bool, fresh_only: bool = False):
        self.fmt = fmt
        self.scaled = DynamicScaledCast(fmt, count=count) if scaled else None
        self.count = count
        self.fresh_only = fresh_only
        self._counts: Tensor | None = None  # [overflows, underflows], on an accelerator
        self._host = [0, 0]  # the same, of CPU tensors: read back at once (free there)

    def __call__(self, x: Tensor) -> Tensor:
        x = x.detach()
        if self.scaled is not None:
            return self.scaled.round_trip(x)  # scale, round, count, unscale: one kernel
        if not self.count:
            return quantize(x, self.fmt)
        rounded, counts = quantize_counted(x, self.fmt)  # counted in the one kernel
        # the fused count includes every non-finite value that arrived (its result is not
        # finite either): a fresh-only stream takes them off
        if x.device.type == "cpu":  # look for them only when something overflowed
            over, under = counts.tolist()
            if over and self.fresh_only:
                over -= int((~torch.isfinite(x)).sum())
            self._host[0] += over
            self._host[1] += under
            return rounded
        if self.fresh_only:
            arrived = (~torch.isfinite(x)).sum()
            counts = counts - torch.stack((arrived, torch.zeros_like(arrived)))
        # summed in place, on the device: one small operation a call, no synchronisation
        self._counts = counts.long() if self._counts is None else self._counts.add_(counts)
        return rounded

    def counts(self) -> tuple[int, int]:
        if self.scaled is not None:
            return self.scaled.overflows, self.scaled.underflows
        over, under = self._host
        if self._counts is not None:
            device_over, device_under = self._counts.tolist()
            over, under = over + device_over, under + device_under
        return over, under


class _Call:
    """What one forward call's nodes share in backward: the power-of-two factor the output
    gradient was scaled by (per-layer scaling), which the operand gradients are rounded under."""

    factor: Tensor | None = None


@dataclass
class LayerCasts:
    """The casters of one layer at one precision.

    Args:
        precision: the layer's precision; fp32 means no casting at all.
        count: keep overflow/underflow counts (costs two reductions per cast).
        output_format: the format native code stores the layer's results in (its output in
            forward, the gradients with respect to its operands in backward): ``"auto"`` is
            the layer's own format for bf16/fp16 (autocast) and fp32 otherwise; an fp8 layer
            run by torchao under bf16 autocast stores bf16 (``output_format="bf16"``, which also
            rounds its input to bf16 before the fp8 cast, as ``Float8Linear`` does). ``None``
            or ``"fp32"``: results stay fp32.

    Raises:
        ValueError: ``output_format`` is not a known format.
    """

    precision: Precision
    count: bool = True
    output_format: str | None = _AUTO
    _casts: dict[str, _Cast] = field(default_factory=dict, repr=False)
    _call: _Call | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.output_format == _AUTO:
            self.output_format = _STORED.get(self.precision)
        elif self.output_format is not None:
            self.output_format = get_format(self.output_format).name
            if self.output_format == "fp32":
                self.output_format = None
        if not self.active:
            return
        scaled = self.precision.scaled
        forward = get_format(self.precision.forward_format)
        backward = get_format(self.precision.backward_format)
        self._casts = {
            "input": _Cast(forward, scaled=scaled, count=self.count),
            "weight": _Cast(forward, scaled=scaled, count=self.count),
            "grad_output": _Cast(backward, scaled=scaled, count=self.count),
        }
        if self.output_format is not None:
            stored = get_format(self.output_format)
            for stream in ("bias", "output", "grad_input", "grad_weight", "grad_bias"):
                self._casts[stream] = _Cast(stored, scaled=False, count=self.count, fresh_only=True)

    @property
    def active(self) -> bool:
        return self.precision is not Precision.FP32

    def forward_operand(self, x: Tensor, stream: str) -> Tensor:
        """``x`` rounded for the forward matmul (``stream``: ``"input"`` or ``"weight"``), or a
        bias (``"bias"``) rounded to ``output_format``, the dtype native code adds it in
        (autocast casts the bias with the weight; torchao adds it in the output's dtype).

        In backward the gradient arriving at the rounded operand is rounded to
        ``output_format`` (the dtype the native backward GEMM writes), else passed straight
        through.

        Raises:
            ValueError: an unknown stream.
        """
        if stream not in _OPERANDS:
            raise ValueError(f"unknown operand stream {stream!r}; expected input, weight or bias")
        if not self.active or not torch.is_floating_point(x):
            return x
        if stream == "bias" and self.output_format is None:
            return x
        if self._call is None:
            self._call = _Call()
        return _CastOperand.apply(x, self, stream, self._call)

    def backward_gradient(
        self, out: Tensor, scale: Callable[[Tensor], Tensor] | None = None
    ) -> Tensor:
        """The layer's output as native code stores it; the gradient arriving at it is rounded
        to the backward format.

        For bf16/fp16 (and any ``output_format``) the output is rounded to that format by an
        autograd function returning a fresh tensor, whose backward rounds the gradient. Else
        ``out`` itself is returned and a tensor hook rounds its gradient. Neither hands back a
        view: the in-place activation that often follows a layer (``nn.ReLU(inplace=True)`` in
        torchvision's MobileNet, EfficientNet, VGG) may not modify a view made by a custom
        function. Both see the gradient of the output as the layer produced it, before any
        later in-place change.

        ``scale``, if given, maps the arriving gradient to a power-of-two factor: the gradient
        is multiplied by it before the rounding and divided by it after (both exact), which
        moves it into the format's range (per-layer scaling, :mod:`.layer_scaling`); the
        gradients of the layer's operands are rounded under the same factor.
        """
        call, self._call = self._call or _Call(), None
        if not self.active or not torch.is_floating_point(out):
            return out
        if self.output_format is None:
            if out.requires_grad:
                out.register_hook(lambda grad: self._output_gradient(grad, scale, call))
            return out
        return _RoundOutput.apply(out, self, scale, call)

    def counts(self) -> tuple[int, int]:
        """(overflows, underflows) over all streams since creation."""
        over = under = 0
        for cast in self._casts.values():
            o, u = cast.counts()
            over, under = over + o, under + u
        return over, under

    # --- the casts, in the order native code makes them -------------------------------------------
    def _operand(self, x: Tensor, stream: str) -> Tensor:
        if self.precision.scaled and stream == "input" and self.output_format is not None:
            x = quantize(x.detach(), self.output_format)  # Float8Linear: input.to(autocast dtype)
        return self._casts[stream](x)

    def _output_gradient(
        self, grad: Tensor, scale: Callable[[Tensor], Tensor] | None, call: _Call
    ) -> Tensor:
        x = grad
        if self.output_format not in (None, self.precision.backward_format):
            x = quantize(x.detach(), self.output_format)  # as the next op stored it
        factor = None if scale is None else scale(grad).to(grad.dtype)
        call.factor = factor
        if factor is not None:
            x = x * factor
        rounded = self._casts["grad_output"](x).to(grad.dtype)
        return rounded if factor is None else rounded / factor

    def _operand_gradient(self, grad: Tensor, stream: str, call: _Call) -> Tensor:
        if self.output_format is None:
            return grad
        factor = call.factor
        x = grad if factor is None else grad * factor
        rounded = self._casts[f"grad_{stream}"](x).to(grad.dtype)
        return rounded if factor is None else rounded / factor


class _CastOperand(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, casts, stream, call):  # noqa: D102
        ctx.casts, ctx.stream, ctx.call = casts, stream, call
        return casts._operand(x, stream).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        return ctx.casts._operand_gradient(grad, ctx.stream, ctx.call), None, None, None


class _RoundOutput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out, casts, scale, call):  # noqa: D102
        ctx.casts, ctx.scale, ctx.call = casts, scale, call
        return casts._casts["output"](out).to(out.dtype)

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        return ctx.casts._output_gradient(grad, ctx.scale, ctx.call), None, None, None
