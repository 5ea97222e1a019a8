"""The bytes a layer's precision decides: storage per format, and per layer the low-precision
weight copy and the activations saved for backward (what :meth:`CostModel.step
<autoprec.hardware.cost.CostModel.step>` and the environment's memory feature add up)."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING

from autoprec.precision import FORMAT_FACTS, Precision

if TYPE_CHECKING:
    from autoprec.graph.table import LayerRow

__all__ = ["STORAGE_BYTES", "layer_memory"]

#: Bytes one value of each format occupies (tf32 lives in a 32-bit container).
STORAGE_BYTES: Mapping[str, int] = MappingProxyType(
    {name: facts.storage_bytes for name, facts in FORMAT_FACTS.items()}
)


def layer_memory(row: LayerRow, precision: Precision, scale: float = 1.0) -> tuple[float, float]:
    """``(low-precision weight copy, saved activations)``: the bytes of one layer in a step
    that depend on its precision (:meth:`CostModel.step`'s ``low_precision_weights`` and
    ``activations``; a copy only below fp32's width). ``scale`` multiplies the table's batch.
    """
    ratio = precision.bytes_ratio
    low = row.params * ratio * 4 if ratio < 1 else 0.0
    return low, row.input_bytes * scale * ratio + row.output_bytes * scale
