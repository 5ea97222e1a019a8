"""Native mode's program: what each layer runs as, checked against what the device runs natively.

The program is the one ``torch.autocast`` runs, with per-layer exceptions, so that the cost
model can price it as autocast's:

- While the model's forward runs, one ``torch.autocast`` *region* is open (see
  :func:`region_dtype`); operations between the tunable layers follow autocast's own rules, and
  low-precision activations flow from one low-precision layer to the next. The region's
  low-precision outputs become fp32 once, when the model returns.
- A bf16 or fp16 layer of the region's dtype runs as autocast runs it; one of the other 16-bit
  dtype opens a nested autocast of its own dtype.
- An fp32 or tf32 layer disables autocast and takes its floating inputs in fp32 (one cast at the
  boundary), with the TF32 switches (``torch.backends.cuda.matmul.fp32_precision`` and
  ``torch.backends.cudnn.conv.fp32_precision``) set to ``"tf32"`` or ``"ieee"`` for its forward
  and for its backward (see :class:`_BackwardSwitches`).
- An fp8 layer is a torchao ``Float8Linear`` (:class:`Float8Swap`) with its precision's recipe;
  inside the region it takes its input in the region's dtype (one cast at the boundary) and
  writes its output in it, as ``Float8Linear`` does under CUDA autocast.
- A block-scaled layer is a swapped module too, reading its input in
  :func:`~autoprec.precision.block_io_format`'s dtype, autocast off: torchao's ``MXFP8Linear``
  (mxfp8, any device: its emulated kernel off CUDA), ``Float8BlockwiseLinear`` (fp8_block) and
  ``NVFP4Linear`` (nvfp4, from ``NVFP4TrainingConfig``). The last two are Triton kernels for
  CUDA (sm90+ and sm100): :func:`check_native` refuses them elsewhere in one line naming the
  backend and the target (:data:`NATIVE_BLOCK`). Their wiring is not exercised by the CPU
  tests (no GPU here); the emulate mode runs both formats anywhere.

What a device runs natively is read from :mod:`autoprec.hardware.runnability`, the table the
masks and the cost model read too; :func:`check_native` refuses anything else.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autoprec.hardware.program import region_of
from autoprec.hardware.runnability import LayerShape, Target, refuse, unrunnable
from autoprec.precision import Precision, block_io_format
from autoprec.runtime.native_blocks import block_module, refuse_block

__all__ = [
    "CPU_NATIVE_PRECISIONS",
    "Float8Swap",
    "Frame",
    "check_native",
    "enter_layer",
    "exit_layer",
    "local_device",
    "region_dtype",
]

LOW_DTYPES = {Precision.BF16: torch.bfloat16, Precision.FP16: torch.float16}
# On the CPU, autocast runs bf16 and fp16, torch._scaled_mm and torchao's float8 training run,
# torchao's MXFP8 training runs with its emulated kernel, and the TF32 switches are accepted (a
# no-op there), so that any runnable policy can be run.
CPU_NATIVE_PRECISIONS = ("fp32", "tf32", "bf16", "fp16", "fp8", "mxfp8")


@dataclass(frozen=True)
class _LocalCpu:
    name: str = "this CPU"
    supported_precisions: tuple[str, ...] = CPU_NATIVE_PRECISIONS


def local_device(device_type: str) -> Target:
    """What the local device runs natively: a ``DeviceSpec``-like object with ``name`` and
    ``supported_precisions`` (the CPU's from :data:`CPU_NATIVE_PRECISIONS`, an accelerator's
    from :func:`autoprec.hardware.detect`)."""
    if device_type == "cpu":
        return _LocalCpu()
    from autoprec.hardware import detect

    return detect()


def check_native(
    layers: Mapping[str, tuple[nn.Module, Precision]], device: Target, device_type: str = "cpu"
) -> None:
    """Refuse precisions that ``device`` cannot run natively for these layers.

    Raises:
        NotRunnableError: one line naming the layers (the first few) and why.
    """
    refuse_block(layers, device_type)
    shapes = {name or "<model>": LayerShape.of_module(m) for name, (m, _) in layers.items()}
    precisions = {name or "<model>": p for name, (_, p) in layers.items()}
    refuse(unrunnable(precisions, device, shapes), device)


def region_dtype(precisions: Iterable[Precision]) -> torch.dtype | None:
    """The autocast region's dtype (:func:`autoprec.hardware.program.region_of`, the rule the
    cost model replays): bf16 if any layer is bf16, else fp16 if any is, else none."""
    name = region_of(precisions)
    return None if name is None else LOW_DTYPES[Precision(name)]


def cast_floating(value: Any, dtype: torch.dtype) -> Any:
    """``value`` with its floating tensors (top level and in tuples/lists) cast to ``dtype``."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() and value.dtype != dtype else value
    if isinstance(value, (tuple, list)):
        return type(value)(cast_floating(v, dtype) for v in value)
    return value


# --- TF32 switches --------------------------------------------------------------------------------
def _switches() -> tuple[str, str]:
    return torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision


def _set_switches(state: tuple[str, str]) -> tuple[str, str]:
    previous = _switches()
    torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision = state
    return previous


class _BackwardSwitches:
    """Holds one layer call's TF32 switches through its backward.

    A hook on the layer's output (it runs before the layer's first backward node) sets the
    switches; the backward of an identity on each of its inputs that needs a gradient (it runs
    once the layer's backward has produced that gradient) puts back what was there, after the
    last of them. Where no input needs a gradient (a first layer), or a partial backward never
    reaches them, a callback at the end of the backward pass puts them back.
    """

    def __init__(self, state: tuple[str, str]) -> None:
        self.state = state
        self.inputs = 0
        self.left = 0
        self.previous: tuple[str, str] | None = None

    def mark(self, x: torch.Tensor) -> torch.Tensor:
        self.inputs += 1
        return _MarkInput.apply(x, self)

    def start(self, grad: torch.Tensor) -> None:
        if self.previous is None:
            self.previous = _set_switches(self.state)
            self.left = self.inputs
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)

    def input_done(self) -> None:
        self.left -= 1
        if self.left <= 0:
            self.finish()

    def finish(self) -> None:
        if self.previous is not None:
            _set_switches(self.previous)
            self.previous = None


class _MarkInput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, switches):  # noqa: D102
        ctx.switches = switches
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        ctx.switches.input_done()
        return grad, None


# --- one layer call ---------------------------------------------------------------------------
@dataclass
class Frame:
    """What :func:`enter_layer` opened for one call, for :func:`exit_layer` to close."""

    context: contextlib.AbstractContextManager | None = None
    switches: tuple[str, str] | None = None  # to put back after forward
    backward: _BackwardSwitches | None = None
    back_to: torch.dtype | None = None  # standalone call: outputs back to the input dtype


def enter_layer(
    precision: Precision,
    device_type: str,
    weight_dtype: torch.dtype,
    args: tuple,
    kwargs: dict,
) -> tuple[tuple, dict, Frame]:
    """Open the native rule of one layer call; returns the (cast) arguments and its frame."""
    frame = Frame()
    outer = torch.is_autocast_enabled(device_type)
    if precision.is_fp8:
        # torchao's Float8Linear casts its input to CUDA autocast's dtype (through the deprecated
        # get_autocast_gpu_dtype, and not on the CPU): do that cast here, for every device, and
        # run it with autocast off, so that the program is the same everywhere
        if outer:
            dtype = torch.get_autocast_dtype(device_type)
            frame.context = torch.autocast(device_type, enabled=False)
            frame.context.__enter__()
            args = tuple(cast_floating(a, dtype) for a in args)
        return args, kwargs, frame
    if precision.is_block:
        # torchao's MXFP8Linear multiplies its operands in the dtype they come in: the layer
        # reads (and its module casts its weight to) block_io_format's dtype, autocast off
        region = None
        if outer:
            bf16 = torch.get_autocast_dtype(device_type) == torch.bfloat16
            region = (Precision.BF16 if bf16 else Precision.FP16).value
            frame.context = torch.autocast(device_type, enabled=False)
            frame.context.__enter__()
        dtype = LOW_DTYPES.get(Precision(block_io_format(precision, region)), weight_dtype)
        args = tuple(cast_floating(a, dtype) for a in args)
        return args, kwargs, frame
    if precision in LOW_DTYPES:
        dtype = LOW_DTYPES[precision]
        if not (outer and torch.get_autocast_dtype(device_type) == dtype):
            frame.context = torch.autocast(device_type, dtype=dtype)
            frame.context.__enter__()
            if not outer:  # called outside the model's region: behave as a standalone layer
                first = next((a for a in args if isinstance(a, torch.Tensor)), None)
                frame.back_to = weight_dtype if first is None else first.dtype
        return args, kwargs, frame
    if outer:
        frame.context = torch.autocast(device_type, enabled=False)
        frame.context.__enter__()
        args = tuple(cast_floating(a, weight_dtype) for a in args)
        kwargs = {k: cast_floating(v, weight_dtype) for k, v in kwargs.items()}
    state = ("tf32", "tf32") if precision is Precision.TF32 else ("ieee", "ieee")
    frame.switches = _set_switches(state)
    if torch.is_grad_enabled():
        frame.backward = _BackwardSwitches(state)
        marked: dict[int, torch.Tensor] = {}  # keeps `query is key` true for self-attention

        def mark(x: Any) -> Any:
            if not (isinstance(x, torch.Tensor) and x.requires_grad):
                return x
            if id(x) not in marked:
                marked[id(x)] = frame.backward.mark(x)
            return marked[id(x)]

        args = tuple(mark(a) for a in args)
        kwargs = {k: mark(v) for k, v in kwargs.items()}
    return args, kwargs, frame


def exit_layer(frame: Frame, output: Any) -> Any:
    """Close what :func:`enter_layer` opened; returns the output (cast back if standalone)."""
    if frame.context is not None:
        frame.context.__exit__(None, None, None)
    if frame.switches is not None:
        _set_switches(frame.switches)
    if frame.back_to is not None:
        output = cast_floating(output, frame.back_to)
    if frame.backward is not None:
        for t in output if isinstance(output, (tuple, list)) else (output,):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(frame.backward.start)
    return output


# --- fp8 ----------------------------------------------------------------------------------------
class Float8Swap:
    """8-bit modules in place of a model's fp8 and mxfp8 ``nn.Linear`` layers.

    Natively an fp8 layer is a torchao ``Float8Linear``: ``torchao.float8
    .convert_to_float8_training`` swaps them, one call per recipe with
    ``Float8LinearConfig.from_recipe_name`` (``Float8Linear.from_float`` keeps the very same
    ``Parameter`` objects); an mxfp8 layer is a torchao ``MXFP8Linear`` (:func:`mx_module`).
    ``build`` replaces both (emulate mode's :mod:`~.float8_emulate` modules). :meth:`restore`
    puts the original modules back. A root module cannot be swapped in place, so a model that is
    itself the swapped ``Linear`` runs the new module's ``forward`` in its own place instead (an
    instance attribute, deleted on restore).

    Args:
        model: the model.
        precisions: ``{layer name: fp8 precision}``.
        build: ``(name, linear, precision) -> module``; None: the native modules.
    """

    def __init__(
        self,
        model: nn.Module,
        precisions: Mapping[str, Precision],
        build: Callable[[str, nn.Module, Precision], nn.Module] | None = None,
    ) -> None:
        self.model = model
        modules = dict(model.named_modules())
        self.originals = {name: modules[name] for name in precisions}
        self.runners: dict[str, nn.Module] = {}
        if build is None:
            self._torchao(model, {n: p for n, p in precisions.items() if p.is_fp8})
            for name, precision in precisions.items():
                if precision.is_block:
                    self._place(name, block_module(name, modules[name], precision))
        else:
            for name, precision in precisions.items():
                runner = build(name, modules[name], precision)
                self._place(name, runner)
        if "" in precisions:
            self._root = self.runners[""]
            model.forward = self._root.forward
            self.runners[""] = model

    def _torchao(self, model: nn.Module, precisions: Mapping[str, Precision]) -> None:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        from torchao.float8.float8_linear import Float8Linear

        for recipe in sorted({p.recipe.name for p in precisions.values()}):
            config = Float8LinearConfig.from_recipe_name(recipe)
            wanted = {n for n, p in precisions.items() if p.recipe.name == recipe}
            if wanted - {""}:
                convert_to_float8_training(
                    model,
                    module_filter_fn=lambda _, fqn, w=wanted: fqn in w and fqn != "",
                    config=config,
                )
            if "" in wanted:
                self.runners[""] = Float8Linear.from_float(model, config=config)
        swapped = dict(model.named_modules())
        self.runners.update({n: swapped[n] for n in precisions if n != ""})

    def _place(self, name: str, runner: nn.Module) -> None:
        if name == "":
            self.runners[""] = runner
            return
        self.runners[name] = runner
        parent_name, _, child = name.rpartition(".")
        setattr(self.model.get_submodule(parent_name), child, runner)

    def restore(self, name: str) -> nn.Module:
        """Put layer ``name``'s original module back; returns it."""
        original = self.originals.pop(name)
        self.runners.pop(name)
        if name == "":
            del original.__dict__["forward"]
            return original
        parent_name, _, child = name.rpartition(".")
        setattr(self.model.get_submodule(parent_name), child, original)
        return original

    def restore_all(self) -> None:
        for name in list(self.originals):
            self.restore(name)
