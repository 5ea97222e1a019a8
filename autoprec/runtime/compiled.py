"""``compile_policy``: native mode's program in a form ``torch.compile`` traces.

Native mode (:mod:`.native`) opens its autocast contexts in forward hooks, and ``torch.compile``
cannot trace a context entered in one hook and left in another (on an H200: ``AttributeError:
'autocast' object has no attribute 'prev'``, docs/benchmarks.md, ``gpu_validate``). Yet fp8
training pays only compiled: there torchao fuses its scaling into the neighbouring kernels
(Llama3-8B widths on the H200: eager fp8 0.69x of all-bf16, compiled 1.27x).

The policies production fp8 training runs, one 16-bit format with fp8 Linears (torchao's
auto-filter, the searched exports of ``autoprec search --train-shape``), need no per-layer
hooks: the program is the model's forward inside one ``torch.autocast`` region of that format
(its low-precision outputs handed on as fp32, as native mode's region does), with each fp8
layer a torchao ``Float8Linear`` (native's :class:`~.native.Float8Swap`, each layer's recipe)
that takes its input in the region's dtype, autocast off (native's rule for fp8 layers). That
is native mode's program, written as plain ``forward`` functions that compile. Layers at fp32,
tf32, the other 16-bit format or MX formats need native mode's per-layer rules; such a policy
is refused. There is no overflow guard (no per-layer counts, no promotion).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

from autoprec.hardware.program import region_of
from autoprec.precision import Precision
from autoprec.runtime import native
from autoprec.runtime.handle import Removable

if TYPE_CHECKING:
    from autoprec.policy.precision_policy import PolicyLike

__all__ = ["CompiledPolicy", "NotCompilableError", "check_compilable", "compile_policy"]


class NotCompilableError(ValueError):
    """The policy needs native mode's per-layer rules, which ``torch.compile`` cannot trace."""


_LOW = tuple(native.LOW_DTYPES.values())


def _region_forward(forward: Callable, device_type: str, dtype: torch.dtype, *args, **kwargs):
    with torch.autocast(device_type, dtype=dtype):
        out = forward(*args, **kwargs)
    return tree_map_only(torch.Tensor, lambda t: t.float() if t.dtype in _LOW else t, out)


def _fp8_forward(forward: Callable, device_type: str, dtype: torch.dtype, x, *args, **kwargs):
    with torch.autocast(device_type, enabled=False):
        return forward(native.cast_floating(x, dtype), *args, **kwargs)


class CompiledPolicy(Removable):
    """What :func:`compile_policy` did to a model; ``remove()`` undoes it (the same modules and
    parameters, the model's own ``forward``, not compiled). Also a context manager."""

    def __init__(self, model: nn.Module, region: str | None, fp8: dict[str, Precision]) -> None:
        self.model = model
        self.region = region
        self.fp8 = fp8
        self.swap: native.Float8Swap | None = None
        self.wrapped: list[tuple[nn.Module, Any]] = []  # (module, its forward before)
        self.removed = False

    def totals(self) -> dict[str, int]:
        """As :meth:`PolicyHandle.totals`; nothing is counted in a compiled program."""
        return {"overflows": 0, "underflows": 0, "promotions": 0}

    def remove(self) -> None:
        """Put the model back as it was."""
        if self.removed:
            return
        for module, before in reversed(self.wrapped):
            if before is None:
                del module.__dict__["forward"]
            else:  # a root Linear swapped in place: Float8Swap's own forward
                module.forward = before
        if self.swap is not None:
            for name in list(self.swap.originals):
                self.swap.restore(name)
        self.model._compiled_call_impl = None  # nn.Module.compile's in-place state
        self.removed = True


def check_compilable(model: nn.Module, policy: PolicyLike) -> dict[str, Precision]:
    """Each tunable layer's precision under ``policy`` (layers a mapping does not name: fp32,
    as native mode holds them).

    Raises:
        NotCompilableError: a layer is neither fp8 nor at the policy's one 16-bit format.
    """
    from autoprec.layers import tunable_layers
    from autoprec.runtime.apply import resolve_layers

    listed = resolve_layers(model, policy)
    precisions = {n: listed.get(n, Precision.FP32) for n, _ in tunable_layers(model)}
    region = region_of(precisions)
    odd = {n: p.value for n, p in precisions.items() if not p.is_fp8 and p.value != region}
    if odd:
        names = ", ".join(f"{n} ({p})" for n, p in list(odd.items())[:3])
        raise NotCompilableError(
            f"a compiled program runs one 16-bit format ({region or 'none here'}) and fp8 "
            f"layers; {len(odd)} layer(s) need native mode's per-layer rules: {names}"
        )
    return precisions


def compile_policy(model: nn.Module, policy: PolicyLike, *, compile: bool = True, **options: Any):
    """Run ``policy``'s native program on ``model`` in a form ``torch.compile`` traces (see
    the module docstring), and compile the model in place (``model.compile(**options)``)
    unless ``compile`` is False.

    Args:
        model: the model (a ``DistributedDataParallel`` wrapper is looked through).
        policy: a :class:`~autoprec.PrecisionPolicy`, a ``{layer: precision}`` map or one
            precision, as :func:`~autoprec.runtime.apply_policy` takes it.
        compile: whether to compile; False gives the same program eagerly.
        options: ``torch.compile`` options (``mode``, ``dynamic``, ...).

    Returns:
        A :class:`CompiledPolicy`; ``remove()`` restores the model.

    Raises:
        NotCompilableError: a tunable layer is neither fp8 nor at the policy's one 16-bit
            format (one line naming the formats and the first layers).
        NotRunnableError: a precision the local device cannot run natively.
    """
    from autoprec.runtime.apply import model_device_type

    if isinstance(model, nn.parallel.DistributedDataParallel):
        model = model.module
    precisions = check_compilable(model, policy)
    modules = dict(model.named_modules())
    device_type = model_device_type(model)
    native.check_native(
        {n: (modules[n], p) for n, p in precisions.items()},
        native.local_device(device_type),
        device_type,
    )
    region = region_of(precisions)
    fp8 = {n: p for n, p in precisions.items() if p.is_fp8}
    handle = CompiledPolicy(model, region, fp8)
    if fp8:
        handle.swap = native.Float8Swap(model, fp8)
    if region is not None:
        dtype = native.LOW_DTYPES[Precision(region)]
        runners = [m for m in handle.swap.runners.values() if m is not model] if fp8 else []
        for module, wrap in [*((r, _fp8_forward) for r in runners), (model, _region_forward)]:
            handle.wrapped.append((module, module.__dict__.get("forward")))
            module.forward = functools.partial(wrap, module.forward, device_type, dtype)
    if compile:
        model.compile(**options)
    return handle
