"""``run_search``: one whole search, as ``autoprec search`` runs it, without printing.

Phases: check the outputs, build the model and data, the fp32 warm start and reference
(cached), the per-layer sensitivities (cached), MLflow tracking, the agent's search, the
comparisons with the target's AMP and the hand-written rules, export, and (``verify``) the
verification of the exported policy. What happens is told through :class:`SearchCallbacks`,
with the estimate of the time left in all (:class:`~autoprec.pipeline.eta.Remaining`, fed here
as each part starts, reports and ends); what was found comes back as a :class:`SearchReport`.

A ``KeyboardInterrupt`` during the set-up or the search (Ctrl-C; SIGTERM too where the caller's
``interruptible`` turns it into one) exports what was found so far; running the same search
again (or with ``resume=True``) continues without repeating finished evaluations: every
evaluation is kept in the evaluator's SQLite cache, Optuna trials in ``storage`` and the PPO
agent in a checkpoint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autoprec.evaluate.config import EvaluatorConfig
from autoprec.evaluate.workload import (
    Workload,
    build_evaluator,
    fallback_note,
    production_parameters,
    resolve_target,
)
from autoprec.pipeline.callbacks import SearchCallbacks
from autoprec.pipeline.config import (
    DEFAULT_STORAGE,
    SEARCH_VERIFY_SEEDS,
    SEARCH_VERIFY_STEPS,
    SearchConfig,
    SearchSetupError,
)
from autoprec.pipeline.eta import Remaining
from autoprec.pipeline.evaluations import comparisons, prefetch_comparisons, start_workers
from autoprec.pipeline.export import Exporter, Found
from autoprec.pipeline.report import Comparison, SearchReport

if TYPE_CHECKING:  # pragma: no cover
    from autoprec.agents import Problem
    from autoprec.agents.result import SearchResult, Trial
    from autoprec.evaluate import Evaluator, Metrics
    from autoprec.evaluate.reward import RewardConfig
    from autoprec.models import ModelSpec
    from autoprec.policy import PrecisionPolicy
    from autoprec.verify import VerifyConfig


def run_search(config: SearchConfig, callbacks: SearchCallbacks | None = None) -> SearchReport:
    """Run the search ``config`` describes and export its best policy.

    Example:
        >>> import autoprec  # doctest: +SKIP
        >>> report = autoprec.search(autoprec.SearchConfig(model="mlp", agent="random",
        ...                          budget=1, mlflow=False, out="p.yaml"))
        >>> report.policy_path, report.phase_times["search"]

    Args:
        config: the search's settings.
        callbacks: what is told while it runs (None: nothing).

    Raises:
        SearchSetupError: an output that cannot be written, a precision the target lacks.
        SearchExportError: the search finished but a file cannot be written.
        ValueError: any other mistake of the inputs (one line).
    """
    return _Run(config, callbacks or SearchCallbacks()).main()


class _Run:
    """One search: setup, phases, interruption, export."""

    def __init__(self, config: SearchConfig, callbacks: SearchCallbacks) -> None:
        self.c = config
        self.train_tokens = config.train_tokens  # the config keeps the weight it sets
        self.tell = callbacks
        self.phases: dict[str, float] = {}
        self.latest: SearchResult | None = None  # the newest result seen by the search
        self.tracker: Any = None  # the SearchTracker once the search starts
        self.problem: Problem | None = None
        self.evaluator: Evaluator | None = None
        self.exporter: Exporter | None = None
        self.rules: list[tuple[str, Metrics, float]] = []  # the hand rules' metrics, rewards
        self.at_once = 1  # real evaluations side by side (the worker processes)
        self.verify_status = 0
        self.policy: PrecisionPolicy | None = None  # the best policy as exported
        self.measured: dict[str, Any] = {}  # what the finalists' timings were, for provenance
        self.eta = Remaining()  # the time left in all, told to the callbacks as it starts

    def main(self) -> SearchReport:
        try:
            return self._main()
        except BaseException as err:
            if self.tracker is not None:  # still open only when something went wrong
                self.tracker.close("KILLED" if isinstance(err, KeyboardInterrupt) else "FAILED")
            raise
        finally:
            if self.evaluator is not None:
                self.evaluator.stop_workers()

    def _main(self) -> SearchReport:
        start = time.perf_counter()
        self.tell.remaining(self.eta)
        self._check_output()
        with self.tell.interruptible():
            try:
                problem, agent_kwargs = self._setup()
                result = self._search(problem, agent_kwargs)
            except KeyboardInterrupt:
                return self._interrupted()
        amp, self.rules = comparisons(problem, self._phase)
        if problem.evaluator.measured:
            from autoprec.pipeline import measured

            with self._phase("measured finalists"):
                found = measured.time_finalists(problem, result, amp, self.rules)
            result, amp, self.rules, self.measured = (
                found.result, found.amp, found.rules, found.provenance
            )  # fmt: skip
            self.tell.line(measured.finalists_line(found.provenance))
            measured.keep_steps(problem, self.c, found.timed, self.tell.line)
        written = self._export(result, amp, interrupted=False)
        self._finish_tracking(result, written, amp, status="FINISHED")
        if self.c.verify and written is not None:
            self.verify_status = self._verify(written)
        if not self.verify_status:  # interrupted: the policy is written, the finished runs kept
            self.phases["total"] = time.perf_counter() - start
        return self._report(result, amp, interrupted=False)

    def _interrupted(self) -> SearchReport:
        self.tell.line("[yellow]interrupted: exporting what was found so far[/]")
        if self.latest is not None:
            written = self._export(self.latest, None, interrupted=True)
            self._finish_tracking(self.latest, written, None, status="KILLED")
        else:
            self.tell.line("no evaluation finished; nothing to export")
            if self.tracker is not None:
                self.tracker.close("KILLED")
                self.tracker = None
        return self._report(self.latest, None, interrupted=True)

    def _report(
        self, result: SearchResult | None, amp: Metrics | None, *, interrupted: bool
    ) -> SearchReport:
        exporter = self.exporter
        verdicts = {} if exporter is None else exporter.verdicts
        amp_cmp = hand = None
        if amp is not None and "amp" in verdicts and self.problem is not None:
            amp_cmp = Comparison("amp", amp, self.problem.reward(amp), verdicts["amp"])
        if self.rules and "hand_rules" in verdicts:
            name, metrics, reward = max(self.rules, key=lambda r: r[2])
            hand = Comparison(name, metrics, reward, verdicts["hand_rules"])
        return SearchReport(
            config=self.c,
            result=result,
            policy=self.policy,
            policy_path=None if exporter is None else exporter.written.get("policy"),
            amp=amp_cmp,
            hand_rules=hand,
            rules=tuple(self.rules),
            written={} if exporter is None else dict(exporter.written),
            phase_times=dict(self.phases),
            interrupted=interrupted,
            verify_status=self.verify_status,
        )

    @contextlib.contextmanager
    def _phase(self, name: str, draws_progress: bool = False) -> Iterator[None]:
        begin = time.perf_counter()
        self.eta.begin(name)
        with contextlib.nullcontext() if draws_progress else self.tell.working(name):
            yield
        self.eta.end(name)
        self.phases[name] = self.phases.get(name, 0.0) + time.perf_counter() - begin
        self.tell.phase_done(name, self.phases[name])

    def _check_output(self) -> None:
        """Fail before any work if an output cannot be written: ``out`` (its folder and its
        suffix), ``pareto_dir``, the cache folder, and a damaged SQLite Optuna storage."""
        from autoprec.agents.naming import state_folder
        from autoprec.agents.optuna_study import check_storage
        from autoprec.cache import cache_dir
        from autoprec.pipeline import checks
        from autoprec.policy import PolicyError
        from autoprec.policy.io import policy_format
        from autoprec.tracking import resolve_tracking_uri

        c = self.c
        try:
            policy_format(c.out)
        except PolicyError as err:
            raise SearchSetupError(f"--out {err}") from None
        targets = [Path(c.out).resolve().parent]
        if c.pareto_dir:
            targets.append(Path(c.pareto_dir).resolve())
        checks.check_writable(targets, SearchSetupError)
        cache_dir()  # a file in its place is an error now, not after the warm start
        if c.study_name:  # a name that would leave its folder is refused now too
            state_folder(c.study_name)
        if c.agent in ("tpe", "nsga2"):
            tracking = resolve_tracking_uri(c.tracking_uri) if c.mlflow else None
            check_storage(c.storage or DEFAULT_STORAGE, tracking)

    def _setup(self) -> tuple[Problem, dict[str, Any]]:
        from autoprec.agents import Problem
        from autoprec.evaluate.reward import RewardConfig
        from autoprec.precision import parse_precision

        c = self.c
        weights = {"speedup": c.w_speedup, "memory": c.w_memory, "accuracy": c.w_accuracy}
        reward = RewardConfig(weights, c.accuracy_tolerance)
        device, fell_back = resolve_target(c.target)
        if fell_back:
            self.tell.line(fallback_note("optimising"))
        from autoprec.hardware.defaults import search_precisions

        # every precision the target runs, in action order
        shown = c.precisions or ",".join(search_precisions(device))
        precisions = tuple(p.strip() for p in shown.split(",") if p.strip())
        lacking = [p.value for p in map(parse_precision, precisions) if not device.supports(p)]
        if lacking:
            raise SearchSetupError(
                f"{device.name} cannot run {', '.join(lacking)} (it supports "
                f"{', '.join(device.supported_precisions)}); drop it from --precisions"
            )
        workload = Workload(
            c.model, c.dataset, c.data_dir, c.num_classes, c.image_size,
            train_shape=c.train_shape, train_image_size=c.train_image_size,
            cost_batch_size=c.train_batch_size, seed=c.seed, init_weights=c.init_weights,
            max_samples=c.max_samples,
        ).resolved()  # fmt: skip
        with self._phase("model and data"):
            settings = EvaluatorConfig(
                fidelity=c.fidelity,
                steps=c.steps,
                target_mode=c.target_mode,
                recipe=c.recipe,
                execution=c.execution,
                pricing=c.pricing,
            )
            evaluator, workload = build_evaluator(workload, device, settings)
        self.c = c = dataclasses.replace(
            c, target=device.name, precisions=shown, dataset=workload.dataset,
            train_batch_size=workload.cost_batch_size,
        )  # fmt: skip
        spec, cost_spec = evaluator.spec, evaluator.cost_spec
        self.tell.line(
            f"{spec.name}: fine-tuning at {tuple(spec.input_shape)} on {c.dataset}; "
            f"costs for {device.name} at batch {c.train_batch_size}, input "
            f"{tuple(cost_spec.input_shape)}"
        )
        if c.train_tokens is not None:
            reward = self._reward_for_length(workload, cost_spec)
        # a model with no layer to tune is refused here, before the warm start
        problem = Problem(evaluator, fidelity=c.fidelity, reward=reward, precisions=precisions)
        rules = self._expect(problem)
        if evaluator.measured:  # before any worker process shares the device
            from autoprec.pipeline.measured import measure_layers

            with self._phase("per-layer timings", draws_progress=True):
                measure_layers(problem, self.tell)
        eta = self.eta
        with self._phase("warm start and fp32 reference", draws_progress=True):
            eta.begin("warm start")
            with self.tell.stage_progress("warm start") as (progress, _):
                # its steps and time left, if it trains
                evaluator.warm_start_state(eta.steps("warm start", progress))
            eta.end("warm start")
            if c.verify:  # the verification's steps at the warm start's pace, if it trained
                verify = self._verify_config(evaluator)  # the policy's arm and the others'
                runs = (1 + len(verify.arms)) * len(verify.seeds)
                eta.expect_steps("verification", runs * verify.steps)
            with self.tell.working("fp32 reference"):
                evaluator.reference()
            eta.end("fp32 reference")
            self.evaluator = evaluator  # its workers are stopped when the search ends
            self.at_once = start_workers(evaluator, c.workers, self.tell.line)
            self._expect_evaluations(evaluator, rules)  # known as the phase ends
        prefetch_comparisons(problem)  # the workers run them while the sensitivities are measured
        if self.at_once > 1:
            eta.queue("AMP comparison", "hand rules")
        with self._phase("sensitivity", draws_progress=True):
            with self.tell.stage_progress("sensitivity") as (progress, on_plan):
                on_plan = eta.plan("sensitivity", on_plan)
                evaluator.surrogate(progress=progress, on_plan=on_plan)
            self._pace_search(evaluator)  # a worker's evaluation timed meanwhile, if any
        self.device = device
        self.problem = problem
        pareto = Path(c.pareto_dir) if c.pareto_dir else None
        self.exporter = Exporter(self.tell.line, spec, device, Path(c.out), pareto)
        return problem, self._agent_kwargs()

    def _expect(self, problem: Problem) -> int:
        """The parts of the estimate still to come (:mod:`autoprec.pipeline.eta`), each
        unknown until predicted; returns how many hand rules will be compared."""
        from autoprec.agents.hand_rules import hand_rule_policies

        measured = problem.evaluator.measured
        rules = len(hand_rule_policies(problem))
        parts = [
            *(["per-layer timings"] if measured else []),
            "warm start",
            "fp32 reference",
            "sensitivity",
            "search",
            "AMP comparison",
            *(["hand rules"] if rules else []),
            *(["measured finalists"] if measured else []),
            *(["verification"] if self.c.verify else []),
        ]
        self.eta.expect(*parts)
        return rules

    def _expect_evaluations(self, evaluator: Evaluator, rules: int) -> None:
        """The search (:meth:`_pace_search`) and the comparisons (AMP and ``rules`` hand
        rules) predicted from one evaluation's seconds at :attr:`at_once` side by side."""
        one = self._pace_search(evaluator)
        self.eta.predict("AMP comparison", one / self.at_once)
        self.eta.predict("hand rules", rules * one / self.at_once)

    def _pace_search(self, evaluator: Evaluator) -> float:
        """The seconds of one of the search's evaluations: a worker's timed run (the
        comparisons handed to them), else the fp32 reference's (with workers only a floor);
        the estimate's search is predicted from it (returned for the search bar)."""
        timed = evaluator.worker_evaluation_s()
        one = timed or evaluator.reference().wall_time_s  # (cached)
        floor = timed is None and self.at_once > 1
        self.eta.expect_search(self.c.budget, one, self.at_once, at_least=floor)
        return one

    def _reward_for_length(self, workload: Workload, cost_spec: ModelSpec) -> RewardConfig:
        """The reward at ``train_tokens``' accuracy weight (Chinchilla's price of a loss increase
        for the production model), said in one line; the config takes the weight."""
        from autoprec.evaluate.reward import RewardConfig, chinchilla_accuracy_weight

        params = production_parameters(workload, cost_spec)
        weight = chinchilla_accuracy_weight(params, self.train_tokens)
        self.c = c = dataclasses.replace(self.c, w_accuracy=weight, train_tokens=None)
        self.tell.line(
            f"accuracy weight {weight:.1f}: a relative loss increase priced as the tokens that "
            f"recover it, by Chinchilla's fit for {params / 1e9:.2f}B parameters trained on "
            f"{self.train_tokens:.3g} tokens"
        )
        weights = {"speedup": c.w_speedup, "memory": c.w_memory, "accuracy": weight}
        return RewardConfig(weights, c.accuracy_tolerance)

    def _search_name(self) -> str:
        """The name the search's state is kept under (``study_name``, else the default)."""
        from autoprec.agents.naming import search_name

        c = self.c
        if c.study_name:
            return c.study_name
        return search_name(c.model, c.dataset, c.target, c.agent, c.seed)

    def _agent_kwargs(self) -> dict[str, Any]:
        """The agent's options: the search's name and ``resume`` (the agent keeps its own
        state under that name), and for Optuna the storage and the study it will use."""
        c = self.c
        kwargs: dict[str, Any] = {"name": self._search_name(), "resume": c.resume}
        if c.agent in ("tpe", "nsga2"):
            from autoprec.agents.optuna_study import shown_storage, study_name_for

            storage = c.storage or DEFAULT_STORAGE
            study = c.study_name or study_name_for(storage, kwargs["name"], c.resume)
            self.tell.line(f"optuna study {study!r} in {shown_storage(storage)}")
            kwargs |= {"storage": storage, "study_name": study}
        return kwargs

    def _search(self, problem: Problem, agent_kwargs: dict[str, Any]) -> SearchResult:
        from autoprec.agents import search

        tracking: list[Any] = []
        if self.c.mlflow:
            self._start_tracking()
            tracking.append(self.tracker)
        begin = time.perf_counter()
        one = self._pace_search(problem.evaluator)  # a worker's evaluation, if one is timed
        self.eta.begin("search")
        with self.tell.search_progress(self.c.budget, one, self.at_once) as shown:
            result = search(
                problem,
                budget=self.c.budget,
                seed=self.c.seed,
                # self first: the newest result, what an interrupt raised by another exports
                callbacks=[self, *shown, *tracking],
                agent=self.c.agent,
                **agent_kwargs,
            )
        self.latest = result
        self.eta.end("search")
        self.phases["search"] = time.perf_counter() - begin
        self.tell.phase_done("search", self.phases["search"])
        return result

    def on_trial(self, trial: Trial, result: SearchResult) -> None:
        """A search callback: keeps the newest result (what an interrupted search exports) and
        tells the estimate how many real evaluations finished."""
        self.latest = result
        self.eta.evaluated(len(result.real_trials))

    def _start_tracking(self) -> None:
        """Open the MLflow parent run (a failure turns tracking off with one line)."""
        from autoprec.tracking import SearchRunInfo, SearchTracker
        from autoprec.training.recipe import to_provenance

        begin = time.perf_counter()
        c = self.c
        info = SearchRunInfo(
            c.model,
            dataset=c.dataset,
            target=c.target,
            agent=c.agent,
            budget=c.budget,
            seed=c.seed,
            fidelity=c.fidelity,
            reward=self.problem.reward,
            params={
                "steps": c.steps,
                "precisions": c.precisions,
                "train_batch_size": c.train_batch_size,
                "train_image_size": c.train_image_size,
                "train_shape": c.train_shape,
                "init_weights": c.init_weights,
                "max_samples": c.max_samples,
                "train_tokens": self.train_tokens,
                "execution": c.execution,
                "pricing": c.pricing,
                "image_size": c.image_size,
                "num_classes": c.num_classes,
                "study_name": self._search_name(),
                "resume": c.resume,
                **to_provenance(c.recipe, default_too=True),  # recipe_optimizer, recipe_lr, ...
            },
        )
        self.tracker = SearchTracker(info, tracking_uri=c.tracking_uri, experiment=c.experiment)
        if self.tracker.start():
            self.tell.line(
                f"mlflow: run {self.tracker.run_id} in experiment "
                f"{self.tracker.experiment!r} at {self.tracker.tracking_uri}"
            )
        self.phases["tracking"] = time.perf_counter() - begin

    def _finish_tracking(
        self, result: SearchResult, policy_path: Path | None, amp: Metrics | None, status: str
    ) -> None:
        """Final metrics and artifacts on the parent run; it ends with ``status``."""
        if self.tracker is None:
            return
        begin = time.perf_counter()
        fp32 = None
        if self.problem is not None and status == "FINISHED":
            fp32 = self.problem.evaluator.reference()  # cached since the warm start
        self.tracker.finish(
            result, best_policy_path=policy_path, amp_metrics=amp, fp32_metrics=fp32, status=status
        )
        self.phases["tracking"] = self.phases.get("tracking", 0.0) + time.perf_counter() - begin

    def _verify(self, policy_path: Path) -> int:
        """The verification of the exported policy with ``verify``'s small defaults, at the
        rate the warm start learnt at (the recipe's unless it backed off); 0, or the exit
        status of an interrupted verification."""
        with self._phase("verification", draws_progress=True):  # each run's progress line
            verify = self._verify_config(self.problem.evaluator)
            return self.tell.verify(policy_path, self.c, verify)

    def _verify_config(self, evaluator: Evaluator) -> VerifyConfig:
        """The :class:`~autoprec.verify.VerifyConfig` of ``verify=True``: its small
        defaults, at the rate the warm start learnt at (a rate fp32 learns at from fresh
        weights), at the shape the search trained at, with the search's seed, data and
        tolerance."""
        from autoprec.verify import VerifyConfig

        c = self.c
        shape = evaluator.spec.input_shape
        return VerifyConfig(
            recipe=dataclasses.replace(evaluator.config.recipe, lr=evaluator.warm_start_lr),
            steps=SEARCH_VERIFY_STEPS,
            seeds=tuple(range(c.seed, c.seed + SEARCH_VERIFY_SEEDS)),
            tolerance=c.accuracy_tolerance,
            dataset=c.dataset,
            data_dir=c.data_dir,
            num_classes=c.num_classes,
            image_size=shape[-1] if len(shape) == 3 else None,
        )

    # -- export --
    def _export(
        self, result: SearchResult, amp: Metrics | None, *, interrupted: bool
    ) -> Path | None:
        """The search's files (:class:`~autoprec.pipeline.export.Exporter`); the best
        policy's path, None when no real evaluation finished."""
        begin = time.perf_counter()
        result.execution = self.problem.evaluator.execution  # the exports' target.execution
        self.policy = self._best_policy(result, interrupted)
        from autoprec.agents.hand_rules import hand_rule_policies, hand_rules_left_out

        amp_reward = None if amp is None else self.problem.reward(amp)
        left_out = () if amp is None else hand_rules_left_out(self.problem)
        maps = dict(hand_rule_policies(self.problem)) if self.rules else {}
        found = Found(result, self.policy, amp, amp_reward, self.rules, left_out, maps)
        written = self.exporter.export(found)
        self.phases["export"] = time.perf_counter() - begin
        return written

    def _best_policy(self, result: SearchResult, interrupted: bool) -> PrecisionPolicy | None:
        """The best policy with its provenance; None when no real evaluation finished."""
        from autoprec.training.recipe import to_provenance
        from autoprec.verify import WARM_START_LR

        c = self.c
        if result.best is None:
            return None
        policy = result.best_policy(self.exporter.spec_module)
        return policy.replace(
            provenance={
                **dict(policy.provenance),
                "agent": c.agent,
                "dataset": c.dataset,
                "seed": c.seed,
                "budget": c.budget,
                "interrupted": str(interrupted).lower(),
                **to_provenance(self.problem.evaluator.config.recipe),
                WARM_START_LR: float(f"{self.problem.evaluator.warm_start_lr:g}"),
                **{f"w_{k}": float(f"{w:.6g}") for k, w in self.problem.reward.weights.items()},
                **self._given({"train_tokens": self.train_tokens, "max_samples": c.max_samples}),
                **self.measured,
                **self._run_provenance(),
            }
        )

    @staticmethod
    def _given(values: dict[str, Any]) -> dict[str, Any]:
        """``values`` but those left at None."""
        return {k: v for k, v in values.items() if v is not None}

    def _run_provenance(self) -> dict[str, str]:
        tracker = self.tracker
        if tracker is None or not tracker.active or tracker.run_id is None:
            return {}
        return {"mlflow_run_id": tracker.run_id}
