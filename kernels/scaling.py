"""Per-tensor scaled casting with delayed scaling, as Transformer Engine does for fp8.

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

from .formats import Format, get_format
from .quantize import ROUNDING_MODES, quantize

__all__ = ["ScaledCast", "ScaledTensor", "AMAX_RULES"]

AMAX_RULES = ("max", "most_recent")


class ScaledTensor(NamedTuple):
    """A tensor cast in the scaled domain: ``data`` lies on the format's grid, ``data / scale``
    approximates the original."""

    data: Tensor
    scale: Tensor

    def dequantize(self) -> Tensor:
        """Back to the original range (float32)."""
        return self.data / self.scale


class ScaledCast:
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
        if rounding not in ROUNDING_MODES:
            raise ValueError(
                f"unknown rounding {rounding!r}; expected one of {', '.join(ROUNDING_MODES)}"
            )
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
    @property
    def overflows(self) -> int:
        """Values clamped to the largest finite value since the last reset."""
        return int(self._overflows)

    @property
    def underflows(self) -> int:
        """Non-zero values flushed to zero since the last reset."""
        return int(self._underflows)

    @property
    def numel(self) -> int:
        """Values cast since the last reset."""
        return self._numel

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
