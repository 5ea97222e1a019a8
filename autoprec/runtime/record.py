"""Record what really ran: the dtype casts and matrix operations of a piece of PyTorch code.

A :class:`OpRecorder` is a ``TorchDispatchMode``: it sees every aten operation below autograd
and autocast, in forward and backward, so that the casts ``torch.autocast`` inserts and the
kernels a backward pass runs are all in the record. The runtime's tests compare native mode
against ``torch.autocast`` with it, and the cost model's kernel inventory can be compared with
the same record.

Tensor subclasses (torchao's float8 tensors) are looked through: the recorder declines their
operations (``NotImplemented``), so that the subclass runs its own implementation and the plain
operations it issues (``aten._scaled_mm``, the casts to fp8) are what get recorded.

Example:
    >>> with OpRecorder() as rec:
    ...     loss_fn(model(x), y).backward()
    >>> len(rec.casts()), {op.dtypes for op in rec.matmuls()}
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

__all__ = ["CAST_OPS", "MATMUL_OPS", "Op", "OpRecorder", "tf32_switches"]

CAST_OPS = ("_to_copy", "copy_", "copy")
MATMUL_OPS = (
    "mm",
    "addmm",
    "bmm",
    "baddbmm",
    "_scaled_mm",
    "convolution",
    "convolution_backward",
    "mkldnn_convolution",
)


def tf32_switches() -> tuple[str, str]:
    """``(cuda matmul, cudnn conv)`` ``fp32_precision`` settings: ``"tf32"``, ``"ieee"`` or
    ``"none"`` (inherit)."""
    return torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision


@dataclass(frozen=True)
class Op:
    """One aten operation that ran.

    Attributes:
        name: the overload packet's name (``"_to_copy"``, ``"mm"``, ``"convolution_backward"``).
        dtypes: dtypes of its tensor arguments, in order.
        shapes: shapes of its tensor arguments, in order.
        out_dtype: dtype of its (first) tensor result, or None.
        tf32: :func:`tf32_switches` when it ran.
    """

    name: str
    dtypes: tuple[torch.dtype, ...]
    shapes: tuple[tuple[int, ...], ...]
    out_dtype: torch.dtype | None
    tf32: tuple[str, str]

    @property
    def is_cast(self) -> bool:
        """A copy that changes the dtype (``_to_copy``/``copy_`` between two dtypes)."""
        if self.name not in CAST_OPS or self.out_dtype is None or not self.dtypes:
            return False
        source = self.dtypes[-1] if self.name == "copy_" else self.dtypes[0]
        return source != self.out_dtype

    @property
    def is_matmul(self) -> bool:
        return self.name in MATMUL_OPS


class OpRecorder(TorchDispatchMode):
    """A dispatch mode that keeps an :class:`Op` for every aten operation it sees (``ops``)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[Op] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105
        kwargs = kwargs or {}
        flat, _ = tree_flatten((args, kwargs))
        if any(is_traceable_wrapper_subclass(t) for t in flat if isinstance(t, torch.Tensor)):
            return NotImplemented  # let the subclass run; its plain ops come back here
        out = func(*args, **kwargs)
        out_flat, _ = tree_flatten(out)
        first = next((t for t in out_flat if isinstance(t, torch.Tensor)), None)
        tensors = [t for t in flat if isinstance(t, torch.Tensor)]
        self.ops.append(
            Op(
                name=func.overloadpacket.__name__,
                dtypes=tuple(t.dtype for t in tensors),
                shapes=tuple(tuple(t.shape) for t in tensors),
                out_dtype=None if first is None else first.dtype,
                tf32=tf32_switches(),
            )
        )
        return out

    def casts(self) -> list[Op]:
        """The dtype-changing copies, in the order they ran."""
        return [op for op in self.ops if op.is_cast]

    def cast_pairs(self) -> dict[tuple[torch.dtype, torch.dtype], int]:
        """``{(from, to): count}`` over :meth:`casts`."""
        pairs: dict[tuple[torch.dtype, torch.dtype], int] = {}
        for op in self.casts():
            source = op.dtypes[-1] if op.name == "copy_" else op.dtypes[0]
            key = (source, op.out_dtype)
            pairs[key] = pairs.get(key, 0) + 1
        return pairs

    def matmuls(self) -> list[Op]:
        """The matrix operations (GEMMs, convolutions and their backward), in order."""
        return [op for op in self.ops if op.is_matmul]

    def summary(self) -> dict[str, Any]:
        """Counts for a quick look: casts, matmuls by ``(name, dtypes)``."""
        kinds: dict[tuple[str, tuple[torch.dtype, ...]], int] = {}
        for op in self.matmuls():
            kinds[(op.name, op.dtypes)] = kinds.get((op.name, op.dtypes), 0) + 1
        return {"casts": len(self.casts()), "cast_pairs": self.cast_pairs(), "matmuls": kinds}
