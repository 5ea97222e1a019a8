"""The block-scaled Linears of a step's program: ``mxfp8``, ``fp8_block`` and ``nvfp4`` as the
backends that run them do (:func:`block_linear`, called by :mod:`autoprec.hardware.program`).

Each reads its input and weight in :func:`~autoprec.precision.block_io_format`'s dtype (a fp32
weight is cast to it each step and its gradient cast back), quantises the operands of its three
GEMMs with its own kernels and writes its output (and the bias added to it) in that dtype:

- ``mxfp8``: torchao's ``MXFP8Linear``: every operand of every GEMM cast to e4m3 blocks of 32
  with their E8M0 scales (``to_mx`` computes in fp32: a bf16 operand and its block amaxes are
  upcast first), three MX GEMMs.
- ``fp8_block``: torchao's ``fp8_blockwise_mm`` (``blockwise_fp8_training``; Transformer
  Engine's ``Float8BlockScaling`` casts the same tiles): one kernel per operand of each GEMM,
  reading the bf16 tensor once and writing e4m3 with one fp32 scale per tile (its amax taken in
  the same kernel): the input and the output gradient in 1x128 tiles along the GEMM's reduction
  dimension (twice each: rowwise for one GEMM, along the tokens for the weight gradient), the
  weight in 128x128 blocks (twice: forward and input gradient). Three fp8 GEMMs.
- ``nvfp4``: torchao's ``nvfp4_mm_triton`` (what torchtitan's NVFP4 converter runs; Transformer
  Engine's ``NVFP4BlockScaling`` quantises the same operands the same way): per tensor, one
  ``amax`` pass for its per-tensor scales (the Hadamard-transformed amax with it) and one kernel
  that writes both layouts its GEMMs read: the input rowwise (round to nearest) for the forward
  GEMM and columnwise after the random Hadamard transform for the weight gradient; the weight in
  16x16 blocks, itself and its transpose; the output gradient rowwise and, transformed,
  columnwise, both stochastically rounded. Three FP4 GEMMs. The transform is a 16x16 matrix
  product per 16 elements inside those kernels (``tl.dot`` on the tensor cores): 32 FLOPs per
  2-byte element, far below the ridge point of any device here, so it adds no time beyond the
  kernels' memory traffic.

Plain data, torch-free, as :mod:`autoprec.hardware.program`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from autoprec.hardware.program_types import Cast, FlowOp, Matmul
from autoprec.precision import GEMM_OPERANDS, MX_BLOCK, Precision, block_io_format

if TYPE_CHECKING:
    from autoprec.hardware.program import _Replay

__all__ = ["FP8_BLOCK_CASTS", "NVFP4_CASTS", "block_linear"]

#: fp8_block's cast of each operand of each GEMM (torchao's ``fp8_blockwise_mm``): 1x128 tiles
#: for activations and gradients, 128x128 blocks for the weight.
FP8_BLOCK_CASTS = {"input": "e4m3_1x128", "grad_output": "e4m3_1x128", "weight": "e4m3_128x128"}
#: nvfp4's casts of each tensor, after its ``amax`` pass: the two layouts one kernel writes.
NVFP4_CASTS = {
    "input": ("nvfp4", "nvfp4_rht"),
    "weight": ("nvfp4_16x16", "nvfp4_16x16"),
    "grad_output": ("nvfp4_sr", "nvfp4_rht_sr"),
}
_PHASES = (("forward", ("output",)), ("backward", ("grad_input", "grad_weight")))


def block_linear(replay: _Replay, op: FlowOp, args: list[int], precision: Precision) -> str:
    """Record a block-scaled Linear's casts and GEMMs (see the module docstring); return its
    output's dtype."""
    layer = op.layer
    io = block_io_format(precision, replay.region)
    weights = [a for a in args if replay.is_weight(a) and replay.tensors[replay.root(a)].dim == 2]
    bias = [a for a in args if replay.is_weight(a) and a not in weights]
    acts = [a for a in args if not replay.is_weight(a)]
    for a in acts:
        if replay.dtype[a] != io:
            replay.cast(a, io, layer)
            replay.dtype[a] = io
    for a in weights + bias:
        if replay.dtype[a] != io:
            replay.cast(a, io, layer, cache=False)
    grad_numel = replay.tensors[op.outs[0]].numel if op.outs else 0
    numel = {"input": [replay.tensors[a].numel for a in acts], "grad_output": [grad_numel]}
    numel["weight"] = [replay.tensors[replay.root(w)].numel for w in weights]
    if precision is Precision.NVFP4:
        _nvfp4(replay, layer, io, numel)
    else:
        _per_gemm(replay.casts, replay.matmuls, layer, io, numel, precision)
    return io


def _per_gemm(
    casts: list[Cast],
    matmuls: list[Matmul],
    layer: str,
    io: str,
    numel: dict[str, list[int]],
    precision: Precision,
) -> None:
    """mxfp8 and fp8_block: each GEMM casts its own two operands, then runs."""
    dtype = precision.hardware
    for phase, gemms in _PHASES:
        for gemm in gemms:
            for role in GEMM_OPERANDS[gemm]:
                weight = role == "weight"
                for n in numel[role]:
                    if precision is Precision.FP8_BLOCK:
                        casts.append(Cast(phase, layer, io, FP8_BLOCK_CASTS[role], n, weight))
                        continue
                    scales = max(1, n // MX_BLOCK)
                    if io != "fp32":  # torchao's to_mx upcasts the block amaxes and data
                        casts.append(Cast(phase, layer, io, "fp32", scales, weight))
                        casts.append(Cast(phase, layer, io, "fp32", n, weight))
                    casts.append(Cast(phase, layer, "fp32", "fp8_e4m3", n, weight))
                    casts.append(Cast(phase, layer, "fp32", "e8m0", scales, weight))
            matmuls.append(Matmul(phase, layer, "_scaled_mm", dtype))


def _nvfp4(replay: _Replay, layer: str, io: str, numel: dict[str, list[int]]) -> None:
    """nvfp4: each tensor quantised once into both layouts its GEMMs read, then the GEMMs."""
    roles = {"forward": ("input", "weight"), "backward": ("grad_output",)}
    for phase, gemms in _PHASES:
        for role in roles[phase]:
            for n in numel[role]:
                weight = role == "weight"
                replay.casts.append(Cast(phase, layer, io, "amax", n, weight))
                replay.casts.extend(Cast(phase, layer, io, t, n, weight) for t in NVFP4_CASTS[role])
        replay.matmuls.extend(Matmul(phase, layer, "_scaled_mm", "nvfp4") for _ in gemms)
