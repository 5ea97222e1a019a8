"""The data of a step's program: the recorded forward data flow (:class:`Flow`) and what one
training step runs (:class:`Program`: its casts and matrix operations). Plain data, torch-free;
:mod:`autoprec.hardware.program` replays the runtime's rule on it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

__all__ = ["Cast", "Flow", "FlowOp", "FlowTensor", "Matmul", "Program"]


@dataclass(frozen=True)
class FlowTensor:
    """One tensor of a recorded forward pass.

    Attributes:
        kind: ``"input"`` (a model input), ``"param"`` or ``"value"`` (computed).
        layer: the tunable layer owning a parameter (``""`` otherwise).
        numel: elements at the analysed batch.
        dim: number of dimensions (0-dim tensors take no part in type promotion).
        requires_grad: for inputs and parameters: whether it needs a gradient.
        base: the tensor a view was taken of (-1: not a view).
    """

    kind: str
    layer: str
    numel: int
    dim: int
    requires_grad: bool
    base: int = -1

    def viewing(self, base: int) -> FlowTensor:
        return replace(self, base=base)


@dataclass(frozen=True)
class FlowOp:
    """One forward aten operation on floating tensors: its arguments and results by number."""

    name: str
    layer: str
    args: tuple[int, ...]
    outs: tuple[int, ...]
    view: bool = False
    inplace: bool = False


@dataclass(frozen=True)
class Flow:
    """The forward data flow of a model at the analysed batch."""

    tensors: tuple[FlowTensor, ...]
    ops: tuple[FlowOp, ...]
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]

    def to_dict(self) -> dict[str, Any]:
        """Compact plain data (lists), for the analysis cache."""
        return {
            "tensors": [
                [t.kind, t.layer, t.numel, t.dim, int(t.requires_grad), t.base]
                for t in self.tensors
            ],
            "ops": [
                [o.name, o.layer, list(o.args), list(o.outs), int(o.view), int(o.inplace)]
                for o in self.ops
            ],
            "inputs": list(self.inputs),
            "outputs": list(self.outputs),
        }

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> Flow:
        tensors = tuple(
            FlowTensor(k, layer, int(n), int(d), bool(g), int(b))
            for k, layer, n, d, g, b in doc["tensors"]
        )
        ops = tuple(
            FlowOp(name, layer, tuple(a), tuple(o), bool(v), bool(i))
            for name, layer, a, o, v, i in doc["ops"]
        )
        return cls(tensors, ops, tuple(doc["inputs"]), tuple(doc["outputs"]))


@dataclass(frozen=True)
class Cast:
    """One dtype cast of the step: ``numel`` elements from ``source`` to ``target``."""

    phase: str  # "forward" | "backward"
    layer: str  # the layer it belongs to ("" between layers)
    source: str
    target: str
    numel: int
    weight: bool  # a parameter's cast (does not grow with the batch)


@dataclass(frozen=True)
class Matmul:
    """One matrix operation of the step, in ``dtype`` (fp8: ``"fp8"``, MX: ``"mxfp8"``)."""

    phase: str
    layer: str
    op: str
    dtype: str


@dataclass(frozen=True)
class Program:
    """The casts and matrix operations of one training step under a policy."""

    casts: tuple[Cast, ...]
    matmuls: tuple[Matmul, ...]

    def cast_pairs(self) -> Counter:
        """``{(source, target): count}``."""
        return Counter((c.source, c.target) for c in self.casts)

    def matmul_kinds(self) -> Counter:
        """``{(op, dtype): count}``."""
        return Counter((m.op, m.dtype) for m in self.matmuls)
