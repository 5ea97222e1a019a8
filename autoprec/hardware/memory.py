"""The bytes a layer's precision decides: storage per format, and per layer the low-precision
weight copy and the activations saved for backward (what :meth:`CostModel.step
<autoprec.hardware.cost.CostModel.step>` and the environment's memory feature add up)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING

# the programs a step runs as (CostModel.step's ``execution``; a policy's target.execution)
from autoprec.policy.fields import EXECUTION_MODES
from autoprec.precision import (
    FORMAT_FACTS,
    FP8_BLOCK_TILE,
    NVFP4_BLOCK,
    Precision,
    block_io_format,
)

if TYPE_CHECKING:
    from autoprec.graph.table import LayerRow
    from autoprec.hardware.program_types import Cast

__all__ = [
    "BLOCK_CAST_BYTES",
    "EAGER_FP8_CAST_KERNELS",
    "EXECUTION_MODES",
    "STORAGE_BYTES",
    "activation_ratio",
    "cast_traffic",
    "layer_memory",
    "saved_input_ratio",
]

#: Bytes one value of each format occupies (tf32 lives in a 32-bit container).
STORAGE_BYTES: Mapping[str, int] = MappingProxyType(
    {name: facts.storage_bytes for name, facts in FORMAT_FACTS.items()}
)


#: Bytes per element of a block-scaled cast's result, its scales included, by the target name
#: the step's program gives it (:mod:`autoprec.hardware.program`): fp8 block scaling's e4m3
#: tiles with one fp32 scale per 1x128 tile or 128x128 block; NVFP4's packed E2M1 (half a
#: byte) with one E4M3 scale byte per 16 elements (round to nearest, stochastic rounding, after
#: the random Hadamard transform, or in 16x16 weight blocks: the same bytes; the one fp32
#: scale per tensor is left out); ``amax``: a reduction pass that reads and writes nothing
#: per element.
BLOCK_CAST_BYTES: Mapping[str, float] = MappingProxyType(
    {
        "e4m3_1x128": 1 + 4 / FP8_BLOCK_TILE,
        "e4m3_128x128": 1 + 4 / FP8_BLOCK_TILE**2,
        **dict.fromkeys(
            ("nvfp4", "nvfp4_sr", "nvfp4_rht", "nvfp4_rht_sr", "nvfp4_16x16"),
            FORMAT_FACTS["fp4_e2m1"].storage_bytes + 1 / NVFP4_BLOCK,
        ),
        "amax": 0,
    }
)


def activation_ratio(precision: Precision, region: str | None = None) -> float:
    """Bytes per element of a layer's activations (its output, and the input it saves for
    backward unless :func:`saved_input_ratio` says otherwise) relative to fp32's 4: its
    format's for the 16-bit and wide precisions; for a swapped layer (an fp8 recipe, a
    block-scaled format) the dtype around it, low-precision operands existing only inside its
    GEMMs: torchao's ``Float8Linear`` writes and saves the region's format (``region``: bf16,
    fp16, None for fp32), the block-scaled layers :func:`~autoprec.precision.block_io_format`'s.
    """
    if precision.is_fp8:
        return STORAGE_BYTES[region or "fp32"] / 4
    if precision.is_block:
        return STORAGE_BYTES[block_io_format(precision, region)] / 4
    return precision.bytes_ratio


def saved_input_ratio(precision: Precision, region: str | None = None) -> float:
    """Bytes per element of the input a layer saves for backward, relative to fp32's 4:
    :func:`activation_ratio`'s, except for ``nvfp4``, which saves its input only quantised
    (torchao's ``nvfp4_mm_triton`` keeps the columnwise, Hadamard-transformed E2M1 codes and
    their E4M3 scales for the weight-gradient GEMM: "Saves only FP4 codes+scales for backward",
    torchao/prototype/moe_training/nvfp4_training/nvfp4_linear.py, torchao 0.18)."""
    if precision is Precision.NVFP4:
        return BLOCK_CAST_BYTES["nvfp4_rht"] / 4
    return activation_ratio(precision, region)


def layer_memory(
    row: LayerRow, precision: Precision, scale: float = 1.0, activations: float | None = None
) -> tuple[float, float]:
    """``(low-precision weight copy, saved activations)``: the bytes of one layer in a step
    that depend on its precision (:meth:`CostModel.step`'s ``low_precision_weights`` and
    ``activations``; a copy only below fp32's width). ``scale`` multiplies the table's batch;
    ``activations`` is the saved input's bytes per element over fp32's (default: the
    precision's format; :meth:`CostModel.step` passes :func:`saved_input_ratio`). The weight
    copy kept for backward is the precision's format, except: ``fp8_block`` saves its bf16
    weight (torchao's ``fp8_blockwise_mm`` recasts it in backward), ``nvfp4`` the 16x16-block
    E2M1 codes of the transposed weight with their scales.
    """
    kept = {Precision.FP8_BLOCK: STORAGE_BYTES["bf16"], Precision.NVFP4: BLOCK_CAST_BYTES["nvfp4"]}
    weight = kept[precision] / 4 if precision in kept else precision.bytes_ratio
    low = row.params * weight * 4 if weight < 1 else 0.0
    saved = precision.bytes_ratio if activations is None else activations
    return low, row.input_bytes * scale * saved + row.output_bytes * scale


# torchao computes fp8 scales through fp64; MX block scales are one byte each (E8M0)
_CAST_BYTES = {**STORAGE_BYTES, "fp64": 8, "e8m0": 1, **BLOCK_CAST_BYTES}
# NVFP4 casts one kernel writes together from one read of the tensor (torchao's
# triton_rht_quantize_row_col: the rowwise and the Hadamard-transformed columnwise codes;
# triton_weight_quantize_2d: the weight's and its transpose's 16x16-block codes)
_NVFP4_FUSED = frozenset({"nvfp4", "nvfp4_sr", "nvfp4_rht", "nvfp4_rht_sr", "nvfp4_16x16"})


def cast_traffic(
    casts: Sequence[Cast], scale: float, execution: str | None = None
) -> Iterator[tuple[float, int]]:
    """``(bytes moved, kernels)`` of a program's casts: each reads its source and writes its
    target (one kernel); a cast to fp8 also reads its source once more for the amax.
    Activations scale with ``scale`` (the batch over the table's), weights do not. A
    block-scaled cast (:data:`BLOCK_CAST_BYTES`) computes its block amaxes in the same kernel
    and writes its scales with its elements; an ``amax`` pass only reads; the two NVFP4 layouts
    of one tensor that torchao's kernels write together cost one read (Triton kernels of their
    own, the same in every execution mode).

    ``execution`` is the program that runs (:data:`EXECUTION_MODES`):

    - ``"compiled"`` (``torch.compile``): a torchao fp8 cast (the program's chain: the scale
      through fp64, an upcast to fp32 of a 16-bit source, the saturated cast) is two kernels
      that read the source in its own dtype (the amax, then scale-and-cast) and write fp8; an
      MX cast of a 16-bit operand likewise; a plain cast of an activation or of its gradient
      (autocast's, autograd's) is fused into the neighbouring element-wise kernel and moves
      nothing of its own; a weight's cast (a graph input read once per step) stays.
    - ``"eager"``: every operation of torchao's fp8 cast is its own kernel, as
      ``torchao.float8`` runs it without ``torch.compile`` (``tensor_to_amax``: ``abs``, then
      ``max``; ``amax_to_scale``: five kernels on the scale, through fp64;
      ``hp_tensor_and_scale_to_float8``: the upcast to fp32, the multiplication by the scale,
      the saturating ``clamp`` and the cast): :data:`EAGER_FP8_CAST_KERNELS` kernels and about
      33 bytes per element where the compiled cast moves 5; an MX cast's upcast is a kernel
      of its own; every plain cast is one kernel.
    - None, the cost model's default: the eager program with torchao's fp8 and MX casts
      priced as compiled, as every published fp8 training figure in
      experiments/published_speedups.yaml was measured (torchao's float8 training is meant
      to run compiled): the prediction of a step made before the execution mode was a
      setting.
    """
    i = 0
    eager = execution == "eager"
    while i < len(casts):
        c = casts[i]
        if c.target == "fp64":  # an fp8 cast's chain, up to and including its fp8 target
            end = next(j for j in range(i, len(casts)) if casts[j].target.startswith("fp8"))
            last = casts[end]
            numel = last.numel if last.weight else last.numel * scale
            yield _fp8_chain(_CAST_BYTES[c.source], _CAST_BYTES[last.target], numel, eager)
            i = end + 1
            continue
        numel = c.numel if c.weight else c.numel * scale
        after = casts[i + 1] if i + 1 < len(casts) else None
        if not eager and _upcast_to_fp8(c, after):  # an MX cast of a 16-bit operand, fused
            yield numel * (2 * _CAST_BYTES[c.source] + _CAST_BYTES[after.target]), 2
            i += 2
            continue
        if _fused_nvfp4(c, after):  # two NVFP4 layouts of one tensor from one read
            yield numel * (_CAST_BYTES[c.source] + 2 * _CAST_BYTES[c.target]), 1
            i += 2
            continue
        nbytes = numel * (_CAST_BYTES[c.source] + _CAST_BYTES[c.target])
        if c.target.startswith("fp8"):
            yield nbytes + numel * _CAST_BYTES[c.source], 2
        elif execution == "compiled" and not c.weight and c.target not in BLOCK_CAST_BYTES:
            yield 0.0, 0  # fused into its neighbour
        else:
            yield nbytes, 1
        i += 1


#: Kernels of one torchao fp8 cast of a 16-bit tensor run eagerly: ``abs`` and ``max`` (the
#: amax), five on the scale (``to(float64)``, ``clamp``, the division as ``reciprocal`` and
#: ``mul``, ``to(float32)``), then the upcast to fp32, the multiplication by the scale,
#: ``clamp`` and the cast to fp8 (torchao/float8/float8_utils.py and
#: float8_training_tensor.py, torchao 0.18, as a dispatch mode records them); an fp32 tensor
#: skips the upcast.
EAGER_FP8_CAST_KERNELS = 11


def _fp8_chain(source: float, target: float, numel: float, eager: bool) -> tuple[float, int]:
    """``(bytes, kernels)`` of one torchao fp8 cast of ``numel`` elements of ``source`` bytes
    each (see :func:`cast_traffic`)."""
    if not eager:  # the amax read, then one read and the fp8 write
        return numel * (2 * source + target), 2
    upcast = source != 4  # a 16-bit source is upcast to fp32 before the scaling
    amax = 3 * source  # abs: read and write; max: read
    scaled = (source + 4 if upcast else 0) + 2 * (4 + 4) + 4 + target  # upcast, mul, clamp, cast
    return numel * (amax + scaled), EAGER_FP8_CAST_KERNELS - (0 if upcast else 1)


def _same_tensor(cast: Cast, after: Cast) -> bool:
    return (after.phase, after.layer, after.source, after.numel, after.weight) == (
        cast.phase,
        cast.layer,
        cast.source,
        cast.numel,
        cast.weight,
    )


def _fused_nvfp4(cast: Cast, after: Cast | None) -> bool:
    """Whether ``cast`` and ``after`` are the two NVFP4 layouts one kernel writes of one tensor
    (see ``_NVFP4_FUSED``)."""
    return (
        after is not None
        and cast.target in _NVFP4_FUSED
        and after.target in _NVFP4_FUSED
        and _same_tensor(cast, after)
    )


def _upcast_to_fp8(cast: Cast, after: Cast | None) -> bool:
    """Whether ``cast`` upcasts a 16-bit tensor to fp32 only for ``after`` to cast it to fp8
    (torchao's ``to_mx``), a chain ``torch.compile`` fuses as it does torchao's fp8 casts."""
    return (
        after is not None
        and cast.target == "fp32"
        and _CAST_BYTES[cast.source] == 2
        and after.target.startswith("fp8")
        and (after.phase, after.layer, after.numel, after.weight)
        == (cast.phase, cast.layer, cast.numel, cast.weight)
    )
