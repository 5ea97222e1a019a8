"""Evaluate a precision policy: fine-tune from a cached fp32 warm start, score, cost.

Every policy starts from the same fp32 warm start (``warm_start_steps`` SGD steps, trained once
per model architecture, data, seed and settings and kept on disk), fine-tunes for the same
number of steps on the same fixed batches with the policy applied, and is then scored with the
policy still applied: loss over the whole training split, accuracy and loss on the validation
split. The uniform fp32 policy, evaluated the same way, is the reference of every delta.

Step time and memory are measured (CUDA events, peak allocated memory) when the target is the
local CUDA device, and come from :class:`autoprec.hardware.CostModel` otherwise.

The ``"surrogate"`` fidelity trains nothing: :class:`autoprec.evaluate.surrogate.Surrogate`
predicts ``loss_delta`` from per-layer sensitivities (computed once per evaluator, cached on disk)
and is refit on every real evaluation that did not diverge. See :meth:`Evaluator.evaluate`.

Example:
    >>> from autoprec.models import load_model
    >>> from autoprec.data import load_dataset_for
    >>> spec = load_model("tinycnn", num_classes=10)
    >>> ev = Evaluator(spec, load_dataset_for(spec, "digits"), target="a100-40gb-sxm")
    >>> m = ev.evaluate("bf16")  # doctest: +SKIP
    >>> m.loss_delta, m.speedup, m.source  # doctest: +SKIP
    (0.0021, 1.87, 'model')
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import itertools
import json
import logging
import math
import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from autoprec.cache import cache_dir as default_cache_dir
from autoprec.evaluate._store import (
    EvaluationStore,
    load_state,
    save_state_atomic,
)
from autoprec.evaluate.metrics import Metrics
from autoprec.evaluate.surrogate import Surrogate
from autoprec.hardware import CostModel, DeviceSpec, detect, get_device
from autoprec.hardware.defaults import amp_policy
from autoprec.hardware.runnability import float8_available
from autoprec.layers import model_fingerprint
from autoprec.policy import PrecisionPolicy
from autoprec.precision import Precision, parse_precision
from autoprec.runtime import LossScaler, apply_policy

log = logging.getLogger(__name__)

FIDELITIES = ("short", "full", "surrogate")
SURROGATE_REFERENCE = "short"  # the real fidelity whose fp32 run anchors surrogate predictions
SURROGATE_TAYLOR_ABOVE = 30  # more tunable layers than this: taylor sensitivities, else sweep
SURROGATE_SWEEP_BATCHES = 2
SURROGATE_TAYLOR_BATCHES = 4
SURROGATE_BATCH_SIZE = 32
SHORT_STEPS = 10
FULL_STEPS = 30
# Fine-tunes per evaluation, each on batches of its own; the losses are averaged. On the
# default task (resnet18, `teacher`) one 10-step fine-tune already ranks random policies the
# same way from one batch order to the next (Spearman 0.83; at 30 steps 0.32, as trajectories
# separate; on digits -0.25 and -0.20): docs/benchmarks.md, "Policy evaluator". Averaging
# replicates lowers the batch-order noise for tasks where one fine-tune does not repeat.
SHORT_REPLICATES = 1
FULL_REPLICATES = 3
REPLICATE_SEED_STRIDE = 10_000  # replicate r of seed s fine-tunes on batches of s + r * stride
# Fine-tuning under a policy: plain SGD at a fifth of the warm start's rate. With the warm
# start's lr 0.05 and momentum 0.9 the 30-step loss is chaotic (tinycnn on digits: tf32 moves
# it by -1.1% ± 2.4% over seeds, fp8 by +4% ± 91%); at 0.01 without momentum tf32 and fp16
# stay within 0.02% of fp32 (experiments/study_short_fidelity.py, docs/benchmarks.md).
FINETUNE_LR = 0.01
FINETUNE_MOMENTUM = 0.0
DIVERGENCE_FACTOR = 10.0  # a final loss above this many times fp32's counts as diverged
PENALTY_LOSS_DELTA = 10.0  # loss_delta of a diverged run (any other run has at most 9.0)
SCORE_BATCH = 256


@dataclass
class _Run:
    """What one fine-tuning run produced (before it is compared with the reference)."""

    loss: float = math.nan
    val_loss: float = math.nan
    accuracy: float = 0.0
    step_time_s: float | None = None  # measured runs only
    memory_bytes: int | None = None
    overflows: int = 0
    underflows: int = 0
    loss_scale: dict[str, Any] = dataclasses.field(default_factory=dict)
    diverged: bool = False
    out_of_memory: bool = False
    wall_time_s: float = 0.0


def _sha(obj: Any) -> str:
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _weights_digest(module: nn.Module) -> str:
    """SHA-256 (hex, 32 characters) of every tensor of the module's state, in order."""
    digest = hashlib.sha256()
    for name, tensor in module.state_dict().items():
        t = tensor.detach().cpu().contiguous().reshape(-1)
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()[:32]


def _cost_fields(
    step_time: float, memory: int, fp32: tuple[float, int], amp: tuple[float, int]
) -> dict[str, Any]:
    """Step time and memory, and their ratios to the fp32 and blanket-AMP policies'."""
    return {
        "speedup": fp32[0] / step_time,
        "memory_ratio": memory / max(fp32[1], 1),
        "speedup_vs_amp": amp[0] / step_time,
        "memory_ratio_vs_amp": memory / max(amp[1], 1),
        "step_time_s": step_time,
        "memory_bytes": memory,
    }


class Evaluator:
    """Scores precision policies of one model on one dataset for one target.

    Args:
        spec: a ModelSpec (``module``, ``loss``, ``logits``, ``name``); its module is not changed.
        data: a DataBundle (``loader``, ``fixed_batches``, ``key``).
        target: a device name or DeviceSpec; None detects the local one.
        fidelity: default fidelity, ``"short"`` (``steps`` or 10 steps, ``replicates`` or one
            fine-tune), ``"full"`` (three fine-tunes of 30 steps, averaged) or ``"surrogate"``
            (predicted, no training; see :meth:`evaluate`).
        steps: fine-tuning steps at ``"short"`` fidelity.
        replicates: fine-tunes at ``"short"`` fidelity, each from the warm start on batches of
            its own; the scores are averaged (less dependence on one batch order).
        batch_size: examples per fine-tuning (and warm-start) step.
        lr: SGD learning rate (momentum 0.9) of the warm start.
        warm_start_steps: fp32 steps from the spec's weights before any policy is applied.
        seed: seeds the warm-start loader, the fixed batches and torch before each run.
        batch_seed: seeds the fine-tuning batches (and torch) instead of ``seed``, keeping the
            warm start of ``seed``: the same policies on another batch order, to measure how
            much a score depends on it. None: ``seed``.
        cache_dir: where ``warmstart/*.pt`` and ``evaluations.sqlite`` live; None means
            ``$AUTOPREC_CACHE_DIR`` or ``~/.cache/autoprec``.
        cost_spec: the model as it will be trained in production, for the cost model's step
            time and memory (same layer names; e.g. resnet50 at 224 px while ``spec`` is the
            same architecture at 32 px for the fine-tuning); None: ``spec``.
        cost_batch_size: the production batch size for the cost model; None: ``batch_size``.
        finetune_lr: SGD learning rate while fine-tuning under a policy (default
            :data:`FINETUNE_LR`); None: ``lr``.
        momentum: SGD momentum while fine-tuning under a policy (:data:`FINETUNE_MOMENTUM`).
        target_mode: ``"native"``: a policy is feasible only if every layer runs natively on
            the target (:mod:`autoprec.hardware.runnability`: no fp8 convolution, torchao's
            shape rules, ...); ``"emulate"``: a study of formats the target lacks, anything
            the device's format list holds is feasible.

    Divergence (a non-finite loss while fine-tuning, an exception in training, or a final
    loss above 10x fp32's) never raises: the result has ``diverged=True``, ``accuracy=0``,
    ``loss = 11 x fp32_loss`` (so ``loss_delta = 10.0``, above any run that did not diverge)
    and ``val_loss = 11 x`` fp32's. Precisions the target cannot run are still evaluated
    (emulated) with ``feasible=False``; their cost is estimated as fp32 for those layers (in
    ``native`` target mode, a layer is runnable as :mod:`autoprec.hardware.runnability` says). Out
    of memory on a measured run gives ``feasible=False`` with the same penalties.

    Attributes:
        runs: fine-tuning runs done by this instance (cache hits do not count).
        surrogate_pairs: ``{policy key: (precisions, loss_delta)}`` of the real evaluations
            (either fidelity, cache hits included) that did not diverge; the surrogate's
            training data.
        warm_start_trained: whether this instance trained the warm start (False: loaded).
    """

    def __init__(
        self,
        spec: Any,
        data: Any,
        target: str | DeviceSpec | None = None,
        fidelity: str = "short",
        *,
        steps: int | None = None,
        replicates: int | None = None,
        batch_size: int = 32,
        lr: float = 0.05,
        finetune_lr: float | None = FINETUNE_LR,
        momentum: float = FINETUNE_MOMENTUM,
        warm_start_steps: int = 200,
        seed: int = 0,
        batch_seed: int | None = None,
        cache_dir: str | Path | None = None,
        cost_spec: Any = None,
        cost_batch_size: int | None = None,
        target_mode: str = "native",
    ) -> None:
        self.spec = spec
        self.data = data
        self.device = detect() if target is None else get_device(target)
        if target_mode not in ("native", "emulate"):
            raise ValueError(f"target_mode must be native or emulate, got {target_mode!r}")
        self.target_mode = target_mode
        self.fidelity = self._check_fidelity(fidelity)
        if steps is not None and (not isinstance(steps, int) or steps < 1):
            raise ValueError(f"steps must be an integer >= 1, got {steps!r}")
        self.steps = {"short": steps or SHORT_STEPS, "full": FULL_STEPS}
        if replicates is not None and (not isinstance(replicates, int) or replicates < 1):
            raise ValueError(f"replicates must be an integer >= 1, got {replicates!r}")
        self.replicates = {"short": replicates or SHORT_REPLICATES, "full": FULL_REPLICATES}
        self.batch_size = batch_size
        self.lr = lr
        self.finetune_lr = lr if finetune_lr is None else finetune_lr
        self.momentum = momentum
        self.warm_start_steps = warm_start_steps
        self.seed = seed
        self.batch_seed = seed if batch_seed is None else int(batch_seed)
        self.cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        self.cost_spec = spec if cost_spec is None else cost_spec
        self.cost_batch_size = batch_size if cost_batch_size is None else int(cost_batch_size)
        if self.cost_batch_size < 1:
            raise ValueError(f"cost_batch_size must be >= 1, got {cost_batch_size!r}")
        self.measured = torch.cuda.is_available() and detect().name == self.device.name
        self.mode = "native" if self.measured else "emulate"
        self.fingerprint = model_fingerprint(spec.module)
        warm = {"steps": warm_start_steps, "lr": lr, "batch_size": batch_size}
        # the initial weights too: two specs of one architecture built with different
        # random weights must not share a warm start
        initial = _weights_digest(spec.module)
        self._warm_key = _sha([self.fingerprint, initial, data.key, seed, warm])
        # the cost model reads the device's calibration (if this machine has one): part of the
        # key, so that a calibration is not answered with speedups priced before it
        self._cost = CostModel(self.device)
        settings = {
            **warm,
            "finetune": [self.finetune_lr, momentum],
            "cost": [
                model_fingerprint(self.cost_spec.module),
                list(getattr(self.cost_spec, "input_shape", None) or []),
                self.cost_batch_size,
            ],
            "device": self.device.name,
            "efficiency": self._cost.efficiency.to_dict(),
            "mode": self.mode,
            "target_mode": target_mode,
            "float8": float8_available(),  # what runs natively (the runnability table)
            "steps": self.steps,
            "replicates": self.replicates,
            "batch_seed": self.batch_seed,
        }
        self._settings_key = _sha([self.fingerprint, initial, data.key, seed, settings])
        self._store = EvaluationStore(self.cache_dir / "evaluations.sqlite")
        self._memo: dict[str, Metrics] = {}
        self._warm_state: dict[str, torch.Tensor] | None = None
        self._table: Any = None
        self._amp_runs: dict[str, _Run] = {}
        self._surrogate: Surrogate | None = None
        self.surrogate_pairs: dict[str, tuple[dict[str, Precision], float]] = {}
        self.runs = 0
        self.warm_start_trained = False

    # --- public -----------------------------------------------------------------------------
    @property
    def warm_start_path(self) -> Path:
        """The file holding the fp32 warm-start weights."""
        return self.cache_dir / "warmstart" / f"{self._warm_key}.pt"

    def evaluate(self, policy: Any, fidelity: str | None = None) -> Metrics:
        """Metrics of ``policy`` (a PrecisionPolicy, a precision name, or ``{layer: precision}``).

        Served from the cache (memory, then SQLite) when this policy was evaluated before with
        the same settings and fidelity. Each real (``short``/``full``) result that did not
        diverge becomes a training pair of the surrogate, which is refit if already built.

        ``fidelity="surrogate"`` runs no training and is never cached (the surrogate changes as
        it is refit): ``loss_delta`` is :meth:`Surrogate.predict`, clipped to [-0.99, 9];
        ``loss`` and ``val_loss`` are the fp32 ``"short"`` reference's times ``1 + loss_delta``;
        ``accuracy`` is fp32's (unknown; ``accuracy_delta = 0``); step time, memory and the
        ratios come from the cost model for this policy, fp32 and AMP alike (``source =
        "model"``, even where real runs are measured); ``steps = 0``, ``diverged = False``,
        ``overflows = underflows = 0``. The first call runs (or loads) the fp32 short
        reference and computes the sensitivity table (see :meth:`surrogate`); later calls
        take about a millisecond.
        """
        policy = self._as_policy(policy)
        fid = self._check_fidelity(fidelity or self.fidelity)
        if fid == "surrogate":
            return self._predict(policy)
        reference = self._reference(fid)
        metrics = self._cached(policy, fid, lambda: self._score(policy, fid, reference))
        self._record(policy, fid, metrics)
        return metrics

    def reference(self, fidelity: str | None = None) -> Metrics:
        """Metrics of the uniform fp32 policy (computed once, cached).

        For ``"surrogate"`` this is the real ``"short"`` reference that predictions scale.
        """
        fid = self._check_fidelity(fidelity or self.fidelity)
        return self._reference(SURROGATE_REFERENCE if fid == "surrogate" else fid)

    def surrogate(self) -> Surrogate:
        """The surrogate, built on first use and fitted on :attr:`surrogate_pairs`.

        Its sensitivity table comes from :func:`autoprec.graph.grade.sensitivity`, measured on
        this evaluator's fp32 warm start (the very weights every evaluation fine-tunes) with
        its seed, ``cache=True`` (on disk under ``$AUTOPREC_CACHE_DIR``): ``method="sweep"`` on
        2 batches of 32 for models with at most 30 tunable layers (exact one-layer
        measurements), ``method="taylor"`` on 4 batches of 32 otherwise (one pass whatever the
        depth).
        """
        if self._surrogate is None:
            from autoprec.graph.grade import sensitivity
            from autoprec.layers import tunable_layers

            n_layers = sum(1 for _ in tunable_layers(self.spec.module))
            taylor = n_layers > SURROGATE_TAYLOR_ABOVE
            table = sensitivity(
                self.spec,
                self.data,
                batches=SURROGATE_TAYLOR_BATCHES if taylor else SURROGATE_SWEEP_BATCHES,
                batch_size=SURROGATE_BATCH_SIZE,
                method="taylor" if taylor else "sweep",
                train_steps=0,
                seed=self.seed,
                cache=True,
                initial_state=self._warm_start(),
                initial_state_key=self._warm_key,
            )
            self._surrogate = Surrogate(table)
            if self.surrogate_pairs:
                self._surrogate.fit(self.surrogate_pairs.values())
        return self._surrogate

    # --- policies and cache -----------------------------------------------------------------
    @staticmethod
    def _check_fidelity(fidelity: str) -> str:
        if fidelity not in FIDELITIES:
            raise ValueError(
                f"unknown fidelity {fidelity!r}; expected one of {', '.join(FIDELITIES)}"
            )
        return fidelity

    @staticmethod
    def _as_policy(policy: Any) -> PrecisionPolicy:
        if isinstance(policy, PrecisionPolicy):
            return policy
        if isinstance(policy, (str, Precision)):
            return PrecisionPolicy.uniform(parse_precision(policy))
        if isinstance(policy, Mapping):
            return PrecisionPolicy(default=Precision.FP32, layers=dict(policy))
        raise TypeError(
            "policy must be a PrecisionPolicy, a precision name such as 'bf16', or a "
            f"{{layer name: precision}} mapping; got {type(policy).__name__}"
        )

    def _key(self, policy: PrecisionPolicy, fidelity: str) -> str:
        resolved = [[n, p.value] for n, p in policy.resolve(self.spec.module).items()]
        ls = policy.loss_scaling
        scaling = None if ls is None else dataclasses.asdict(ls)
        return _sha([self._settings_key, fidelity, resolved, scaling])

    def _cached(self, policy: PrecisionPolicy, fidelity: str, compute: Any) -> Metrics:
        key = self._key(policy, fidelity)
        if key in self._memo:
            return self._memo[key]
        stored = self._store.get(key)
        if stored is not None:
            metrics = Metrics.from_dict(stored)
        else:
            metrics = compute()
            self._store.put(key, metrics.to_dict())
        self._memo[key] = metrics
        return metrics

    def _record(self, policy: PrecisionPolicy, fidelity: str, metrics: Metrics) -> None:
        """Add a real, non-diverged result to the surrogate's pairs and refit (cheap)."""
        if metrics.diverged or not math.isfinite(metrics.loss_delta):
            return
        key = self._key(policy, fidelity)
        if key in self.surrogate_pairs:
            return
        self.surrogate_pairs[key] = (policy.resolve(self.spec.module), metrics.loss_delta)
        if self._surrogate is not None:
            self._surrogate.fit(self.surrogate_pairs.values())

    def _reference(self, fidelity: str) -> Metrics:
        fp32 = PrecisionPolicy.uniform(Precision.FP32)
        return self._cached(fp32, fidelity, lambda: self._score(fp32, fidelity, None))

    # --- warm start -------------------------------------------------------------------------
    def _warm_start(self) -> dict[str, torch.Tensor]:
        if self._warm_state is not None:
            return self._warm_state
        path = self.warm_start_path
        state = load_state(path)  # None: missing, or damaged and discarded
        if state is not None:
            self._warm_state = state
            return state
        torch.manual_seed(self.seed)
        model = copy.deepcopy(self.spec.module).cpu()
        model.train()
        opt = torch.optim.SGD(model.parameters(), lr=self.lr, momentum=0.9)
        loader = self.data.loader("train", batch_size=self.batch_size, seed=self.seed)
        for x, y in itertools.islice(itertools.cycle(loader), self.warm_start_steps):
            opt.zero_grad(set_to_none=True)
            self.spec.loss(model(x), y).backward()
            opt.step()
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        save_state_atomic(path, state)  # a full disk: a note, the state is kept in memory
        self.warm_start_trained = True
        self._warm_state = state
        return state

    # --- one run ----------------------------------------------------------------------------
    def _run(self, policy: PrecisionPolicy, fidelity: str) -> _Run:
        """Every replicate of ``fidelity``: losses and accuracy averaged, counts summed, step
        times pooled; one diverging replicate makes the run diverged."""
        run = _Run()
        start = time.perf_counter()
        state = self._warm_start()
        dev = torch.device("cuda") if self.measured else torch.device("cpu")
        mode = self.mode
        if mode == "native" and self.unrunnable(policy.resolve(self.spec.module)):
            mode = "emulate"  # scored for its accuracy only: it is infeasible on the target
        self.runs += 1
        losses, val_losses, accuracies, times = [], [], [], []
        for replicate in range(self.replicates[fidelity]):
            batch_seed = self.batch_seed + replicate * REPLICATE_SEED_STRIDE
            torch.manual_seed(batch_seed)
            model = copy.deepcopy(self.spec.module)
            model.load_state_dict(state)
            model.to(dev)
            batches = self.data.fixed_batches(
                self.steps[fidelity],
                self.batch_size,
                seed=batch_seed,
            )
            handle = None
            try:
                handle = apply_policy(model, policy, mode=mode)
                scaler = LossScaler.from_config(policy.loss_scaling, device=dev)
                opt = torch.optim.SGD(
                    model.parameters(), lr=self.finetune_lr, momentum=self.momentum
                )
                times += self._fine_tune(model, batches, opt, scaler, dev, run)
                run.loss_scale = scaler.summary()
                if not run.diverged:
                    losses.append(self._score_split(model, "train", dev)[0])
                    val_loss, accuracy = self._score_split(model, "val", dev)
                    val_losses.append(val_loss)
                    accuracies.append(accuracy)
                if self.measured and times:
                    run.memory_bytes = max(
                        run.memory_bytes or 0, int(torch.cuda.max_memory_allocated(dev))
                    )
            except torch.cuda.OutOfMemoryError:
                log.warning("out of memory evaluating policy %s", policy.digest())
                run.out_of_memory = run.diverged = True
            except Exception:  # noqa: BLE001 - a bad policy must not end a search
                log.exception("training failed for policy %s; counted as diverged", policy.digest())
                run.diverged = True
            finally:
                if handle is not None:
                    totals = handle.totals()
                    run.overflows += totals["overflows"]
                    run.underflows += totals["underflows"]
                    handle.remove()
            if run.diverged:
                break
        if not run.diverged and losses:
            run.loss = statistics.fmean(losses)
            run.val_loss = statistics.fmean(val_losses)
            run.accuracy = statistics.fmean(accuracies)
        if self.measured and times:
            run.step_time_s = statistics.median(times)
        run.wall_time_s = time.perf_counter() - start
        return run

    def _fine_tune(self, model, batches, opt, scaler, dev, run: _Run) -> list[float]:
        model.train()
        times: list[float] = []
        if self.measured:
            torch.cuda.reset_peak_memory_stats(dev)
        for i, (x, y) in enumerate(batches):
            x, y = x.to(dev), y.to(dev)
            if self.measured:
                begin, end = (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
                begin.record()
            opt.zero_grad(set_to_none=True)
            loss = self.spec.loss(model(x), y)
            if not torch.isfinite(loss.detach()):
                run.diverged = True
                break
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            if self.measured:
                end.record()
                torch.cuda.synchronize(dev)
                if i >= 2:  # the first steps warm up kernels and allocator
                    times.append(begin.elapsed_time(end) / 1e3)
        return times

    @torch.no_grad()
    def _score_split(self, model: nn.Module, split: str, dev: torch.device) -> tuple[float, float]:
        """Mean loss and accuracy over ``split``, in eval mode, policy applied."""
        model.eval()
        total_loss = correct = count = labels = 0.0
        for x, y in self.data.loader(split, batch_size=SCORE_BATCH, shuffle=False):
            x, y = x.to(dev), y.to(dev)
            out = model(x)
            total_loss += float(self.spec.loss(out, y)) * len(x)
            count += len(x)
            pred = self.spec.logits(out).argmax(-1)
            correct += float((pred == y).sum())
            labels += y.numel()
        return total_loss / max(count, 1), correct / max(labels, 1)

    # --- cost -------------------------------------------------------------------------------
    def cost_table(self) -> Any:
        """The layer table of :attr:`cost_spec` at :attr:`cost_batch_size` (cached)."""
        if self._table is None:
            from autoprec.graph import analyze

            self._table = analyze(self.cost_spec, self.cost_batch_size, cache=True)
        return self._table

    def unrunnable(self, precisions: Mapping[str, Precision]) -> dict[str, str]:
        """``{layer: reason}`` for the layers of ``precisions`` the target cannot run in its
        :attr:`target_mode` (the runnability table; layers the table lacks are not judged)."""
        from autoprec.hardware.runnability import verdict_for_row

        rows = {row.name: row for row in self.cost_table().rows}
        out = {}
        for name, p in precisions.items():
            if name in rows:
                verdict = verdict_for_row(rows[name], p, self.device, self.target_mode)
                if not verdict.runnable:
                    out[name] = verdict.reason
            elif not self.device.supports(p):
                out[name] = f"{self.device.name} has no {parse_precision(p).value} tensor cores"
        return out

    def _estimate(self, precisions: Mapping[str, Precision]) -> tuple[float, int]:
        bad = self.unrunnable(precisions)
        runnable = {n: (Precision.FP32 if n in bad else p) for n, p in precisions.items()}
        est = self._cost.step(self.cost_table(), runnable, batch_size=self.cost_batch_size)
        return est.step_time_s, int(est.memory_bytes)

    def _amp_cost(self, fidelity: str) -> tuple[float, int]:
        """Step time and memory of the target's blanket AMP policy."""
        amp = amp_policy(self.device)
        if not self.measured:
            return self._estimate(amp.resolve(self.spec.module))
        if fidelity not in self._amp_runs:  # a raw run, so that no evaluate() recursion occurs
            self._amp_runs[fidelity] = self._run(amp, fidelity)
        run = self._amp_runs[fidelity]
        if run.step_time_s is None:  # the AMP run itself failed; fall back to the model
            return self._estimate(amp.resolve(self.spec.module))
        return run.step_time_s, run.memory_bytes or 0

    # --- metrics ----------------------------------------------------------------------------
    def _predict(self, policy: PrecisionPolicy) -> Metrics:
        """Surrogate metrics (see :meth:`evaluate`); not cached."""
        reference = self._reference(SURROGATE_REFERENCE)
        surrogate = self.surrogate()
        start = time.perf_counter()
        precisions = policy.resolve(self.spec.module)
        predicted = surrogate.predict(precisions)
        if not math.isfinite(predicted):
            predicted = PENALTY_LOSS_DELTA - 1.0
        loss_delta = min(max(predicted, -0.99), PENALTY_LOSS_DELTA - 1.0)
        step_time, memory = self._estimate(precisions)
        ref_time, ref_memory = self._estimate({n: Precision.FP32 for n in precisions})
        amp_time, amp_memory = self._estimate(amp_policy(self.device).resolve(self.spec.module))
        feasible = not self.unrunnable(precisions)
        return Metrics(
            accuracy=reference.accuracy,
            loss=reference.loss * (1.0 + loss_delta),
            val_loss=reference.val_loss * (1.0 + loss_delta),
            fp32_accuracy=reference.accuracy,
            fp32_loss=reference.loss,
            accuracy_delta=0.0,
            loss_delta=loss_delta,
            **_cost_fields(step_time, memory, (ref_time, ref_memory), (amp_time, amp_memory)),
            source="model",
            diverged=False,
            feasible=feasible,
            wall_time_s=time.perf_counter() - start,
            fidelity="surrogate",
            steps=0,
        )

    def _score(self, policy: PrecisionPolicy, fidelity: str, reference: Metrics | None) -> Metrics:
        precisions = policy.resolve(self.spec.module)
        run = self._run(policy, fidelity)
        if self.measured and run.step_time_s is not None:
            step_time, memory = run.step_time_s, run.memory_bytes or 0
        else:
            step_time, memory = self._estimate(precisions)
        if reference is None:  # this is the fp32 reference itself
            if run.diverged or not math.isfinite(run.loss):
                raise RuntimeError(
                    "the fp32 reference run diverged; lower lr or check the model and data"
                )
            ref_loss, ref_val, ref_acc = run.loss, run.val_loss, run.accuracy
            ref_time, ref_memory = step_time, memory
        else:
            ref_loss, ref_val, ref_acc = reference.loss, reference.val_loss, reference.accuracy
            ref_time, ref_memory = reference.step_time_s, reference.memory_bytes
        amp_time, amp_memory = self._amp_cost(fidelity)
        diverged = (
            run.diverged or not math.isfinite(run.loss) or run.loss > DIVERGENCE_FACTOR * ref_loss
        )
        if diverged:
            loss = (1.0 + PENALTY_LOSS_DELTA) * ref_loss
            val_loss, accuracy = (1.0 + PENALTY_LOSS_DELTA) * ref_val, 0.0
        else:
            loss, val_loss, accuracy = run.loss, run.val_loss, run.accuracy
        loss_delta = PENALTY_LOSS_DELTA if diverged else (loss - ref_loss) / max(ref_loss, 1e-12)
        feasible = not run.out_of_memory and not self.unrunnable(precisions)
        return Metrics(
            accuracy=accuracy,
            loss=loss,
            val_loss=val_loss,
            fp32_accuracy=ref_acc,
            fp32_loss=ref_loss,
            accuracy_delta=accuracy - ref_acc,
            loss_delta=loss_delta,
            **_cost_fields(step_time, memory, (ref_time, ref_memory), (amp_time, amp_memory)),
            source="measured" if self.measured else "model",
            overflows=run.overflows,
            underflows=run.underflows,
            loss_scale=run.loss_scale,
            diverged=diverged,
            feasible=feasible,
            wall_time_s=run.wall_time_s,
            fidelity=fidelity,
            steps=self.steps[fidelity],
        )
