"""The measurements behind a sensitivity table, on one model, one fixed batch, one reference.

:class:`Measurer` holds a model in measurement mode, the concatenated fixed batch and the fp32
reference (loss and full gradient, and how long that one forward and backward pass took: the
unit of :mod:`autoprec.sensitivities.budget`'s cost predictions). It grades one layer at one
precision two ways:

- :meth:`Measurer.sweep`: lower only that layer through the runtime (emulate mode) and run the
  pass again (one pass per layer and precision);
- :meth:`Measurer.taylor`: one fp32 pass that keeps each layer's input, weight, their gradients
  and its output gradient; each (layer, precision) is then scored from the rounding errors of
  those tensors, with no further pass (see :mod:`autoprec.sensitivities.grade` for the formulas).
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from autoprec.kernels import ScaledCast, quantize
from autoprec.layers import tunable_layers
from autoprec.precision import Precision
from autoprec.runtime import GuardConfig, apply_policy
from autoprec.sensitivities.budget import Row

if TYPE_CHECKING:
    from autoprec.models import ModelSpec

#: ``grade(index, layer, precision) -> (loss_delta, grad_cosine)``
Grade = Callable[[int, str, Precision], tuple[float, float]]


def flat_grad(model: nn.Module) -> torch.Tensor:
    """Every trainable parameter's gradient (zeros where none), flattened, in float64."""
    return torch.cat(
        [
            (p.grad if p.grad is not None else torch.zeros_like(p)).detach().flatten().double()
            for p in model.parameters()
            if p.requires_grad
        ]
    )


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """Cosine similarity; a non-finite gradient (diverged) scores 0, two zero gradients 1."""
    if not torch.isfinite(a).all():
        return 0.0
    na, nb = a.norm(), b.norm()
    if na == 0 or nb == 0:
        return 1.0 if na == nb else 0.0
    return float(torch.dot(a, b) / (na * nb))


def loss_and_grad(
    model: nn.Module, spec: ModelSpec, x: torch.Tensor, y: torch.Tensor
) -> tuple[float, torch.Tensor]:
    """One forward and backward pass: the loss and the flat gradient (:func:`flat_grad`)."""
    model.zero_grad(set_to_none=True)
    loss = spec.loss(model(x), y)
    loss.backward()
    return float(loss.detach()), flat_grad(model)


def measurement_mode(model: nn.Module) -> None:
    """Eval mode (no dropout) except batch norm, which keeps using batch statistics.

    Every measurement then sees the same function of the same batch. Batch norm on the running
    statistics of a briefly trained model can shrink activations into fp32 subnormals, which
    slows a CPU down many times over.
    """
    model.eval()
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.train()


def round_like_runtime(t: torch.Tensor, precision: Precision, stream: str) -> torch.Tensor:
    """What the emulate runtime turns ``t`` into (fp8: scaled by its own amax, first call;
    nvfp4 and fp8_block: their blocks along the last dimension, :func:`_round_blocks`)."""
    if precision in (Precision.NVFP4, Precision.FP8_BLOCK):
        return _round_blocks(t, precision)
    fmt = precision.backward_format if stream == "grad_output" else precision.forward_format
    if precision.scaled:
        return ScaledCast(fmt)(t).dequantize()
    return quantize(t, fmt)


def _round_blocks(t: torch.Tensor, precision: Precision) -> torch.Tensor:
    """``t`` through nvfp4's 1x16 blocks (TE's scales, round to nearest: the estimate's
    expected error, stochastic rounding's being unbiased) or fp8_block's 1x128 tiles (a partial
    one zero-padded, as the emulation pads it), along its last dimension. A 1-D tensor (a bias,
    which the kernels leave unrounded) and, for nvfp4, a last size that is not a multiple of 16
    (a shape the runtime refuses) are returned as is."""
    from autoprec.kernels import fp8_block_quantize_lhs, nvfp4_te_round

    last = t.shape[-1] if t.dim() else 0
    if t.dim() < 2 or t.numel() == 0 or (precision is Precision.NVFP4 and last % 16):
        return t
    flat = t.reshape(-1, last)
    if precision is Precision.NVFP4:
        return nvfp4_te_round(flat).reshape(t.shape)
    padded = nn.functional.pad(flat, (0, -last % precision.block_size))
    return fp8_block_quantize_lhs(padded).dequantize(t.dtype)[:, :last].reshape(t.shape)


#: The entry of a (layer, precision) pair the runtime cannot run: not graded.
NOT_GRADED = (math.nan, math.nan)


def row(name: str, index: int, precisions: Sequence[Precision], grade: Grade) -> Row:
    """One layer's entries at every precision; fp32 is the reference (no change, cosine 1)."""
    pairs = [(0.0, 1.0) if p is Precision.FP32 else grade(index, name, p) for p in precisions]
    return tuple(change for change, _ in pairs), tuple(cos for _, cos in pairs)


class Measurer:
    """``model`` (put in measurement mode) on the batch ``(x, y)``, with its fp32 reference.

    Attributes:
        names: the tunable layers in execution order.
        params: their parameter counts.
        reference_loss, reference_grad: the fp32 pass's loss and flat gradient.
        pass_s: how long that pass took (seconds).
    """

    def __init__(self, model: nn.Module, spec: ModelSpec, x: torch.Tensor, y: torch.Tensor) -> None:
        measurement_mode(model)
        self.model, self.spec, self.x, self.y = model, spec, x, y
        layers = list(tunable_layers(model))
        self.names = [n for n, _ in layers]
        self.params = [sum(p.numel() for p in m.parameters()) for _, m in layers]
        start = time.perf_counter()
        self.reference_loss, self.reference_grad = loss_and_grad(model, spec, x, y)
        self.pass_s = time.perf_counter() - start
        self._guard = GuardConfig(count=False)

    def change(self, loss: float) -> float:
        """The relative loss change against the reference (inf for a non-finite loss)."""
        ref = self.reference_loss
        return (loss - ref) / abs(ref) if math.isfinite(loss) else math.inf

    def sweep(self, index: int, name: str, precision: Precision) -> tuple[float, float]:
        """Only ``name`` at ``precision``, measured: one emulated forward and backward pass.

        A pair the runtime cannot run (a block format on a convolution, a width that is not a
        multiple of the format's block: the runtime refuses it in one line) is not graded:
        ``(nan, nan)``, which the table reads as no entry (a diverged pass is ``inf``)."""
        try:
            with apply_policy(self.model, {name: precision}, mode="emulate", guard=self._guard):
                loss, grad = loss_and_grad(self.model, self.spec, self.x, self.y)
        except ValueError:  # NotRunnableError, or a kernel's shape rule
            self.model.zero_grad(set_to_none=True)
            return NOT_GRADED
        return self.change(loss), cosine(grad, self.reference_grad)

    def taylor(self) -> Grade:
        """Run the one fp32 pass that keeps what the estimate needs; return the estimate."""
        model, names = self.model, self.names
        modules = dict(tunable_layers(model))
        saved = _keep_tensors(model, modules, names, lambda: self.spec.loss(model(self.x), self.y))
        grad_sq = {
            n: sum(
                float(p.grad.double().pow(2).sum())
                for p in modules[n].parameters()
                if p.grad is not None
            )
            for n in names
        }
        total_sq = float(flat_grad(model).pow(2).sum()) or 1.0
        upstream = list(itertools.accumulate(grad_sq[n] for n in names))  # execution order
        params = {
            n: [(w.detach(), w.grad) for k, w in m.named_parameters() if "bias" not in k]
            for n, m in modules.items()
        }
        ref_loss = abs(self.reference_loss)

        held: dict[str, Any] = {}  # one layer's float64 tensors, shared by its precisions

        def operands(name: str) -> tuple[list[tuple[torch.Tensor, ...]], Any]:
            if held.get("name") != name:
                s = saved[name]
                pairs = [(t, g) for t, g in params[name] if g is not None]
                if "x" in s and s["x"].grad is not None:
                    pairs.append((s["x"].detach(), s["x"].grad))
                forward = []
                for t, g in pairs:
                    gd = g.double()
                    forward.append((t, gd, gd.pow(2), t.double().pow(2).sum().clamp_min(1e-300)))
                go = s.get("go")
                backward = None if go is None else (go, go.double().pow(2).sum().clamp_min(1e-300))
                held.clear()
                held.update(name=name, value=(forward, backward))
            return held["value"]

        def grade(i: int, name: str, p: Precision) -> tuple[float, float]:
            forward, backward = operands(name)
            first = second = rel_fwd = 0.0
            for t, gd, gd_sq, t_sq in forward:
                d = (round_like_runtime(t, p, "forward") - t).double()
                first += float((gd * d).sum())
                second += 0.5 * float((gd_sq * d.pow(2)).sum())
                rel_fwd += float(d.pow(2).sum() / t_sq)
            rel_bwd = 0.0
            if backward is not None:
                go, go_sq = backward
                dgo = (round_like_runtime(go, p, "grad_output") - go).double()
                rel_bwd = float(dgo.pow(2).sum() / go_sq)
            distance = 0.5 * (rel_fwd + upstream[i] / total_sq * min(rel_bwd, 4.0))
            return (first + second) / ref_loss, 1.0 - min(distance, 2.0)

        return grade


def _keep_tensors(
    model: nn.Module,
    modules: dict[str, nn.Module],
    names: Sequence[str],
    loss: Callable[[], torch.Tensor],
) -> dict[str, dict[str, torch.Tensor]]:
    """Run ``loss().backward()`` keeping each layer's input (with its gradient, ``"x"``) and the
    gradient of its output (``"go"``); the parameters keep theirs in ``.grad``."""
    saved: dict[str, dict[str, torch.Tensor]] = {n: {} for n in names}
    hooks = []
    for name in names:

        def pre(mod, args, name=name):
            inp = args[0]
            if not (isinstance(inp, torch.Tensor) and inp.is_floating_point()):
                return None
            if inp.requires_grad:  # keep the graph whole; just keep this gradient too
                inp.retain_grad()
                saved[name]["x"] = inp
                return None
            inp = inp.detach().requires_grad_(True)  # model input: nothing upstream to cut
            saved[name]["x"] = inp
            return (inp, *args[1:])

        def post(mod, args, out, name=name):
            out = out[0] if isinstance(out, tuple) else out
            if out.requires_grad:
                out.register_hook(lambda g, name=name: saved[name].__setitem__("go", g.detach()))

        hooks += [
            modules[name].register_forward_pre_hook(pre),
            modules[name].register_forward_hook(post),
        ]
    model.zero_grad(set_to_none=True)
    try:
        loss().backward()
    finally:
        for h in hooks:
            h.remove()
    return saved
