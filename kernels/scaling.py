"""Per-tensor scaled casting for fp8 (and fp16): current scaling, as torchao.float8's tensorwise
recipe, and delayed scaling, as Transformer Engine.

A narrow format (fp8, and fp16 for gradients) covers only a few binades, so a tensor is
multiplied by a scale before it is cast and divided by it after. With *delayed scaling* the scale
used at step t comes from the absolute maxima (amax) seen at earlier steps, so no extra pass over
the tensor is needed before casting:

    scale = max_finite / (amax * 2**margin)

where ``amax`` is the maximum (or the most recent value) of a rolling history. The first call,
with an empty history, scales by its own amax. A zero or non-finite amax keeps the previous scale.
Values that saturate (``|x * scale| > max_finite``) count as overflows, non-zero values that
become zero count as underflows; the counters live on the tensor's device so that counting does
not synchronise a GPU.

With *current* (dynamic) scaling, :class:`DynamicScaledCast`, the scale comes from the tensor
being cast, with nothing kept from one call to the next. This is what torchao's float8 training
does by default (``Float8LinearConfig()``: tensorwise, dynamic, for input, weight and
grad_output), and the runtime's emulate mode follows it bit for bit (:func:`amax_to_scale`).

Example:
    >>> cast = ScaledCast("fp8_e4m3", history_len=16)
    >>> out = cast(torch.randn(64, 64))
    >>> out.data.abs().max() <= 448, out.dequantize().shape
    (tensor(True), torch.Size([64, 64]))
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from .dispatch import Kernel
from .formats import FORMATS, Format, get_format
from .quantize import (
    GRAPH_MAX_NUMEL,
    check_rounding,
    constant_tensors,
    quantize,
    round_bits,
    round_split,
    shaped,
    splits,
    unpack_constants,
    with_sign,
)

__all__ = [
    "AMAX_EPS",
    "AMAX_RULES",
    "DynamicScaledCast",
    "ScaledCast",
    "ScaledTensor",
    "amax_to_scale",
]

AMAX_RULES = ("max", "most_recent")

# torchao.float8.float8_utils.EPS: the smallest amax a scale is computed from, so that an
# all-zero tensor gets a large finite scale instead of inf.
AMAX_EPS = 1e-12


class ScaledTensor(NamedTuple):
    """A tensor cast in the scaled domain: ``data`` lies on the format's grid, ``data / scale``
    approximates the original."""

    data: Tensor
    scale: Tensor

    def dequantize(self) -> Tensor:
        """Back to the original range (float32): ``data`` times the inverse scale, which is what
        torchao hands ``torch._scaled_mm`` (``scale.reciprocal()``), so that the dequantised
        operands are those its fp8 GEMM multiplies."""
        return self.data * self.scale.reciprocal()


class _Counts:
    """Counters every scaled cast keeps: overflows (values that could not be represented: see
    each class's docstring), underflows (non-zero values flushed to zero) and values cast,
    since the last reset."""

    _overflows: Tensor | int
    _underflows: Tensor | int
    _numel: int

    @property
    def overflows(self) -> int:
        return int(self._overflows)

    @property
    def underflows(self) -> int:
        return int(self._underflows)

    @property
    def numel(self) -> int:
        return self._numel


class ScaledCast(_Counts):
    """Cast one tensor stream (a layer's activations, weights or gradients) with delayed scaling.

    Args:
        fmt: target format, usually ``"fp8_e4m3"`` (forward) or ``"fp8_e5m2"`` (gradients).
        history_len: how many past amax values to keep.
        margin: extra head room, in powers of two.
        amax_rule: ``"max"`` over the history or ``"most_recent"``.
        rounding: ``"nearest"`` or ``"stochastic"``.
        power_of_two: round the scale down to a power of two, so scaling itself is exact.

    Raises:
        ValueError: unknown format, rule or rounding, or a history length below 1.
    """

    def __init__(
        self,
        fmt: str | Format = "fp8_e4m3",
        history_len: int = 16,
        margin: int = 0,
        amax_rule: str = "max",
        rounding: str = "nearest",
        power_of_two: bool = False,
    ) -> None:
        self.fmt = get_format(fmt)
        if history_len < 1:
            raise ValueError(f"history_len must be at least 1, got {history_len}")
        if amax_rule not in AMAX_RULES:
            raise ValueError(
                f"unknown amax_rule {amax_rule!r}; expected one of {', '.join(AMAX_RULES)}"
            )
        check_rounding(rounding)
        self.history_len = history_len
        self.margin = margin
        self.amax_rule = amax_rule
        self.rounding = rounding
        self.power_of_two = power_of_two
        self.reset()

    def reset(self) -> None:
        """Forget the history, the scale and the counters."""
        self.amax_history = torch.zeros(self.history_len)
        self.scale = torch.ones(())
        self._recorded = 0
        self._overflows = torch.zeros((), dtype=torch.int64)
        self._underflows = torch.zeros((), dtype=torch.int64)
        self._numel = 0

    # --- state ----------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "amax_history": self.amax_history.clone(),
            "scale": self.scale.clone(),
            "recorded": self._recorded,
            "overflows": self.overflows,
            "underflows": self.underflows,
            "numel": self._numel,
        }

    def load_state_dict(self, state: dict) -> None:
        history = state["amax_history"]
        if history.numel() != self.history_len:
            raise ValueError(
                f"amax history of length {history.numel()} does not fit "
                f"history_len={self.history_len}"
            )
        self.amax_history = history.clone()
        self.scale = state["scale"].clone()
        self._recorded = int(state["recorded"])
        self._overflows = torch.tensor(int(state["overflows"]))
        self._underflows = torch.tensor(int(state["underflows"]))
        self._numel = int(state["numel"])

    # --- scaling --------------------------------------------------------------------------------
    def _to(self, device: torch.device) -> None:
        if self.amax_history.device != device:
            self.amax_history = self.amax_history.to(device)
            self.scale = self.scale.to(device)
            self._overflows = self._overflows.to(device)
            self._underflows = self._underflows.to(device)

    def _scale_from(self, amax: Tensor) -> Tensor:
        scale = self.fmt.max_finite / (amax * 2.0**self.margin)
        if self.power_of_two:
            scale = torch.exp2(torch.floor(torch.log2(scale)))
        usable = torch.isfinite(amax) & (amax > 0) & torch.isfinite(scale) & (scale > 0)
        return torch.where(usable, scale, self.scale)

    def compute_scale(self) -> Tensor:
        """The scale delayed scaling would use now, from the recorded history."""
        recorded = self.amax_history[: min(self._recorded, self.history_len)]
        amax = (
            recorded.max()
            if self.amax_rule == "max"
            else self.amax_history[(self._recorded - 1) % self.history_len]
        )
        return self._scale_from(amax)

    def record(self, amax: Tensor) -> None:
        """Append one amax to the rolling history."""
        self.amax_history[self._recorded % self.history_len] = amax
        self._recorded += 1

    def __call__(self, x: Tensor, generator: torch.Generator | None = None) -> ScaledTensor:
        """Scale ``x`` with the delayed scale, cast it, record its amax and count what saturated
        or flushed to zero."""
        x32 = x.float()
        self._to(x32.device)
        amax = x32.abs().amax() if x32.numel() else torch.zeros((), device=x32.device)
        if self._recorded == 0:  # nothing to delay from yet: scale by this tensor's own amax
            self.scale = self._scale_from(amax)
        else:
            self.scale = self.compute_scale()
        scaled = x32 * self.scale
        data = quantize(
            scaled, self.fmt, rounding=self.rounding, saturate=True, generator=generator
        )
        finite = torch.isfinite(scaled)
        self._overflows += (finite & (scaled.abs() > self.fmt.max_finite)).sum()
        self._underflows += ((data == 0) & (x32 != 0)).sum()
        self._numel += x32.numel()
        self.record(amax)
        return ScaledTensor(data, self.scale.clone())

    def __repr__(self) -> str:
        return (
            f"ScaledCast(fmt={self.fmt.name!r}, history_len={self.history_len}, "
            f"margin={self.margin}, amax_rule={self.amax_rule!r}, rounding={self.rounding!r})"
        )


def amax_to_scale(amax: Tensor, fmt: str | Format, power_of_two: bool = False) -> Tensor:
    """The scale that maps ``amax`` onto the format's largest finite value, as torchao computes it.

    ``max_finite / max(amax, AMAX_EPS)`` in float64, returned as float32, optionally rounded down
    to a power of two (``Float8LinearConfig.round_scales_to_power_of_2``), exactly as
    ``torchao.float8.float8_utils.amax_to_scale``. On MPS, which has no float64, the division runs
    in float32; for amax at least ``AMAX_EPS`` this gives the same bits (both operands are
    float32 values, and a division rounded to 53 bits and then to 24 equals one rounded to 24).

    Example:
        >>> amax_to_scale(torch.tensor(2.0), "fp8_e4m3")
        tensor(224.)
    """
    fmt = get_format(fmt)
    scale = _scale_of(amax, fmt.max_finite)
    if power_of_two:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return scale


def _scale_of(amax: Tensor, max_finite: float | Tensor) -> Tensor:
    # `max_finite / t` is `t.reciprocal() * max_finite` for a tensor t (Tensor.__rtruediv__):
    # written out, so that a graph taking max_finite as a tensor computes the same bits
    wide = torch.float32 if amax.device.type == "mps" else torch.float64
    return (torch.clamp(amax.to(wide), min=AMAX_EPS).reciprocal() * max_finite).to(torch.float32)


def _round_trip_graph(
    flat: Tensor, ints: Tensor, floats: Tensor, limits: Tensor
) -> tuple[Tensor, Tensor]:
    """:meth:`DynamicScaledCast.round_trip` as one graph for every format: amax, scale,
    saturating cast, counts and dequantisation; ``limits`` is (max_finite, overflow
    threshold) in float64."""
    amax = flat.abs().amax()
    scale = _scale_of(amax, limits[0])
    limit = limits[0].to(torch.float32)
    scaled = flat * scale
    clamped = torch.clamp(scaled, -limit, limit)
    rounded = round_bits(clamped, None, unpack_constants(ints, floats), in_range=True)
    data = with_sign(clamped, rounded)
    mag = flat.view(torch.int32) & 0x7FFFFFFF
    lost = (mag >= 0x7F800000) | (scaled.abs() >= limits[1].to(torch.float32))
    flushed = (rounded == 0) & (mag != 0)
    counts = torch.stack((lost.sum(dtype=torch.int32), flushed.sum(dtype=torch.int32)))
    return data * scale.reciprocal(), counts


def _cast_round_trip_graph(fmt: Format) -> Kernel:
    """:func:`_round_trip_graph` for a format with a torch dtype, in float arithmetic: the
    clamp keeps the values in range, where fp16 and fp8 round by :func:`.round_split` on the
    CPU (about twice as fast as inductor's CPU code for torch's fp8 cast, which converts in
    software) and otherwise through torch's saturated cast; the same bits and counts without
    the int32 view of the floats, which inductor's CPU code reads one element at a time; a
    graph per format and device."""
    limit, threshold = fmt.max_finite, fmt.overflow_threshold

    def graph(flat: Tensor) -> tuple[Tensor, Tensor]:
        amax = flat.abs().amax()
        scale = _scale_of(amax, limit)
        scaled = flat * scale
        clamped = torch.clamp(scaled, -limit, limit)
        if splits(fmt) and flat.device.type == "cpu":  # GPU compilers may fuse into an FMA
            data = round_split(clamped, fmt)
        else:
            data = clamped.to(fmt.torch_dtype).to(torch.float32)
        lost = ~(flat.abs() < float("inf")) | (scaled.abs() >= threshold)  # inf, NaN, past max
        flushed = (data == 0) & (flat != 0)
        counts = torch.stack((lost.sum(dtype=torch.int32), flushed.sum(dtype=torch.int32)))
        return data * scale.reciprocal(), counts

    return Kernel(f"scaled_round_trip_{fmt.name}", graph)


_ROUND_TRIP = Kernel("scaled_round_trip", _round_trip_graph)
_CAST_ROUND_TRIPS = {
    name: _cast_round_trip_graph(fmt)
    for name, fmt in FORMATS.items()
    if fmt.torch_dtype is not None and name != "fp32"
}
_limits: dict[tuple, tuple[Tensor, Format]] = {}


class DynamicScaledCast(_Counts):
    """Cast one tensor stream with current scaling: each call scales by its own tensor's amax.

    The cast is torchao's ``hp_tensor_to_float8_dynamic`` with tensorwise granularity:
    ``scale = amax_to_scale(max|x|)``, ``data = fp8(clamp(float32(x) * scale, ±max_finite))``
    (a saturating cast, as torchao's ``to_fp8_saturated``), bit for bit. No history is kept:
    the only state is the counters.

    Overflows count values the cast could not represent: non-finite inputs (an inf makes the
    scale zero and the whole tensor NaN or zero, as in torchao) and scaled values that round
    past the largest finite value (possible only with ``power_of_two=False`` rounding errors far
    below one step, so in practice never). Underflows count non-zero values that became zero:
    with current scaling, those more than the format's dynamic range below the tensor's amax.

    With ``axis`` set, the granularity is torchao's ``AXISWISE``: one scale per slice, the amax
    reduced over ``axis`` (``amax(|x|, dim=axis, keepdim=True)``, so ``scale`` broadcasts
    against ``data``), as the rowwise recipes cast each GEMM operand along its reduction
    dimension.

    Args:
        fmt: target format, ``"fp8_e4m3"`` (forward operands) or ``"fp8_e5m2"`` (gradients).
        power_of_two: round the scale down to a power of two, so scaling itself is exact.
        rounding: ``"nearest"`` (torch's cast) or ``"stochastic"``.
        count: keep the overflow/underflow counters (two reductions per call).
        axis: None for one scale per tensor, else the dimension the amax is reduced over.

    Example:
        >>> cast = DynamicScaledCast("fp8_e4m3")
        >>> out = cast(torch.tensor([2.0, -0.5]))
        >>> out.scale, out.data
        (tensor(224.), tensor([448., -112.]))
    """

    def __init__(
        self,
        fmt: str | Format = "fp8_e4m3",
        power_of_two: bool = False,
        rounding: str = "nearest",
        count: bool = True,
        axis: int | None = None,
    ) -> None:
        self.fmt = get_format(fmt)
        check_rounding(rounding)
        self.axis = axis
        self.power_of_two = power_of_two
        self.rounding = rounding
        self.count = count
        self.reset()

    def reset(self) -> None:
        """Zero the counters."""
        self._overflows: Tensor | int = 0
        self._underflows: Tensor | int = 0
        self._fused: Tensor | list[int] | None = None  # the compiled round trips' counts
        self._numel = 0

    @property
    def overflows(self) -> int:
        return int(self._overflows) + (0 if self._fused is None else int(self._fused[0]))

    @property
    def underflows(self) -> int:
        return int(self._underflows) + (0 if self._fused is None else int(self._fused[1]))

    def __call__(self, x: Tensor, generator: torch.Generator | None = None) -> ScaledTensor:
        """Scale ``x`` by its own amax, cast it with saturation, count what was lost."""
        x32 = x.detach().float()
        if self.axis is not None:
            amax = x32.abs().amax(dim=self.axis, keepdim=True)
        elif x32.numel():
            amax = x32.abs().amax()
        else:
            amax = torch.zeros((), device=x32.device)
        scale = amax_to_scale(amax, self.fmt, self.power_of_two)
        limit = self.fmt.max_finite
        scaled = x32 * scale
        data = quantize(
            scaled.clamp(-limit, limit),
            self.fmt,
            rounding=self.rounding,
            saturate=True,
            generator=generator,
        )
        if self.count:
            lost = ~torch.isfinite(x32) | (scaled.abs() >= self.fmt.overflow_threshold)
            self._overflows = self._overflows + lost.sum()
            self._underflows = self._underflows + ((data == 0) & (x32 != 0)).sum()
        self._numel += x32.numel()
        return ScaledTensor(data, scale)

    def _limits(self, device: torch.device) -> Tensor:
        """(max_finite, overflow threshold) as :func:`_round_trip_graph` takes them."""
        key = (id(self.fmt), device)  # Format's dataclass hash is slow; fmt is kept below
        if key not in _limits:
            wide = torch.float32 if device.type == "mps" else torch.float64  # as _scale_of
            limits = [self.fmt.max_finite, self.fmt.overflow_threshold]
            _limits[key] = (torch.tensor(limits, dtype=wide, device=device), self.fmt)
        return _limits[key][0]

    def round_trip(self, x: Tensor, *, backend: str = "auto") -> Tensor:
        """``self(x).dequantize()``, counted the same way: the values the fp8 GEMM multiplies.

        Per-tensor nearest rounding without power-of-two scales, the torchao default, runs as
        one compiled graph once that pays (:mod:`.dispatch`): one pass for the amax, one for
        the rest; other settings, and the eager path, take the two steps. Same bits either way.
        """
        two_step = self.axis is not None or self.power_of_two or self.rounding != "nearest"
        if two_step or x.numel() > GRAPH_MAX_NUMEL:
            return self(x).dequantize()
        x32 = x.detach().float()
        eager = lambda: (self(x32).dequantize(), None)  # noqa: E731
        cast = _CAST_ROUND_TRIPS.get(self.fmt.name)
        if cast is not None:
            out, counts = cast.run((x32.reshape(-1),), (), eager, backend)
        else:
            constants = (*constant_tensors(self.fmt, True, x32.device), self._limits(x32.device))
            out, counts = _ROUND_TRIP.run((x32.reshape(-1),), constants, eager, backend)
        if counts is not None:  # the eager path counted already
            self._numel += x32.numel()
            if self.count and counts.device.type == "cpu":  # read back at once: free there
                pair, fused = counts.tolist(), self._fused or [0, 0]
                self._fused = [fused[0] + pair[0], fused[1] + pair[1]]
            elif self.count:  # one small operation a call: the pair, summed in place
                self._fused = counts.long() if self._fused is None else self._fused.add_(counts)
        return shaped(out, x32.shape)

    def __repr__(self) -> str:
        return (
            f"DynamicScaledCast(fmt={self.fmt.name!r}, power_of_two={self.power_of_two}, "
            f"rounding={self.rounding!r}, axis={self.axis})"
        )
