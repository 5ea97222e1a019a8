"""The layer table: what :func:`~autoprec.graph.analyze` measured, one row per tunable layer.

Plain data with JSON export and import; this module imports neither torch nor the analysis, so a
cached table can be read and costed (``autoprec hardware estimate``) without loading torch.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

FLOP_UNIT = "FLOPs (2 per multiply-add)"
#: Bump when what analyze() measures, or how a table is cached, changes: old entries are ignored.
TABLE_VERSION = 3


@dataclass(frozen=True)
class LayerRow:
    """One tunable layer. Byte counts are at fp32 for the analysed batch."""

    name: str
    type: str
    index: int
    first: bool
    last: bool
    params: int
    forward_flops: int
    backward_flops: int
    input_bytes: int
    weight_bytes: int
    output_bytes: int
    fan_in: int
    fan_out: int
    kernel_size: tuple[int, ...]
    stride: tuple[int, ...]
    calls: int
    default_precision: str
    position: float  # relative depth in [0, 1]
    # Memory traffic (bytes read + written, at fp32) and kernel count of every op that is not a
    # matmul/convolution from this layer's start to the next tunable layer's: norms,
    # activations, pooling, residual adds, bias and softmax work. Backward is the measured
    # backward total shared out in proportion to forward traffic. -1: not measured.
    other_bytes_forward: int = -1
    other_bytes_backward: int = -1
    other_ops_forward: int = -1
    other_ops_backward: int = -1

    @property
    def flops(self) -> int:
        """Forward plus backward FLOPs."""
        return self.forward_flops + self.backward_flops


@dataclass(frozen=True)
class LayerTable:
    """Rows in execution order plus what the analysis ran on."""

    model: str
    fingerprint: str
    batch_size: int
    input_shape: tuple[int, ...]
    rows: tuple[LayerRow, ...]
    total_forward_flops: int
    flop_unit: str = FLOP_UNIT

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self) -> Iterator[LayerRow]:
        return iter(self.rows)

    def __getitem__(self, name: str) -> LayerRow:
        for row in self.rows:
            if row.name == name:
                return row
        raise KeyError(name)

    @property
    def names(self) -> list[str]:
        return [r.name for r in self.rows]

    def to_dicts(self) -> list[dict[str, Any]]:
        """Plain dicts (JSON-ready), one per row."""
        out = []
        for row in self.rows:
            d = asdict(row)
            d["kernel_size"], d["stride"] = list(row.kernel_size), list(row.stride)
            out.append(d)
        return out

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> LayerTable:
        """The inverse of ``json.loads(table.to_json())``."""
        rows = []
        for d in doc["layers"]:
            d = dict(d, kernel_size=tuple(d["kernel_size"]), stride=tuple(d["stride"]))
            rows.append(LayerRow(**d))
        return cls(
            model=doc["model"],
            fingerprint=doc["fingerprint"],
            batch_size=int(doc["batch_size"]),
            input_shape=tuple(doc["input_shape"]),
            rows=tuple(rows),
            total_forward_flops=int(doc["total_forward_flops"]),
            flop_unit=doc.get("flop_unit", FLOP_UNIT),
        )

    def to_json(self, path: str | Path | None = None) -> str:
        doc = {
            "model": self.model,
            "fingerprint": self.fingerprint,
            "batch_size": self.batch_size,
            "input_shape": list(self.input_shape),
            "flop_unit": self.flop_unit,
            "total_forward_flops": self.total_forward_flops,
            "layers": self.to_dicts(),
        }
        text = json.dumps(doc, indent=2)
        if path is not None:
            Path(path).write_text(text + "\n")
        return text
