"""Per-layer precision sensitivity: how much lowering one layer hurts training.

For each (layer, precision) two numbers, both against the fp32 model on the same fixed batches:

- ``loss_delta``: relative change of the loss, ``(L - L_fp32) / |L_fp32|``;
- ``grad_cosine``: cosine similarity (in float64) of the full parameter gradient to fp32's. Its
  distance ``1 - cosine`` is the primary score: it catches gradients flushed to zero (unscaled
  fp8), which the loss change misses.

Methods (:mod:`autoprec.sensitivities.budget` predicts their cost and picks one for ``auto``):

- ``sweep``: lower exactly one layer at a time through the runtime (emulate mode) and measure:
  layers x precisions forward/backward passes on one concatenated batch, in eval mode so that
  batch-norm statistics stay fixed.
- ``taylor``: one fp32 pass that keeps each layer's input, weight and their gradients and its
  output gradient, then for each precision the rounding errors of those tensors give a
  first-order loss change ``<g, dW> + <g_x, dx>`` plus a diagonal (empirical) Fisher term
  ``1/2 sum g^2 d^2``, as NVIDIA ModelOpt's auto_quantize scores layers, and a gradient distance
  from the relative errors of the forward operands and of the output gradient (weighted by the
  share of the gradient norm that flows through that output gradient). No pass per layer.
- ``focused``: the sweep of as many layers as the time budget allows, taken in turn from each
  role in the model's repeated blocks (``blocks.#.mlp.fc#``) and spread over the depth, the
  others interpolated over depth between the swept layers of their role
  (:func:`autoprec.sensitivities.budget.fill`); ``SensitivityTable.measured`` says which rows were
  measured.
- ``auto``: the sweep if it fits the budget, else the focused sweep, else the estimate.

Results are cached on disk by (model fingerprint, data key, seed and settings, the method and
budget asked for among them; ``auto`` first looks for a cached full sweep).
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from autoprec._periodic import Progress
from autoprec.cache import cache_dir, read_entry, write_entry
from autoprec.layers import model_fingerprint
from autoprec.precision import Precision, parse_precision
from autoprec.sensitivities.budget import (
    DEFAULT_TIME_BUDGET_S,
    Costs,
    Row,
    SensitivityPlan,
    check_budget,
    check_method,
    fill,
    plan,
    priority,
    warm_up_steps,
)
from autoprec.sensitivities.measure import Measurer, row
from autoprec.training.pretrain import BACKOFF_SETTINGS, MAX_BACKOFFS, backoff_note, train_fp32

if TYPE_CHECKING:
    from autoprec.data import DataBundle
    from autoprec.models import ModelSpec

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
    """Sensitivities of every layer at every precision; matrices are [layer][precision].

    ``method`` is what ran (``sweep``, ``taylor`` or ``focused``); ``settings["method"]`` what
    was asked (``auto`` among them). ``measured`` marks, per layer, a row swept (True) or
    estimated (False); empty means every row came from ``method`` (see :meth:`is_measured`).
    ``note`` says why the method was chosen, for ``auto`` and ``focused``.
    """

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
    measured: tuple[bool, ...] = ()
    note: str = ""

    def is_measured(self, layer: str) -> bool:
        """Whether ``layer``'s row was swept (measured) rather than estimated.

        Raises:
            KeyError: the table has no such layer.
        """
        i = self._rows()[layer]
        return self.measured[i] if self.measured else self.method == "sweep"

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
        """One layer at one precision, or None when the table did not grade that pair (nor
        could: the runtime does not run that layer at that precision).

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
        entry = Sensitivity(self.loss_delta[i][j], self.grad_cosine[i][j])
        return None if all(map(math.isnan, entry)) else entry  # (nan, nan): not runnable

    def _rows(self) -> dict[str, int]:
        return _indexes(self, "layers")

    def _columns(self) -> dict[str, int]:
        return _indexes(self, "precisions")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> SensitivityTable:
        d = dict(d)
        for key in ("layers", "precisions", "measured"):
            d[key] = tuple(d.get(key, ()))
        for key in ("loss_delta", "grad_cosine"):
            d[key] = tuple(tuple(row) for row in d[key])
        return cls(**d)


def _warm_start(
    model: torch.nn.Module,
    spec: ModelSpec,
    data: DataBundle,
    steps: int,
    lr: float,
    batch: int,
    seed: int,
) -> None:
    """``steps`` fp32 SGD steps at ``lr``, backed off to a rate at which the model learns
    (:func:`autoprec.training.pretrain.train_fp32`; when none does, the last attempt's weights,
    with a warning: the sensitivities are then of a model that did not learn)."""
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


def _step_seconds(
    model: torch.nn.Module, spec: ModelSpec, data: DataBundle, batch: int, seed: int
) -> float:
    """One fp32 forward and backward pass at the warm-up's batch, timed on a copy of ``model``
    (so that its batch-norm statistics stay as they are); the second of two (the first call
    allocates)."""
    probe = copy.deepcopy(model).train()
    x, y = next(iter(data.loader("train", batch_size=batch, shuffle=True, seed=seed)))
    took = []
    for _ in range(2):
        start = time.perf_counter()
        spec.loss(probe(x), y).backward()
        took.append(time.perf_counter() - start)
    return took[-1]


def _read_table(path: Path) -> SensitivityTable:
    return SensitivityTable.from_dict(json.loads(path.read_text()))


def _entry(fingerprint: str, data_key: str, settings: dict) -> Path:
    key = hashlib.sha256(
        json.dumps([fingerprint, data_key, settings], sort_keys=True).encode()
    ).hexdigest()[:24]
    return cache_dir() / "sensitivity" / f"{key}.json"


def sensitivity(
    spec: ModelSpec,
    data: DataBundle,
    formats: Sequence[str] = DEFAULT_FORMATS,
    batches: int = 4,
    *,
    batch_size: int = 8,
    method: str = "sweep",
    time_budget_s: float = DEFAULT_TIME_BUDGET_S,
    train_steps: int = 30,
    lr: float = 0.05,
    seed: int = 0,
    cache: bool = True,
    progress: Progress | None = None,
    on_plan: Callable[[SensitivityPlan], None] | None = None,
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
        method: ``"sweep"`` (one pass per layer and precision), ``"taylor"`` (one pass),
            ``"focused"`` (the sweep of the layers that fit the budget, spread over the roles and
            the depth, the rest interpolated) or ``"auto"`` (the most accurate that fits).
        time_budget_s: seconds for the whole call, fp32 warm-up included, for ``auto`` and
            ``focused`` (:mod:`autoprec.sensitivities.budget`; the warm-up is cut to fewer steps
            when its back-off's worst case would take more than ``WARM_UP_SHARE`` of it); the other
            methods ignore it.
        train_steps: fp32 SGD steps before measuring, so gradients look like training's.
        cache: reuse/store the result under ``$AUTOPREC_CACHE_DIR`` (default ~/.cache/autoprec).
        progress: ``progress(stage, done, total)`` (:data:`autoprec._periodic.Progress`), called as
            each stage starts (``done`` 0) and after each step; stages: the fp32 warm-up, the sweep
        (one step per layer and precision measured), the Taylor estimate. on_plan: called once with
            the :class:`~autoprec.sensitivities.budget.SensitivityPlan` before the measurements
        start (not on a cache hit). initial_state: weights to load into the copy before the
            ``train_steps`` (e.g. the evaluator's fp32 warm start, with ``train_steps=0``, so that
            the sensitivities describe the very model the evaluations fine-tune).
        initial_state_key: a name for ``initial_state`` in the cache key (required with it
            when ``cache`` is on: the fingerprint covers the architecture, not the weights).

    Raises:
        ValueError: an unknown method, a budget that is not a positive number of seconds, or
            ``initial_state`` without its key while caching.
    """
    check_method(method)
    budgeted = method in ("auto", "focused")
    if budgeted:
        check_budget(time_budget_s)
    precisions = tuple(parse_precision(f) for f in formats)
    fingerprint = model_fingerprint(spec.module)
    if initial_state is not None and cache and not initial_state_key:
        raise ValueError("initial_state needs an initial_state_key when cache=True")
    settings = _settings(method, precisions, batches, batch_size, train_steps, lr, seed)
    if initial_state is not None:
        settings["initial_state"] = initial_state_key
    sweep_path = _entry(fingerprint, data.key, settings | {"method": "sweep"})
    if budgeted:
        settings["time_budget_s"] = float(time_budget_s)
    path = _entry(fingerprint, data.key, settings)
    if cache:  # a damaged entry is discarded with a note, and recomputed
        table = _cached((sweep_path, path) if method == "auto" else (path,))
        if table is not None:
            return table

    start = time.perf_counter()
    report = progress or (lambda stage, done, total: None)
    budget_s = time_budget_s if budgeted else None
    model, warm_up = _warmed_model(spec, data, settings, budget_s, initial_state, report)
    measurer = _measurer(model, spec, data, settings)
    chosen = _plan(method, measurer, precisions, start, budget_s)
    if on_plan is not None:
        on_plan(chosen)
    deadline = start + time_budget_s if budgeted else math.inf
    rows, measured = _measure(measurer, precisions, chosen, deadline, report)
    ran = "sweep" if all(measured) else "taylor" if not any(measured) else "focused"
    table = SensitivityTable(
        method=ran,
        model=getattr(spec, "name", type(spec.module).__name__),
        fingerprint=fingerprint,
        data_key=data.key,
        layers=tuple(measurer.names),
        precisions=tuple(p.value for p in precisions),
        loss_delta=tuple(r[0] for r in rows),
        grad_cosine=tuple(r[1] for r in rows),
        reference_loss=measurer.reference_loss,
        wall_time_s=time.perf_counter() - start,
        settings=settings,
        measured=tuple(measured) if ran == "focused" else (),
        note=f"{chosen.describe()}; {warm_up}" if budgeted else "",
    )
    if cache:  # a full sweep is stored as one (which `auto` looks up first, whatever its budget)
        _store(table, sweep_path if ran == "sweep" else path)
    return table


def _cached(paths: Sequence[Path]) -> SensitivityTable | None:
    """The first table stored under one of ``paths``, or None (a damaged entry is discarded
    with a note)."""
    for candidate in paths:
        table = read_entry(candidate, _read_table, "sensitivity cache entry")
        if table is not None:
            return table
    return None


def _store(table: SensitivityTable, path: Path) -> None:
    """Keep ``table`` in the cache under ``path``."""
    write_entry(path, lambda fh: json.dump(table.to_dict(), fh), what="sensitivity cache entry")


def _plan(
    method: str,
    measurer: Measurer,
    precisions: Sequence[Precision],
    start: float,
    budget_s: float | None,
) -> SensitivityPlan:
    """What to measure (:func:`~autoprec.sensitivities.budget.plan`) within what is left of
    ``budget_s`` (None: no budget) since ``start``, at the pace of ``measurer``'s passes."""
    lowered = [p for p in precisions if p is not Precision.FP32]
    costs = Costs(len(measurer.names), len(lowered), measurer.pass_s)
    left = budget_s - (time.perf_counter() - start) if budget_s is not None else None
    return plan(method, costs, left, budget_s)


def _settings(
    method: str,
    precisions: Sequence[Precision],
    batches: int,
    batch_size: int,
    train_steps: int,
    lr: float,
    seed: int,
) -> dict[str, Any]:
    """What a table is computed from besides the model and the data: its cache key, stored in
    :attr:`SensitivityTable.settings` (the budget and the initial state's key are added by
    :func:`sensitivity`)."""
    settings: dict[str, Any] = {
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
    return settings


def _warmed_model(
    spec: ModelSpec,
    data: DataBundle,
    settings: Mapping[str, Any],
    budget_s: float | None,
    initial_state: Mapping[str, torch.Tensor] | None,
    report: Progress,
) -> tuple[torch.nn.Module, str]:
    """A copy of ``spec.module`` (``initial_state`` loaded) after the fp32 warm-up of
    ``settings["train_steps"]`` steps, cut to fewer when a budget of ``budget_s`` seconds
    cannot hold its back-off's worst case; and the warm-up's name as the progress shows it."""
    train_steps, batch_size = settings["train_steps"], settings["batch_size"]
    seed = settings["seed"]
    torch.manual_seed(seed)
    model = copy.deepcopy(spec.module)
    if initial_state is not None:
        model.load_state_dict(initial_state)
    steps, warm_up = train_steps, f"fp32 warm-up ({train_steps} steps)"
    if budget_s is not None and train_steps > 0:
        step_s = _step_seconds(model, spec, data, batch_size, seed)
        steps = warm_up_steps(train_steps, step_s, budget_s, MAX_BACKOFFS + 1)
        if steps < train_steps:
            warm_up = f"fp32 warm-up ({steps} of {train_steps} steps, to fit the budget)"
    report(warm_up, 0, 1)
    _warm_start(model, spec, data, steps, settings["lr"], batch_size, seed)
    report(warm_up, 1, 1)
    return model, warm_up


def _measurer(
    model: torch.nn.Module, spec: ModelSpec, data: DataBundle, settings: Mapping[str, Any]
) -> Measurer:
    """A :class:`~autoprec.sensitivities.measure.Measurer` of ``model`` on the fixed batches
    ``settings`` names, concatenated into one."""
    batch_size, seed = settings["batch_size"], settings["seed"]
    fixed = data.fixed_batches(settings["batches"], batch_size, split="train", seed=seed)
    x = torch.cat([b[0] for b in fixed])
    y = torch.cat([b[1] for b in fixed])
    return Measurer(model, spec, x, y)


def _measure(
    measurer: Measurer,
    precisions: Sequence[Precision],
    chosen: SensitivityPlan,
    deadline: float,
    report: Progress,
) -> tuple[list[Row], list[bool]]:
    """The rows of ``chosen`` in execution order, and which of them were swept: the swept
    layers (:func:`_sweep`) and the rest interpolated between them
    (:func:`~autoprec.sensitivities.budget.fill`); the Taylor estimate when none was swept."""
    names = measurer.names
    swept = (
        {} if chosen.method == "taylor" else _sweep(measurer, precisions, chosen, deadline, report)
    )
    if swept:
        return fill(swept, names), [i in swept for i in range(len(names))]
    lowered = sum(p is not Precision.FP32 for p in precisions)
    stage, done = f"Taylor estimate ({len(names)} layers x {lowered})", 0
    report(stage, 0, len(names) * lowered)
    estimate = measurer.taylor()

    def estimated(index: int, name: str, p: Precision) -> tuple[float, float]:
        nonlocal done
        result = estimate(index, name, p)
        done += 1
        report(stage, done, len(names) * lowered)
        return result

    rows = [row(n, i, precisions, estimated) for i, n in enumerate(names)]
    measurer.model.zero_grad(set_to_none=True)
    return rows, [False] * len(names)


def _sweep(
    measurer: Measurer,
    precisions: Sequence[Precision],
    chosen: SensitivityPlan,
    deadline: float,
    report: Progress,
) -> dict[int, Row]:
    """``{layer index: row}`` of the layers swept, in
    :func:`~autoprec.sensitivities.budget.priority` order: all of them for ``sweep``; for
    ``focused`` and ``auto``, while the next layer is expected to end before ``deadline`` (at least
    ``chosen.measured`` for ``focused``), at the pace measured so far (or as predicted)."""
    names = measurer.names
    lowered = sum(p is not Precision.FP32 for p in precisions)
    stage = "sweep" if chosen.method == "sweep" else "focused sweep"
    # auto sweeps more layers than planned while the budget lasts (the total grows with them)
    more = "+" if chosen.method != "sweep" and chosen.requested == "auto" else ""
    stage += f" ({chosen.measured}{more} layers x {lowered})"
    total, done = chosen.measured * lowered, 0
    report(stage, 0, total)

    def graded(index: int, name: str, p: Precision) -> tuple[float, float]:
        nonlocal done, total
        result = measurer.sweep(index, name, p)
        done += 1
        total = max(total, done)
        report(stage, done, total)
        return result

    swept: dict[int, Row] = {}
    took: list[float] = []  # seconds per swept layer
    for i in priority(names, measurer.params):
        must = chosen.requested == "sweep" or (
            chosen.requested == "focused" and len(swept) < chosen.measured
        )
        # the pace so far, leaving out the first layer (the rounding kernels' first calls
        # compile them); the prediction until there is one
        pace = sum(took[1:]) / (len(took) - 1) if len(took) > 1 else chosen.costs.layer_s
        if not must and time.perf_counter() + pace > deadline:
            break
        begin = time.perf_counter()
        swept[i] = row(names[i], i, precisions, graded)
        took.append(time.perf_counter() - begin)
    return swept
