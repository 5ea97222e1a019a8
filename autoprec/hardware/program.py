"""The program a policy runs: the casts and matrix operations of one native training step.

The native runtime (:mod:`autoprec.runtime`) runs a policy the way ``torch.autocast`` runs a
model, with per-layer exceptions. This module replays that rule on the forward data flow the
analysis recorded (:class:`Flow`, from :mod:`autoprec.graph.flow`), so that the cost model
prices exactly the kernels the runtime executes, and a test can compare the two (the runtime's
``OpRecorder`` on one real step against :func:`program`).

The rule, per forward operation, with ``region`` the policy's 16-bit dtype (bf16 if a layer is
bf16, else fp16 if one is fp16, else none: the runtime's outer autocast region):

- a layer's matrix operation (its weight is an argument; inside ``nn.MultiheadAttention``,
  every one) computes in the layer's dtype: bf16/fp16 as autocast casts them, fp32 for fp32 and
  tf32 (fp32 storage), fp8 as torchao's ``Float8Linear`` (tensorwise: input and weight cast to
  e4m3, the output in the input's dtype; on CUDA under autocast the input first goes to the
  autocast dtype, as ``Float8Linear.forward`` does). Each argument of another dtype is cast
  once (a weight once per step: autocast caches it);
- any other matrix operation (attention scores of activations) runs in ``region`` (autocast's
  lower-precision list), or in its inputs' dtype outside a region;
- on CUDA, the operations autocast runs in fp32 (:data:`CUDA_FP32_OPS`) cast their inputs to
  fp32 inside a region; on the CPU autocast keeps norms and softmax in the input's dtype;
- norms keep their input's dtype (fp32 weights are accepted as they are); views keep the
  viewed tensor's; every other operation produces the promoted dtype of its floating
  arguments (in place: its first argument's), as PyTorch's type promotion does;
- the model's outputs are cast to fp32 once (the runtime's exit from the region), so the loss
  is computed in fp32, as autocast's fp32-listed losses would.

Backward: every forward cast of a tensor that needs a gradient is cast back once; wherever an
argument that needs a gradient has another dtype than the operation's result without an
explicit cast (a residual add of a bf16 and an fp32 branch), autograd casts its gradient once;
each matrix operation has its backward matrix operations (``convolution_backward`` for a
convolution; one ``mm``/``bmm`` per argument that needs a gradient for a GEMM; torchao's fp8
layer: two ``_scaled_mm`` and four fp8 casts: the output gradient to e5m2 twice, the weight
and the input to e4m3 again; a block-scaled layer, ``mxfp8``, ``fp8_block`` or ``nvfp4``:
its backend's casts and GEMMs, :mod:`autoprec.hardware.program_blocks`). Every fp8 cast is
torchao's: the scale from the amax through fp64 (two scalar casts), a 16-bit tensor upcast to
fp32 for the scaling, then the cast; its weight gradient leaves the GEMM in the layer's output
dtype and is cast to fp32.

Torch-free (plain data), so that a cached layer table can be costed without torch.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from autoprec.hardware.program_blocks import block_linear
from autoprec.hardware.program_types import Cast, Flow, FlowOp, FlowTensor, Matmul, Program
from autoprec.precision import GEMM_OPERANDS, Precision, parse_precision

__all__ = [
    "CUDA_FP32_OPS",
    "MATMUL_OPS",
    "Cast",
    "Flow",
    "FlowOp",
    "FlowTensor",
    "Matmul",
    "Program",
    "program",
    "region_of",
    "view_root",
]

#: Matrix operations as a dispatch mode sees them; ``scaled_dot_product_attention`` stands for
#: the fused attention kernel (flash or memory-efficient) a device runs, one each way.
ATTENTION_OP = "scaled_dot_product_attention"
MATMUL_OPS = ("mm", "addmm", "bmm", "baddbmm", "convolution", ATTENTION_OP)
#: The ops that CUDA autocast runs in float32 whatever the input dtype ("CUDA Ops that can
#: autocast to float32", https://pytorch.org/docs/stable/amp.html#cuda-ops-that-can-autocast-to-float32),
#: by the aten names a TorchDispatchMode sees below autograd (composite ops such as layer_norm,
#: softmax or cross_entropy arrive decomposed: native_layer_norm, _softmax, _log_softmax +
#: nll_loss_forward; __rdiv__/__rtruediv__ arrive as reciprocal). On the CPU autocast keeps
#: norms and softmax in their input's dtype (only losses are fp32 there, outside the model).
CUDA_FP32_OPS: frozenset[str] = frozenset(
    (
        "pow acos asin cosh sinh tan erfinv exp expm1 log log10 log1p log2 reciprocal rsqrt "
        "softplus native_layer_norm native_group_norm _softmax _safe_softmax _log_softmax "
        "norm linalg_vector_norm renorm dist _cdist_forward _pdist_forward cumprod cumsum prod "
        "sum binary_cross_entropy_with_logits nll_loss_forward nll_loss2d_forward mse_loss "
        "l1_loss smooth_l1_loss huber_loss soft_margin_loss multilabel_margin_loss_forward "
        "multi_margin_loss kl_div poisson_nll_loss hinge_embedding_loss margin_ranking_loss "
        "cosine_embedding_loss cosine_similarity triplet_margin_loss"
    ).split()
)
NORM_OPS = frozenset(
    {
        "native_batch_norm",
        "_native_batch_norm_legit",
        "_native_batch_norm_legit_functional",
        "native_layer_norm",
        "native_group_norm",
    }
)


def _compute(precision: Precision) -> str:
    if precision in (Precision.FP32, Precision.TF32):
        return "fp32"
    return precision.hardware


def _promote(dtypes: list[str]) -> str:
    """PyTorch's promotion among the activation dtypes (fp32, bf16, fp16; fp8 tensors exist
    only inside torchao's layer): one dtype stays, any two give fp32 (bf16 with fp16 too)."""
    kinds = set(dtypes)
    return kinds.pop() if len(kinds) == 1 else "fp32"


def region_of(precisions: Mapping[str, Any] | Iterable[Any]) -> str | None:
    """The runtime's outer autocast format for a policy: bf16 if a layer is bf16, else fp16 if
    one is fp16, else None (no region)."""
    items = precisions.values() if isinstance(precisions, Mapping) else precisions
    values = {parse_precision(p) for p in items}
    if Precision.BF16 in values:
        return "bf16"
    return "fp16" if Precision.FP16 in values else None


def view_root(tensors: tuple[FlowTensor, ...] | list[FlowTensor], index: int) -> int:
    """The tensor that tensor ``index`` is a view of, following views of views.

    The walk stops at a tensor that is no view, at a base outside the flow (a damaged cached
    flow), and on a cycle: an operation that returns its own argument as a "view"
    (``lift_fresh`` for a ``torch.tensor(...)`` made inside ``forward``) was once recorded as a
    view of itself, and such flows may still be in the analysis cache.
    """
    seen = {index}
    while 0 <= tensors[index].base < len(tensors) and tensors[index].base not in seen:
        index = tensors[index].base
        seen.add(index)
    return index


def program(
    flow: Flow,
    precisions: Mapping[str, str | Precision],
    device_type: str = "cuda",
) -> Program:
    """Replay the runtime's rule on ``flow`` for ``precisions`` (layers missing: fp32).

    Args:
        flow: the recorded forward pass.
        precisions: ``{layer: precision}``.
        device_type: ``"cuda"`` or ``"cpu"`` (autocast's lists and torchao's input cast
            differ).
    """
    replay = _Replay(flow, {n: parse_precision(p) for n, p in precisions.items()}, device_type)
    for op in flow.ops:
        replay.run(op)
    for o in flow.outputs:  # leaving the region: the loss is computed in fp32
        if o in replay.dtype and replay.dtype[o] != "fp32":
            replay.cast(o, "fp32", "")
    return Program(tuple(replay.casts), tuple(replay.matmuls))


class _Replay:
    """The dtype of every tensor as the step runs, and the casts and matmuls so far."""

    def __init__(self, flow: Flow, policy: dict[str, Precision], device_type: str) -> None:
        self.tensors = flow.tensors
        self.policy = policy
        self.region = region_of(policy)
        self.cuda = device_type == "cuda"
        self.dtype: dict[int, str] = {}
        self.grad: dict[int, bool] = {}
        for i, t in enumerate(self.tensors):
            if t.kind in ("input", "param"):
                self.dtype[i], self.grad[i] = "fp32", t.requires_grad
        self.casts: list[Cast] = []
        self.matmuls: list[Matmul] = []
        self._cached: set[tuple[int, str]] = set()

    def root(self, i: int) -> int:
        return view_root(self.tensors, i)

    def is_weight(self, i: int) -> bool:
        return self.tensors[self.root(i)].kind == "param"

    def cast(self, i: int, target: str, layer: str, *, cache: bool = True) -> None:
        """A forward cast of tensor ``i`` (a weight once per step, as autocast caches it),
        and its backward cast if ``i`` needs a gradient."""
        source, weight = self.dtype[i], self.is_weight(i)
        r = self.root(i)
        if weight and cache:
            if (r, target) in self._cached:
                return
            self._cached.add((r, target))
        numel = self.tensors[r].numel if weight else self.tensors[i].numel
        self.casts.append(Cast("forward", layer, source, target, numel, weight))
        if self.grad.get(i, False):
            self.casts.append(Cast("backward", layer, target, source, numel, weight))

    def run(self, op: FlowOp) -> None:
        args = [a for a in op.args if a in self.dtype]
        needs = any(self.grad.get(a, False) for a in args)
        if op.view:
            out = self.dtype[args[0]] if args else "fp32"
        elif op.name in MATMUL_OPS:
            out = self.matmul(op, args)
        elif self.cuda and self.region and op.name in CUDA_FP32_OPS:
            for a in args:
                if self.dtype[a] != "fp32":
                    self.cast(a, "fp32", "")
            out = "fp32"
        elif op.name in NORM_OPS:
            out = self.dtype[args[0]] if args else "fp32"
        else:
            for a in args:  # a layer's bias added after its GEMM: autocast cast it with the GEMM
                owner = self.tensors[self.root(a)].layer if self.is_weight(a) else ""
                compute = _compute(self.policy.get(owner, Precision.FP32)) if owner else ""
                if compute in ("bf16", "fp16") and self.dtype[a] != compute:
                    self.cast(a, compute, owner)
                    self.dtype[a] = compute
            ranked = [self.dtype[a] for a in args if self.tensors[a].dim > 0]
            ranked = ranked or [self.dtype[a] for a in args]
            out = self.dtype[args[0]] if op.inplace and args else _promote(ranked)
            for a in args:  # autograd casts the gradient of a promoted argument back
                if self.grad.get(a, False) and self.dtype[a] != out:
                    numel = self.tensors[a].numel
                    self.casts.append(Cast("backward", "", out, self.dtype[a], numel, False))
        for o in op.outs:
            self.dtype[o] = out
            self.grad[o] = needs or self.grad.get(o, False)

    def matmul(self, op: FlowOp, args: list[int]) -> str:
        """Cast a matrix operation's arguments as the runtime does; record it and its
        backward; return its result's dtype."""
        layer = op.layer
        precision = self.policy.get(layer, Precision.FP32)
        if layer and precision.is_block:  # mxfp8, fp8_block, nvfp4: their backends' kernels
            return block_linear(self, op, args, precision)
        if layer:
            compute = _compute(precision)
        elif self.region:
            compute = self.region  # autocast's lower-precision list
        else:
            compute = _promote([self.dtype[a] for a in args])
        if compute == "fp8":
            return self.float8(op, args)
        for a in args:
            if self.dtype[a] != compute:
                self.cast(a, compute, layer)
        self.matmuls.append(Matmul("forward", layer, op.name, compute))
        if op.name == "convolution":
            self.matmuls.append(Matmul("backward", layer, "convolution_backward", compute))
        elif op.name == ATTENTION_OP:
            self.matmuls.append(Matmul("backward", layer, f"{ATTENTION_OP}_backward", compute))
        else:
            name = "bmm" if "bmm" in op.name else "mm"
            for a in args[-2:]:  # addmm(bias, a, b), mm(a, b), bmm(a, b)
                if self.grad.get(a, False):
                    self.matmuls.append(Matmul("backward", layer, name, compute))
        return compute

    def float8(self, op: FlowOp, args: list[int]) -> str:
        """torchao's Float8Linear under the layer's recipe, as the runtime runs it: see the
        module docstring."""
        layer = op.layer
        recipe = self.policy[layer].recipe
        weights = [a for a in args if self.is_weight(a) and self.tensors[self.root(a)].dim == 2]
        bias = [a for a in args if self.is_weight(a) and a not in weights]
        acts = [a for a in args if not self.is_weight(a)]
        for a in acts:  # inside a region the layer reads (and writes) the region's dtype
            if self.region and self.dtype[a] != self.region:
                self.cast(a, self.region, layer)
                self.dtype[a] = self.region
        out = self.dtype[acts[0]] if acts else "fp32"
        grad_numel = self.tensors[op.outs[0]].numel if op.outs else 0
        # per GEMM, (tensor dtype, numel, weight?, operand cast, scales) of each fp8 operand:
        # every GEMM casts its own operands (tensorwise recasts to the same bits)
        sizes = {"input": [], "weight": [], "grad_output": []}
        for a in acts:
            sizes["input"].append((self.dtype[a], self.tensors[a].numel, False))
            sizes["grad_output"].append((out, grad_numel, False))
        for w in weights:
            sizes["weight"].append(("fp32", self.tensors[self.root(w)].numel, True))
        features = _features(sizes)
        gemms = {"forward": [("output", acts)], "backward": []}
        gemms["backward"] = [("grad_input", acts), ("grad_weight", acts)]
        hp = []
        for phase, run in gemms.items():
            for gemm, operands in run:
                specs = recipe.gemms()[gemm]
                if specs[0].fmt is None:  # a high-precision GEMM: a plain mm in `out`
                    hp += [Matmul(phase, layer, "mm", out)] * len(operands)
                    continue
                for role, spec in zip(GEMM_OPERANDS[gemm], specs, strict=True):
                    for source, numel, weight in sizes[role]:
                        scales = _scales(role, spec.axis, numel, features)
                        self._fp8_cast(phase, layer, source, numel, weight, spec.fmt, scales)
                kind = "forward" if phase == "forward" else "backward"
                self.matmuls.extend([Matmul(kind, layer, "_scaled_mm", "fp8")] * len(operands))
        self.matmuls.extend(hp)
        if out != "fp32":  # the weight gradient leaves the GEMM in `out`: autograd casts it
            for w in weights:
                numel = self.tensors[self.root(w)].numel
                self.casts.append(Cast("backward", layer, out, "fp32", numel, True))
        for a in bias:  # Float8Linear adds bias.to(output dtype)
            if out != "fp32":
                self.cast(a, out, layer, cache=False)
        return out

    def _fp8_cast(
        self,
        phase: str,
        layer: str,
        source: str,
        numel: int,
        weight: bool,
        target: str,
        scales: int,
    ) -> None:
        """One torchao fp8 cast: the scales from the amax in fp64 (``amax_to_scale``: one per
        tensor, or one per row), the tensor scaled in fp32, then cast."""
        self.casts.append(Cast(phase, layer, source, "fp64", scales, False))
        self.casts.append(Cast(phase, layer, "fp64", "fp32", scales, False))
        if source != "fp32":
            self.casts.append(Cast(phase, layer, source, "fp32", numel, weight))
        self.casts.append(Cast(phase, layer, "fp32", target, numel, weight))


def _features(sizes: Mapping[str, list[tuple[str, int, bool]]]) -> tuple[int, int, int]:
    """``(M, K, N)`` of a Linear's GEMM from its input (M x K), weight (N x K) and output
    gradient (M x N) element counts (``K**2 = input * weight / output``); ones when unknown."""
    try:
        a, w, o = (sizes[r][0][1] for r in ("input", "weight", "grad_output"))
        k = max(1, round(math.sqrt(a * w / o)))
    except (IndexError, ZeroDivisionError, ValueError):
        return 1, 1, 1
    return max(1, a // k), k, max(1, w // k)


def _scales(role: str, axis: int | None, numel: int, features: tuple[int, int, int]) -> int:
    """How many scales an operand's cast computes: one per tensor, else one per slice across
    ``axis`` of the operand as stored (input M x K, weight N x K, output gradient M x N)."""
    if axis is None:
        return 1
    m, k, n = features
    rows, cols = {"input": (m, k), "weight": (n, k), "grad_output": (m, n)}[role]
    return rows if axis == 1 else cols
