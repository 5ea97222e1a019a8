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

from autoprec.hardware.program import Flow

FLOP_UNIT = "FLOPs (2 per multiply-add)"
#: Bump when what analyze() measures, or how a table is cached, changes: old entries are ignored.
TABLE_VERSION = 5  # 4: weights found by parameter, backward per layer, kind, sources; 5: flow


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
    # "conv" | "linear" | "matmul" | "attention" (autoprec.hardware.runnability.layer_kind):
    # a Linear whose own forward never runs (its weight used functionally) is "matmul"
    kind: str = ""
    # The tunable layers whose outputs reach this layer's input through non-tunable ops
    # (residual adds, norms, activations, pooling, reshapes), in execution order; "" stands for
    # a model input (fp32).
    sources: tuple[str, ...] = ()

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
    # Forward matrix work no tunable layer covers, as (reason, FLOPs) pairs; part of
    # total_forward_flops but of no row.
    uncovered: tuple[tuple[str, int], ...] = ()
    # Empty when the analysis ran on the meta device; else why it could not (the op and the
    # error), and it ran on the CPU at the same shapes.
    meta_failure: str = ""
    # The forward data flow (autoprec.hardware.program.Flow): the casts a policy's native step
    # runs are replayed on it. None for a table built by hand.
    flow: Flow | None = None

    @property
    def uncovered_flops(self) -> int:
        """Forward FLOPs of matrix work outside every tunable layer."""
        return sum(flops for _, flops in self.uncovered)

    @property
    def uncovered_share(self) -> float:
        """:attr:`uncovered_flops` as a share of :attr:`total_forward_flops`."""
        return self.uncovered_flops / self.total_forward_flops if self.total_forward_flops else 0.0

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
            d["sources"] = list(row.sources)
            out.append(d)
        return out

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> LayerTable:
        """The inverse of ``json.loads(table.to_json())``."""
        rows = []
        for d in doc["layers"]:
            d = dict(d, kernel_size=tuple(d["kernel_size"]), stride=tuple(d["stride"]))
            d["sources"] = tuple(d.get("sources", ()))
            rows.append(LayerRow(**d))
        return cls(
            model=doc["model"],
            fingerprint=doc["fingerprint"],
            batch_size=int(doc["batch_size"]),
            input_shape=tuple(doc["input_shape"]),
            rows=tuple(rows),
            total_forward_flops=int(doc["total_forward_flops"]),
            flop_unit=doc.get("flop_unit", FLOP_UNIT),
            uncovered=tuple((str(r), int(f)) for r, f in doc.get("uncovered", ())),
            meta_failure=doc.get("meta_failure", ""),
            flow=Flow.from_dict(doc["flow"]) if doc.get("flow") else None,
        )

    def to_json(self, path: str | Path | None = None) -> str:
        doc = {
            "model": self.model,
            "fingerprint": self.fingerprint,
            "batch_size": self.batch_size,
            "input_shape": list(self.input_shape),
            "flop_unit": self.flop_unit,
            "total_forward_flops": self.total_forward_flops,
            "uncovered_flops": self.uncovered_flops,
            "uncovered": [list(pair) for pair in self.uncovered],
            "meta_failure": self.meta_failure,
            "layers": self.to_dicts(),
            "flow": None if self.flow is None else self.flow.to_dict(),
        }
        text = json.dumps(doc, indent=2)
        if path is not None:
            from autoprec.cache import write_output

            write_output(path, lambda fh: fh.write(text + "\n"), what="layer table")
        return text
