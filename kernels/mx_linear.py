"""torchao's MX training linear (``mx_mm``, ``KernelPreference.EMULATED``), emulated: the
three GEMMs of a Linear with MX-quantised operands (:func:`~.mx.mx_round`), forward and backward.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .mx import check_mx_options, mx_round

__all__ = ["MXLinearFunction", "mx_linear"]


class MXLinearFunction(torch.autograd.Function):
    """``x @ weight.T`` with MX-quantised operands in all three GEMMs, as torchao's ``mx_mm``
    with ``KernelPreference.EMULATED``; each operand is blocked along the GEMM's reduction dim:

    ========================  ==================  ========================  ==============
    GEMM                      left operand        right operand             blocked along
    ========================  ==================  ========================  ==============
    output = x @ W.T          x (M, K)            W (N, K)                  K (in_features)
    grad_x = dY @ W           dY (M, N)           W (N, K)                  N (out_features)
    grad_W = dY.T @ x         dY (M, N)           x (M, K)                  M (tokens)
    ========================  ==================  ========================  ==============

    The dequantised operands are multiplied by ``torch.mm`` in the inputs' dtype, with the
    memory layouts torchao uses, so the results match it bit for bit on the same machine.
    Use :func:`mx_linear`.
    """

    @staticmethod
    def forward(ctx, x, weight, elem, grad_elem, block_size, scaling, wgrad_with_hp):  # noqa: D102
        ctx.save_for_backward(x, weight)
        ctx.config = (elem, grad_elem, block_size, scaling, wgrad_with_hp)
        x2 = x.reshape(-1, x.shape[-1])
        xq = mx_round(x2, elem, block_size, scaling)
        wq = mx_round(weight, elem, block_size, scaling)
        out = torch.mm(xq, wq.t())
        return out.reshape(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):  # noqa: D102
        x, weight = ctx.saved_tensors
        elem, grad_elem, block_size, scaling, wgrad_with_hp = ctx.config
        g2 = grad_out.contiguous().reshape(-1, grad_out.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            gq = mx_round(g2, grad_elem, block_size, scaling)
            wtq = mx_round(weight.t().contiguous(), elem, block_size, scaling)
            grad_x = torch.mm(gq, wtq.t()).reshape(x.shape)
        if ctx.needs_input_grad[1]:
            if wgrad_with_hp:
                grad_w = torch.mm(g2.t(), x2)
            else:
                gtq = mx_round(g2.t().contiguous(), grad_elem, block_size, scaling)
                xtq = mx_round(x2.t().contiguous(), elem, block_size, scaling)
                grad_w = torch.mm(gtq, xtq.t())
        return grad_x, grad_w, None, None, None, None, None


def mx_linear(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    *,
    elem: str = "fp8_e4m3",
    grad_elem: str | None = None,
    block_size: int = 32,
    scaling: str = "rceil",
    wgrad_with_hp: bool = False,
) -> Tensor:
    """A linear layer trained in an MX format, as torchao's ``MXFP8Linear`` (emulated kernels).

    Args:
        x: input (..., K), float32 or bfloat16.
        weight: (N, K), the same dtype as ``x``.
        bias: optional (N,), added in the output's dtype after the GEMM (unquantised).
        elem: element format of the input and weight (torchao's MXFP8 training: fp8_e4m3).
        grad_elem: element format of the output gradient; ``None`` means ``elem``.
        block_size: elements per block; K, N and the number of rows M of ``x`` must be
            multiples of it (the three GEMMs block along K, N and M).
        scaling: one of :data:`MX_SCALING_MODES`; torchao's training default is ``"rceil"``.
        wgrad_with_hp: compute the weight gradient from the unquantised operands.

    Returns:
        (..., N) in ``x``'s dtype (on Blackwell, torchao's real kernels return bfloat16).

    Raises:
        ValueError: mismatched shapes or dtypes, a dimension that is not a multiple of
            block_size, unknown element or scaling.
    """
    grad_elem = elem if grad_elem is None else grad_elem
    check_mx_options((elem, grad_elem), scaling, block_size)
    if weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"mx_linear expects x (..., K) and weight (N, K), got {tuple(x.shape)} and "
            f"{tuple(weight.shape)}"
        )
    if x.dtype != weight.dtype or x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(
            f"mx_linear expects x and weight both float32 or both bfloat16, got {x.dtype} "
            f"and {weight.dtype}"
        )
    n, k = weight.shape
    m = x.numel() // k if k else 0
    sizes = {"K (in_features)": k}
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        sizes["N (out_features)"] = n
        if weight.requires_grad and not wgrad_with_hp:
            sizes["M (rows of x)"] = m
    for what, size in sizes.items():
        if size % block_size:
            raise ValueError(
                f"mx_linear: {what} = {size} is not a multiple of block_size {block_size}; "
                "pad it (torchao's MX linear needs the same)"
            )
    out = MXLinearFunction.apply(x, weight, elem, grad_elem, block_size, scaling, wgrad_with_hp)
    return out if bias is None else out + bias.to(out.dtype)
