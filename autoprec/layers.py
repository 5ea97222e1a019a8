"""Which modules of a model are tunable layers, and a fingerprint of the model's structure.

Tunable layers are the ones whose matrix work can change precision: ``Conv1d/2d/3d``,
``Linear``, ``nn.MultiheadAttention`` (its input and output projections run as one unit; its
``out_proj`` is covered by the attention module, not listed on its own), Hugging Face's
GPT-2 style ``Conv1D`` (a transposed linear: ``torch.addmm(bias, x, weight)`` with ``weight`` of
shape ``(in, out)``; matched by class name, so transformers need not be imported) and a mixture
of experts' fused experts (:data:`FUSED_EXPERTS`: torchtitan's ``GroupedExperts``, the zoo's
``llama-moe`` ones, and transformers' ``MixtralExperts``, 3-d weights of shape (experts, out,
in) run as grouped GEMMs; one layer, one precision for its GEMMs). A layer is
tunable whether its own ``forward`` runs or its weight is used functionally (torchvision's Swin
calls ``F.linear`` on ``self.qkv.weight``): the analysis finds its matrix work by the parameter.
Normalisation layers are not tunable by default: they stay fp32 unless a policy names them.
"""

from __future__ import annotations

import hashlib
import math
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


class NoTunableLayerError(ValueError):
    """No layer autoprec can tune runs in the model's forward: nothing to search or price."""

    @classmethod
    def of(cls, model: str) -> NoTunableLayerError:
        """The error for the model named ``model``."""
        kinds = ", ".join(t.__name__ for t in TUNABLE_TYPES)
        return cls(
            f"model {model!r} has no layer autoprec can tune: no {kinds}, Hugging Face Conv1D or "
            "fused experts "
            "runs in its forward, so there is no precision to choose; give a model with one"
        )


def is_conv1d(module: nn.Module) -> bool:
    """A GPT-2 style ``Conv1D`` (class named ``Conv1D`` with a 2-d ``weight`` of (in, out))."""
    weight = getattr(module, "weight", None)
    return type(module).__name__ == "Conv1D" and getattr(weight, "ndim", 0) == 2


#: Fused experts by class name: the names of their 3-d weights, ``(experts, out, in)`` each, in
#: the order their GEMMs run. torchtitan's (and the zoo's) ``GroupedExperts``:
#: ``w2(silu(w1(x)) * w3(x))``; transformers' ``MixtralExperts`` (and its relatives): one
#: ``gate_up_proj`` whose output halves are the gate and the up projection, then ``down_proj``.
FUSED_EXPERTS: dict[str, tuple[str, ...]] = {
    "GroupedExperts": ("w1", "w3", "w2"),
    "MixtralExperts": ("gate_up_proj", "down_proj"),
}


def expert_weights(module: nn.Module) -> tuple[str, ...]:
    """The names of ``module``'s 3-d expert weights if it is fused experts
    (:data:`FUSED_EXPERTS`), else ``()``."""
    names = FUSED_EXPERTS.get(type(module).__name__, ())
    if names and all(getattr(getattr(module, n, None), "ndim", 0) == 3 for n in names):
        return names
    return ()


def is_fused_experts(module: nn.Module) -> bool:
    """Whether ``module`` is a mixture of experts' fused experts (one tunable layer)."""
    return bool(expert_weights(module))


def is_tunable(module: nn.Module, name: str = "") -> bool:
    """The default filter: convolutions, linears, attention blocks, ``Conv1D`` and fused
    experts."""
    return isinstance(module, TUNABLE_TYPES) or is_conv1d(module) or is_fused_experts(module)


def is_norm(module: nn.Module, name: str = "") -> bool:
    return isinstance(module, NORM_TYPES)


def geometry(module: nn.Module) -> tuple[int, int, tuple[int, ...], tuple[int, ...]]:
    """``(fan_in, fan_out, kernel_size, stride)`` of a tunable layer (zeros for others)."""
    if isinstance(module, nn.modules.conv._ConvNd):
        k = math.prod(module.kernel_size)
        fan_in = module.in_channels // module.groups * k
        return fan_in, module.out_channels * k // module.groups, module.kernel_size, module.stride
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features, (), ()
    if isinstance(module, nn.MultiheadAttention):
        return module.embed_dim, module.embed_dim, (), ()
    if is_conv1d(module):
        fan_in, fan_out = module.weight.shape
        return int(fan_in), int(fan_out), (), ()
    names = expert_weights(module)
    if names:  # the model's width and each expert's hidden width: (out, in) of the last GEMM
        _, width, hidden = getattr(module, names[-1]).shape
        return int(width), int(hidden), (), ()
    return 0, 0, (), ()


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
