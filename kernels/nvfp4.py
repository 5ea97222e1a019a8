"""NVFP4 as Transformer Engine trains in it (``NVFP4BlockScaling``), emulated on any device.

:mod:`.mx`'s :func:`~.mx.nvfp4_quantize` is torchao's ``NVFP4Tensor`` (inference) cast. TE's
training recipe computes the scales in another order and adds three parts, each here:

- **Scales** (TE's ``NVFP4QuantizerRef._quantize_blockwise_reference``, which TE's CUDA
  kernels match bit for bit, ``tests/pytorch/nvfp4/test_nvfp4_quantize_exact.py``): with
  ``amax`` the tensor's largest magnitude, the global encode scale is ``S = 448 * 6 / amax``
  (1 when amax is 0); a block's decode scale is ``e4m3(block_amax * (S * fp32(1/6)))``
  (round to nearest, clamped to 448; it may be an E4M3 subnormal or 0); elements are
  ``x * min(1 / (scale * (1 / S)), fp32 max)`` clamped to ±6 and rounded to E2M1. A value
  dequantises as ``element * (scale * amax * fp32(1 / 2688))`` (TE's ``dequantize_fp4_kernel``)
  and a GEMM of two operands is scaled by ``amax_a * amax_b * fp32(1 / (6 * 6 * 448 * 448))``
  after the fp32 accumulation (TE's ``compute_nvfp4_per_tensor_scale_kernel``): :func:`nvfp4_mm`.
  torchao's Triton NVFP4 training kernels (``nvfp4_training/quantize_2d_triton.py``) use the
  same formula but clamp a block scale to at least E4M3's smallest normal (2**-6) first; TE
  keeps subnormal and zero scales, and so does this module.
- **2-D weight blocks**: one scale per 16x16 tile (``two_d=True``), so that ``W`` and ``W^T``
  quantise to the same values and the weight enters forward and input-gradient GEMMs alike.
- **Stochastic rounding** of the elements (``stochastic=True``, TE's ``cvt.rs``): a value
  rounds to one of its two E2M1 neighbours with probability proportional to its distance from
  the other (:func:`~.quantize.quantize`'s stochastic mode, driven by a ``torch.Generator``).
- **Random Hadamard transform** (:func:`rht`): blocks of 16 times ``diag(signs) @ H16 / 4``,
  ``H16`` Sylvester's Hadamard matrix; TE applies it to both operands of the weight-gradient
  GEMM along the token dimension with one fixed sign vector (:data:`TE_RHT_SIGNS`, TE's
  ``get_wgrad_sign_vector``); being orthogonal, it leaves the exact product unchanged. The
  amax of a transformed operand is taken after the transform (TE's ``with_post_rht_amax``).

Example:
    >>> q = nvfp4_te_quantize(torch.randn(32, 64), two_d=True)
    >>> w = q.dequantize()
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from .formats import get_format
from .mx import NVFP4_BLOCK_SIZE
from .quantize import quantize

__all__ = [
    "NVFP4Blocks",
    "RHT_SIZE",
    "TE_RHT_SIGNS",
    "check_rht_signs",
    "hadamard_matrix",
    "nvfp4_mm",
    "nvfp4_te_quantize",
    "nvfp4_te_round",
    "rht",
    "rht_matrix",
]

#: Size of the Hadamard blocks TE's NVFP4 recipe transforms (its ``hadamard_dimension``).
RHT_SIZE = 16
#: TE's fixed random signs of its weight-gradient Hadamard transform
#: (``transformer_engine/pytorch/tensor/nvfp4_tensor.py``, ``get_wgrad_sign_vector``).
TE_RHT_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)

_E2M1 = "fp4_e2m1"
_E4M3 = "fp8_e4m3"
_F32_MAX = torch.finfo(torch.float32).max


def _limits() -> tuple[float, float]:
    return get_format(_E2M1).max_finite, get_format(_E4M3).max_finite  # 6, 448


@dataclass(frozen=True)
class NVFP4Blocks:
    """A 2-D tensor quantised as TE's NVFP4, blocked along its last dimension.

    Attributes:
        elements: float32 E2M1 values, shaped like the input.
        scales: float32 E4M3 decode scales, one per 1x16 block: ``(rows, cols // 16)``; with
            16x16 tiles each tile's scale repeats over its 16 rows.
        amax: the float32 0-dim amax the global scale came from.
        two_d: whether the scales belong to 16x16 tiles.
    """

    elements: Tensor
    scales: Tensor
    amax: Tensor
    two_d: bool = False

    def scaled(self) -> Tensor:
        """Elements times their block scale, in float32 (exact: 2 by 4 significant bits)."""
        return self._times(self.scales)

    def _times(self, block_values: Tensor) -> Tensor:
        rows, cols = self.elements.shape
        blocks = self.elements.reshape(rows, cols // NVFP4_BLOCK_SIZE, NVFP4_BLOCK_SIZE)
        return (blocks * block_values.unsqueeze(-1)).reshape(rows, cols)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The values, as TE dequantises: ``element * (scale * amax * fp32(1/2688))``."""
        fp4_max, e4m3_max = _limits()
        factor = torch.tensor(1.0 / (fp4_max * e4m3_max), dtype=torch.float32)
        final = (self.scales * self.amax) * factor.to(self.amax.device)
        return self._times(final).to(dtype)


def _check_2d(x: Tensor, what: str) -> None:
    if not isinstance(x, Tensor) or not x.is_floating_point() or x.dim() != 2:
        got = f"shape {tuple(x.shape)}, {x.dtype}" if isinstance(x, Tensor) else type(x).__name__
        raise ValueError(f"{what} expects a 2-D floating-point tensor, got {got}")


def nvfp4_te_quantize(
    x: Tensor,
    *,
    two_d: bool = False,
    stochastic: bool = False,
    generator: torch.Generator | None = None,
) -> NVFP4Blocks:
    """Quantise a 2-D tensor to NVFP4 as TE's recipe: blocks of 16 along the last dimension
    (16x16 tiles with ``two_d``), E4M3 block scales, one fp32 amax for the tensor.

    Args:
        x: a 2-D float tensor (any float dtype; the arithmetic is TE's, in float32) whose last
            size, and with ``two_d`` its first, is a multiple of 16.
        two_d: one scale per 16x16 tile (TE's weight quantisation) instead of per 1x16 block.
        stochastic: round the elements stochastically (TE's gradients) instead of to nearest.
        generator: random source of the stochastic rounding, on ``x``'s device.

    Raises:
        ValueError: not a 2-D float tensor, or a blocked size not a multiple of 16.
    """
    _check_2d(x, "nvfp4_te_quantize")
    rows, cols = x.shape
    block = NVFP4_BLOCK_SIZE
    if cols % block or (two_d and rows % block):
        need = "both sizes" if two_d else "the last size"
        raise ValueError(
            f"nvfp4_te_quantize: shape {tuple(x.shape)} needs {need} a multiple of {block} "
            "(TE's NVFP4 kernels refuse other shapes); pad the tensor"
        )
    fp4_max, e4m3_max = _limits()
    x32 = x.float()
    magnitude = torch.abs(x32)
    amax = torch.max(magnitude) if x32.numel() else torch.zeros((), device=x.device)
    # a tensor quotient: ``scalar / tensor`` is ``reciprocal(tensor) * scalar`` in torch, which
    # rounds twice; TE divides once (torch.div in its reference, IEEE division in CUDA)
    encode = torch.clamp_max(torch.div(amax.new_tensor(e4m3_max * fp4_max), amax), _F32_MAX)
    encode = torch.where((amax == 0) | (encode == 0), 1.0, encode)
    decode = 1.0 / encode
    blocks = x32.reshape(rows, cols // block, block)
    block_amax = torch.amax(magnitude.reshape(rows, cols // block, block), -1)
    if two_d:
        tiles = block_amax.reshape(rows // block, block, cols // block)
        block_amax = torch.amax(tiles, 1).repeat_interleave(block, 0)
    multiplier = encode * torch.reciprocal(torch.tensor(fp4_max, device=x.device))
    scale = quantize(torch.clamp(block_amax * multiplier, max=e4m3_max), _E4M3)
    encode_block = torch.clamp_max(1.0 / (scale * decode), _F32_MAX)
    scaled = torch.clamp(blocks * encode_block.unsqueeze(-1), -fp4_max, fp4_max)
    rounding = "stochastic" if stochastic else "nearest"
    elements = quantize(scaled, _E2M1, rounding, saturate=True, generator=generator)
    return NVFP4Blocks(elements.reshape(rows, cols), scale, amax.float(), two_d)


def nvfp4_te_round(
    x: Tensor,
    *,
    two_d: bool = False,
    stochastic: bool = False,
    generator: torch.Generator | None = None,
) -> Tensor:
    """:func:`nvfp4_te_quantize` and back, in ``x``'s dtype."""
    q = nvfp4_te_quantize(x, two_d=two_d, stochastic=stochastic, generator=generator)
    return q.dequantize(x.dtype)


def nvfp4_mm(a: NVFP4Blocks, b: NVFP4Blocks, out_dtype: torch.dtype) -> Tensor:
    """``a @ b.T`` of two NVFP4 operands blocked along their shared (last) dimension, as TE's
    NVFP4 GEMM: block-scaled elements multiplied and accumulated in float32, the product of
    the two global scales applied after, the result written in ``out_dtype``."""
    fp4_max, e4m3_max = _limits()
    factor = torch.tensor(1.0 / (fp4_max * fp4_max * e4m3_max * e4m3_max), dtype=torch.float32)
    alpha = a.amax * b.amax * factor.to(a.amax.device)
    return (torch.mm(a.scaled(), b.scaled().t()) * alpha).to(out_dtype)


def check_rht_signs(signs: tuple[int, ...] | None) -> tuple[int, ...]:
    """``signs`` as a tuple of 16 ±1 (None: :data:`TE_RHT_SIGNS`).

    Raises:
        ValueError: not 16 values, each 1 or -1.
    """
    if signs is None:
        return TE_RHT_SIGNS
    values = tuple(signs)
    if len(values) != RHT_SIZE or any(s not in (1, -1) for s in values):
        raise ValueError(
            f"rht_signs must be {RHT_SIZE} values, each 1 or -1, got {values[:20]!r}; "
            "None uses Transformer Engine's fixed signs"
        )
    return tuple(int(s) for s in values)


def hadamard_matrix(size: int = RHT_SIZE) -> Tensor:
    """Sylvester's Hadamard matrix of a power-of-two ``size``: entries ±1, float32."""
    if size < 1 or size & (size - 1):
        raise ValueError(f"a Hadamard size must be a power of two, got {size}")
    h = torch.ones(1, 1)
    while h.shape[0] < size:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return h


@functools.lru_cache(maxsize=64)
def _rht_matrix(signs: tuple[int, ...]) -> Tensor:
    return torch.diag(torch.tensor(signs, dtype=torch.float32)) @ hadamard_matrix() / 4.0


def rht_matrix(signs: tuple[int, ...] | None = None) -> Tensor:
    """TE's transform matrix ``diag(signs) @ H16 / 4`` (float32, orthogonal): a row block
    ``v`` of 16 becomes ``v @ rht_matrix(signs)``."""
    return _rht_matrix(check_rht_signs(signs)).clone()


def rht(
    x: Tensor, dim: int = -1, signs: tuple[int, ...] | None = None, *, inverse: bool = False
) -> Tensor:
    """The random Hadamard transform of ``x`` in blocks of 16 along ``dim``, computed in
    float32 and returned in ``x``'s dtype (TE transforms bf16 operands into bf16).

    Args:
        x: a float tensor whose size along ``dim`` is a multiple of 16.
        dim: the blocked dimension: the weight-gradient GEMM's reduction (token) dimension.
        signs: 16 ±1 (None: :data:`TE_RHT_SIGNS`).
        inverse: apply the transpose (the inverse: the matrix is orthogonal).

    Raises:
        ValueError: bad signs, dim, or a size not a multiple of 16.
    """
    matrix = _rht_matrix(check_rht_signs(signs)).to(x.device)
    if x.dim() == 0 or not -x.dim() <= dim < x.dim():
        raise ValueError(f"rht: dim {dim} is out of range for shape {tuple(x.shape)}")
    if x.shape[dim] % RHT_SIZE:
        raise ValueError(
            f"rht: size {x.shape[dim]} of dim {dim} is not a multiple of {RHT_SIZE}; pad it"
        )
    moved = x.movedim(dim, -1).float()
    blocks = moved.reshape(-1, RHT_SIZE) @ (matrix.t() if inverse else matrix)
    return blocks.reshape(moved.shape).movedim(-1, dim).to(x.dtype)
