"""Layer analysis: what each tunable layer of a model costs and where it sits.

``analyze(spec, batch)`` runs one forward and backward pass of the model on a batch and returns
a :class:`LayerTable` with one row per tunable layer in execution order (as forward hooks see
them): parameter count, forward and backward FLOPs (``torch.utils.flop_counter``; FLOPs count 2
per multiply-add), bytes of input, weight and output at fp32, position, fan-in/out, kernel size
and stride, and the seed rule's default precision (convolutions and matmuls may go low).
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode

from autoprec.graph.cache import read_entry, write_entry
from autoprec.graph.table import FLOP_UNIT, TABLE_VERSION, LayerRow, LayerTable
from autoprec.layers import model_fingerprint, tunable_layers

__all__ = ["FLOP_UNIT", "LayerRow", "LayerTable", "analyze"]  # the table's names re-exported


def _seed_rule(module: nn.Module) -> str:
    """Convolutions and matmuls may go low; everything else stays fp32."""
    tunable = isinstance(module, (nn.modules.conv._ConvNd, nn.Linear, nn.MultiheadAttention))
    return "bf16" if tunable else "fp32"


def _geometry(module: nn.Module) -> tuple[int, int, tuple[int, ...], tuple[int, ...]]:
    if isinstance(module, nn.modules.conv._ConvNd):
        k = math.prod(module.kernel_size)
        fan_in = module.in_channels // module.groups * k
        return fan_in, module.out_channels * k // module.groups, module.kernel_size, module.stride
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features, (), ()
    if isinstance(module, nn.MultiheadAttention):
        return module.embed_dim, module.embed_dim, (), ()
    return 0, 0, (), ()


def _nbytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * 4
    if isinstance(obj, (tuple, list)):
        return sum(_nbytes(o) for o in obj)
    return 0


def _module_flops(counts: dict, root: str) -> dict[str, int]:
    """FlopCounterMode's per-module totals keyed by qualified name ('' for the root)."""
    out = {}
    for key, ops in counts.items():
        if key == "Global":
            continue
        name = "" if key == root else key[len(root) + 1 :] if key.startswith(root + ".") else None
        if name is not None:
            out[name] = int(sum(ops.values()))
    return out


_MATMUL_OPS = {
    "aten.convolution",
    "aten._convolution",
    "aten.convolution_backward",
    "aten.mm",
    "aten.addmm",
    "aten.bmm",
    "aten.baddbmm",
}


class _Traffic(TorchDispatchMode):
    """Bytes read + written and kernels of every non-matmul op, by the tunable layer running.

    Views move no data and are skipped. Ops before the first tunable layer count towards it.
    """

    def __init__(self) -> None:
        super().__init__()
        self.current: str | None = None
        self.in_backward = False
        self.forward: dict[str | None, list[int]] = {}
        self.backward = [0, 0]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view and str(func.overloadpacket) not in _MATMUL_OPS:
            nbytes = sum(
                t.numel() * t.element_size()
                for t in tree_leaves((args, kwargs, out))
                if isinstance(t, torch.Tensor)
            )
            if self.in_backward:
                slot = self.backward
            else:
                slot = self.forward.setdefault(self.current, [0, 0])
            slot[0] += nbytes
            slot[1] += 1
        return out

    def per_layer(self, order: list[str]) -> dict[str, tuple[int, int, int, int]]:
        """(forward bytes, backward bytes, forward ops, backward ops) per layer."""
        forward = {name: list(self.forward.get(name, [0, 0])) for name in order}
        if order and None in self.forward:  # before the first tunable layer
            forward[order[0]][0] += self.forward[None][0]
            forward[order[0]][1] += self.forward[None][1]
        total = sum(b for b, _ in forward.values()) or 1
        return {
            name: (
                b,
                round(self.backward[0] * b / total),
                n,
                round(self.backward[1] * b / total),
            )
            for name, (b, n) in forward.items()
        }


def analyze(
    spec: Any, batch: int | tuple[torch.Tensor, torch.Tensor] = 2, *, cache: bool = False
) -> LayerTable:
    """Analyse ``spec.module`` on one batch.

    Args:
        spec: a :class:`~autoprec.models.ModelSpec` (anything with ``module``, ``name``,
            ``loss(output, target)`` and ``example_batch(n)``).
        batch: a batch size (random example inputs) or an ``(inputs, targets)`` pair.
        cache: reuse/store the table under ``$AUTOPREC_CACHE_DIR/analysis``, keyed by the model
            name, its fingerprint (module names, types and parameter shapes), the input and
            target shapes and dtypes, and the torch version. Leave it off for a model whose
            forward changes without its parameters changing.

    Returns:
        The :class:`LayerTable`; FLOPs are for that batch.
    """
    x, y = _example_batch(spec, batch) if isinstance(batch, int) else batch
    key = None
    if cache:
        key = [
            TABLE_VERSION,
            getattr(spec, "name", type(spec.module).__name__),
            model_fingerprint(spec.module),
            [list(x.shape), str(x.dtype), list(y.shape), str(y.dtype)],
            torch.__version__,
        ]
        cached = read_entry(key)  # None also for a damaged entry: recomputed and replaced
        if cached is not None:
            return cached
    table = _analyze(spec, x, y)
    if key is not None:
        write_entry(key, table)
    return table


def _example_batch(spec: Any, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``spec.example_batch(batch)`` drawn on the meta device (only shapes and dtypes are used,
    and drawing a large batch of random images takes a while); on the CPU if it cannot be."""
    try:
        with torch.device("meta"):
            return spec.example_batch(batch)
    except (RuntimeError, NotImplementedError, TypeError):
        return spec.example_batch(batch)


def _analyze(spec: Any, x: torch.Tensor, y: torch.Tensor) -> LayerTable:
    # Shapes are all the analysis needs: run a copy on the meta device, so any batch size and
    # image size cost milliseconds and the user's model is never touched.
    model: nn.Module = copy.deepcopy(spec.module).to("meta")
    x, y = x.to("meta"), y.to("meta")
    layers = dict(tunable_layers(model))
    order: list[str] = []
    calls: dict[str, int] = {}
    io_bytes: dict[str, tuple[int, int]] = {}
    hooks = []
    for name, module in layers.items():

        def hook(mod, args, output, name=name):
            if name not in calls:
                order.append(name)
                io_bytes[name] = (_nbytes(args), _nbytes(output))
            calls[name] = calls.get(name, 0) + 1

        hooks.append(module.register_forward_hook(hook))
    traffic = _Traffic()
    for name, module in layers.items():

        def starts(mod, args, name=name):
            traffic.current = name

        hooks.append(module.register_forward_pre_hook(starts))
    root = type(model).__name__
    model.train()
    try:
        with FlopCounterMode(display=False) as counter, traffic:
            output = model(x)
            forward_counts = {k: dict(v) for k, v in counter.get_flop_counts().items()}
            loss = spec.loss(output, y)
            traffic.in_backward = True  # backward: one pool, shared out below
            loss.backward()
    finally:
        for h in hooks:
            h.remove()
    fwd = _module_flops(forward_counts, root)
    both = _module_flops(counter.get_flop_counts(), root)
    other = traffic.per_layer(order)
    rows = []
    for index, name in enumerate(order):
        module = layers[name]
        backward = both.get(name, 0) - fwd.get(name, 0)
        if isinstance(module, nn.modules.conv._ConvNd) and module.groups > 1 and backward:
            # torch.utils.flop_counter ignores groups in convolution_backward (a depthwise
            # conv's backward comes out ~channels times too large). Each gradient a convolution
            # computes (input, weight) costs what its forward costs.
            backward = fwd.get(name, 0) * (1 if index == 0 else 2)
        params = sum(p.numel() for p in module.parameters())
        weight_bytes = sum(p.numel() * 4 for n, p in module.named_parameters() if "bias" not in n)
        fan_in, fan_out, kernel, stride = _geometry(module)
        rows.append(
            LayerRow(
                name=name,
                type=type(module).__name__,
                index=index,
                first=index == 0,
                last=index == len(order) - 1,
                params=params,
                forward_flops=fwd.get(name, 0),
                backward_flops=backward,
                input_bytes=io_bytes[name][0],
                weight_bytes=weight_bytes,
                output_bytes=io_bytes[name][1],
                fan_in=fan_in,
                fan_out=fan_out,
                kernel_size=tuple(kernel),
                stride=tuple(stride),
                calls=calls[name],
                default_precision=_seed_rule(module),
                position=index / max(1, len(order) - 1),
                other_bytes_forward=other[name][0],
                other_bytes_backward=other[name][1],
                other_ops_forward=other[name][2],
                other_ops_backward=other[name][3],
            )
        )
    return LayerTable(
        model=getattr(spec, "name", root),
        fingerprint=model_fingerprint(spec.module),
        batch_size=int(x.shape[0]),
        input_shape=tuple(x.shape[1:]),
        rows=tuple(rows),
        total_forward_flops=int(sum(forward_counts["Global"].values())),
    )
