"""Layer analysis: what each tunable layer of a model costs and where it sits.

``analyze(spec, batch)`` runs one forward and backward pass of the model on a batch and returns
a :class:`LayerTable` with one row per tunable layer in execution order: parameter count,
forward and backward FLOPs (``torch.utils.flop_counter``'s formulas; FLOPs count 2 per
multiply-add), bytes of input, weight and output at fp32, position, fan-in/out, kernel size and
stride, its runnability kind, the layers feeding it, and the seed rule's default precision.

A layer's matrix work is found by its parameters (:mod:`autoprec.graph.trace`), whether its own
``forward`` runs or its weight is used functionally; backward work goes to the layer whose
autograd node runs it. Matrix work that no tunable layer covers (attention scores of two
activations, a parameter of a non-tunable module) is listed in ``LayerTable.uncovered``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from typing import TYPE_CHECKING

import torch
from torch import nn

from autoprec.graph.cache import read_entry, write_entry
from autoprec.graph.flow import recording
from autoprec.graph.table import FLOP_UNIT, TABLE_VERSION, LayerRow, LayerTable
from autoprec.graph.trace import AtenOps, FunctionCalls, Recorder, module_hooks
from autoprec.hardware.runnability import layer_kind
from autoprec.layers import geometry, is_tunable, model_fingerprint, tunable_layers
from autoprec.models.user import user_code

if TYPE_CHECKING:
    from autoprec.models import ModelSpec

__all__ = ["FLOP_UNIT", "AnalysisError", "LayerRow", "LayerTable", "analyze"]


class AnalysisError(ValueError):
    """The model's forward and backward pass could not be analysed."""


def _seed_rule(module: nn.Module) -> str:
    """Convolutions and matmuls may go low; everything else stays fp32."""
    return "bf16" if is_tunable(module) else "fp32"


def analyze(
    spec: ModelSpec, batch: int | tuple[torch.Tensor, torch.Tensor] = 2, *, cache: bool = False
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


def _example_batch(spec: ModelSpec, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``spec.example_batch(batch)`` drawn on the meta device (only shapes and dtypes are used,
    and drawing a large batch of random images takes a while); on the CPU if it cannot be."""
    try:
        with torch.device("meta"):
            return spec.example_batch(batch)
    except (RuntimeError, NotImplementedError, TypeError):
        return spec.example_batch(batch)


def _analyze(spec: ModelSpec, x: torch.Tensor, y: torch.Tensor) -> LayerTable:
    # Shapes are all the analysis needs: run a copy on the meta device, so any batch size and
    # image size cost milliseconds and the user's model is never touched. A model whose forward
    # reads values (``.item()``, data-dependent shapes) runs on the CPU at the same shapes.
    try:
        return _run(spec, copy.deepcopy(spec.module).to("meta"), x.to("meta"), y.to("meta"))
    except Exception as err:  # any failure of the meta pass: try it for real
        op = getattr(err, "autoprec_op", None) or "an op"
        failure = f"{op}: {str(err).splitlines()[0][:120] if str(err) else type(err).__name__}"
        name = getattr(spec, "name", type(spec.module).__name__)
        if any(p.is_meta for p in spec.module.parameters()):
            raise AnalysisError(
                f"the analysis of {name} cannot run on the meta device (it failed in "
                f"{failure}) and the model's weights are on the meta device too; build the "
                "model on the CPU so that the analysis can run it there"
            ) from err
    model = copy.deepcopy(spec.module).to("cpu")
    cpu_x, cpu_y = (_real(t) for t in (x, y))
    head = f"model {name!r} failed on input of shape {tuple(x.shape)}: its training step"
    with user_code(head, "its output"):  # the user's model failing: one line, its own words
        table = _run(spec, model, cpu_x, cpu_y)
    return dataclasses.replace(table, meta_failure=failure)


def _real(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the CPU; a meta tensor becomes zeros (valid token ids and class labels)."""
    return torch.zeros(t.shape, dtype=t.dtype) if t.is_meta else t.to("cpu")


def _run(spec: ModelSpec, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> LayerTable:
    layers = dict(tunable_layers(model))
    rec = Recorder(model, layers)
    rec.tag_input(x)
    hooks = module_hooks(rec)
    model.train()
    try:
        with FunctionCalls(rec), AtenOps(rec):
            with recording(layers, x) as flow_recorder:  # the data flow, for the casts
                output = model(x)
            flow = flow_recorder.flow(output)
            loss = spec.loss(output, y)
            rec.in_backward = True
            loss.backward()
    except Exception as err:
        with contextlib.suppress(AttributeError):
            err.autoprec_op = rec.failed_op  # type: ignore[attr-defined]  # for the message
        raise
    finally:
        for h in hooks:
            h.remove()
    order = rec.order
    position = {name: i for i, name in enumerate(order)}
    traffic = rec.traffic(order)
    rows = []
    for index, name in enumerate(order):
        module, trace = layers[name], rec.trace[name]
        io = trace.module_io or trace.call_io or trace.op_io or (0, 0)
        fan_in, fan_out, kernel, stride = geometry(module)
        sources = sorted(trace.sources, key=lambda s: position.get(s, -1)) or [""]
        rows.append(
            LayerRow(
                name=name,
                type=type(module).__name__,
                index=index,
                first=index == 0,
                last=index == len(order) - 1,
                params=sum(p.numel() for p in module.parameters()),
                forward_flops=trace.forward_flops,
                backward_flops=trace.backward_flops,
                input_bytes=io[0],
                weight_bytes=sum(
                    p.numel() * 4 for n, p in module.named_parameters() if "bias" not in n
                ),
                output_bytes=io[1],
                fan_in=fan_in,
                fan_out=fan_out,
                kernel_size=tuple(kernel),
                stride=tuple(stride),
                calls=max(trace.forward_runs, trace.calls, 1),
                default_precision=_seed_rule(module),
                position=index / max(1, len(order) - 1),
                other_bytes_forward=traffic[name][0],
                other_bytes_backward=traffic[name][1],
                other_ops_forward=traffic[name][2],
                other_ops_backward=traffic[name][3],
                kind=layer_kind(type(module).__name__, swappable=trace.forward_runs > 0),
                sources=tuple(sources),
            )
        )
    covered = sum(r.forward_flops for r in rows)
    return LayerTable(
        model=getattr(spec, "name", type(spec.module).__name__),
        fingerprint=model_fingerprint(spec.module),
        batch_size=int(x.shape[0]),
        input_shape=tuple(x.shape[1:]),
        rows=tuple(rows),
        total_forward_flops=covered + sum(rec.uncovered.values()),
        uncovered=tuple(sorted(rec.uncovered.items(), key=lambda kv: -kv[1])),
        flow=flow,
    )
