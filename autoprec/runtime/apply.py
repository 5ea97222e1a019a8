"""``apply_policy``: run each layer of a model at the precision a policy gives it.

Two modes:

- ``emulate`` (any device): forward hooks round a layer's input(s) and weight(s) to its
  precision's format before the layer's own fp32 computation, and round the gradient with
  respect to its output in backward. Arithmetic accumulates in fp32, as tensor cores do; master
  weights stay fp32 (the rounded weight is a temporary that autograd differentiates straight
  through to the fp32 parameter).
- ``native``: per-layer ``torch.autocast`` for bf16/fp16 and the TF32 switches for tf32 layers;
  the layer's output goes back to the dtype of its input so that neighbouring fp32 layers are
  unaffected. fp8 has no native path here yet (torchao's float8 training is not wired in):
  fp8 layers are emulated, with one warning.

``auto`` picks native on CUDA and emulate elsewhere. Everything is undone by
``handle.remove()``: the hooks go, the parameters are the very same objects, and the model's
outputs and ``state_dict`` are as before.
"""

from __future__ import annotations

import logging
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from autoprec.policy import TARGET_MODES
from autoprec.precision import Precision, parse_precision
from autoprec.runtime.casting import LayerCasts

__all__ = [
    "apply_policy",
    "PolicyHandle",
    "LayerStats",
    "GuardConfig",
    "RuntimeStateError",
    "MODES",
]

log = logging.getLogger("autoprec.runtime")

MODES = TARGET_MODES
_WEIGHT_NAMES = ("weight", "in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight")
_MHA_INPUTS = ("query", "key", "value")
_applied: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()


class RuntimeStateError(RuntimeError):
    """The model is already under a policy, or the handle was already removed."""


@dataclass(frozen=True)
class GuardConfig:
    """Overflow guard settings.

    Args:
        count: count overflows and underflows per layer (emulate mode; two reductions per cast).
        promote_after: promote a layer to the next wider precision once this many of its last
            ``window`` forward calls (each with the backward that followed) saw an overflow;
            None turns promotion off.
        window: the number of recent forward calls the promotion rule looks at.
    """

    count: bool = True
    promote_after: int | None = None
    window: int = 100

    def __post_init__(self) -> None:
        if self.promote_after is not None and self.promote_after < 1:
            raise ValueError(f"promote_after must be at least 1 or None, got {self.promote_after}")
        if self.window < 1:
            raise ValueError(f"window must be at least 1, got {self.window}")


@dataclass
class LayerStats:
    """What the runtime saw at one layer."""

    precision: Precision
    initial_precision: Precision
    calls: int = 0
    overflows: int = 0
    underflows: int = 0
    promotions: list[dict[str, Any]] = field(default_factory=list)


class _Layer:
    """Hooks and casting state of one tunable layer."""

    def __init__(self, name: str, module: nn.Module, precision: Precision, handle: PolicyHandle):
        self.name = name
        self.module = module
        self.initial = precision
        self.handle = handle
        self.native = handle.mode == "native" and precision is not Precision.FP8
        self.casts = LayerCasts(precision, count=handle.guard.count and not self.native)
        self.calls = 0
        self.promotions: list[dict[str, Any]] = []
        self._folded = (0, 0)  # counts of casters replaced by a promotion
        self._window: deque[int] = deque(maxlen=handle.guard.window)
        self._seen_overflows = 0
        self._native_overflows = 0
        self._swapped: list[tuple[nn.Module, str, nn.Parameter]] = []
        self._native_state: list[Any] = []
        # per-layer scaling of the output gradient (emulate mode; see .layer_scaling): maps the
        # arriving gradient to a power-of-two factor applied around its rounding
        self.gradient_scale: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.hooks = [
            module.register_forward_pre_hook(self.pre_forward, with_kwargs=True),
            module.register_forward_hook(self.post_forward, always_call=True),
        ]

    @property
    def precision(self) -> Precision:
        return self.casts.precision

    # --- weights --------------------------------------------------------------------------------
    def _weight_slots(self) -> list[tuple[nn.Module, str]]:
        slots = [
            (self.module, n) for n in _WEIGHT_NAMES if self.module._parameters.get(n) is not None
        ]
        if isinstance(self.module, nn.MultiheadAttention):
            slots.append((self.module.out_proj, "weight"))
        return slots

    def _swap_weights(self) -> None:
        for owner, pname in self._weight_slots():
            param = owner._parameters[pname]
            # A non-leaf stand-in for the duration of forward; gradients reach `param` through it.
            owner._parameters[pname] = self.casts.forward_operand(param, "weight")
            self._swapped.append((owner, pname, param))

    def restore_weights(self) -> None:
        while self._swapped:
            owner, pname, param = self._swapped.pop()
            owner._parameters[pname] = param

    # --- hooks ----------------------------------------------------------------------------------
    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        self.calls += 1
        if self.handle.guard.promote_after is not None:
            self._check_promotion()
        if self.native:
            self._enter_native(args)
            return args, kwargs
        if not self.casts.active:
            return args, kwargs
        rounded: dict[int, torch.Tensor] = {}  # keeps `query is key` true for self-attention

        def cast(x: Any) -> Any:
            if not isinstance(x, torch.Tensor):
                return x
            if id(x) not in rounded:
                rounded[id(x)] = self.casts.forward_operand(x, "input")
            return rounded[id(x)]

        n_inputs = 3 if isinstance(module, nn.MultiheadAttention) else 1
        args = tuple(cast(a) if i < n_inputs else a for i, a in enumerate(args))
        if n_inputs == 3:
            kwargs = {k: cast(v) if k in _MHA_INPUTS else v for k, v in kwargs.items()}
        self._swap_weights()
        return args, kwargs

    def post_forward(self, module: nn.Module, args: tuple, output: Any) -> Any:
        self.restore_weights()
        if self.native:
            return self._exit_native(args, output)
        if not self.casts.active:
            return output
        if isinstance(output, tuple):  # nn.MultiheadAttention: (attn_output, attn_weights)
            first = self.casts.backward_gradient(output[0], self.gradient_scale)
            return (first, *output[1:])
        if isinstance(output, torch.Tensor):
            return self.casts.backward_gradient(output, self.gradient_scale)
        return output

    # --- native mode ----------------------------------------------------------------------------
    def _enter_native(self, args: tuple) -> None:
        p = self.precision
        device_type = next((a.device.type for a in args if isinstance(a, torch.Tensor)), "cuda")
        state: dict[str, Any] = {}
        if p in (Precision.BF16, Precision.FP16):
            dtype = torch.bfloat16 if p is Precision.BF16 else torch.float16
            ctx = torch.autocast(device_type=device_type, dtype=dtype)
            ctx.__enter__()
            state["autocast"] = ctx
        elif device_type == "cuda":  # tf32 on, or off for fp32 layers
            state["tf32"] = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
            torch.backends.cuda.matmul.allow_tf32 = p is Precision.TF32
            torch.backends.cudnn.allow_tf32 = p is Precision.TF32
        self._native_state.append(state)

    def _exit_native(self, args: tuple, output: Any) -> Any:
        state = self._native_state.pop() if self._native_state else {}
        if "autocast" in state:
            state["autocast"].__exit__(None, None, None)
        if "tf32" in state:
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = state["tf32"]
        in_dtype = next((a.dtype for a in args if isinstance(a, torch.Tensor)), torch.float32)

        def back(t: Any) -> Any:
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != in_dtype:
                t = t.to(in_dtype)
            if isinstance(t, torch.Tensor) and t.requires_grad and self.handle.guard.count:
                t.register_hook(self._count_native_gradient)
            return t

        if isinstance(output, tuple):
            return tuple(back(t) for t in output)
        return back(output)

    def _count_native_gradient(self, grad: torch.Tensor) -> None:
        with torch.no_grad():
            self._native_overflows += int((~torch.isfinite(grad)).sum())

    # --- guard ----------------------------------------------------------------------------------
    def counts(self) -> tuple[int, int]:
        over, under = self.casts.counts()
        return (
            over + self._folded[0] + self._native_overflows,
            under + self._folded[1],
        )

    def _check_promotion(self) -> None:
        total = self.counts()[0]
        self._window.append(int(total > self._seen_overflows))  # did the last call overflow?
        self._seen_overflows = total
        guard = self.handle.guard
        if sum(self._window) < guard.promote_after:
            return
        wider = self.precision.wider()
        if wider is None:
            return
        event = {
            "call": self.calls,
            "from": self.precision.value,
            "to": wider.value,
            "overflowing_calls": sum(self._window),
            "window": len(self._window),
        }
        log.warning(
            "autoprec: layer %r promoted %s -> %s: %d of its last %d calls overflowed",
            self.name,
            event["from"],
            event["to"],
            event["overflowing_calls"],
            event["window"],
        )
        over, under = self.casts.counts()
        self._folded = (self._folded[0] + over, self._folded[1] + under)
        self.casts = LayerCasts(wider, count=self.casts.count)
        self.native = self.handle.mode == "native" and wider is not Precision.FP8
        self.promotions.append(event)
        self._window.clear()
        self._seen_overflows = self.counts()[0]

    def stats(self) -> LayerStats:
        over, under = self.counts()
        return LayerStats(
            self.precision, self.initial, self.calls, over, under, list(self.promotions)
        )

    def remove(self) -> None:
        self.restore_weights()
        for h in self.hooks:
            h.remove()
        self.hooks = []


class PolicyHandle:
    """The result of :func:`apply_policy`: read stats, then ``remove()`` to undo everything.

    Also a context manager: ``with apply_policy(model, policy): ...`` removes on exit.
    """

    def __init__(self, model: nn.Module, mode: str, guard: GuardConfig) -> None:
        self.model = model
        self.mode = mode
        self.guard = guard
        self.layers: dict[str, _Layer] = {}
        self.removed = False

    def precisions(self) -> dict[str, Precision]:
        """Each managed layer's current precision (after any promotion)."""
        return {name: layer.precision for name, layer in self.layers.items()}

    def stats(self) -> dict[str, LayerStats]:
        """Per-layer calls, overflow and underflow counts, and promotions so far."""
        return {name: layer.stats() for name, layer in self.layers.items()}

    def totals(self) -> dict[str, int]:
        """Overflows, underflows and promotions summed over the layers."""
        stats = self.stats().values()
        return {
            "overflows": sum(s.overflows for s in stats),
            "underflows": sum(s.underflows for s in stats),
            "promotions": sum(len(s.promotions) for s in stats),
        }

    def remove(self) -> None:
        """Take every hook off and give the layers back their own parameters."""
        if self.removed:
            return
        for layer in self.layers.values():
            layer.remove()
            _applied.pop(layer.module, None)
        self.removed = True

    def __enter__(self) -> PolicyHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        state = "removed" if self.removed else f"{len(self.layers)} layers"
        return f"PolicyHandle(mode={self.mode!r}, {state})"


def _resolve(model: nn.Module, policy: Any) -> dict[str, Precision]:
    if isinstance(policy, (str, Precision)):
        from autoprec.layers import tunable_layers

        precision = parse_precision(policy)
        return {name: precision for name, _ in tunable_layers(model)}
    if isinstance(policy, Mapping):
        return {name: parse_precision(p) for name, p in policy.items()}
    return dict(policy.resolve(model))


def _pick_mode(model: nn.Module, mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"unknown runtime mode {mode!r}; expected one of {', '.join(MODES)}")
    if mode != "auto":
        return mode
    param = next(model.parameters(), None)
    return "native" if param is not None and param.device.type == "cuda" else "emulate"


def apply_policy(
    model: nn.Module,
    policy: Any,
    mode: str = "auto",
    guard: GuardConfig | None = None,
) -> PolicyHandle:
    """Run each tunable layer of ``model`` at the precision ``policy`` gives it.

    Args:
        model: any module; a ``DistributedDataParallel`` wrapper is looked through.
        policy: a :class:`~autoprec.PrecisionPolicy`, a ``{layer name: precision}`` mapping, or
            one precision for every tunable layer (``"bf16"``).
        mode: ``"auto"``, ``"emulate"`` or ``"native"``.
        guard: overflow counting and automatic promotion (:class:`GuardConfig`).

    Returns:
        A :class:`PolicyHandle`; ``handle.remove()`` restores the model exactly.

    Raises:
        RuntimeStateError: a layer of ``model`` is already under a policy.
        ValueError: unknown mode, precision, or a layer name the model does not have.

    Example:
        >>> handle = apply_policy(model, {"fc": "bf16"}, mode="emulate")
        >>> loss_fn(model(x), y).backward()
        >>> handle.stats()["fc"].overflows
        0
        >>> handle.remove()
    """
    if isinstance(model, nn.parallel.DistributedDataParallel):
        model = model.module
    guard = guard or GuardConfig()
    mode = _pick_mode(model, mode)
    precisions = _resolve(model, policy)
    modules = dict(model.named_modules())
    missing = [n for n in precisions if n not in modules]
    if missing:
        raise ValueError(f"policy names layers the model does not have: {', '.join(missing)}")
    busy = [n for n in precisions if modules[n] in _applied]
    if busy:
        raise RuntimeStateError(
            f"layer {busy[0]!r} is already under a policy ({_applied[modules[busy[0]]]}); "
            "call remove() on the earlier handle before applying another policy"
        )
    if mode == "native" and any(p is Precision.FP8 for p in precisions.values()):
        warnings.warn(
            "native fp8 training is not available in this build (torchao float8 is not wired in); "
            "fp8 layers are emulated",
            RuntimeWarning,
            stacklevel=2,
        )
    handle = PolicyHandle(model, mode, guard)
    for name, precision in precisions.items():
        handle.layers[name] = _Layer(name, modules[name], precision, handle)
        _applied[modules[name]] = f"handle {id(handle):#x}"
    return handle
