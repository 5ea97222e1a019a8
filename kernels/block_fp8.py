"""fp8 with block scaling (DeepSeek-V3's recipe), as torchao's ``blockwise_fp8_training`` runs
it, emulated on any device.

Every block of an operand gets its own float32 scale ``s = fp32(448 / max(amax, 1e-12))``
(the division in float64), its values become ``e4m3(clamp(x * s, ±448))`` and dequantise as
``e4m3 * (1 / s)``. The quantisers equal torchao's torch references bit for bit
(``torchao/prototype/blockwise_fp8_training/kernels.py``):

- :func:`fp8_block_quantize_lhs`: 1x128 tiles along the last dimension (activations and
  gradients as a GEMM's left operand; ``torch_blockwise_scale_act_quant_lhs``);
- :func:`fp8_block_quantize_rhs`: 128x1 tiles along the first dimension (the activation as
  the right operand of the weight gradient; ``torch_blockwise_scale_act_quant_rhs``, which
  clamps the amax at 1e-12 in the input's dtype, the others in float64);
- :func:`fp8_block_quantize_weight`: 128x128 tiles (``torch_blockwise_scale_weight_quant``).

:func:`block_fp8_linear` is torchao's ``fp8_blockwise_mm`` (``linear.py``): output
``x @ W.T`` with x 1x128 along K and W 128x128; input gradient ``dY @ W`` with dY 1x128 along N
and W 128x128 (the same tiles: the same values); weight gradient ``dY.T @ x`` with dY^T 1x128
along M (torchao's ``act_quant_transposed_lhs``) and x 128x1 along M. Each GEMM multiplies the
dequantised operands in float32 and writes the input's dtype (torchao writes bf16 and runs
bf16 operands: feed bf16 to match; the runtime does).

Transformer Engine's ``Float8BlockScaling`` uses the same tiles (``x_block_scaling_dim=1``,
``w_block_scaling_dim=2``, ``grad_block_scaling_dim=1``) but by default rounds each scale to a
power of two (``power_2_scale=True`` unless ``NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1``) with
``amax_epsilon=0.0`` (``transformer_engine/common/recipe/__init__.py``), and accumulates with
split (fp32-promoted) accumulation; these quantisers follow torchao's float32 scales.
"""

from __future__ import annotations

import torch
from torch import Tensor

from autoprec.precision import FP8_BLOCK_TILE

from .formats import get_format
from .mx import BlockQuantized, check_block_linear
from .quantize import quantize

__all__ = [
    "FP8_BLOCK_EPS",
    "BlockFP8LinearFunction",
    "block_fp8_linear",
    "fp8_block_quantize_lhs",
    "fp8_block_quantize_rhs",
    "fp8_block_quantize_weight",
]

#: The amax floor of torchao's block fp8 quantisers (its ``EPS``).
FP8_BLOCK_EPS = 1e-12
_E4M3 = "fp8_e4m3"


def _check(x: Tensor, what: str, rows: bool, cols: bool) -> None:
    if not isinstance(x, Tensor) or not x.is_floating_point() or x.dim() != 2:
        got = f"shape {tuple(x.shape)}, {x.dtype}" if isinstance(x, Tensor) else type(x).__name__
        raise ValueError(f"{what} expects a 2-D floating-point tensor, got {got}")
    for size, blocked in zip(x.shape, (rows, cols), strict=True):
        if blocked and size % FP8_BLOCK_TILE:
            raise ValueError(
                f"{what}: shape {tuple(x.shape)} is not tiled by {FP8_BLOCK_TILE}; pad it "
                "(torchao's blockwise fp8 kernels need the same)"
            )


def _cast(blocks: Tensor, amax64: Tensor) -> tuple[Tensor, Tensor]:
    """e4m3 values of ``blocks`` scaled by ``448 / amax64`` (float64, rounded to float32),
    and the reciprocal float32 scales."""
    e4m3_max = get_format(_E4M3).max_finite
    s = (e4m3_max / amax64).to(torch.float32)
    values = quantize(torch.clamp(blocks * s, -e4m3_max, e4m3_max), _E4M3)
    return values, 1.0 / s


def fp8_block_quantize_lhs(x: Tensor) -> BlockQuantized:
    """1x128 tiles along the last dimension of a 2-D ``x`` (any float dtype): torchao's
    ``torch_blockwise_scale_act_quant_lhs``.

    Raises:
        ValueError: not 2-D, or the last size not a multiple of 128.
    """
    _check(x, "fp8_block_quantize_lhs", False, True)
    blocks = x.reshape(x.shape[0], -1, FP8_BLOCK_TILE)
    amax = torch.amax(torch.abs(blocks), -1, keepdim=True).to(torch.float64)
    values, scales = _cast(blocks, torch.clamp(amax, min=FP8_BLOCK_EPS))
    return BlockQuantized(values.reshape(x.shape), scales.squeeze(-1), FP8_BLOCK_TILE, 1)


def fp8_block_quantize_rhs(x: Tensor) -> BlockQuantized:
    """128x1 tiles along the first dimension of a 2-D ``x``: torchao's
    ``torch_blockwise_scale_act_quant_rhs`` (the amax clamped in ``x``'s dtype).

    Raises:
        ValueError: not 2-D, or the first size not a multiple of 128.
    """
    _check(x, "fp8_block_quantize_rhs", True, False)
    blocks = x.reshape(-1, FP8_BLOCK_TILE, x.shape[1])
    amax = torch.clamp(torch.amax(torch.abs(blocks), 1, keepdim=True), min=FP8_BLOCK_EPS)
    values, scales = _cast(blocks, amax.to(torch.float64))
    return BlockQuantized(values.reshape(x.shape), scales.squeeze(1), FP8_BLOCK_TILE, 0)


def fp8_block_quantize_weight(x: Tensor) -> BlockQuantized:
    """128x128 tiles of a 2-D ``x``: torchao's ``torch_blockwise_scale_weight_quant``. The
    result is blocked along the last dimension, each tile's scale repeated over its 128 rows
    (``scales`` is ``(rows, cols // 128)``), so that it dequantises as any
    :class:`~.mx.BlockQuantized`.

    Raises:
        ValueError: not 2-D, or a size not a multiple of 128.
    """
    _check(x, "fp8_block_quantize_weight", True, True)
    t = FP8_BLOCK_TILE
    rows, cols = x.shape
    tiles = x.reshape(rows // t, t, cols // t, t)
    amax = torch.amax(torch.abs(tiles), (1, 3), keepdim=True).to(torch.float64)
    values, scales = _cast(tiles, torch.clamp(amax, min=FP8_BLOCK_EPS))
    scales = scales.reshape(rows // t, cols // t).repeat_interleave(t, 0)
    return BlockQuantized(values.reshape(x.shape), scales, t, 1)


def _mm(a: Tensor, b: Tensor, out_dtype: torch.dtype) -> Tensor:
    """``a @ b`` of two dequantised (float32) operands, in float32 even inside an autocast
    region, written in ``out_dtype``."""
    with torch.autocast(a.device.type, enabled=False):
        return torch.mm(a, b).to(out_dtype)


class BlockFP8LinearFunction(torch.autograd.Function):
    """``x @ weight.T`` with block-scaled fp8 operands in all three GEMMs, as torchao's
    ``fp8_blockwise_mm`` (the module docstring). Use :func:`block_fp8_linear`."""

    @staticmethod
    def forward(ctx, x, weight):  # noqa: D102
        ctx.save_for_backward(x, weight)
        x2 = x.reshape(-1, x.shape[-1])
        wq = fp8_block_quantize_weight(weight).dequantize()
        out = _mm(fp8_block_quantize_lhs(x2).dequantize(), wq.t(), x.dtype)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):  # noqa: D102
        x, weight = ctx.saved_tensors
        g2 = grad_out.reshape(-1, grad_out.shape[-1]).to(x.dtype).contiguous()
        x2 = x.reshape(-1, x.shape[-1])
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            gq = fp8_block_quantize_lhs(g2).dequantize()
            wq = fp8_block_quantize_weight(weight).dequantize()
            grad_x = _mm(gq, wq, x.dtype).reshape(x.shape)
        if ctx.needs_input_grad[1]:
            gtq = fp8_block_quantize_lhs(g2.t().contiguous()).dequantize()
            xq = fp8_block_quantize_rhs(x2).dequantize()
            grad_w = _mm(gtq, xq, x.dtype).to(weight.dtype)
        return grad_x, grad_w


def block_fp8_linear(
    input: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
) -> Tensor:
    """A linear layer trained in block-scaled fp8, as torchao's ``Float8BlockwiseLinear``.

    Args:
        input: (..., K), a float tensor (torchao: bf16).
        weight: (N, K), the same dtype.
        bias: optional (N,), added after the GEMM in the output's dtype (unquantised; torchao's
            layer has none).

    Returns:
        (..., N) in ``input``'s dtype.

    K, N and the rows M of ``input`` need not be multiples of 128: the operands are padded with
    zeros to the next multiple and the output cut back, which scales a partial tile from its own
    values (a zero never raises a tile's amax) -- as torchao's blockwise grouped GEMM pads token
    groups. torchao's ``Float8BlockwiseLinear`` itself refuses such shapes; native runnability
    says so.

    Raises:
        ValueError: mismatched shapes or dtypes.
    """
    check_block_linear("block_fp8_linear", input, weight, FP8_BLOCK_TILE, (False,) * 3, "torchao")
    n, k = weight.shape
    rows = input.reshape(-1, k)
    pad_n, pad_k, pad_m = ((-size) % FP8_BLOCK_TILE for size in (n, k, rows.shape[0]))
    if pad_n or pad_k:
        weight = torch.nn.functional.pad(weight, (0, pad_k, 0, pad_n))
    if pad_k or pad_m:
        rows = torch.nn.functional.pad(rows, (0, pad_k, 0, pad_m))
    out = BlockFP8LinearFunction.apply(rows, weight)[: rows.shape[0] - pad_m, :n]
    out = out.reshape(*input.shape[:-1], n)
    return out if bias is None else out + bias.to(out.dtype)
