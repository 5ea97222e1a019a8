"""Emulate mode's fused experts: a mixture of experts' grouped GEMMs at one precision.

Fused experts (:data:`autoprec.layers.FUSED_EXPERTS`: torchtitan's and the zoo's
``GroupedExperts``, transformers' ``MixtralExperts``) are one tunable layer whose three GEMMs per
expert run as grouped GEMMs over the tokens sorted by expert. Under a policy they are swapped,
as an fp8 Linear is (:class:`~.native.Float8Swap`), for an :class:`EmulatedExperts` that shares
their very parameters and runs each grouped GEMM ``out[e] = x[e] @ weight[e].T`` with, per
expert group, the casts a Linear at the same precision gets:

- bf16/fp16: operands rounded to the format, products summed in fp32, results (and both
  gradients) rounded to it: what ``torch._grouped_mm`` on bf16 operands computes (torchtitan
  casts the experts' operands to bf16 itself: autocast has no rule for ``_grouped_mm``);
- tf32: every GEMM's operands rounded to tf32, results in fp32;
- the fp8 recipes: :class:`~.float8_emulate.RecipeCasts` applied to each expert's slice. For
  ``fp8_rowwise`` that is torchao's ``moe_training`` fp8 grouped GEMM
  (``_Float8GroupedMM``): e4m3 throughout, power-of-two scales, every operand scaled along its
  GEMM's reduction dimension -- the output GEMM's input per token and weight per output
  feature of each expert, the input gradient's output gradient per token and weight per input
  feature of each expert, the weight gradient's operands per feature over each expert's
  tokens -- and bf16 results. ``fp8`` (tensorwise) scales each expert's operand slices as a
  Float8Linear per expert would, one scale each;
- mxfp8: torchao's ``_MXFP8GroupedMM`` (:func:`~autoprec.kernels.mx_linear` per expert, e4m3
  blocks of 32 along each GEMM's reduction dimension, RCEIL scales); each expert's tokens are
  padded with zero rows to a multiple of 32, as torchao pads token groups, which leaves every
  block's amax as it was;
- fp8_block: torchao's ``_Float8BlockwiseGroupedMM`` (:func:`~autoprec.kernels.block_fp8_linear`
  per expert: activations and gradients in 1x128 tiles, each expert's weight in 128x128
  blocks, the weight gradient's operands tiled along the tokens), each expert's tokens padded to
  a multiple of 128 as torchao pads them, so that no tile spans two experts; operands in bf16.
- nvfp4 is refused: torchao's NVFP4 grouped GEMM is a forward-only emulation without autograd,
  and how Transformer Engine splits its per-tensor amax, stochastic rounding and Hadamard
  transform over experts is not reproduced here.

The products of the (dequantised) operands are summed in fp32, as the CPU's ``_grouped_mm``
sums each group (``x[e] @ weight[e].T``). Elementwise work between the GEMMs (the SiLU and the
product of gate and up) stays in fp32, as between layers elsewhere in emulate mode.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from autoprec.hardware.runnability import NotRunnableError
from autoprec.kernels import block_fp8_linear, fake_quantize, get_format, mx_linear, quantize
from autoprec.layers import expert_weights
from autoprec.precision import MX_BLOCK, Precision, block_io_format
from autoprec.runtime.float8_emulate import RecipeCasts

__all__ = [
    "EmulatedExperts",
    "GroupedCasts",
    "check_experts",
    "grouped_gemm",
    "runs_grouped",
]

_STORED = {Precision.BF16: "bf16", Precision.FP16: "fp16"}
_EMULATED = (Precision.TF32, Precision.BF16, Precision.FP16, Precision.MXFP8, Precision.FP8_BLOCK)


@dataclass
class GroupedCasts:
    """The casts of one fused-experts layer's grouped GEMMs; quacks like
    :class:`~.casting.LayerCasts` for :class:`~.layer.ManagedLayer` (``active`` False: the
    swapped module casts by itself).

    Args:
        precision: the layer's precision.
        count: keep overflow/underflow counts (the fp8 recipes' casts).
        output_format: the autocast region's format an fp8 layer writes (None: fp32).
    """

    precision: Precision
    count: bool = True
    output_format: str | None = None

    active = False

    def __post_init__(self) -> None:
        self.recipe = (
            RecipeCasts(self.precision, self.count, self.output_format)
            if self.precision.is_fp8
            else None
        )
        self.format = None if self.precision is Precision.FP32 else self.precision.value
        self.stored_format = _STORED.get(self.precision)

    def cast(self, gemm: str, operand: str, x: Tensor) -> Tensor:
        """``x`` (one expert's slice) as ``gemm`` reads it, in float32."""
        if self.recipe is not None:
            return self.recipe.cast(gemm, operand, x)
        return x if self.format is None else quantize(x, self.format)

    def result(self, gemm: str, out: Tensor) -> Tensor:
        """``gemm``'s result as the layer writes it."""
        if self.recipe is not None:
            return self.recipe.result(gemm, out)
        return self.stored(out)

    def stored(self, x: Tensor) -> Tensor:
        """``x`` in the format the layer's results are stored in (a gradient arriving)."""
        if self.recipe is not None:
            return self.recipe.stored(x)
        return x if self.stored_format is None else quantize(x, self.stored_format)

    def counts(self) -> tuple[int, int]:
        """(overflows, underflows) of the fp8 casts; zeros for the others (the layer's own
        hooks count the 16-bit roundings of its input and output gradient)."""
        return (0, 0) if self.recipe is None else self.recipe.counts()


def _bounds(counts: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(expert, start, end)`` of every expert with tokens."""
    out, start = [], 0
    for expert, n in enumerate(counts):
        if n:
            out.append((expert, start, start + n))
        start += n
    return out


class _GroupedMatmul(torch.autograd.Function):
    """``out[s:e] = x[s:e] @ weight[g].T`` per expert ``g``, each of the three GEMMs with
    ``casts`` applied to that expert's operand slices."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, counts: list[int], casts: GroupedCasts):  # noqa: D102
        ctx.save_for_backward(x, weight)
        ctx.counts, ctx.casts = counts, casts
        out = x.new_zeros((x.shape[0], weight.shape[1]), dtype=torch.float32)
        for g, s, e in _bounds(counts):
            xg = casts.cast("output", "input", x[s:e].detach().float())
            wg = casts.cast("output", "weight", weight[g].detach().float())
            out[s:e] = casts.result("output", xg @ wg.t())
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, grad: Tensor):  # noqa: D102
        x, weight = ctx.saved_tensors
        casts: GroupedCasts = ctx.casts
        g2 = casts.stored(grad.float())  # as the next op stored it
        grad_x = torch.zeros_like(x, dtype=torch.float32) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        for g, s, e in _bounds(ctx.counts):
            xg, wg, gg = x[s:e].detach().float(), weight[g].detach().float(), g2[s:e]
            if grad_x is not None:
                gx = casts.cast("grad_input", "grad_output", gg) @ casts.cast(
                    "grad_input", "weight", wg
                )
                grad_x[s:e] = casts.result("grad_input", gx)
            if grad_w is not None:
                gw = casts.cast("grad_weight", "grad_output", gg).t() @ casts.cast(
                    "grad_weight", "input", xg
                )
                grad_w[g] = casts.result("grad_weight", gw)
        grad_x = None if grad_x is None else grad_x.to(x.dtype)
        grad_w = None if grad_w is None else grad_w.to(weight.dtype)
        return grad_x, grad_w, None, None


def _block_grouped(
    x: Tensor, weight: Tensor, counts: list[int], precision: Precision, region: str | None
) -> Tensor:
    """mxfp8 (:func:`~autoprec.kernels.mx_linear`) or fp8_block
    (:func:`~autoprec.kernels.block_fp8_linear`) per expert, each expert's tokens padded with
    zero rows to a multiple of the block, as torchao pads token groups; operands in
    :func:`~autoprec.precision.block_io_format`'s dtype, as the Linears' emulations read them."""
    io = get_format(block_io_format(precision, region)).torch_dtype
    dtype = weight.dtype if io == torch.float32 else io
    block = precision.block_size or 1
    outs = []
    for g, s, e in _bounds(counts):
        xg = F.pad(x[s:e].to(dtype), (0, 0, 0, -(e - s) % block))
        if precision.is_mx:
            out = mx_linear(xg, weight[g].to(dtype), elem="fp8_e4m3", block_size=MX_BLOCK)
        else:
            out = block_fp8_linear(xg, weight[g].to(dtype))
        outs.append(out[: e - s])
    if not outs:
        return x.new_zeros((0, weight.shape[1]))
    return torch.cat(outs).to(x.dtype)


def grouped_gemm(x: Tensor, weight: Tensor, counts: Sequence[int], casts: GroupedCasts) -> Tensor:
    """``x`` (tokens sorted by expert, K) times ``weight[e].T`` (``weight``: (E, N, K)) for each
    expert's ``counts[e]`` rows, at ``casts``' precision (see the module docstring)."""
    counts = [int(c) for c in counts]
    if casts.precision.is_block:
        return _block_grouped(x, weight, counts, casts.precision, casts.output_format)
    return _GroupedMatmul.apply(x, weight, counts, casts)


class EmulatedExperts(nn.Module):
    """Fused experts running their grouped GEMMs at one precision in emulation; holds the
    original module's very parameters under their own names.

    Args:
        module: the fused experts (:func:`autoprec.layers.is_fused_experts`).
        precision: its precision (not nvfp4 or fp8_block: see :func:`emulation_refusal`).
        region: the autocast region's format of the policy (None: none).
        count: keep overflow/underflow counts.
    """

    def __init__(
        self, module: nn.Module, precision: Precision, region: str | None, count: bool = True
    ) -> None:
        super().__init__()
        self.names = expert_weights(module)
        self.kind = type(module).__name__
        for name in self.names:
            setattr(self, name, getattr(module, name))
        self.act = getattr(module, "act_fn", F.silu)
        stored = region if precision.swapped else None
        self.casts = GroupedCasts(precision, count, stored)

    def _swiglu(self, x: Tensor, counts: Sequence[int]) -> Tensor:
        if self.casts.output_format is not None:  # an fp8 layer reads the region's format
            x = fake_quantize(x, self.casts.output_format, None)
        gemm = lambda a, w: grouped_gemm(a, w, counts, self.casts)  # noqa: E731
        if len(self.names) == 3:  # w1 (gate), w3 (up), w2 (down)
            w1, w3, w2 = (getattr(self, n) for n in self.names)
            gate, up = gemm(x, w1), gemm(x, w3)
        else:  # gate_up_proj: one GEMM, its output's halves the gate and the up projection
            gate_up, w2 = (getattr(self, n) for n in self.names)
            gate, up = gemm(x, gate_up).chunk(2, dim=-1)
        return gemm(self.act(gate) * up, w2)

    def forward(self, x: Tensor, *routing: Tensor) -> Tensor:  # noqa: D102
        if len(self.names) == 3:  # GroupedExperts(x sorted by expert, tokens per expert)
            return self._swiglu(x, routing[0].tolist()).type_as(x)
        top_k_index, top_k_weights = routing  # MixtralExperts(hidden, top_k_index, weights)
        experts = top_k_index.shape[-1]
        chosen = top_k_index.reshape(-1)
        n_experts = getattr(self, self.names[0]).shape[0]
        order = torch.argsort(chosen, stable=True)
        order = order[chosen[order] < n_experts]  # an index of n_experts: no expert here
        token = order // experts
        counts = torch.bincount(chosen[order], minlength=n_experts).tolist()
        routed = self._swiglu(x[token], counts)
        weighted = routed * top_k_weights.reshape(-1)[order, None]
        return torch.zeros_like(x).index_add(0, token, weighted.to(x.dtype))


def runs_grouped(module: nn.Module, precision: Precision) -> bool:
    """Whether emulate mode swaps ``module`` for :class:`EmulatedExperts` at ``precision``:
    fused experts at any precision but fp32 (whose module runs as it is)."""
    return bool(expert_weights(module)) and precision is not Precision.FP32


def emulation_refusal(name: str, precision: Precision) -> str | None:
    """Why fused experts ``name`` cannot run at ``precision`` in emulation, or None."""
    if precision.is_fp8 or precision in _EMULATED or precision is Precision.FP32:
        return None
    return (
        f"layer {name!r} is fused experts at {precision.value}, which autoprec does not emulate "
        "for grouped GEMMs yet; choose fp8_rowwise, fp8_block, mxfp8 or a 16-bit precision"
    )


def native_refusal(name: str, precision: Precision, target: str) -> str | None:
    """Why fused experts ``name`` cannot run at ``precision`` natively on ``target``, or None:
    their fp8 and block-scaled grouped GEMMs are torchao's ``moe_training`` (not wired into
    the native runtime); 16-bit and tf32 run under the policy's autocast region and switches."""
    if not precision.swapped:
        return None
    if precision is Precision.NVFP4:
        return (
            f"layer {name!r} is fused experts at nvfp4: no backend autoprec drives trains "
            "grouped GEMMs in NVFP4 (torchao's NVFP4 grouped GEMM has no backward yet); use "
            "mode='emulate' with another precision for it, or bf16"
        )
    return (
        f"layer {name!r} is fused experts at {precision.value}: its grouped GEMMs run natively "
        "in torchao.prototype.moe_training (MoETrainingConfig: fp8 rowwise, fp8 blockwise and "
        f"MXFP8 grouped GEMMs on CUDA), which autoprec's native runtime does not drive on "
        f"{target}; use mode='emulate' or a 16-bit precision for it"
    )


def check_experts(
    layers: dict[str, tuple[nn.Module, Precision]], mode: str, target: str = "this device"
) -> None:
    """Refuse, in one line, fused experts at a precision ``mode`` cannot run them at.

    Raises:
        NotRunnableError: naming the first such layer (and torchao's moe_training natively).
    """
    bad = {}
    for name, (module, precision) in layers.items():
        if expert_weights(module):
            why = (
                native_refusal(name, precision, target)
                if mode == "native"
                else emulation_refusal(name, precision)
            )
            if why:
                bad[name] = why
    if bad:
        first = next(iter(bad.values()))
        more = f" (and {len(bad) - 1} more such layers)" if len(bad) > 1 else ""
        raise NotRunnableError(first + more, {n: why for n, why in bad.items()})
