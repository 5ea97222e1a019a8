"""Transformer Engine's NVFP4 training Linear (``NVFP4BlockScaling``), emulated: the three GEMMs
of a Linear with NVFP4 operands (:mod:`.nvfp4`), forward and backward, each part switchable.

========================  ============================  =================================
GEMM                      left operand                  right operand
========================  ============================  =================================
output = x @ W.T          x, 1x16 along K, nearest      W, 16x16 tiles (1x16 along K)
grad_x = dY @ W           dY, 1x16 along N, stochastic  W^T, 16x16 tiles (1x16 along N)
grad_W = dY.T @ x         RHT(dY^T), 1x16 along M, st.  RHT(x^T), 1x16 along M, nearest
========================  ============================  =================================

as TE's recipe assigns them (``fp4_quant_fwd_inp``: RHT on the column-wise copy only;
``fp4_quant_fwd_weight``: 2-D; ``fp4_quant_bwd_grad``: RHT and stochastic rounding), each
operand quantised from the high-precision tensor (TE computes the row-wise and column-wise
copies separately, never one from the other). Each GEMM multiplies the block-scaled elements
in float32 and applies the two global scales after (:func:`~.nvfp4.nvfp4_mm`), as TE's
tensor-core GEMM accumulates in fp32, and writes the operands' dtype: TE trains under bf16
autocast, so feed bf16 operands to get its bf16 outputs (the runtime does). The token count
M must be a multiple of 16 when the weight-gradient GEMM is quantised: TE's kernels refuse
other shapes (its CPU reference pads with zeros; a real run cannot), so this refuses too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .mx import NVFP4_BLOCK_SIZE, check_block_linear
from .nvfp4 import check_rht_signs, nvfp4_mm, nvfp4_te_quantize, rht

__all__ = ["NVFP4_GEMMS", "NVFP4LinearFunction", "NVFP4Options", "nvfp4_linear"]

#: The three GEMMs of a Linear, as :attr:`NVFP4Options.hp_gemms` names them.
NVFP4_GEMMS = ("output", "grad_input", "grad_weight")


@dataclass(frozen=True)
class NVFP4Options:
    """Which parts of TE's NVFP4 recipe run; the defaults are TE's ``NVFP4BlockScaling()``.

    Attributes:
        two_d_weight: the weight in 16x16 tiles (TE's ``disable_2d_quantization=False``);
            False: 1x16 blocks along each GEMM's reduction dimension.
        stochastic_rounding: the output gradient rounded stochastically in both backward GEMMs
            (TE's ``disable_stochastic_rounding=False``).
        rht: the random Hadamard transform on both weight-gradient operands (TE's
            ``disable_rht=False``).
        hp_gemms: GEMMs left unquantised, in the operands' dtype: names of :data:`NVFP4_GEMMS`.
        rht_signs: the transform's 16 signs; None: TE's fixed signs
            (:data:`~.nvfp4.TE_RHT_SIGNS`, the same for every layer, as TE uses them).

    Raises:
        ValueError: an unknown GEMM name or bad signs.
    """

    two_d_weight: bool = True
    stochastic_rounding: bool = True
    rht: bool = True
    hp_gemms: frozenset[str] = frozenset()
    rht_signs: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        gemms = self.hp_gemms
        if isinstance(gemms, str) or not all(isinstance(g, str) for g in gemms):
            raise ValueError(f"hp_gemms must be a set of GEMM names, got {gemms!r}")
        unknown = sorted(set(gemms) - set(NVFP4_GEMMS))
        if unknown:
            raise ValueError(
                f"unknown GEMM {unknown[0]!r} in hp_gemms; expected any of {', '.join(NVFP4_GEMMS)}"
            )
        object.__setattr__(self, "hp_gemms", frozenset(gemms))
        if self.rht_signs is not None:
            object.__setattr__(self, "rht_signs", check_rht_signs(self.rht_signs))


class NVFP4LinearFunction(torch.autograd.Function):
    """``x @ weight.T`` with TE's NVFP4 operands in all three GEMMs (the module docstring's
    table). Use :func:`nvfp4_linear`."""

    @staticmethod
    def forward(ctx, x, weight, options, generator):  # noqa: D102
        ctx.save_for_backward(x, weight)
        ctx.options, ctx.generator = options, generator
        x2 = x.reshape(-1, x.shape[-1])
        with torch.autocast(x.device.type, enabled=False):  # the GEMMs' dtypes are TE's
            if "output" in options.hp_gemms:
                out = torch.mm(x2, weight.t())
            else:
                qx = nvfp4_te_quantize(x2)
                qw = nvfp4_te_quantize(weight, two_d=options.two_d_weight)
                out = nvfp4_mm(qx, qw, x.dtype)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):  # noqa: D102
        x, weight = ctx.saved_tensors
        options, generator = ctx.options, ctx.generator
        g2 = grad_out.reshape(-1, grad_out.shape[-1]).to(x.dtype)
        x2 = x.reshape(-1, x.shape[-1])
        sr = options.stochastic_rounding
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            if "grad_input" in options.hp_gemms:
                grad_x = torch.mm(g2, weight)
            else:
                qg = nvfp4_te_quantize(g2, stochastic=sr, generator=generator)
                qwt = nvfp4_te_quantize(weight.t(), two_d=options.two_d_weight)
                grad_x = nvfp4_mm(qg, qwt, x.dtype)
            grad_x = grad_x.reshape(x.shape)
        if ctx.needs_input_grad[1]:
            if "grad_weight" in options.hp_gemms:
                grad_w = torch.mm(g2.t(), x2)
            else:
                gt, xt = g2.t(), x2.t()
                if options.rht:
                    gt, xt = rht(gt, 1, options.rht_signs), rht(xt, 1, options.rht_signs)
                qgt = nvfp4_te_quantize(gt, stochastic=sr, generator=generator)
                qxt = nvfp4_te_quantize(xt)
                grad_w = nvfp4_mm(qgt, qxt, x.dtype)
            grad_w = grad_w.to(weight.dtype)
        return grad_x, grad_w, None, None


def nvfp4_linear(
    input: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    *,
    options: NVFP4Options = NVFP4Options(),  # noqa: B008 (frozen, shared safely)
    generator: torch.Generator | None = None,
) -> Tensor:
    """A linear layer trained in NVFP4 as Transformer Engine's ``NVFP4BlockScaling`` recipe.

    Args:
        input: (..., K), a float tensor.
        weight: (N, K), the same dtype as ``input``.
        bias: optional (N,), added after the GEMM in the output's dtype (unquantised).
        options: which parts of the recipe run (:class:`NVFP4Options`).
        generator: random source of the stochastic rounding, on the tensors' device; a
            generator seeded alike repeats a run bit for bit. The input-gradient GEMM draws
            first, then the weight-gradient GEMM.

    Returns:
        (..., N) in ``input``'s dtype.

    The rows M of ``input`` (the tokens) need not be a multiple of 16: they are padded with
    zero rows to the next multiple and the output cut back, as TE's reference quantizer pads
    (its CUDA kernels refuse such a count), so a last partial batch trains.

    Raises:
        ValueError: mismatched shapes or dtypes, or K or N not a multiple of 16 where a
            quantised GEMM blocks it: K (always), N (input gradient, or 16x16 weight tiles).
    """
    if not isinstance(options, NVFP4Options):
        raise ValueError(f"options must be an NVFP4Options, got {type(options).__name__}")
    hp, two_d = options.hp_gemms, options.two_d_weight
    grads = torch.is_grad_enabled() and (input.requires_grad or weight.requires_grad)
    fwd, dgrad = "output" not in hp, grads and "grad_input" not in hp
    wgrad = grads and weight.requires_grad and "grad_weight" not in hp
    # K: blocks of the forward GEMM or the weight's 16x16 tiles; N likewise; M: the wgrad's
    blocked = (fwd or (dgrad and two_d), dgrad or (fwd and two_d), False)
    check_block_linear("nvfp4_linear", input, weight, NVFP4_BLOCK_SIZE, blocked, "TE's NVFP4")
    rows = input.reshape(-1, input.shape[-1])
    pad = (-rows.shape[0]) % NVFP4_BLOCK_SIZE if wgrad else 0
    if pad:
        rows = torch.nn.functional.pad(rows, (0, 0, 0, pad))
    out = NVFP4LinearFunction.apply(rows, weight, options, generator)
    out = out[: out.shape[0] - pad].reshape(*input.shape[:-1], weight.shape[0])
    return out if bias is None else out + bias.to(out.dtype)
