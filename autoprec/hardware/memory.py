"""The bytes a layer's precision decides: storage per format, and per layer the low-precision
weight copy and the activations saved for backward (what :meth:`CostModel.step
<autoprec.hardware.cost.CostModel.step>` and the environment's memory feature add up)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING

from autoprec.precision import FORMAT_FACTS, Precision, mx_io_format

if TYPE_CHECKING:
    from autoprec.graph.table import LayerRow
    from autoprec.hardware.program_types import Cast

__all__ = ["STORAGE_BYTES", "activation_ratio", "cast_traffic", "layer_memory"]

#: Bytes one value of each format occupies (tf32 lives in a 32-bit container).
STORAGE_BYTES: Mapping[str, int] = MappingProxyType(
    {name: facts.storage_bytes for name, facts in FORMAT_FACTS.items()}
)


def activation_ratio(precision: Precision, region: str | None = None) -> float:
    """Bytes per element of a layer's activations (its output, the input it saves for backward)
    relative to fp32's 4: its format's for the 16-bit and wide precisions; for an 8-bit layer
    (an fp8 recipe, mxfp8) the dtype around it, fp8 operands existing only inside its GEMMs:
    torchao's ``Float8Linear`` writes and saves the region's format (``region``: bf16, fp16,
    None for fp32), ``MXFP8Linear`` :func:`~autoprec.precision.mx_io_format`'s."""
    if precision.is_fp8:
        return STORAGE_BYTES[region or "fp32"] / 4
    if precision.is_mx:
        return STORAGE_BYTES[mx_io_format(region)] / 4
    return precision.bytes_ratio


def layer_memory(
    row: LayerRow, precision: Precision, scale: float = 1.0, activations: float | None = None
) -> tuple[float, float]:
    """``(low-precision weight copy, saved activations)``: the bytes of one layer in a step
    that depend on its precision (:meth:`CostModel.step`'s ``low_precision_weights`` and
    ``activations``; a copy only below fp32's width). ``scale`` multiplies the table's batch;
    ``activations`` is the saved input's bytes per element over fp32's (default: the
    precision's format; :func:`activation_ratio`).
    """
    ratio = precision.bytes_ratio
    low = row.params * ratio * 4 if ratio < 1 else 0.0
    saved = ratio if activations is None else activations
    return low, row.input_bytes * scale * saved + row.output_bytes * scale


# torchao computes fp8 scales through fp64; MX block scales are one byte each (E8M0)
_CAST_BYTES = {**STORAGE_BYTES, "fp64": 8, "e8m0": 1}


def cast_traffic(casts: Sequence[Cast], scale: float) -> Iterator[tuple[float, int]]:
    """``(bytes moved, kernels)`` of a program's casts: each reads its source and writes its
    target (one kernel); a cast to fp8 also reads its source once more for the amax.
    Activations scale with ``scale`` (the batch over the table's), weights do not.

    A torchao fp8 cast (the program's chain: the scale through fp64, an upcast to fp32 of a
    16-bit source, the saturated cast) counts as ``torch.compile`` fuses it: two kernels that
    read the source in its own dtype (the amax, then scale-and-cast) and write fp8. torchao's
    float8 training is meant to run compiled, and every published fp8 training figure in
    experiments/published_speedups.yaml was measured so; priced eagerly, the chain moves three
    times the bytes (Llama3-8B's fp8 Linears on an H100 then come out slower than bf16, where
    torchtitan measures them 1.25x faster).
    """
    i = 0
    while i < len(casts):
        c = casts[i]
        if c.target == "fp64":  # an fp8 cast's chain, up to and including its fp8 target
            end = next(j for j in range(i, len(casts)) if casts[j].target.startswith("fp8"))
            last = casts[end]
            numel = last.numel if last.weight else last.numel * scale
            yield numel * (2 * _CAST_BYTES[c.source] + _CAST_BYTES[last.target]), 2
            i = end + 1
            continue
        numel = c.numel if c.weight else c.numel * scale
        after = casts[i + 1] if i + 1 < len(casts) else None
        if _upcast_to_fp8(c, after):  # an MX cast of a 16-bit operand, fused likewise
            yield numel * (2 * _CAST_BYTES[c.source] + _CAST_BYTES[after.target]), 2
            i += 2
            continue
        nbytes = numel * (_CAST_BYTES[c.source] + _CAST_BYTES[c.target])
        if c.target.startswith("fp8"):
            yield nbytes + numel * _CAST_BYTES[c.source], 2
        else:
            yield nbytes, 1
        i += 1


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
