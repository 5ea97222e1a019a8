"""Per-layer scaling of the output gradients of fp16 layers (emulate mode).

Loss scaling multiplies the loss, hence every gradient, by one factor. Per-layer scaling gives
the output-gradient stream of each low-precision layer its own power-of-two scale instead,
chosen by delayed scaling from the largest magnitudes (amax) of that layer's recent gradients,
as Transformer Engine scales each fp8 tensor:

    scale = 2 ** floor(log2(max_finite / (amax * 2 ** margin)))

with ``amax`` the maximum over the last ``history_len`` backward passes of the layer (its first
backward pass uses its own amax). In backward, the gradient arriving at the layer's output is
multiplied by the scale before the runtime rounds it to the layer's format and divided by it
right after, so the layer's own backward and everything upstream see the unscaled gradient.
Both operations are exact (the scale is a power of two), so with neither overflow nor
underflow the result equals the plain rounding; the scale only moves the gradient into the
format's range. A gradient that has grown beyond the delayed scale's head room overflows to inf
in the rounding, as it would in fp16, and the step should be skipped (a
``LossScaler(kind="static", init_scale=1.0)`` does exactly that); the next scale then accounts
for the larger amax. Non-finite amaxes are not recorded.

The scale plugs into the runtime's rounding of the output gradient (a tensor hook of
:mod:`autoprec.runtime.casting`; no extra autograd node and no copy, so in-place operations
after the layer behave as without it): scale, round, unscale in one step. Only the emulate mode
has such a step. Native autocast keeps the gradient inside the layer in fp16
and has no such step, so native handles are refused.

Example:
    >>> handle = apply_policy(model, "fp16", mode="emulate")
    >>> scaling = apply_layer_scaling(handle)
    >>> scaler = LossScaler(kind="static", init_scale=1.0)  # skips steps that overflowed
    >>> scaler.scale(loss_fn(model(x), y)).backward()
    >>> scaler.step(optimizer); scaler.update()
    >>> scaling.scales()  # each layer's scale in its latest backward pass
    >>> scaling.remove(); handle.remove()
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from autoprec.kernels import get_format
from autoprec.precision import Precision, parse_precision
from autoprec.runtime.apply import PolicyHandle
from autoprec.runtime.handle import Removable

if TYPE_CHECKING:
    from autoprec.runtime.layer import ManagedLayer

__all__ = ["DEFAULT_MARGIN", "LayerScaling", "apply_layer_scaling"]

# Head room in powers of two. An fp16 overflow is an inf and costs a skipped step, while the
# format spans 40 binades (2**-24 to 2**16) and one layer's gradient values about 20, so a few
# binades are cheap. With no margin a layer's amax only has to grow by 2x from one batch to the
# next to overflow, which training resnet18 on digits does often
# (`python experiments/overflow.py --layer-margin 0`).
DEFAULT_MARGIN = 4


class _DelayedScale:
    """Amax history of one gradient stream and the power-of-two scale it gives."""

    def __init__(self, max_finite: float, history_len: int, margin: int) -> None:
        self.max_finite = max_finite
        self.history_len = history_len
        self.margin = margin
        self.history = torch.zeros(history_len)
        self.recorded = 0
        self.scale = torch.ones(())

    def _scale_from(self, amax: Tensor) -> Tensor:
        scale = torch.exp2(torch.floor(torch.log2(self.max_finite / (amax * 2.0**self.margin))))
        usable = (amax > 0) & torch.isfinite(scale) & (scale > 0)
        return torch.where(usable, scale, self.scale)

    @torch.no_grad()
    def next(self, amax: Tensor) -> Tensor:
        """The scale for a gradient of this ``amax``: from the history (the first time, from
        ``amax`` itself); then ``amax`` joins the history unless it is not finite."""
        if self.history.device != amax.device:
            self.history, self.scale = self.history.to(amax.device), self.scale.to(amax.device)
        amax = torch.where(torch.isfinite(amax), amax, torch.zeros_like(amax))
        if self.recorded == 0:
            self.scale = self._scale_from(amax)
        else:
            seen = self.history[: min(self.recorded, self.history_len)]
            self.scale = self._scale_from(seen.max())
        self.history[self.recorded % self.history_len] = amax
        self.recorded += 1
        return self.scale

    def state_dict(self) -> dict[str, Any]:
        return {
            "history": self.history.detach().cpu().clone(),
            "recorded": self.recorded,
            "scale": float(self.scale),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        history = torch.as_tensor(state["history"], dtype=torch.float32)
        if history.numel() != self.history_len:
            raise ValueError(
                f"amax history of length {history.numel()} does not fit "
                f"history_len={self.history_len}"
            )
        self.history = history.clone().to(self.history.device)
        self.recorded = int(state["recorded"])
        self.scale = torch.tensor(float(state["scale"]), device=self.history.device)


class _ScaledLayer:
    """The delayed-scaling state of one layer, plugged into its runtime slot."""

    def __init__(
        self, name: str, layer: ManagedLayer, fmt: str, history_len: int, margin: int
    ) -> None:
        self.name = name
        self.layer = layer  # the runtime's per-layer state (PolicyHandle.layers[name])
        self.delayed = _DelayedScale(get_format(fmt).max_finite, history_len, margin)
        layer.gradient_scale = self.next_scale

    @torch.no_grad()
    def next_scale(self, grad: Tensor) -> Tensor:
        """The scale for ``grad`` (see :meth:`_DelayedScale.next`)."""
        if grad.numel():
            amax = grad.detach().float().abs().amax()
        else:
            amax = torch.zeros((), device=grad.device)
        return self.delayed.next(amax)

    def remove(self) -> None:
        if self.layer.gradient_scale == self.next_scale:
            self.layer.gradient_scale = None


class LayerScaling(Removable):
    """Per-layer output-gradient scales on a :class:`~autoprec.runtime.PolicyHandle`; made
    by :func:`apply_layer_scaling`. Also a context manager (removes on exit)."""

    def __init__(self, layers: dict[str, _ScaledLayer]) -> None:
        self.layers = layers
        self.removed = False

    def scales(self) -> dict[str, float]:
        """Each layer's scale of its latest backward pass (1.0 before the first)."""
        return {name: float(layer.delayed.scale) for name, layer in self.layers.items()}

    def state_dict(self) -> dict[str, Any]:
        """Every layer's amax history and scale, for checkpoints."""
        return {name: layer.delayed.state_dict() for name, layer in self.layers.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned.

        Raises:
            ValueError: the state names other layers than this one manages.
        """
        if set(state) != set(self.layers):
            raise ValueError(
                f"layer scaling state for layers {sorted(state)} does not fit the managed "
                f"layers {sorted(self.layers)}"
            )
        for name, layer in self.layers.items():
            layer.delayed.load_state_dict(state[name])

    def remove(self) -> None:
        """Take the hooks off (the policy handle stays as it is)."""
        for layer in self.layers.values():
            layer.remove()
        self.removed = True

    def __repr__(self) -> str:
        return f"LayerScaling({len(self.layers)} layers{', removed' if self.removed else ''})"


def apply_layer_scaling(
    handle: PolicyHandle,
    precisions: Iterable[str | Precision] = ("fp16",),
    *,
    history_len: int = 16,
    margin: int = DEFAULT_MARGIN,
) -> LayerScaling:
    """Give each layer of ``handle`` at one of ``precisions`` its own output-gradient scale.

    Args:
        handle: what :func:`~autoprec.runtime.apply_policy` returned, in emulate mode.
        precisions: the layers (by their current precision) that get a scale; fp16 by default,
            the one format whose range loss scaling exists for.
        history_len: backward passes of a layer its amax history covers.
        margin: head room below the format's largest value, in powers of two (see
            :data:`DEFAULT_MARGIN`).

    Returns:
        The :class:`LayerScaling`; ``remove()`` takes its hooks off.

    Raises:
        ValueError: a native handle, a removed one, an unknown or scaled (fp8) precision, or a
            history shorter than one pass.
    """
    if handle.removed:
        raise ValueError("the policy handle was removed; apply the policy again first")
    if handle.mode != "emulate":
        raise ValueError(
            f"per-layer gradient scaling needs an emulate-mode handle, got mode {handle.mode!r}; "
            "apply the policy with mode='emulate'"
        )
    if isinstance(history_len, bool) or not isinstance(history_len, int) or history_len < 1:
        raise ValueError(f"history_len must be an integer >= 1, got {history_len!r}")
    chosen = {parse_precision(p) for p in precisions}
    if any(p.scaled for p in chosen):
        raise ValueError(
            "fp8 layers already scale every tensor (from its current amax); leave fp8 out"
        )
    layers = {
        name: _ScaledLayer(name, layer, layer.precision.backward_format, history_len, margin)
        for name, layer in handle.layers.items()
        if layer.precision in chosen and layer.precision is not Precision.FP32
    }
    return LayerScaling(layers)
