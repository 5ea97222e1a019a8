"""FLOPs of one aten op: torch.utils.flop_counter's formulas, plus the matrix operations it has
no formula for (grouped GEMMs, the CPU's fused attention) and a fix for grouped convolutions'
backward. :mod:`autoprec.graph.trace` gives each op's FLOPs to a layer.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.flop_counter import (
    conv_flop_count,
    flop_registry,
    sdpa_backward_flop_count,
    sdpa_flop_count,
)

__all__ = ["counts_flops", "flops", "meta_grouped_mm"]

_CONV_BACKWARD = torch.ops.aten.convolution_backward


def _grouped_mm_flops(a: torch.Tensor, b: torch.Tensor, *_: Any) -> int:
    """FLOPs of ``_grouped_mm(a, b, offs)`` (and of its scaled form): each group multiplies its
    slice of ``a`` by its matrix of ``b``; the groups' sizes (``offs``) add up to the split
    dimension, so the operands' shapes are enough. ``a`` (tokens, K) by ``b`` (groups, K, N):
    tokens x K x N multiply-adds; (M, K) by (K, N) with K split; (groups, M, K) by (K, N) with N
    split; 3-d by 3-d: a batch."""
    if a.dim() == 2 and b.dim() == 2:
        return 2 * a.shape[0] * a.shape[1] * b.shape[1]
    if a.dim() == 3 and b.dim() == 2:
        return 2 * a.shape[1] * a.shape[2] * b.shape[1]
    return 2 * (a.numel() // a.shape[-1]) * a.shape[-1] * b.shape[-1]


def meta_grouped_mm(func: Any, args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The result of ``_grouped_mm`` on meta operands of any float dtype (torch's meta kernel
    takes bf16 only, while the analysis runs models in fp32): a (tokens, K) by (groups, K, N)
    product is (tokens, N), a (M, K) by (K, N) product split along K is (groups, M, N). None
    for another op or other operands (the op runs as it is)."""
    if func._overloadpacket is not torch.ops.aten._grouped_mm or not args[0].is_meta:
        return None
    a, b = args[0], args[1]
    offs = args[2] if len(args) > 2 else kwargs.get("offs")
    dtype = kwargs.get("out_dtype") or a.dtype
    if a.dim() == 2 and b.dim() == 3:
        shape: tuple[int, ...] = (a.shape[0], b.shape[-1])
    elif a.dim() == 2 and b.dim() == 2 and offs is not None:
        shape = (offs.shape[0], a.shape[0], b.shape[1])
    else:
        return None
    return torch.empty(shape, dtype=dtype, device="meta")


def _heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[tuple[int, ...], ...]:
    """Attention's (batch, heads, length, dim) shapes of query, key and value, the key's and
    value's heads as the query's (grouped-query attention shares them)."""
    b, h, sq, d = q.shape
    return (b, h, sq, d), (b, h, k.shape[-2], d), (b, h, k.shape[-2], v.shape[-1])


def _cpu_attention_flops(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *_: Any) -> int:
    return int(sdpa_flop_count(*_heads(q, k, v)))


def _cpu_attention_backward_flops(
    grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *_: Any
) -> int:
    shapes = _heads(q, k, v)
    return int(sdpa_backward_flop_count((*shapes[0][:3], shapes[2][-1]), *shapes))


#: Matrix operations torch.utils.flop_counter has no formula for: the grouped GEMMs of mixtures
#: of experts (transformers 5 multiplies its 3-d expert weights with ``torch._grouped_mm``),
#: and the CPU's fused attention (where the meta pass fails and the analysis runs on the CPU).
_MORE_FLOPS: dict[Any, Any] = {
    torch.ops.aten._grouped_mm: _grouped_mm_flops,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_attention_flops,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: (
        _cpu_attention_backward_flops
    ),
}
if hasattr(torch.ops.aten, "_scaled_grouped_mm"):
    _MORE_FLOPS[torch.ops.aten._scaled_grouped_mm] = _grouped_mm_flops


def counts_flops(func: Any) -> bool:
    """Whether the analysis has a FLOP formula for aten op ``func``."""
    return func._overloadpacket in flop_registry or func._overloadpacket in _MORE_FLOPS


def flops(func: Any, args: tuple, kwargs: dict, out: Any) -> int:
    """FLOPs of aten op ``func`` called with ``args``/``kwargs`` and returning ``out``
    (:func:`counts_flops` must hold for it)."""
    packet = func._overloadpacket
    if packet in _MORE_FLOPS:
        return int(_MORE_FLOPS[packet](*args))
    if packet is _CONV_BACKWARD and len(args) >= 11:
        # torch.utils.flop_counter ignores groups in convolution_backward (a depthwise conv's
        # backward comes out ~channels times too large). Each gradient a convolution computes
        # (input, weight) costs what its forward costs.
        grad_out, x, w, transposed, mask = args[0], args[1], args[2], args[7], args[10]
        once = conv_flop_count(list(x.shape), list(w.shape), list(grad_out.shape), transposed)
        return int(once) * (int(bool(mask[0])) + int(bool(mask[1])))
    return int(flop_registry[packet](*args, **kwargs, out_val=out))
