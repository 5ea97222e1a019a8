"""Per-layer precision sensitivity: how much lowering one layer hurts training.

For each (layer, precision) two numbers, both against the fp32 model on the same fixed batches:

- ``loss_delta``: relative change of the loss, ``(L - L_fp32) / |L_fp32|``;
- ``grad_cosine``: cosine similarity (in float64) of the full parameter gradient to fp32's. Its
  distance ``1 - cosine`` is the primary score: it catches gradients flushed to zero (unscaled
  fp8), which the loss change misses.

Two methods:

- ``sweep``: lower exactly one layer at a time through the runtime (emulate mode) and measure:
  layers x precisions forward/backward passes on one concatenated batch, in eval mode so that
  batch-norm statistics stay fixed.
- ``taylor``: one fp32 pass that keeps each layer's input, weight and their gradients and its
  output gradient, then for each precision the rounding errors of those tensors give a
  first-order loss change ``<g, dW> + <g_x, dx>`` plus a diagonal (empirical) Fisher term
  ``1/2 sum g^2 d^2``, as NVIDIA ModelOpt's auto_quantize scores layers, and a gradient distance
  from the relative errors of the forward operands and of the output gradient (weighted by the
  share of the gradient norm that flows through that output gradient). No pass per layer.

Results are cached on disk by (model fingerprint, data key, seed and settings).
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import json
import math
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from autoprec.cache import cache_dir, read_entry, write_entry
from autoprec.kernels import ScaledCast, quantize
from autoprec.layers import model_fingerprint, tunable_layers
from autoprec.precision import Precision, parse_precision
from autoprec.pretrain import BACKOFF_SETTINGS, backoff_note, train_fp32
from autoprec.runtime import GuardConfig, apply_policy

METHODS = ("taylor", "sweep")
DEFAULT_FORMATS = ("fp32", "tf32", "bf16", "fp16", "fp8")


def grad_distance(cosine: float) -> float:
    """``1 - cosine``, never below 0: a float64 cosine of two equal gradients can round to just
    above 1 (a distance of -6.7e-16), which is no distance at all. NaN stays NaN."""
    distance = 1.0 - cosine
    return 0.0 if distance < 0.0 else distance


class Sensitivity(NamedTuple):
    """How one layer reacts to one precision (a :class:`SensitivityTable` entry)."""

    loss_delta: float  # the relative loss change with only this layer at the precision
    grad_cosine: float  # cosine of the full gradient against fp32's

    @property
    def grad_distance(self) -> float:
        """``1 - grad_cosine`` (:func:`grad_distance`)."""
        return grad_distance(self.grad_cosine)


def _indexes(table: SensitivityTable, axis: str) -> dict[str, int]:
    """``{name: position}`` along ``layers`` or ``precisions``, built once per table."""
    cache = table.__dict__.setdefault("_indexes", {})
    if axis not in cache:
        cache[axis] = {name: i for i, name in enumerate(getattr(table, axis))}
    return cache[axis]


@dataclass(frozen=True)
class SensitivityTable:
    """Sensitivities of every layer at every precision; matrices are [layer][precision]."""

    method: str
    model: str
    fingerprint: str
    data_key: str
    layers: tuple[str, ...]
    precisions: tuple[str, ...]
    loss_delta: tuple[tuple[float, ...], ...]
    grad_cosine: tuple[tuple[float, ...], ...]
    reference_loss: float
    wall_time_s: float
    settings: dict

    def distance(self, layer: str, precision: str) -> float:
        """``1 - grad_cosine`` of one layer at one precision (see :func:`grad_distance`).

        Raises:
            KeyError: the table did not grade that layer at that precision.
        """
        entry = self.entry(layer, precision)
        if entry is None:
            raise KeyError(f"no sensitivity for layer {layer!r} at {precision}")
        return entry.grad_distance

    def matrix(self, metric: str = "grad_distance") -> list[list[float]]:
        """``grad_distance`` (1 - cosine), ``grad_cosine`` or ``loss_delta``, [layer][precision]."""
        if metric == "grad_distance":
            return [[grad_distance(c) for c in row] for row in self.grad_cosine]
        if metric in ("grad_cosine", "loss_delta"):
            return [list(row) for row in getattr(self, metric)]
        raise ValueError(
            f"unknown metric {metric!r}; expected grad_distance, grad_cosine or loss_delta"
        )

    def entry(self, layer: str, precision: Precision | str) -> Sensitivity | None:
        """One layer at one precision, or None when the table did not grade that pair.

        An fp8 recipe the table did not grade reads as tensorwise fp8's entry: the same e4m3
        operands with one scale per tensor, which per-row scales (and a high-precision weight
        gradient) can only improve on, so the grade is an upper bound on its damage.
        """
        i = self._rows().get(layer)
        j = self._columns().get(str(precision))
        if j is None and parse_precision(precision).is_fp8:
            j = self._columns().get("fp8")
        if i is None or j is None:
            return None
        return Sensitivity(self.loss_delta[i][j], self.grad_cosine[i][j])

    def _rows(self) -> dict[str, int]:
        return _indexes(self, "layers")

    def _columns(self) -> dict[str, int]:
        return _indexes(self, "precisions")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> SensitivityTable:
        d = dict(d)
        for key in ("layers", "precisions"):
            d[key] = tuple(d[key])
        for key in ("loss_delta", "grad_cosine"):
            d[key] = tuple(tuple(row) for row in d[key])
        return cls(**d)


# --- helpers -----------------------------------------------------------------------------------


def _flat_grad(model: nn.Module) -> torch.Tensor:
    return torch.cat(
        [
            (p.grad if p.grad is not None else torch.zeros_like(p)).detach().flatten().double()
            for p in model.parameters()
            if p.requires_grad
        ]
    )


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """Cosine similarity; a non-finite gradient (diverged) scores 0, two zero gradients 1."""
    if not torch.isfinite(a).all():
        return 0.0
    na, nb = a.norm(), b.norm()
    if na == 0 or nb == 0:
        return 1.0 if na == nb else 0.0
    return float(torch.dot(a, b) / (na * nb))


def _loss_and_grad(model: nn.Module, spec: Any, x, y) -> tuple[float, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss = spec.loss(model(x), y)
    loss.backward()
    return float(loss.detach()), _flat_grad(model)


def _warm_start(
    model: nn.Module, spec: Any, data: Any, steps: int, lr: float, batch: int, seed: int
) -> None:
    """``steps`` fp32 SGD steps at ``lr``, backed off to a rate at which the model learns
    (:func:`autoprec.pretrain.train_fp32`; when none does, the last attempt's weights, with a
    warning: the sensitivities are then of a model that did not learn)."""
    if steps <= 0:
        return
    attempts = train_fp32(
        model,
        spec.loss,
        lambda: data.loader("train", batch_size=batch, shuffle=True, seed=seed),
        steps,
        lr,
        seed,
        strict=False,
    )
    note = backoff_note(f"the {steps}-step fp32 training before the sensitivities", attempts)
    if note is not None:
        warnings.warn(note, stacklevel=3)


def _measurement_mode(model: nn.Module) -> None:
    """Eval mode (no dropout) except batch norm, which keeps using batch statistics.

    Every measurement then sees the same function of the same batch. Batch norm on the running
    statistics of a briefly trained model can shrink activations into fp32 subnormals, which
    slows a CPU down many times over.
    """
    model.eval()
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.train()


def _round_like_runtime(t: torch.Tensor, precision: Precision, stream: str) -> torch.Tensor:
    """What the emulate runtime turns ``t`` into (fp8: scaled by its own amax, first call)."""
    fmt = precision.backward_format if stream == "grad_output" else precision.forward_format
    if precision.scaled:
        return ScaledCast(fmt)(t).dequantize()
    return quantize(t, fmt)


# --- methods -----------------------------------------------------------------------------------


def _grid(names, precisions, measure, progress):
    """Fill the [layer][precision] matrices; fp32 is the reference (no change, cosine 1)."""
    loss_delta, cosine = [], []
    for i, name in enumerate(names):
        row_l, row_c = [], []
        for p in precisions:
            if p is Precision.FP32:
                change, cos = 0.0, 1.0
            else:
                change, cos = measure(i, name, p)
                if progress:
                    progress()
            row_l.append(change)
            row_c.append(cos)
        loss_delta.append(tuple(row_l))
        cosine.append(tuple(row_c))
    return loss_delta, cosine


def _sweep(model, spec, x, y, names, precisions, ref_loss, ref_grad, progress):
    guard = GuardConfig(count=False)

    def measure(i, name, p):
        with apply_policy(model, {name: p}, mode="emulate", guard=guard):
            loss, grad = _loss_and_grad(model, spec, x, y)
        change = (loss - ref_loss) / abs(ref_loss) if math.isfinite(loss) else math.inf
        return change, _cosine(grad, ref_grad)

    return _grid(names, precisions, measure, progress)


def _taylor(model, spec, x, y, names, precisions, ref_loss, progress):
    modules = dict(tunable_layers(model))
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
        spec.loss(model(x), y).backward()
    finally:
        for h in hooks:
            h.remove()
    grad_sq = {
        n: sum(
            float(p.grad.double().pow(2).sum())
            for p in modules[n].parameters()
            if p.grad is not None
        )
        for n in names
    }
    total_sq = float(_flat_grad(model).pow(2).sum()) or 1.0
    upstream = list(itertools.accumulate(grad_sq[n] for n in names))  # execution order

    def measure(i, name, p):
        m, s = modules[name], saved[name]
        weights = [w for n, w in m.named_parameters() if "bias" not in n and w.grad is not None]
        first = second = rel_fwd = 0.0
        pairs = [(w.detach(), w.grad) for w in weights]
        if "x" in s and s["x"].grad is not None:
            pairs.append((s["x"].detach(), s["x"].grad))
        for t, g in pairs:
            d = (_round_like_runtime(t, p, "forward") - t).double()
            gd = g.double()
            first += float((gd * d).sum())
            second += 0.5 * float((gd.pow(2) * d.pow(2)).sum())
            rel_fwd += float(d.pow(2).sum() / t.double().pow(2).sum().clamp_min(1e-300))
        rel_bwd = 0.0
        if "go" in s:
            go = s["go"]
            dgo = (_round_like_runtime(go, p, "grad_output") - go).double()
            rel_bwd = float(dgo.pow(2).sum() / go.double().pow(2).sum().clamp_min(1e-300))
        distance = 0.5 * (rel_fwd + upstream[i] / total_sq * min(rel_bwd, 4.0))
        return (first + second) / abs(ref_loss), 1.0 - min(distance, 2.0)

    result = _grid(names, precisions, measure, progress)
    model.zero_grad(set_to_none=True)
    return result


def _read_table(path: Path) -> SensitivityTable:
    return SensitivityTable.from_dict(json.loads(path.read_text()))


def sensitivity(
    spec: Any,
    data: Any,
    formats: Sequence[str] = DEFAULT_FORMATS,
    batches: int = 4,
    *,
    batch_size: int = 8,
    method: str = "sweep",
    train_steps: int = 30,
    lr: float = 0.05,
    seed: int = 0,
    cache: bool = True,
    progress: Callable[[], None] | None = None,
    initial_state: Mapping[str, torch.Tensor] | None = None,
    initial_state_key: str | None = None,
) -> SensitivityTable:
    """Grade every tunable layer's need for precision.

    Args:
        spec: a ModelSpec (``module``, ``name``, ``loss``); its module is not modified (a copy
            is trained briefly in fp32 first).
        data: a DataBundle (``loader``, ``fixed_batches``, ``key``).
        formats: precisions to grade (fp32 is the reference and scores 0).
        batches: how many fixed batches of ``batch_size`` to measure on (one concatenated pass).
        method: ``"sweep"`` (one pass per layer and precision) or ``"taylor"`` (one pass).
        train_steps: fp32 SGD steps before measuring, so gradients look like training's.
        cache: reuse/store the result under ``$AUTOPREC_CACHE_DIR`` (default ~/.cache/autoprec).
        progress: called once per (layer, precision) measured.
        initial_state: weights to load into the copy before the ``train_steps`` (e.g. the
            evaluator's fp32 warm start, with ``train_steps=0``, so that the sensitivities
            describe the very model the evaluations fine-tune).
        initial_state_key: a name for ``initial_state`` in the cache key (required with it
            when ``cache`` is on: the fingerprint covers the architecture, not the weights).
    """
    if method not in METHODS:
        raise ValueError(
            f"unknown sensitivity method {method!r}; expected one of {', '.join(METHODS)}"
        )
    precisions = tuple(parse_precision(f) for f in formats)
    fingerprint = model_fingerprint(spec.module)
    settings = {
        "method": method,
        "formats": [p.value for p in precisions],
        "batches": batches,
        "batch_size": batch_size,
        "train_steps": train_steps,
        "lr": lr,
        "seed": seed,
    }
    if train_steps > 0:
        settings["backoff"] = BACKOFF_SETTINGS
    if initial_state is not None:
        if cache and not initial_state_key:
            raise ValueError("initial_state needs an initial_state_key when cache=True")
        settings["initial_state"] = initial_state_key
    key = hashlib.sha256(
        json.dumps([fingerprint, data.key, settings], sort_keys=True).encode()
    ).hexdigest()[:24]
    path = cache_dir() / "sensitivity" / f"{key}.json"
    if cache:  # a damaged entry is discarded with a note, and recomputed
        table = read_entry(path, _read_table, "sensitivity cache entry")
        if table is not None:
            return table

    start = time.perf_counter()
    torch.manual_seed(seed)
    model = copy.deepcopy(spec.module)
    if initial_state is not None:
        model.load_state_dict(initial_state)
    _warm_start(model, spec, data, train_steps, lr, batch_size, seed)
    _measurement_mode(model)
    fixed = data.fixed_batches(batches, batch_size, split="train", seed=seed)
    x = torch.cat([b[0] for b in fixed])
    y = torch.cat([b[1] for b in fixed])
    names = [n for n, _ in tunable_layers(model)]
    ref_loss, ref_grad = _loss_and_grad(model, spec, x, y)
    if method == "sweep":
        loss_delta, cosine = _sweep(
            model, spec, x, y, names, precisions, ref_loss, ref_grad, progress
        )
    else:
        loss_delta, cosine = _taylor(model, spec, x, y, names, precisions, ref_loss, progress)
    table = SensitivityTable(
        method=method,
        model=getattr(spec, "name", type(spec.module).__name__),
        fingerprint=fingerprint,
        data_key=data.key,
        layers=tuple(names),
        precisions=tuple(p.value for p in precisions),
        loss_delta=tuple(loss_delta),
        grad_cosine=tuple(cosine),
        reference_loss=ref_loss,
        wall_time_s=time.perf_counter() - start,
        settings=settings,
    )
    if cache:
        write_entry(path, lambda fh: json.dump(table.to_dict(), fh), what="sensitivity cache entry")
    return table
