"""Record the forward data flow of a model: which aten operations run on which tensors.

The cost model prices the program the native runtime executes, casts included; where a cast
happens depends on how tensors flow between layers (a residual add merges two branches, a
norm keeps its input's dtype), so the analysis records the forward pass as a list of
operations over numbered tensors (:class:`autoprec.hardware.program.Flow`, torch-free). The
runtime's rule for dtypes is then replayed on it for any policy
(:func:`autoprec.hardware.program.program`).

Recorded on the meta device like the rest of the analysis; tensors are identified by object
(a weak dictionary), parameters by the tunable layer that owns them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakTensorKeyDictionary

from autoprec.hardware.program import (
    ATTENTION_OP,
    MATMUL_OPS,
    Flow,
    FlowOp,
    FlowTensor,
    view_root,
)

__all__ = ["FlowRecorder", "record_flow", "recording"]


class FlowRecorder(TorchDispatchMode):
    """Records forward operations on floating tensors while active.

    Args:
        params: ``{id(parameter): layer name}`` for the weights (and biases) of tunable layers.
        attention: modules whose whole forward is one layer (``nn.MultiheadAttention``): every
            matrix operation inside them belongs to that layer.
    """

    def __init__(self, params: dict[int, str], attention: dict[nn.Module, str]) -> None:
        super().__init__()
        self._params = params
        self._ids: WeakTensorKeyDictionary = WeakTensorKeyDictionary()
        self._keep: list[torch.Tensor] = []  # ids must not be reused while recording
        self.tensors: list[FlowTensor] = []
        self.ops: list[FlowOp] = []
        self.current_attention: str = ""
        self.paused = False
        self.input_ids: list[int] = []
        self._hooks = []
        for module, name in attention.items():
            self._hooks.append(module.register_forward_pre_hook(self._enter(name)))
            self._hooks.append(module.register_forward_hook(self._leave, always_call=True))

    def _enter(self, name: str):
        def hook(module: nn.Module, args: Any) -> None:
            self.current_attention = name

        return hook

    def _leave(self, module: nn.Module, args: Any, output: Any) -> None:
        self.current_attention = ""

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self._keep = []

    def tensor_id(self, t: torch.Tensor, kind: str = "value") -> int:
        """The number of ``t``, registering it (as ``kind``) when first seen."""
        if t in self._ids:
            return self._ids[t]
        owner = self._params.get(id(t), "")
        if isinstance(t, nn.Parameter) or owner:
            kind = "param"
        index = len(self.tensors)
        self.tensors.append(
            FlowTensor(
                kind=kind,
                layer=owner,
                numel=t.numel(),
                dim=t.dim(),
                requires_grad=bool(t.requires_grad),
            )
        )
        self._ids[t] = index
        self._keep.append(t)
        return index

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self.paused:
            view = bool(func.is_view)
            inplace = bool(func._schema.is_mutable) and not view
            self.record(func.overloadpacket.__name__, args, kwargs, out, view, inplace)
        return out

    def record(
        self, name: str, args: Any, kwargs: Any, out: Any, view: bool = False, inplace: bool = False
    ) -> None:
        """Add one operation on floating tensors (others are not recorded)."""
        flat, _ = tree_flatten((args, kwargs))
        floats = [t for t in flat if isinstance(t, torch.Tensor) and t.is_floating_point()]
        outs, _ = tree_flatten(out)
        out_floats = [t for t in outs if isinstance(t, torch.Tensor) and t.is_floating_point()]
        if not floats and not out_floats:
            return
        arg_ids = tuple(self.tensor_id(t) for t in floats)
        layer = ""
        if name in MATMUL_OPS:
            owners = {self._root_layer(i) for i in arg_ids} - {""}
            layer = self.current_attention or (owners.pop() if len(owners) == 1 else "")
        out_ids = []
        for t in out_floats:
            if t in self._ids:  # the mutated input itself, or an argument returned as it is
                out_ids.append(self._ids[t])  # (lift_fresh: no view of itself)
                continue
            out_ids.append(self.tensor_id(t))
            if view and arg_ids:  # a view of a weight stays that weight's
                self.tensors[out_ids[-1]] = self.tensors[out_ids[-1]].viewing(arg_ids[0])
        self.ops.append(
            FlowOp(
                name=name,
                layer=layer,
                args=arg_ids,
                outs=tuple(out_ids),
                view=view,
                inplace=inplace,
            )
        )

    def _root_layer(self, index: int) -> str:
        t = self.tensors[view_root(self.tensors, index)]
        return t.layer if t.kind == "param" else ""

    def flow(self, output: Any) -> Flow:
        """The recording so far as a :class:`Flow` whose outputs are ``output``'s tensors."""
        outs, _ = tree_flatten(output)
        output_ids = [
            self._ids[t]
            for t in outs
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t in self._ids
        ]
        return Flow(
            tensors=tuple(self.tensors),
            ops=tuple(self.ops),
            inputs=tuple(self.input_ids),
            outputs=tuple(output_ids),
        )


@contextlib.contextmanager
def recording(layers: dict[str, nn.Module], inputs: Any) -> Iterator[FlowRecorder]:
    """Record the forward operations run inside the block; ``recorder.flow(output)`` then
    gives the :class:`Flow`.

    Args:
        layers: ``{name: module}`` of the model's tunable layers.
        inputs: the model's input(s), registered as model inputs (fp32 where floating).
    """
    params = {id(p): name for name, module in layers.items() for p in module.parameters()}
    attention = {m: n for n, m in layers.items() if isinstance(m, nn.MultiheadAttention)}
    recorder = FlowRecorder(params, attention)
    fused = nn.functional.scaled_dot_product_attention

    def attention_as_one(*args: Any, **kwargs: Any) -> Any:
        # On a device attention runs as one fused kernel (flash, memory-efficient); on the
        # meta device it decomposes into matmuls and a softmax: record it as the one operation.
        recorder.paused = True
        try:
            out = fused(*args, **kwargs)
        finally:
            recorder.paused = False
        recorder.record(ATTENTION_OP, args, kwargs, out)
        return out

    # For the recording only (restored below): module globals are how both user code and
    # F.multi_head_attention_forward reach it; a torch-function mode cannot see inside the
    # latter.
    nn.functional.scaled_dot_product_attention = attention_as_one
    try:
        with recorder:
            flat, _ = tree_flatten(inputs)
            recorder.input_ids = [
                recorder.tensor_id(t, "input")
                for t in flat
                if isinstance(t, torch.Tensor) and t.is_floating_point()
            ]
            yield recorder
    finally:
        nn.functional.scaled_dot_product_attention = fused
        recorder.close()


def record_flow(model: nn.Module, x: Any, layers: dict[str, nn.Module]) -> Flow:
    """The :class:`Flow` of ``model(x)`` (forward only, grad enabled); ``layers`` are its
    tunable layers (``{name: module}``)."""
    with recording(layers, x) as recorder:
        output = model(x)
    return recorder.flow(output)
