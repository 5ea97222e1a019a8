"""Layers whose weight is used functionally: the matmul runs, the module's ``forward`` does not.

torchvision's ``swin_t`` calls ``F.linear(x, self.qkv.weight, ...)`` and
``F.linear(x, self.proj.weight, ...)``; module hooks never see those calls. While the model's
forward runs, :class:`WeightUseMode` (a ``TorchFunctionMode``) looks at every ``F.linear``,
``torch.addmm``/``mm``/``bmm``/``baddbmm``/``matmul`` and ``F.conv*`` call: one whose operand is
a weight of a managed layer whose own forward is not running is handed to that layer
(``layer.call_functional``), which applies its precision as its hooks would.

A ``TorchFunctionMode`` is switched off while it handles a call, so a weight used inside another
overridable function (``F.multi_head_attention_forward`` called from outside an
``nn.MultiheadAttention``) is not seen.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = ["BIAS", "OPERANDS", "WeightUseMode", "bias_of"]

_INPUT_WEIGHT = ((0, "input"), (1, "weight"))
_MM = ((0, "input"), (1, "mat2"))
_ADDMM = ((1, "mat1"), (2, "mat2"))
_BADDBMM = ((1, "batch1"), (2, "batch2"))
_MATMUL = ((0, "input"), (1, "other"))

# func -> the (position, keyword) of its two matrix operands
OPERANDS: dict[Any, tuple[tuple[int, str], ...]] = {
    F.linear: _INPUT_WEIGHT,
    F.conv1d: _INPUT_WEIGHT,
    F.conv2d: _INPUT_WEIGHT,
    F.conv3d: _INPUT_WEIGHT,
    F.conv_transpose1d: _INPUT_WEIGHT,
    F.conv_transpose2d: _INPUT_WEIGHT,
    F.conv_transpose3d: _INPUT_WEIGHT,
    torch.addmm: _ADDMM,
    torch.Tensor.addmm: _ADDMM,
    torch.baddbmm: _BADDBMM,
    torch.Tensor.baddbmm: _BADDBMM,
    torch.mm: _MM,
    torch.Tensor.mm: _MM,
    torch.bmm: _MM,
    torch.Tensor.bmm: _MM,
    torch.matmul: _MATMUL,
    torch.Tensor.matmul: _MATMUL,
    torch.Tensor.__matmul__: _MATMUL,
}


# func -> the (position, keyword) of its additive term (a bias), which autocast casts too
BIAS: dict[Any, tuple[int, str]] = {
    **{f: (2, "bias") for f, spec in OPERANDS.items() if spec is _INPUT_WEIGHT},
    **{f: (0, "input") for f, spec in OPERANDS.items() if spec in (_ADDMM, _BADDBMM)},
}


def bias_of(func: Any, args: tuple, kwargs: dict) -> tuple[int | str | None, Any]:
    """Where ``func``'s bias (additive term) is in its arguments, and its value."""
    slot = BIAS.get(func)
    return (None, None) if slot is None else _get(args, kwargs, *slot)


class FunctionalLayer(Protocol):
    running: int

    def call_functional(
        self, func: Any, args: tuple, kwargs: dict, operands: list[tuple[int | str, bool]]
    ) -> Any: ...


def _get(args: tuple, kwargs: dict, pos: int, key: str) -> tuple[int | str | None, Any]:
    if pos < len(args):
        return pos, args[pos]
    if key in kwargs:
        return key, kwargs[key]
    return None, None


class WeightUseMode(TorchFunctionMode):
    """Hands functional uses of managed weights to their layers.

    Args:
        layers: ``{id(weight parameter): layer}``.
    """

    def __init__(self, layers: Mapping[int, FunctionalLayer]) -> None:
        super().__init__()
        self.layers = layers

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: D105
        kwargs = kwargs or {}
        spec = OPERANDS.get(func)
        if spec is None:
            return func(*args, **kwargs)
        layer = None
        operands: list[tuple[int | str, bool]] = []
        for pos, key in spec:
            where, value = _get(args, kwargs, pos, key)
            if where is None or not isinstance(value, torch.Tensor):
                continue
            owner = self.layers.get(id(value))
            operands.append((where, owner is not None))
            if owner is not None and layer is None:
                layer = owner
        if layer is None or layer.running:
            return func(*args, **kwargs)
        return layer.call_functional(func, args, kwargs, operands)
