"""``apply_policy``: run each layer of a model at the precision a policy gives it.

Two modes:

- ``emulate`` (any device): forward hooks round a layer's input(s) and weight(s) to its
  precision's format before the layer's own fp32 computation, and round the gradient with
  respect to its output in backward. Arithmetic accumulates in fp32, as tensor cores do; master
  weights stay fp32 (the rounded weight is a temporary that autograd differentiates straight
  through to the fp32 parameter).
- ``native``: the program the cost model prices (:mod:`.native`): one ``torch.autocast``
  region over the model's forward, in which low-precision activations flow from layer to layer
  and are cast once at each boundary; per-layer exceptions for layers of the other 16-bit dtype
  (a nested autocast) and fp32/tf32 layers (autocast off, TF32 switches set for their forward
  and backward); fp8 ``nn.Linear`` layers swapped for torchao ``Float8Linear`` modules. A
  precision the local device cannot run natively (:mod:`autoprec.hardware.runnability`) is
  refused with :class:`~autoprec.hardware.runnability.NotRunnableError`.

In both modes a weight used functionally (``F.linear(x, self.qkv.weight)``, as torchvision's
Swin does) is covered too (:mod:`.functional`). ``auto`` picks native on CUDA and emulate
elsewhere. Everything is undone by ``handle.remove()``: the hooks go, the modules and parameters
are the very same objects, and the model's outputs and ``state_dict`` are as before.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

from autoprec._text import excerpt
from autoprec.hardware.program import region_of
from autoprec.hardware.runnability import NotRunnableError
from autoprec.policy import PATTERN_PREFIX, TARGET_MODES, PrecisionPolicy, resolve_mode
from autoprec.precision import Precision
from autoprec.runtime import grouped, native
from autoprec.runtime.functional import WeightUseMode
from autoprec.runtime.handle import Removable
from autoprec.runtime.layer import LayerStats, ManagedLayer

if TYPE_CHECKING:
    from autoprec.policy.precision_policy import PolicyLike

__all__ = [
    "apply_policy",
    "PolicyHandle",
    "LayerStats",
    "GuardConfig",
    "RuntimeStateError",
    "MODES",
]

MODES = TARGET_MODES
_LOW = (torch.bfloat16, torch.float16)
_applied: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()


class RuntimeStateError(RuntimeError):
    """The model is already under a policy, or the handle was already removed."""


@dataclass(frozen=True)
class GuardConfig:
    """Overflow guard settings.

    Args:
        count: count overflows and underflows per layer (emulate mode: two reductions per cast;
            native mode: the non-finite values of each layer's output and output gradient).
        promote_after: promote a layer to the next wider precision once this many of its last
            ``window`` forward calls (each with the backward that followed) saw an overflow;
            None turns promotion off. In native mode the promoted layer runs its new dtype's rule.
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


class _Region:
    """Root hooks: the functional-weight mode (both modes) and, in native mode, the autocast
    region over the model's forward, whose low-precision outputs return as fp32."""

    def __init__(self, handle: PolicyHandle, device_type: str) -> None:
        self.handle = handle
        self.device_type = device_type
        self.depth = 0
        self.open: list[Any] = []
        model = handle.model
        self.hooks = [
            model.register_forward_pre_hook(self.enter, prepend=True),
            model.register_forward_hook(self.exit, always_call=True),
        ]

    def enter(self, module: nn.Module, args: tuple) -> None:
        self.depth += 1
        if self.depth > 1:
            return
        if self.handle.mode == "native":
            dtype = native.region_dtype(self.handle.precisions().values())
            if dtype is not None:
                context = torch.autocast(self.device_type, dtype=dtype)
                context.__enter__()
                self.open.append(context)
        mode = WeightUseMode(self.handle.weight_owners)
        mode.__enter__()
        self.open.append(mode)

    def exit(self, module: nn.Module, args: tuple, output: Any) -> Any:
        self.depth -= 1
        if self.depth > 0:
            return output
        had_region = len(self.open) == 2
        while self.open:
            self.open.pop().__exit__(None, None, None)
        if had_region:  # the model hands fp32 on, as autocast's fp32-listed loss functions see it
            output = tree_map_only(
                torch.Tensor, lambda t: t.float() if t.dtype in _LOW else t, output
            )
        return output

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()


class PolicyHandle(Removable):
    """The result of :func:`apply_policy`: read stats, then ``remove()`` to undo everything.

    Also a context manager: ``with apply_policy(model, policy): ...`` removes on exit.
    """

    def __init__(self, model: nn.Module, mode: str, guard: GuardConfig) -> None:
        self.model = model
        self.mode = mode
        self.guard = guard
        self.layers: dict[str, ManagedLayer] = {}
        self.guards: dict[str, ManagedLayer] = {}  # native: unlisted tunable layers held at fp32
        self.weight_owners: dict[int, ManagedLayer] = {}
        self.float8: native.Float8Swap | None = None
        self.region: _Region | None = None
        self.region_format: str | None = None  # the autocast region's format (bf16, fp16)
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
        """Take every hook off, put swapped modules back and give the layers their parameters."""
        if self.removed:
            return
        if self.region is not None:
            self.region.remove()
        for layer in (*self.layers.values(), *self.guards.values()):
            layer.remove()
            _applied.pop(layer.module, None)
            _applied.pop(layer.runner, None)
        if self.float8 is not None:
            self.float8.restore_all()
        self.weight_owners = {}
        self.removed = True

    def __repr__(self) -> str:
        state = "removed" if self.removed else f"{len(self.layers)} layers"
        return f"PolicyHandle(mode={self.mode!r}, {state})"

    def emulated_float8(self, name: str, module: nn.Module, precision: Precision) -> nn.Module:
        """Emulate mode's stand-in for layer ``name``, an fp8-recipe or block-scaled Linear
        (:mod:`.float8_emulate`, :mod:`.block_emulate`).

        Raises:
            NotRunnableError: the layer is not an ``nn.Linear``.
        """
        from autoprec.runtime.block_emulate import EmulatedBlockFP8Linear, EmulatedNVFP4Linear
        from autoprec.runtime.float8_emulate import (
            EmulatedFloat8Linear,
            EmulatedMXLinear,
            RecipeCasts,
        )

        if grouped.runs_grouped(module, precision):  # fused experts: grouped GEMMs (.grouped)
            return grouped.EmulatedExperts(module, precision, self.region_format, self.guard.count)
        if not isinstance(module, nn.Linear):
            raise NotRunnableError(
                f"{precision.value} runs on nn.Linear layers, not on a "
                f"{type(module).__name__}; choose fp8 (tensorwise) or a 16-bit precision for it",
            )
        if precision.is_mx:
            return EmulatedMXLinear.from_linear(module, self.region_format)
        if precision is Precision.NVFP4:
            return EmulatedNVFP4Linear.from_linear(module, name, self.region_format)
        if precision is Precision.FP8_BLOCK:
            return EmulatedBlockFP8Linear.from_linear(module, self.region_format)
        casts = RecipeCasts(precision, self.guard.count, self.region_format)
        return EmulatedFloat8Linear.from_linear(module, casts)

    def _manage(self, name: str, module: nn.Module, precision: Precision, listed: bool) -> None:
        runner = None
        if self.float8 is not None:
            runner = self.float8.runners.get(name)
        layer = ManagedLayer(name, module, precision, self, runner=runner)
        (self.layers if listed else self.guards)[name] = layer
        for _, param in layer.weight_slots_params():
            self.weight_owners.setdefault(id(param), layer)
        _applied[module] = f"handle {id(self):#x}"
        _applied[layer.runner] = _applied[module]


def resolve_layers(model: nn.Module, policy: PolicyLike) -> dict[str, Precision]:
    """The layers ``policy`` puts under the runtime; a mapping (read as
    :meth:`PrecisionPolicy.coerce` reads it) puts only those it names, exactly or by pattern."""
    coerced = PrecisionPolicy.coerce(policy)
    if isinstance(policy, PrecisionPolicy):
        check_made_for(model, policy)
    if not isinstance(policy, Mapping):
        return coerced.resolve(model)
    modules = dict(model.named_modules())
    missing = [n for n in coerced.layers if not n.startswith(PATTERN_PREFIX) and n not in modules]
    if missing:
        shown = ", ".join(excerpt(n, quote=False) for n in missing[:3])
        more = f" and {len(missing) - 3:,} more" if len(missing) > 3 else ""
        raise ValueError(f"policy names layers the model does not have: {shown}{more}")
    return coerced.resolve(model, named_only=True)


def check_made_for(model: nn.Module, policy: PrecisionPolicy) -> None:
    """Raise :class:`~autoprec.policy.PolicyMismatchError` if ``policy`` names a layer
    ``model`` does not have (an exact name; a pattern that matches nothing is allowed, as in a
    mapping) or records another model's fingerprint: the policy was made for another model
    (:meth:`PrecisionPolicy.validate`, the check ``autoprec train`` makes)."""
    report = policy.validate(model)
    exact = [(k, hints) for k, hints in report.unmatched if not k.startswith(PATTERN_PREFIX)]
    if exact or report.fingerprint:
        report = dataclasses.replace(report, unmatched=exact)
        raise report.error(policy, type(model).__name__)


def model_device_type(model: nn.Module) -> str:
    param = next(model.parameters(), None)
    return param.device.type if param is not None else "cpu"


def _pick_mode(model: nn.Module, mode: str) -> str:
    return resolve_mode(mode, model_device_type(model))


def apply_policy(
    model: nn.Module,
    policy: PolicyLike,
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
        NotRunnableError: (native mode) a layer's precision does not run natively on the local
            device (fp8 on a convolution, a Linear whose features torchao rejects, ...).
        ValueError: unknown mode, precision, or a layer name the model does not have;
            :class:`~autoprec.policy.PolicyMismatchError` for a loaded policy that names
            layers the model lacks or records another model's fingerprint.

    Example:
        >>> handle = apply_policy(model, {"fc": "bf16"}, mode="emulate")
        >>> loss_fn(model(x), y).backward()
        >>> handle.stats()["fc"].overflows
        0
        >>> handle.remove()
    """
    from autoprec.layers import tunable_layers

    if isinstance(model, nn.parallel.DistributedDataParallel):
        model = model.module
    guard = guard or GuardConfig()
    mode = _pick_mode(model, mode)
    precisions = resolve_layers(model, policy)
    modules = dict(model.named_modules())
    busy = [n for n in precisions if modules[n] in _applied]
    if busy:
        raise RuntimeStateError(
            f"layer {busy[0]!r} is already under a policy ({_applied[modules[busy[0]]]}); "
            "call remove() on the earlier handle before applying another policy"
        )
    device_type = model_device_type(model)
    handle = PolicyHandle(model, mode, guard)
    handle.region_format = region_of(precisions)
    unlisted: dict[str, nn.Module] = {}
    device = native.local_device(device_type)
    grouped.check_experts({n: (modules[n], p) for n, p in precisions.items()}, mode, device.name)
    if mode == "native":
        native.check_native(
            {n: (modules[n], p) for n, p in precisions.items()}, device, device_type
        )
        unlisted = {
            n: m for n, m in tunable_layers(model) if n not in precisions and m not in _applied
        }
        fp8 = {n: p for n, p in precisions.items() if p.swapped}
        if fp8:
            handle.float8 = native.Float8Swap(model, fp8)
    else:  # the rowwise recipes and the block formats cast per GEMM: an emulating module
        recipes = {
            n: p
            for n, p in precisions.items()
            if (p.swapped and p is not Precision.FP8) or grouped.runs_grouped(modules[n], p)
        }
        if recipes:
            handle.float8 = native.Float8Swap(model, recipes, build=handle.emulated_float8)
    for name, precision in precisions.items():
        handle._manage(name, modules[name], precision, listed=True)
    for name, module in unlisted.items():
        handle._manage(name, module, Precision.FP32, listed=False)
    if handle.layers:
        handle.region = _Region(handle, device_type)
    return handle
