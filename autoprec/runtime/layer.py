"""One managed layer: its hooks, its precision (and promotions), and what it saw.

In ``emulate`` mode the hooks round the layer's input(s) and weight(s) before its own fp32
computation and the gradient with respect to its output in backward (:class:`LayerCasts`). In
``native`` mode they open and close the layer's native rule (:mod:`.native`). A functional use
of the layer's weight (:mod:`.functional`) goes through :meth:`ManagedLayer.call_functional`,
which applies the same precision to that one call.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from autoprec.hardware.runnability import NotRunnableError
from autoprec.kernels import fake_quantize
from autoprec.kernels.dispatch import outside_function_modes
from autoprec.precision import Precision
from autoprec.runtime import native
from autoprec.runtime.casting import LayerCasts
from autoprec.runtime.functional import bias_of

if TYPE_CHECKING:
    from autoprec.runtime.apply import PolicyHandle

__all__ = ["LayerStats", "ManagedLayer", "WEIGHT_NAMES"]

log = logging.getLogger("autoprec.runtime")

WEIGHT_NAMES = ("weight", "in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight")
BIAS_NAMES = ("bias", "in_proj_bias")
_MHA_INPUTS = ("query", "key", "value")


@dataclass
class LayerStats:
    """What the runtime saw at one layer."""

    precision: Precision
    initial_precision: Precision
    calls: int = 0
    overflows: int = 0
    underflows: int = 0
    promotions: list[dict[str, Any]] = field(default_factory=list)


class ManagedLayer:
    """Hooks and casting state of one tunable layer.

    Args:
        name: its qualified name.
        module: the layer as the model had it.
        precision: its precision under the policy.
        handle: the policy's handle (mode, guard, fp8 swap).
        runner: the module that actually runs (a torchao ``Float8Linear`` for a native fp8
            layer), ``module`` by default.
    """

    def __init__(
        self,
        name: str,
        module: nn.Module,
        precision: Precision,
        handle: PolicyHandle,
        runner: nn.Module | None = None,
    ) -> None:
        self.name = name
        self.module = module
        self.runner = runner if runner is not None else module
        self.initial = precision
        self.handle = handle
        self.native = handle.mode == "native"
        self.casts = self._casts(precision, handle.guard.count and not self.native)
        self.calls = 0
        self.running = 0  # depth of this layer's own forward
        self._held_bias: nn.Parameter | None = None  # an fp8 layer's bias, added after it
        self.promotions: list[dict[str, Any]] = []
        self._folded = (0, 0)  # counts of casters replaced by a promotion
        self._window: deque[int] = deque(maxlen=handle.guard.window)
        self._seen_overflows = 0
        self._native_overflows: torch.Tensor | int = 0
        self._swapped: list[tuple[nn.Module, str, nn.Parameter]] = []
        self._frames: list[native.Frame] = []
        self._unswap = False  # a promoted fp8 layer goes back to its nn.Linear after this call
        weight = next((p for _, p in self.weight_slots_params()), None)
        self.device_type = weight.device.type if weight is not None else "cpu"
        self.weight_dtype = weight.dtype if weight is not None else torch.float32
        # per-layer scaling of the output gradient (emulate mode; see .layer_scaling): maps the
        # arriving gradient to a power-of-two factor applied around its rounding
        self.gradient_scale: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.hooks: list[Any] = []
        self._hook(self.runner)

    @property
    def precision(self) -> Precision:
        return self.casts.precision

    def _hook(self, module: nn.Module) -> None:
        self.hooks = [
            module.register_forward_pre_hook(self.pre_forward, with_kwargs=True),
            module.register_forward_hook(self.post_forward, always_call=True),
        ]

    def _casts(self, precision: Precision, count: bool) -> LayerCasts:
        """The layer's casters; an fp8 layer inside the policy's autocast region stores its
        results in the region's format, as torchao's Float8Linear does under autocast. An
        emulated fp8-recipe layer's module casts by itself (:mod:`.float8_emulate`): its
        casters are that module's."""
        recipe_casts = getattr(self.runner, "casts", None)
        if precision.swapped and not self.native and recipe_casts is not None:
            return recipe_casts
        if precision is Precision.FP8 and self.handle.region_format is not None:
            return LayerCasts(precision, count=count, output_format=self.handle.region_format)
        return LayerCasts(precision, count=count)

    # --- weights --------------------------------------------------------------------------------
    def _weight_slots(self) -> list[tuple[nn.Module, str]]:
        slots = [
            (self.module, n) for n in WEIGHT_NAMES if self.module._parameters.get(n) is not None
        ]
        if isinstance(self.module, nn.MultiheadAttention):
            slots.append((self.module.out_proj, "weight"))
        return slots

    def weight_slots_params(self) -> list[tuple[str, nn.Parameter]]:
        """``(slot name, parameter)`` of the weights this layer's precision applies to."""
        return [(pname, owner._parameters[pname]) for owner, pname in self._weight_slots()]

    def _bias_slots(self) -> list[tuple[nn.Module, str]]:
        owners = [self.module]
        if isinstance(self.module, nn.MultiheadAttention):
            owners.append(self.module.out_proj)
        return [
            (owner, n)
            for owner in owners
            for n in BIAS_NAMES
            if owner._parameters.get(n) is not None
        ]

    def _swap_weights(self) -> None:
        slots = [(o, n, "weight") for o, n in self._weight_slots()]
        bias_slots = self._bias_slots()
        linear = isinstance(self.module, nn.Linear)
        if self.precision is Precision.FP8 and linear and (self.module, "bias") in bias_slots:
            # torchao's Float8Linear adds its bias after the fp8 GEMM (in the output's dtype),
            # so the bias gradient sums the unrounded output gradient: take it out of the layer
            # and add it in post_forward, after the output gradient's rounding
            self._held_bias = self.module._parameters["bias"]
            self.module._parameters["bias"] = None
            self._swapped.append((self.module, "bias", self._held_bias))
            bias_slots.remove((self.module, "bias"))
        slots += [(o, n, "bias") for o, n in bias_slots]  # autocast casts biases too
        for owner, pname, stream in slots:
            param = owner._parameters[pname]
            # A non-leaf stand-in for the duration of forward; gradients reach `param` through it.
            owner._parameters[pname] = self.casts.forward_operand(param, stream)
            self._swapped.append((owner, pname, param))

    def restore_weights(self) -> None:
        while self._swapped:
            owner, pname, param = self._swapped.pop()
            owner._parameters[pname] = param

    # --- hooks ----------------------------------------------------------------------------------
    def _begin_call(self) -> None:
        self.calls += 1
        if self.handle.guard.promote_after is not None:
            self._check_promotion()

    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        self._begin_call()
        self.running += 1
        if self.native:
            args, kwargs, frame = native.enter_layer(
                self.precision, self.device_type, self.weight_dtype, args, kwargs
            )
            self._frames.append(frame)
            return args, kwargs
        if not self.casts.active:
            return args, kwargs
        with outside_function_modes():  # the model's WeightUseMode: nothing to see here
            return self._cast_operands(module, args, kwargs)

    def _cast_operands(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
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
        self.running -= 1
        bias, self._held_bias = self._held_bias, None
        self.restore_weights()
        if self.native:
            output = self._exit_native(output)
        else:
            with outside_function_modes():
                output = self._round_gradient(output)
                if bias is not None and isinstance(output, torch.Tensor):  # as Float8Linear
                    output = output + self.casts.forward_operand(bias, "bias")
                    if self.casts.output_format is not None:  # the add runs in stored dtype
                        output = fake_quantize(output, self.casts.output_format, None)
        if self._unswap and not self.running:
            self._back_to_linear()
        return output

    def _round_gradient(self, output: Any) -> Any:
        if not self.casts.active:
            return output
        if isinstance(output, tuple):  # nn.MultiheadAttention: (attn_output, attn_weights)
            first = self.casts.backward_gradient(output[0], self.gradient_scale)
            return (first, *output[1:])
        if isinstance(output, torch.Tensor):
            return self.casts.backward_gradient(output, self.gradient_scale)
        return output

    def _exit_native(self, output: Any) -> Any:
        frame = self._frames.pop() if self._frames else native.Frame()
        output = native.exit_layer(frame, output)
        if self.handle.guard.count:
            for t in output if isinstance(output, tuple) else (output,):
                if isinstance(t, torch.Tensor) and t.is_floating_point():
                    self._count_non_finite(t)
                    if t.requires_grad:
                        t.register_hook(self._count_non_finite)
        return output

    def _count_non_finite(self, t: torch.Tensor) -> None:
        """Native overflows: non-finite values of the output and of its gradient (kept on the
        device, read by :meth:`counts`)."""
        with torch.no_grad():
            self._native_overflows = self._native_overflows + (~torch.isfinite(t)).sum()

    # --- functional use of the weight -----------------------------------------------------------
    def call_functional(
        self, func: Any, args: tuple, kwargs: dict, operands: list[tuple[int | str, bool]]
    ) -> Any:
        """Run ``func`` (a matmul on this layer's weight, outside its forward) at its precision.

        Args:
            operands: where the matrix operands are (position or keyword), and whether each is
                this layer's weight.
        """
        self._begin_call()
        if not self.native and self.precision.swapped and self.runner is not self.module:
            raise NotRunnableError(
                f"layer {self.name!r} is {self.precision.value} but its weight is used "
                f"functionally ({getattr(func, '__name__', func)}), outside the nn.Linear its "
                "fp8 module replaces; choose bf16 or fp16 for it",
                {self.name: f"{self.precision.value}: weight used functionally"},
            )
        if not self.native:
            args, kwargs = list(args), dict(kwargs)
            for where, is_weight in operands:
                stream = "weight" if is_weight else "input"
                if isinstance(where, int):
                    args[where] = self.casts.forward_operand(args[where], stream)
                else:
                    kwargs[where] = self.casts.forward_operand(kwargs[where], stream)
            where, bias = bias_of(func, tuple(args), kwargs)
            if isinstance(bias, torch.Tensor):  # as the layer's own bias is (_swap_weights)
                rounded = self.casts.forward_operand(bias, "bias")
                if isinstance(where, int):
                    args[where] = rounded
                else:
                    kwargs[where] = rounded
            return self._round_gradient(func(*args, **kwargs))
        if self.precision.swapped:
            raise NotRunnableError(
                f"layer {self.name!r} is fp8 but its weight is used functionally "
                f"({getattr(func, '__name__', func)}), not through an nn.Linear torchao can swap; "
                "choose bf16 or fp16 for it, or use mode='emulate'",
                {self.name: "fp8: weight used functionally"},
            )
        args, kwargs, frame = native.enter_layer(
            self.precision, self.device_type, self.weight_dtype, args, kwargs
        )
        self._frames.append(frame)
        try:
            output = func(*args, **kwargs)
        except BaseException:
            native.exit_layer(self._frames.pop(), None)
            raise
        return self._exit_native(output)

    # --- guard ----------------------------------------------------------------------------------
    def counts(self) -> tuple[int, int]:
        over, under = self.casts.counts()
        return (
            over + self._folded[0] + int(self._native_overflows),
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
        if self.precision.swapped and self.runner is not self.module:
            self._unswap = True  # this call still runs in the fp8 module
        self.casts = self._casts(wider, self.casts.count)
        self.promotions.append(event)
        self._window.clear()
        self._seen_overflows = self.counts()[0]

    def _back_to_linear(self) -> None:
        """After a promotion away from fp8: the original ``nn.Linear`` runs from now on."""
        self._unswap = False
        for h in self.hooks:
            h.remove()
        self.runner = self.handle.float8.restore(self.name)
        self._hook(self.runner)

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
