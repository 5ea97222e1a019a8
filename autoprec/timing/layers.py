"""The per-layer table: each unique layer of the production model, timed alone with its casts.

A model has few distinct layers (a Llama a handful of Linear shapes, repeated per block), so the
table times each unique one once: the layer's type and configuration (``extra_repr``) with the
shape of its input at the production batch (:func:`unique_layers`, shapes read by running the
model on the ``meta`` device, which allocates nothing). For each precision the device runs on
that layer, :class:`LayerTimings` measures, forward and backward:

- ``alone``: the layer alone under the policy ``{layer: precision}``, as production runs it
  (``compiled``: :func:`~autoprec.runtime.compile_policy` under ``torch.compile``; ``eager``:
  native mode), an fp32 input in and an fp32 output out, so its casts at both ends included;
- ``cast_in`` and ``cast_out``: the cast of its input to the precision's 16-bit dtype and of its
  output back, alone (what a layer saves when its neighbours share its dtype).

Timings are medians after warm-up (:func:`autoprec._clock.median_seconds`), kept on disk per
device and software version (:class:`~autoprec.timing.store.TimingStore`): a second search on
the same machine measures nothing. A layer that cannot be timed alone (an exception) is kept as
an error; its precision is then priced from the finalists' whole steps only.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from autoprec._clock import Clock, median_seconds
from autoprec.cache import digest
from autoprec.precision import Precision, parse_precision
from autoprec.timing.step import check_execution, failure, materialize
from autoprec.timing.store import TimingStore

if TYPE_CHECKING:  # pragma: no cover
    from autoprec._periodic import Progress
    from autoprec.models import ModelSpec

__all__ = ["LayerSite", "LayerTimings", "io_dtype", "unique_layers"]

LAYER_WARMUP = 3
LAYER_REPEATS = 7
_IO = {Precision.BF16: torch.bfloat16, Precision.FP16: torch.float16}


def io_dtype(precision: Precision) -> torch.dtype | None:
    """The dtype a layer of ``precision`` hands its neighbours in native mode's region (bf16,
    fp16), None for the rest (fp32 in and out)."""
    return _IO.get(precision)


@dataclass(frozen=True)
class LayerSite:
    """One unique layer of the production model.

    Attributes:
        key: a digest of its type, configuration and input shape (the table's key).
        names: every tunable layer that is this one (the first timed).
        inputs: the shape and dtype of each tensor argument of its first call.
        output: the shape of its output.
    """

    key: str
    names: tuple[str, ...]
    inputs: tuple[tuple[tuple[int, ...], str], ...]
    output: tuple[int, ...]


def _shapes(module: nn.Module, names: list[str], x: torch.Tensor) -> dict[str, tuple]:
    """``{layer: (input tensors' (shape, dtype), output shape)}`` of each layer's first call."""
    seen: dict[str, tuple] = {}
    hooks = []
    modules = dict(module.named_modules())
    for name in names:

        def hook(mod: nn.Module, args: tuple, out: Any, name: str = name) -> None:
            if name in seen or not isinstance(out, torch.Tensor):
                return
            ins = tuple(
                (tuple(a.shape), str(a.dtype).removeprefix("torch."))
                for a in args
                if isinstance(a, torch.Tensor)
            )
            seen[name] = (ins, tuple(out.shape))

        hooks.append(modules[name].register_forward_hook(hook))
    try:
        with torch.no_grad():
            module(x)
    finally:
        for h in hooks:
            h.remove()
    return seen


def unique_layers(spec: ModelSpec, batch_size: int) -> list[LayerSite]:
    """The unique tunable layers of ``spec`` at ``batch_size``, in execution order (see the
    module docstring). Shapes come from a forward pass on the ``meta`` device; a model whose
    forward the meta device cannot run is run on the CPU at batch 1 and its shapes scaled."""
    from autoprec.layers import tunable_layers

    names = [n for n, _ in tunable_layers(spec.module)]
    x, _ = spec.example_batch(1)
    try:
        model = copy.deepcopy(spec.module).to("meta")
        xs = x.to("meta").expand(batch_size, *x.shape[1:])
        seen = _shapes(model, names, xs)
    except Exception:  # noqa: BLE001 - an op without a meta kernel: measure at batch 1
        seen = {
            n: (tuple(((batch_size, *s[1:]), d) for s, d in ins), (batch_size, *out[1:]))
            for n, (ins, out) in _shapes(spec.module, names, x).items()
        }
    modules = dict(spec.module.named_modules())
    sites: dict[str, list] = {}
    for name in names:
        if name not in seen:  # never called with a tensor result (its weight used elsewhere)
            continue
        ins, out = seen[name]
        mod = modules[name]
        key = digest([type(mod).__name__, mod.extra_repr(), ins])
        sites.setdefault(key, [[], ins, out])[0].append(name)
    return [LayerSite(k, tuple(v[0]), v[1], v[2]) for k, v in sites.items()]


class _Alone(nn.Module):
    """A container of one layer, so that a policy names it ``layer``."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return self.layer(*args)


def _tensor(shape: tuple[int, ...], dtype: str, dev: torch.device, layout: str) -> torch.Tensor:
    kind = getattr(torch, dtype)
    if kind.is_floating_point:
        t = torch.randn(shape, device=dev, dtype=kind, requires_grad=False)
    else:
        t = torch.zeros(shape, device=dev, dtype=kind)
    if layout == "channels_last" and t.dim() == 4:
        t = t.contiguous(memory_format=torch.channels_last)
    return t.requires_grad_(kind.is_floating_point)


class LayerTimings:
    """The per-layer table of one production model on the local device.

    Args:
        spec: the production model (its module's layers are copied, not changed).
        batch_size: the production batch.
        device: the device's database name (the store's file).
        torch_device: where it runs.
        execution: ``"compiled"`` or ``"eager"``.
        memory_format: ``"channels_last"`` or ``"contiguous"`` (inputs of 4-d layers).
        store: where timings are kept; None: the default :class:`TimingStore`.

    Example:
        >>> table = LayerTimings(load_model("mlp"), 32, "cpu")  # doctest: +SKIP
        >>> table.measure({"fc1": ["fp32", "bf16"]})  # doctest: +SKIP
        >>> table.alone("fc1", "bf16") > 0  # doctest: +SKIP
        True
    """

    def __init__(
        self,
        spec: ModelSpec,
        batch_size: int,
        device: str,
        torch_device: torch.device | str = "cpu",
        execution: str = "eager",
        memory_format: str = "contiguous",
        store: TimingStore | None = None,
    ) -> None:
        self.spec = spec
        self.batch_size = batch_size
        self.execution = check_execution(execution)
        self.memory_format = memory_format
        self.torch_device = torch.device(torch_device)
        self.store = store if store is not None else TimingStore(device, self.torch_device)
        self.sites = unique_layers(spec, batch_size)
        self.site_of = {name: site for site in self.sites for name in site.names}
        self.measured = 0  # timings taken by this instance (stored ones do not count)

    def _key(self, site: LayerSite, precision: Precision) -> str:
        return f"layer:{site.key}|{precision.value}|{self.execution}|{self.memory_format}"

    def key(self, name: str, precision: str | Precision) -> str | None:
        """The store's key of layer ``name`` in ``precision`` (None: not a timed layer)."""
        site = self.site_of.get(name)
        return None if site is None else self._key(site, parse_precision(precision))

    def entry(self, name: str, precision: str | Precision) -> dict[str, Any] | None:
        """The stored timing of layer ``name`` in ``precision`` (None: not measured)."""
        key = self.key(name, precision)
        return None if key is None else self.store.get(key)

    def _seconds(self, name: str, precision: str | Precision, field: str) -> float:
        entry = self.entry(name, precision)
        if entry is None or entry.get("error"):
            return math.nan
        return float(entry[field])

    def alone(self, name: str, precision: str | Precision) -> float:
        """Seconds of layer ``name`` alone in ``precision``, forward and backward, its casts
        included; NaN when not measured or not runnable alone."""
        return self._seconds(name, precision, "alone_s")

    def cast_in(self, name: str, precision: str | Precision) -> float:
        """Seconds of the cast of its input to ``precision``'s dtype and back (the gradient);
        0 for a precision that takes fp32."""
        return self._seconds(name, precision, "cast_in_s")

    def cast_out(self, name: str, precision: str | Precision) -> float:
        """Seconds of the cast of its output from ``precision``'s dtype, and of the gradient."""
        return self._seconds(name, precision, "cast_out_s")

    def missing(self, choices: Mapping[str, Iterable[str | Precision]]) -> list[tuple]:
        """``(site, precision)`` pairs of ``{layer: precisions}`` not in the store yet."""
        out: dict[tuple[str, Precision], tuple] = {}
        for name, precisions in choices.items():
            site = self.site_of.get(name)
            if site is None:
                continue
            for p in map(parse_precision, precisions):
                if self._key(site, p) not in self.store:
                    out[(site.key, p)] = (site, p)
        return list(out.values())

    def measure(
        self, choices: Mapping[str, Iterable[str | Precision]], progress: Progress | None = None
    ) -> int:
        """Time every layer of ``{layer: precisions}`` in each of its precisions not stored
        yet (fp32 always); ``progress("layers x precisions", done, total)`` after each. Returns
        how many were timed."""
        from autoprec.precision import Precision as P

        wanted = {n: [P.FP32, *map(parse_precision, ps)] for n, ps in choices.items()}
        todo = self.missing(wanted)
        for done, (site, precision) in enumerate(todo, 1):
            self.store.put(self._key(site, precision), self._time(site, precision))
            self.measured += 1
            if progress is not None:
                progress("layers x precisions", done, len(todo))
        return len(todo)

    # --- the programs timed -----------------------------------------------------------------
    def _time(self, site: LayerSite, precision: Precision) -> dict[str, Any]:
        """``{"alone_s", "cast_in_s", "cast_out_s"}`` of ``site`` in ``precision``, or
        ``{"error": why}``."""
        clock = Clock(self.torch_device)
        try:
            alone = self._alone(site, precision, clock)
            dtype = io_dtype(precision)
            if dtype is None:
                cast_in = cast_out = 0.0
            else:
                (shape, _), *_ = site.inputs
                cast_in = self._cast(shape, torch.float32, dtype, clock)
                cast_out = self._cast(site.output, dtype, torch.float32, clock)
            return {"alone_s": alone, "cast_in_s": cast_in, "cast_out_s": cast_out}
        except Exception as err:  # noqa: BLE001 - one layer that cannot run alone is noted
            return {"error": failure(err)}
        finally:
            if self.torch_device.type == "cuda":
                torch.cuda.empty_cache()

    def _compiled(self, fn: Callable) -> Callable:
        return torch.compile(fn) if self.execution == "compiled" else fn

    def _alone(self, site: LayerSite, precision: Precision, clock: Clock) -> float:
        from autoprec.policy import PrecisionPolicy
        from autoprec.runtime import apply_policy
        from autoprec.runtime.compiled import compile_policy

        layer = dict(self.spec.module.named_modules())[site.names[0]]
        box = _Alone(materialize(layer, self.torch_device))
        if self.memory_format == "channels_last" and any(len(s) == 4 for s, _ in site.inputs):
            box = box.to(memory_format=torch.channels_last)
        policy = PrecisionPolicy(layers={"layer": precision})
        if self.execution == "compiled":
            handle = compile_policy(box, policy)
        else:
            handle = apply_policy(box, policy, mode="native")
        try:
            args = [_tensor(s, d, self.torch_device, self.memory_format) for s, d in site.inputs]
            grad = torch.ones(site.output, device=self.torch_device)
            params = list(box.parameters())

            def step() -> None:
                for t in (*params, *args):
                    t.grad = None
                box(*args).float().backward(grad)

            return median_seconds(step, clock, LAYER_WARMUP, LAYER_REPEATS)
        finally:
            handle.remove()

    def _cast(
        self, shape: tuple[int, ...], source: torch.dtype, dtype: torch.dtype, clock: Clock
    ) -> float:
        x = torch.randn(shape, device=self.torch_device, dtype=source, requires_grad=True)
        grad = torch.ones(shape, device=self.torch_device, dtype=dtype)
        cast = self._compiled(lambda t: t.to(dtype))

        def step() -> None:
            x.grad = None
            cast(x).backward(grad)

        return median_seconds(step, clock, LAYER_WARMUP, LAYER_REPEATS)
