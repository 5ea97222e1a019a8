"""One recorded training step: which tunable layer each matrix operation belongs to.

:func:`~autoprec.graph.analyze` runs the model under two modes that share one :class:`Recorder`:

- a ``TorchFunctionMode`` sees every torch call with its Python arguments. A call whose
  arguments hold the parameters of one tunable layer (or tensors computed from them alone, such
  as ``weight.t()``) belongs to that layer, whether the layer's own ``forward`` made it
  (``nn.Linear`` calling ``F.linear``) or not (torchvision's Swin calling ``F.linear`` on
  ``self.qkv.weight``, GPT-2's ``Conv1D`` calling ``torch.addmm``). The autograd nodes the call
  creates are labelled with the layer, so that its backward is the layer's backward too.
- a ``TorchDispatchMode`` sees every aten op: it counts FLOPs with ``torch.utils.flop_counter``'s
  formulas and gives each matrix op to the layer whose weight it reads, else to the layer whose
  call or ``forward`` is running, else to a reason why no layer covers it. Backward ops go to the
  layer of the autograd node executing them (``torch._C._current_autograd_node()``), so layers
  that share an input each get their own gradient work. It also tags activations with the
  layers that produced them, for ``LayerRow.sources``.

Tags live in weak-identity dictionaries keyed by the (meta) tensors themselves.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from autoprec.graph.flops import counts_flops, flops, meta_grouped_mm

ACTIVATION_MATMULS = "matmuls of two activations (attention scores and values): no weight"
_NO_DATA = ("empty_like", "zeros_like", "ones_like", "full_like", "new_empty", "new_zeros")
_NO_DATA += ("new_ones", "new_full", "rand_like", "randn_like", "randint_like", "scalar_tensor")
#: Ops that pick parts of a tensor by indices (an embedding's lookup is not one: its output is
#: the model's data, not a weight).
_GATHERS = frozenset({"index", "index_select", "select", "gather", "take"})


@dataclass(frozen=True)
class _Weight:
    """A parameter, or a tensor computed from one module's parameters alone."""

    layer: str | None  # the tunable layer owning it; None for another module's parameter
    module: str  # qualified name of the owning module
    what: str  # "Type.attr", for messages
    bias: bool


@dataclass(frozen=True)
class _Act:
    """An activation: the (layer, scope) pairs whose outputs reach it ("" for a model input)."""

    sources: frozenset[tuple[str, int]]


@dataclass
class LayerTrace:
    """What the recording saw of one tunable layer."""

    forward_flops: int = 0
    backward_flops: int = 0
    forward_runs: int = 0  # times its own forward ran
    calls: int = 0  # torch calls with its weight that did matrix work
    module_io: tuple[int, int] | None = None  # fp32 bytes in/out of its first forward
    call_io: tuple[int, int] | None = None  # ... of its first call
    op_io: tuple[int, int] | None = None  # ... of its first matrix op
    sources: set[str] = field(default_factory=set)


def fp32_bytes(obj: Any) -> int:
    """Bytes of every tensor in ``obj`` at fp32."""
    return sum(t.numel() * 4 for t in tree_leaves(obj) if isinstance(t, torch.Tensor))


def _tensors(obj: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(obj) if isinstance(t, torch.Tensor)]


class Recorder:
    """Everything one forward and backward pass showed, per tunable layer.

    Args:
        model: the model being run (its parameters are tagged with their owners).
        layers: ``{qualified name: module}`` of its tunable layers.
    """

    def __init__(self, model: nn.Module, layers: dict[str, nn.Module]) -> None:
        self.layers = layers
        self.trace = {name: LayerTrace() for name in layers}
        self.order: list[str] = []
        self.uncovered: Counter[str] = Counter()  # reason -> forward FLOPs
        self.uncovered_backward = 0
        self.in_backward = False
        self.failed_op: str | None = None
        self.tags: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.carried: WeakIdKeyDictionary = WeakIdKeyDictionary()  # activation -> _Weight
        self.nodes: dict[Any, str | None] = {}  # autograd node -> layer
        self.scopes: list[tuple[int, str | None]] = []  # (id, owner; None: several layers)
        self._next_scope = 1
        # bytes and kernels of non-matrix ops: forward by the layer running, backward pooled
        self.current: str | None = None
        self.forward_traffic: dict[str | None, list[int]] = {}
        self.backward_traffic = [0, 0]
        owners = {id(p): name for name, m in layers.items() for p in m.parameters()}
        for mname, module in model.named_modules():
            for attr, p in module.named_parameters(recurse=False):
                if p not in self.tags:
                    what = f"{type(module).__name__}.{attr}"
                    layer = owners.get(id(p))
                    self.tags[p] = _Weight(layer, mname, what, "bias" in attr)

    # --- scopes: a layer's call or forward --------------------------------------------------

    def _fresh_scope(self) -> int:
        self._next_scope += 1
        return self._next_scope - 1

    def open_scope(self, owner: str | None) -> int:
        if owner is not None and self.scopes and self.scopes[-1][1] == owner:
            # a call inside the layer's own forward (fused experts' three grouped GEMMs): the
            # forward's scope, so that its later GEMMs read its earlier ones as its own work
            scope = self.scopes[-1][0]
        else:
            scope = self._fresh_scope()
        self.scopes.append((scope, owner))
        return scope

    def close_scope(self) -> None:
        self.scopes.pop()

    def tag_input(self, x: Any) -> None:
        for t in _tensors(x):
            self.tags[t] = _Act(frozenset({("", 0)}))

    def weight_layers(self, args: tuple, kwargs: dict) -> set[str]:
        """The tunable layers whose weights (or tensors made from them alone) are arguments."""
        found = set()
        for arg in (*args, *kwargs.values()):
            for t in arg if isinstance(arg, (list, tuple)) else (arg,):
                if isinstance(t, torch.Tensor):
                    tag = self.tags.get(t)
                    if isinstance(tag, _Weight) and tag.layer is not None:
                        found.add(tag.layer)
        return found

    def label(self, outputs: Any, inputs: Any, layer: str) -> None:
        """Give ``layer`` the autograd nodes between ``inputs`` and ``outputs`` not yet labelled."""
        stop = {t.grad_fn for t in _tensors(inputs) if t.grad_fn is not None}
        todo = [t.grad_fn for t in _tensors(outputs)]
        while todo:
            node = todo.pop()
            if node is None or node in stop or node in self.nodes or hasattr(node, "variable"):
                continue  # hasattr(variable): AccumulateGrad, a leaf
            self.nodes[node] = layer
            todo.extend(n for n, _ in node.next_functions)

    # --- the ops ----------------------------------------------------------------------------

    def forward_op(self, func: Any, args: tuple, kwargs: dict, out: Any, flops: int) -> None:
        inputs = _tensors((args, kwargs))
        tags = [self.tags.get(t) for t in inputs]
        acts = [(t, g) for t, g in zip(inputs, tags, strict=True) if isinstance(g, _Act)]
        outs = _tensors(out)
        if flops:
            weights = [self.carried.get(t, g) for t, g in zip(inputs, tags, strict=True)]
            layer, reason = self._owner(weights)
            if layer is None:
                self.uncovered[reason] += flops
                sources = frozenset().union(*(g.sources for _, g in acts))
                self._tag(outs, _Act(sources) if sources else None)
                return
            scope = self.scopes[-1][0] if self.scopes else self._fresh_scope()
            self._attribute(layer, scope, acts, outs, flops)
            return
        name = str(func._overloadpacket)
        if not func.is_view:
            nbytes = sum(t.numel() * t.element_size() for t in (*inputs, *outs))
            slot = self.forward_traffic.setdefault(self.current, [0, 0])
            slot[0] += nbytes
            slot[1] += 1
        weights = [g for g in tags if isinstance(g, _Weight)]
        # untagged integer tensors are constant indices: a parameter indexed by them (one
        # expert's matrix out of a 3-d expert weight) is still that parameter
        values = [g for t, g in zip(inputs, tags, strict=True) if t.is_floating_point() or g]
        if (
            weights
            and len(weights) == len(values)
            and len({(g.layer, g.module) for g in weights}) == 1
        ):
            first = weights[0]
            bias = all(g.bias for g in weights)
            self._tag(outs, _Weight(first.layer, first.module, first.what, bias))
            return
        if not acts or name.split(".")[-1] in _NO_DATA:
            return
        sources = frozenset().union(*(g.sources for _, g in acts))
        self._tag(outs, _Act(sources))
        self._carry(name.split(".")[-1], func.is_view, inputs, tags, outs)

    def _carry(self, name: str, view: bool, inputs: list, tags: list, outs: list) -> None:
        """Remember the parameter whose values an activation holds: one gathered by indices
        computed from the data (a mixture of experts' weight matrices picked per token, by the
        router's choice), or a view of such a gathering, so that a matmul with it is counted as
        that parameter's."""
        floats = [(t, g) for t, g in zip(inputs, tags, strict=True) if t.is_floating_point()]
        if len(floats) != 1:
            return
        t, g = floats[0]
        carried = g if name in _GATHERS and isinstance(g, _Weight) and not g.bias else None
        carried = carried or (self.carried.get(t) if view else None)
        if carried is not None:
            for out in outs:
                self.carried[out] = carried

    def _owner(self, tags: list[Any]) -> tuple[str | None, str]:
        """The layer a forward matrix op belongs to, or None and why no layer covers it."""
        weights = [g for g in tags if isinstance(g, _Weight) and not g.bias]
        for g in weights:
            if g.layer is not None:
                return g.layer, ""
        if self.scopes and self.scopes[-1][1] is not None:
            return self.scopes[-1][1], ""
        if weights:
            return None, f"matmuls with parameters of non-tunable modules ({weights[0].what})"
        return None, ACTIVATION_MATMULS

    def _attribute(self, layer: str, scope: int, acts: list, outs: list, flops: int) -> None:
        trace = self.trace[layer]
        trace.forward_flops += flops
        if layer not in self.order:
            self.order.append(layer)
        self.current = layer
        if trace.op_io is None:
            trace.op_io = (fp32_bytes([t for t, _ in acts]), fp32_bytes(outs))
        inner = (layer, scope)
        if not any(inner in g.sources for _, g in acts):  # reads from outside the layer
            trace.sources.update(name for _, g in acts for name, _ in g.sources)
        self._tag(outs, _Act(frozenset({inner})))

    def _tag(self, outs: list[torch.Tensor], tag: Any) -> None:
        for t in outs:
            if tag is None:
                self.tags.pop(t, None)
            else:
                self.tags[t] = tag

    def backward_op(self, func: Any, args: tuple, kwargs: dict, out: Any, flops: int) -> None:
        if not flops:
            if not func.is_view:
                tensors = _tensors((args, kwargs, out))
                self.backward_traffic[0] += sum(t.numel() * t.element_size() for t in tensors)
                self.backward_traffic[1] += 1
            return
        layer = self._node_layer(torch._C._current_autograd_node())
        if layer is None:
            self.uncovered_backward += flops
        else:
            self.trace[layer].backward_flops += flops

    def _node_layer(self, node: Any) -> str | None:
        """The layer of an autograd node: its label, else the tunable weight it feeds a
        gradient to (a few view or cast nodes away)."""
        if node is None:
            return None
        if node in self.nodes:
            return self.nodes[node]
        found, todo = None, [(node, 0)]
        while todo and found is None:
            n, depth = todo.pop()
            for nxt, _ in n.next_functions:
                if nxt is None or nxt in self.nodes:
                    continue
                if hasattr(nxt, "variable"):
                    tag = self.tags.get(nxt.variable)
                    if isinstance(tag, _Weight) and tag.layer is not None and not tag.bias:
                        found = tag.layer
                        break
                elif depth < 2:
                    todo.append((nxt, depth + 1))
        self.nodes[node] = found
        return found

    def traffic(self, order: list[str]) -> dict[str, tuple[int, int, int, int]]:
        """(forward bytes, backward bytes, forward ops, backward ops) per layer; ops before the
        first layer count towards it, backward is shared out in proportion to forward bytes."""
        forward = {name: list(self.forward_traffic.get(name, [0, 0])) for name in order}
        if order and None in self.forward_traffic:
            forward[order[0]][0] += self.forward_traffic[None][0]
            forward[order[0]][1] += self.forward_traffic[None][1]
        total = sum(b for b, _ in forward.values()) or 1
        back_bytes, back_ops = self.backward_traffic
        return {
            name: (b, round(back_bytes * b / total), n, round(back_ops * b / total))
            for name, (b, n) in forward.items()
        }


class _Recording:
    """A torch mode that reports to a :class:`Recorder` (``self.rec``)."""

    def __init__(self, recorder: Recorder) -> None:
        super().__init__()
        self.rec = recorder


class FunctionCalls(_Recording, TorchFunctionMode):
    """Gives each torch call holding a tunable layer's weight to that layer (see module doc)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        rec = self.rec
        if rec.in_backward:
            return func(*args, **kwargs)
        layers = rec.weight_layers(args, kwargs)
        if not layers:
            return func(*args, **kwargs)
        owner = next(iter(layers)) if len(layers) == 1 else None
        before = rec.trace[owner].forward_flops if owner else 0
        rec.open_scope(owner)
        try:
            out = func(*args, **kwargs)
        finally:
            rec.close_scope()
        if owner is not None and rec.trace[owner].forward_flops > before:
            trace = rec.trace[owner]
            trace.calls += 1
            if trace.call_io is None:
                tensors = _tensors((args, kwargs))
                inputs = [t for t in tensors if not isinstance(rec.tags.get(t), _Weight)]
                trace.call_io = (fp32_bytes(inputs), fp32_bytes(out))
        if owner is not None:
            rec.label(out, (args, kwargs), owner)
        return out


class AtenOps(_Recording, TorchDispatchMode):
    """Counts and attributes every aten op (see module doc)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not counts_flops(func) and func is not torch.ops.prim.device.default:
            # as FlopCounterMode does: a composite op may hide matrix work, count its parts
            with self:
                r = func.decompose(*args, **kwargs)
            if r is not NotImplemented:
                return r
        try:
            out = meta_grouped_mm(func, args, kwargs)
            out = func(*args, **kwargs) if out is None else out
        except Exception:
            if self.rec.failed_op is None:
                self.rec.failed_op = str(func)
            raise
        count = flops(func, args, kwargs, out) if counts_flops(func) else 0
        if self.rec.in_backward:
            self.rec.backward_op(func, args, kwargs, out, count)
        else:
            self.rec.forward_op(func, args, kwargs, out, count)
        return out


def module_hooks(recorder: Recorder) -> list[Any]:
    """Hooks on every tunable layer: its forward opens a scope owned by it and labels the
    autograd nodes it creates (a forward whose matrix work the calls did not catch)."""
    handles = []
    for name, module in recorder.layers.items():

        def pre(mod, args, kwargs, name=name):
            recorder.trace[name].forward_runs += 1
            recorder.current = name  # the work from its start on is its traffic
            recorder.open_scope(name)

        def post(mod, args, kwargs, output, name=name):
            recorder.close_scope()
            trace = recorder.trace[name]
            if trace.module_io is None:
                trace.module_io = (fp32_bytes((args, kwargs)), fp32_bytes(output))
            if name not in recorder.order:
                recorder.order.append(name)
            recorder.label(output, (args, kwargs), name)

        handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(module.register_forward_hook(post, with_kwargs=True))
    return handles
