"""Evaluate a precision policy: fine-tune from a cached fp32 warm start, score, cost.

Every policy starts from the same fp32 warm start (``warm_start_steps`` SGD steps, trained once
per model architecture, data, seed and settings and kept on disk), fine-tunes for the same
number of steps on the same fixed batches with the policy applied, and is then scored with the
policy still applied: loss over the whole training split, accuracy and loss on the validation
split. The uniform fp32 policy, evaluated the same way, is the reference of every delta.

Step time and memory are measured when the target is this machine's device (a GPU, or the
CPU as ``--target cpu``; ``config.pricing``): ranked by a per-layer table timed once per device
and software version, the finalists timed as whole steps of the program production runs
(:mod:`autoprec.evaluate.measured`, :meth:`Evaluator.time_steps`); otherwise they come from
:class:`autoprec.hardware.CostModel`.

The ``"surrogate"`` fidelity trains nothing: :class:`autoprec.evaluate.surrogate.Surrogate`
predicts ``loss_delta`` from per-layer sensitivities (computed once per evaluator, cached on disk)
and is refit on every real evaluation that did not diverge. See :meth:`Evaluator.evaluate`.

:class:`Evaluator` is a facade over the parts, each a module of its own: the settings
(:mod:`~autoprec.evaluate.config`), the warm start (:mod:`~autoprec.evaluate.warm_start`), the
fine-tuning runs (:mod:`~autoprec.evaluate.finetune`), the costs
(:mod:`~autoprec.evaluate.costing`), the metrics (:mod:`~autoprec.evaluate.scoring`) and the
cache (:mod:`~autoprec.evaluate.cached`).

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

import math
import statistics
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from autoprec._periodic import Progress
from autoprec.cache import cache_dir as default_cache_dir
from autoprec.evaluate.cached import EvaluationCache, EvaluationIdentity
from autoprec.evaluate.config import MEASURED_EXECUTION, EvaluatorConfig, check_fidelity
from autoprec.evaluate.costing import CostEstimator
from autoprec.evaluate.finetune import FineTuner, FineTuneRun
from autoprec.evaluate.metrics import Metrics
from autoprec.evaluate.scoring import Baseline, predicted_metrics, score_run
from autoprec.evaluate.surrogate import Surrogate
from autoprec.evaluate.warm_start import WarmStart, weights_digest
from autoprec.hardware import DeviceSpec, detect, get_device
from autoprec.layers import model_fingerprint
from autoprec.policy import PrecisionPolicy, resolve_mode
from autoprec.precision import Precision, parse_precision

SURROGATE_REFERENCE = "short"  # the real fidelity whose fp32 run anchors surrogate predictions
SURROGATE_BATCHES = 2  # fixed batches of the sensitivity table (one concatenated pass)
SURROGATE_BATCH_SIZE = 32
ESTIMATE_FILE = "training-split estimate"  # a note's name of the shared pass's file


def _from_config(name: str) -> property:
    """A read-only attribute of the evaluator that is its config's ``name``."""
    return property(lambda self: getattr(self.config, name), doc=f"``config.{name}``")


class Evaluator:
    """Scores precision policies of one model on one dataset for one target.

    Args:
        spec: a ModelSpec (``module``, ``loss``, ``logits``, ``name``); its module is not changed.
        data: a DataBundle (``loader``, ``fixed_batches``, ``key``).
        target: a device name or DeviceSpec; None detects the local one.
        config: every setting that decides a result, the default fidelity and the training
            recipe among them (:class:`~autoprec.evaluate.config.EvaluatorConfig`, the only
            way to set them); None: the defaults.
        cache_dir: where ``warmstart/*.pt`` and ``evaluations.sqlite`` live; None means
            ``$AUTOPREC_CACHE_DIR`` or ``~/.cache/autoprec``.
        cost_spec: the model as it will be trained in production, for the cost model's step
            time and memory (same layer names; e.g. resnet50 at 224 px while ``spec`` is the
            same architecture at 32 px for the fine-tuning); None: ``spec``.

    Divergence (a non-finite loss while fine-tuning, an exception in training, or a final
    loss above 10x fp32's) never raises: the result has ``diverged=True``, ``accuracy=0``,
    ``loss = 11 x fp32_loss`` (so ``loss_delta = 10.0``, above any run that did not diverge)
    and ``val_loss = 11 x`` fp32's (:mod:`autoprec.evaluate.scoring`). Precisions the target
    cannot run are still evaluated (emulated) with ``feasible=False``; their cost is estimated
    as fp32 for those layers (in ``native`` target mode, a layer is runnable as
    :mod:`autoprec.hardware.runnability` says). Out of memory on a measured run gives
    ``feasible=False`` with the same penalties. Only the fp32 reference itself diverging
    raises (:class:`~autoprec.evaluate.scoring.ReferenceDivergedError`).

    Attributes:
        config: the settings (also readable as attributes: ``steps`` and ``replicates`` by
            fidelity, ``finetune_lr``, ``batch_seed`` and ``cost_batch_size`` resolved, the
            ``recipe`` and its ``batch_size`` and ``lr``).
        device: the target's DeviceSpec.
        measured: whether costs are measured on this machine's device (the target is this
            device and ``config.pricing`` allows it), not modelled.
        mode: the runtime mode of the fine-tunes: ``"native"`` on the target's own GPU, else
            ``"emulate"``.
        runs: fine-tuning runs done by this instance (cache hits do not count).
        surrogate_pairs: ``{policy key: (precisions, loss_delta)}`` of the real evaluations
            (either fidelity, cache hits included) that did not diverge; the surrogate's
            training data.
    """

    # the settings of :attr:`config` as read-only attributes, resolved where None stands for
    # another setting's value
    fidelity, recipe, momentum, warm_start_steps, seed, target_mode = map(
        _from_config,
        ("fidelity", "recipe", "momentum", "warm_start_steps", "seed", "target_mode"),
    )
    batch_size = property(lambda self: self.config.recipe.batch_size, doc="``recipe.batch_size``")
    lr = property(lambda self: self.config.recipe.lr, doc="``recipe.lr``")
    steps, replicates, finetune_lr, batch_seed, cost_batch_size = map(
        _from_config,
        (
            "steps_by_fidelity",
            "replicates_by_fidelity",
            "resolved_finetune_lr",
            "resolved_batch_seed",
            "resolved_cost_batch_size",
        ),
    )

    def __init__(
        self,
        spec: Any,
        data: Any,
        target: str | DeviceSpec | None = None,
        *,
        config: EvaluatorConfig | None = None,
        cache_dir: str | Path | None = None,
        cost_spec: Any = None,
    ) -> None:
        self.spec = spec
        self.data = data
        self.device = detect() if target is None else get_device(target)
        self.config = EvaluatorConfig() if config is None else config
        # a fine-tuning batch beyond the machine's memory is one line now, not in a worker
        spec.check_batch(self.config.recipe.batch_size, activations=True)
        self.cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        self.cost_spec = spec if cost_spec is None else cost_spec
        local = detect().name == self.device.name
        on_gpu = torch.cuda.is_available() and local  # the fine-tunes run natively there
        self.measured = self._measures(local)
        self.mode = resolve_mode("auto", "cuda" if on_gpu else "cpu")
        self.fingerprint = model_fingerprint(spec.module)
        model = (self.fingerprint, weights_digest(spec.module))
        self._warm = WarmStart(spec, data, self.config, self.cache_dir, model)
        self._tuner = FineTuner(spec, data, self.config, on_gpu)
        self._costs: Any = CostEstimator(
            self.device, self.cost_spec, self.cost_batch_size, self.target_mode, spec.module,
            execution=self.config.execution,
        )  # fmt: skip
        if self.measured:
            from autoprec.evaluate.measured import MeasuredCosts, local_torch_device

            where = local_torch_device()
            execution = self.config.execution or MEASURED_EXECUTION[where.type]
            optimizer = self.config.recipe.optimizer
            self._costs = MeasuredCosts(self._costs, execution, optimizer, where)
        identity = EvaluationIdentity(
            self.config, model, data.key, self._costs.identity(), self.mode
        )
        self._cache = EvaluationCache(self.cache_dir / "evaluations.sqlite", identity, spec.module)
        self._surrogate: Surrogate | None = None
        self.surrogate_formats: tuple[str, ...] | None = None  # its table's; None: the default
        self._pool: Any = None  # an EvaluationPool while start_workers' workers run
        self._pool_estimates: frozenset[str] = frozenset()  # fidelities its workers estimate
        self.surrogate_pairs: dict[str, tuple[dict[str, Precision], float]] = {}
        self.runs = 0

    def _measures(self, local: bool) -> bool:
        """Whether costs are measured: ``pricing`` ``"measured"`` (the target must be this
        machine's device), or ``"auto"`` on the target's own device."""
        pricing = self.config.pricing
        if pricing == "measured" and not local:
            raise ValueError(
                f"pricing 'measured' times this machine's device ({detect().name}), not the "
                f"target {self.device.name}; name --target {detect().name} or price by the model"
            )
        return pricing == "measured" or (pricing == "auto" and local)

    # --- public -----------------------------------------------------------------------------
    @property
    def warm_start_path(self) -> Path:
        """The file holding the fp32 warm-start weights."""
        return self._warm.path

    def warm_start_state(self, progress: Progress | None = None) -> dict[str, torch.Tensor]:
        """The fp32 warm-start weights every evaluation fine-tunes from (trained or loaded on
        first use; a training tells its steps to ``progress(stage, done, total)``)."""
        return self._warm.state(progress)

    @property
    def warm_start_lr(self) -> float:
        """The SGD rate the warm start learnt at: ``lr``, or a backed-off one (loads or trains
        the warm start)."""
        return self.config.recipe.lr * self._warm.lr_scale

    @property
    def warm_start_trained(self) -> bool:
        """Whether this instance trained the warm start (False: loaded, or not needed yet)."""
        return self._warm.trained

    @property
    def settings_key(self) -> str:
        """The digest of everything besides the policy that decides this evaluator's results
        (the prefix of its cache keys)."""
        return self._cache.settings_key

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

        Raises:
            ReferenceDivergedError: the fp32 reference (run first) diverged.
        """
        policy = PrecisionPolicy.coerce(policy)
        fid = check_fidelity(fidelity or self.fidelity)
        if fid == "surrogate":
            return self._predict(policy)
        baseline = Baseline.of_metrics(self._reference(fid))
        metrics = self._cache.get(
            policy, fid, lambda: self._score(policy, fid, lambda run, cost: baseline)
        )
        self._record(policy, fid, metrics)
        return metrics

    def start_workers(self, workers: int) -> str | None:
        """Run the policies given to :meth:`prefetch` in ``workers`` processes, each on
        ``torch.get_num_threads() // workers`` threads (:mod:`autoprec.evaluate.pool`); loads
        or trains the warm start first, and with ``config.score_examples`` the fp32 reference
        of the default fidelity (the workers score with its training-split estimate). Until
        :meth:`stop_workers`, a real evaluation of a prefetched policy takes its run from
        there.

        Returns:
            None when the workers start, else why not (one line): fewer than 2 asked, or runs
            measured on this machine's GPU (timed runs must not share it).
        """
        if workers < 2:
            return f"{workers} worker(s) asked: evaluating in this process"
        if self.measured and torch.cuda.is_available():
            return "runs are timed on this machine's GPU: evaluating one at a time"
        from autoprec.evaluate.pool import EvaluationPool

        self.stop_workers()
        if self._tuner.estimated():
            self.reference()  # the workers' fine-tuner holds its split estimate
        self._pool = EvaluationPool(self._warm, self._tuner, self.mode, workers)
        self._pool_estimates = frozenset(self._tuner.estimates)
        return None

    def worker_evaluation_s(self) -> float | None:
        """The median CPU time of the runs the worker processes finished so far (the
        comparisons handed to them before the search, among others): what one evaluation
        takes on a worker's share of the threads, which the fp32 reference's run on every
        thread does not tell (CPU time: the comparisons run beside the sensitivity sweep,
        which their wall time would count). None without workers or before any finished."""
        times = [] if self._pool is None else self._pool.run_seconds()
        return statistics.median(times) if times else None

    @property
    def worker_threads(self) -> int:
        """Threads of each worker process (0 without workers)."""
        return 0 if self._pool is None else self._pool.threads

    def stop_workers(self) -> None:
        """Stop the worker processes now (runs not taken yet are dropped)."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def prefetch(self, policies: Iterable[Any], fidelity: str | None = None) -> int:
        """Start real evaluations of ``policies`` in the worker processes (nothing without
        :meth:`start_workers`, at the surrogate fidelity or one whose training-split estimate
        the workers lack, or for a policy already cached or started); :meth:`evaluate` then
        waits for them. Returns how many were started."""
        fid = check_fidelity(fidelity or self.fidelity)
        if self._pool is None or not self._pool.open or fid == "surrogate":
            return 0
        if self._tuner.estimated() and fid not in self._pool_estimates:
            return 0  # a worker would score the whole split: not this evaluator's number
        started = 0
        for item in policies:
            policy = PrecisionPolicy.coerce(item)
            key = self._cache.key(policy, fid)
            if self._cache.holds(key) or self._pool.pending(key):
                continue
            started += self._pool.submit(key, policy, fid)
        return started

    def reference(self, fidelity: str | None = None) -> Metrics:
        """Metrics of the uniform fp32 policy (computed once, cached).

        For ``"surrogate"`` this is the real ``"short"`` reference that predictions scale.

        Raises:
            ReferenceDivergedError: the fp32 run diverged.
        """
        fid = check_fidelity(fidelity or self.fidelity)
        return self._reference(SURROGATE_REFERENCE if fid == "surrogate" else fid)

    def surrogate(
        self,
        progress: Progress | None = None,
        on_plan: Callable[[Any], None] | None = None,
    ) -> Surrogate:
        """The surrogate, built on first use and fitted on :attr:`surrogate_pairs`.

        Its sensitivity table comes from :func:`autoprec.sensitivities.grade.sensitivity`, measured
        on this evaluator's fp32 warm start (the very weights every evaluation fine-tunes) with
        its seed, on 2 batches of 32, ``cache=True`` (on disk under ``$AUTOPREC_CACHE_DIR``),
        ``method="auto"``: the full sweep (exact one-layer measurements) when it fits the
        default time budget, else the focused sweep, else the Taylor estimate
        (:mod:`autoprec.sensitivities.budget`). ``progress`` and ``on_plan`` are handed to it when
        the table is computed (see there).
        """
        if self._surrogate is None:
            from autoprec.sensitivities.grade import DEFAULT_FORMATS, sensitivity

            table = sensitivity(
                self.spec,
                self.data,
                self.surrogate_formats or DEFAULT_FORMATS,
                batches=SURROGATE_BATCHES,
                batch_size=SURROGATE_BATCH_SIZE,
                method="auto",
                train_steps=0,
                seed=self.seed,
                cache=True,
                progress=progress,
                on_plan=on_plan,
                initial_state=self._warm.state(),
                initial_state_key=self._warm.key,
            )
            self._surrogate = Surrogate(table)
            if self.surrogate_pairs:
                self._surrogate.fit(self.surrogate_pairs.values())
        return self._surrogate

    def grade(self, precisions: Iterable[str]) -> None:
        """Have the surrogate's sensitivity table grade ``precisions`` (those a search chooses
        from), against fp32, instead of
        :data:`~autoprec.sensitivities.grade.DEFAULT_FORMATS`: an fp8 recipe as tensorwise fp8
        (the table reads an ungraded recipe as fp8's column), every other format as itself.
        Without its column a format's loss would be priced at 0 (the block formats are not
        among the defaults). Only before the surrogate is built (it is built once).

        Example:
            >>> evaluator.grade(["bf16", "fp8_rowwise", "nvfp4"])  # doctest: +SKIP
            >>> evaluator.surrogate_formats  # doctest: +SKIP
            ('fp32', 'bf16', 'fp8', 'nvfp4')
        """
        if self._surrogate is not None:
            return
        graded = ["fp8" if p.is_fp8 else p.value for p in map(parse_precision, precisions)]
        self.surrogate_formats = tuple(dict.fromkeys(["fp32", *graded]))

    def measure_costs(
        self, choices: Mapping[str, Iterable[str]], progress: Progress | None = None
    ) -> int:
        """Time the per-layer table for ``{layer: precisions}`` (those a search offers) and
        fp32's whole step, before the search runs (measured pricing only; kept on disk, so a
        second search measures nothing). Returns how many layer timings were taken."""
        if not self.measured:
            return 0
        self.stop_workers()  # timings taken alone on the device
        return self._costs.measure(choices, progress)

    def time_steps(self, policies: Iterable[Any]) -> list[Any]:
        """Each policy's whole training step on this machine's device, as production runs it
        (:func:`~autoprec.timing.time_steps`: side by side on the CPU, one at a time on a GPU;
        a :class:`~autoprec.timing.StepTiming` each; measured pricing only, else empty). Worker
        processes are stopped first: a timing shares the device with nothing."""
        if not self.measured:
            return []
        self.stop_workers()
        return self._costs.steps(policies)

    @property
    def execution(self) -> str | None:
        """The program costs are for: measured, the one timed; modelled,
        ``config.execution`` (None: the cost model's default, not stated)."""
        return getattr(self._costs, "execution", None)

    @property
    def costs(self) -> Any:
        """Where costs come from: the cost model's
        :class:`~autoprec.evaluate.costing.CostEstimator`, or, measured, the
        :class:`~autoprec.evaluate.measured.MeasuredCosts` (its ``execution``, ``fp32_step``,
        ``store``)."""
        return self._costs

    def cost_table(self) -> Any:
        """The layer table of :attr:`cost_spec` at :attr:`cost_batch_size` (cached)."""
        return self._costs.cost_table()

    def unrunnable(self, precisions: Mapping[str, Precision]) -> dict[str, str]:
        """``{layer: reason}`` for the layers of ``precisions`` the target cannot run in its
        :attr:`target_mode` (the runnability table; for a layer the table lacks, whether the
        device has the format at all)."""
        return self._costs.unrunnable(precisions)

    # --- evaluations ------------------------------------------------------------------------
    def _record(self, policy: PrecisionPolicy, fidelity: str, metrics: Metrics) -> None:
        """Add a real, non-diverged result to the surrogate's pairs and refit (cheap)."""
        if metrics.diverged or not math.isfinite(metrics.loss_delta):
            return
        key = self._cache.key(policy, fidelity)
        if key in self.surrogate_pairs:
            return
        self.surrogate_pairs[key] = (policy.resolve(self.spec.module), metrics.loss_delta)
        if self._surrogate is not None:
            self._surrogate.fit(self.surrogate_pairs.values())

    def _reference(self, fidelity: str) -> Metrics:
        """The fp32 reference at ``fidelity``: its own run is its baseline. Its run also
        measures the pass that estimates every policy's training-split loss at ``fidelity``
        (:meth:`_split_estimate`)."""
        fp32 = PrecisionPolicy.uniform(Precision.FP32)
        own = Baseline.of_reference_run
        metrics = self._cache.get(
            fp32, fidelity, lambda: self._score(fp32, fidelity, own, reference=True)
        )
        self._split_estimate(fidelity)
        return metrics

    def _split_estimate(self, fidelity: str) -> None:
        """Give the fine-tuner the training split's estimate at ``fidelity`` (when
        ``config.score_examples`` subsets the split): kept from the reference's run, else
        loaded from ``scoring/<key>.pt``, else measured by running the reference again (a
        missing or damaged file; the run is deterministic)."""
        tuner = self._tuner
        if fidelity in tuner.estimates or not tuner.estimated():
            return
        from autoprec.evaluate._store import load_state
        from autoprec.evaluate.split_estimate import SplitEstimate

        saved = load_state(self._estimate_path(fidelity), what=ESTIMATE_FILE)
        estimate = None if saved is None else SplitEstimate.from_state(saved, self.spec.module)
        if estimate is not None:
            tuner.estimates[fidelity] = estimate
        else:  # its run keeps and saves it (a diverged reference raised already)
            self._run(PrecisionPolicy.uniform(Precision.FP32), fidelity, reference=True)

    def _estimate_path(self, fidelity: str) -> Path:
        """The file of the training split's estimate at ``fidelity``: named by the fp32
        reference's evaluation key (every setting that decides it)."""
        key = self._cache.key(PrecisionPolicy.uniform(Precision.FP32), fidelity)
        return self.cache_dir / "scoring" / f"{key}.pt"

    def _run(self, policy: PrecisionPolicy, fidelity: str, reference: bool = False) -> FineTuneRun:
        """A fine-tuning run of ``policy`` from the warm start; a policy the target cannot run
        natively is emulated (it is scored for its accuracy only: it is infeasible). The
        ``reference``'s run measures the training split's estimate (``run.split_estimate``),
        kept by the fine-tuner for the runs that follow."""
        if self._pool is not None and not reference:
            pooled = self._pool.take(self._cache.key(policy, fidelity))
            if pooled is not None:
                self.runs += 1
                return pooled
        start = time.perf_counter()
        state = self._warm.state()
        mode = self.mode
        if mode == "native" and self.unrunnable(policy.resolve(self.spec.module)):
            mode = "emulate"
        self.runs += 1
        run = self._tuner.run(
            policy, fidelity, state, mode, start, self._warm.lr_scale, measure_split=reference
        )
        if run.split_estimate is not None:
            from autoprec.evaluate._store import save_state_atomic

            path = self._estimate_path(fidelity)
            save_state_atomic(path, run.split_estimate.to_state(), what=ESTIMATE_FILE)
            self._tuner.estimates[fidelity] = run.split_estimate
        return run

    def _score(
        self,
        policy: PrecisionPolicy,
        fidelity: str,
        baseline: Callable[[FineTuneRun, tuple[float, int]], Baseline],
        reference: bool = False,
    ) -> Metrics:
        """Run and score ``policy`` against ``baseline(run, its cost)``: the fixed fp32
        reference's for a policy, the run's own for the ``reference`` itself."""
        precisions = policy.resolve(self.spec.module)
        run = self._run(policy, fidelity, reference)
        cost = self._costs.estimate(precisions)
        against = baseline(run, cost)
        return score_run(
            run,
            against,
            cost=cost,
            amp=self._costs.amp,
            runnable=not self.unrunnable(precisions),
            measured=self.measured,
            fidelity=fidelity,
            steps=self.steps[fidelity],
        )

    def _predict(self, policy: PrecisionPolicy) -> Metrics:
        """Surrogate metrics (see :meth:`evaluate`); not cached."""
        reference = self._reference(SURROGATE_REFERENCE)
        surrogate = self.surrogate()
        start = time.perf_counter()
        precisions = policy.resolve(self.spec.module)
        predicted = surrogate.predict(precisions)
        return predicted_metrics(
            predicted,
            reference,
            cost=self._costs.estimate(precisions),
            fp32=self._costs.fp32,
            amp=self._costs.amp,
            runnable=not self.unrunnable(precisions),
            wall_time_s=time.perf_counter() - start,
        )
