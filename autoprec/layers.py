"""Which modules of a model are tunable layers, and a fingerprint of the model's structure.

Tunable layers are the ones whose matrix work can change precision: ``Conv1d/2d/3d``,
``Linear`` and ``nn.MultiheadAttention`` (its input and output projections run as one unit; its
``out_proj`` is covered by the attention module, not listed on its own). Normalisation layers
are not tunable by default: they stay fp32 unless a policy names them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator

from torch import nn

TUNABLE_TYPES: tuple[type[nn.Module], ...] = (
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
    nn.Linear,
    nn.MultiheadAttention,
)

NORM_TYPES: tuple[type[nn.Module], ...] = (
    nn.modules.batchnorm._BatchNorm,
    nn.LayerNorm,
    nn.GroupNorm,
    nn.modules.instancenorm._InstanceNorm,
    nn.LocalResponseNorm,
)

LayerFilter = Callable[[nn.Module, str], bool]


def is_tunable(module: nn.Module, name: str = "") -> bool:
    """The default filter: convolutions, linears and attention blocks."""
    return isinstance(module, TUNABLE_TYPES)


def is_norm(module: nn.Module, name: str = "") -> bool:
    return isinstance(module, NORM_TYPES)


def tunable_layers(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """Yield ``(qualified name, module)`` of every tunable layer, in ``named_modules`` order.

    The ``out_proj`` of an ``nn.MultiheadAttention`` is part of the attention layer (the
    attention module calls its weight directly, never its forward), so it is not yielded.
    """
    attention_children: set[int] = set()
    for name, module in model.named_modules():
        if id(module) in attention_children:
            continue
        if isinstance(module, nn.MultiheadAttention):
            attention_children.update(id(m) for m in module.modules() if m is not module)
        if is_tunable(module, name):
            yield name, module


def model_fingerprint(model: nn.Module) -> str:
    """``"sha256:<hex>"`` over the ordered (name, type, parameter shapes) of every module.

    Two models with the same architecture get the same fingerprint whatever their weights; a
    renamed, added or reshaped layer changes it.
    """
    digest = hashlib.sha256()
    for name, module in model.named_modules():
        shapes = ",".join(
            f"{pname}:{tuple(p.shape)}" for pname, p in module.named_parameters(recurse=False)
        )
        digest.update(f"{name}|{type(module).__qualname__}|{shapes}\n".encode())
    return "sha256:" + digest.hexdigest()
