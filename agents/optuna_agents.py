"""Optuna agents: ``tpe`` (maximise the reward) and ``nsga2`` (the three objectives).

Each tunable layer is one categorical parameter (its name; choices: the supported precisions).
The baselines (fp32, AMP, the target's default rule) are enqueued first in a new study.

Studies may live in an RDB storage (``storage="sqlite:///optuna.db"``), loaded if they exist:

* a resumed search does not repeat finished work: the study's COMPLETE trials count toward the
  budget and come back as :class:`~autoprec.agents.Trial` s (rebuilt from their user attrs);
* several processes may share one study: the budget is the study's total of COMPLETE trials.
  Before asking, a worker counts COMPLETE and RUNNING trials; after asking, the trials
  numbered below its own; a trial asked beyond the budget (a race) is told FAIL with the user
  attr ``autoprec_skipped``, so the study never holds more COMPLETE trials than the budget.
  Give the workers different seeds, or their samplers propose the same policies.

A policy already COMPLETE or RUNNING in the study (or evaluated in this search) is not
evaluated again: its trial is told PRUNED with the user attr ``duplicate_of``. Diverged
policies are COMPLETE trials with the penalised values. Each COMPLETE trial has the user attrs
``metrics`` (``Metrics.to_dict()``), ``reward``, ``fidelity`` and ``wall_time_s``.

A process killed between ask and tell leaves a RUNNING trial that keeps its slot of the budget;
an ``optuna.storages.RDBStorage`` with ``heartbeat_interval`` set lets the next search fail such
trials (``fail_stale_trials`` is called at the start).
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Mapping
from typing import Any, ClassVar

from autoprec.agents.base import Agent, Session, Trial
from autoprec.agents.simple import baseline_policies

PENALTY_VALUES = {"loss_delta": 10.0, "speedup": 0.0, "memory_ratio": 10.0}


class _OptunaAgent(Agent):
    """Shared ask/tell loop of the Optuna agents.

    Args:
        storage: an Optuna storage URL or object; None keeps the study in memory.
        study_name: None: ``autoprec-<agent>-<model>-<target>-<fidelity>``.
        sampler: an ``optuna.samplers.BaseSampler`` to use instead of the default.
        enqueue_baselines: enqueue fp32, AMP and the default rule in a new study.
        max_repeats: stop after this many proposals in a row that were duplicates (the space
            may be smaller than the budget).
    """

    directions: ClassVar[tuple[str, ...]] = ()

    def __init__(
        self,
        storage: Any = None,
        study_name: str | None = None,
        sampler: Any = None,
        enqueue_baselines: bool = True,
        max_repeats: int = 100,
    ) -> None:
        self.storage = storage
        self.study_name = study_name
        self.sampler = sampler
        self.enqueue_baselines = enqueue_baselines
        self.max_repeats = max_repeats

    # --- what the subclasses define -----------------------------------------------------------
    def make_sampler(self, session: Session) -> Any:
        raise NotImplementedError

    def values(self, trial: Trial) -> list[float]:
        raise NotImplementedError

    # --- the loop -----------------------------------------------------------------------------
    def run(self, session: Session) -> None:
        import optuna
        from optuna.distributions import CategoricalDistribution
        from optuna.trial import TrialState

        problem = session.problem
        layers = problem.layers()
        distributions = {n: CategoricalDistribution(problem.choices(n)) for n in layers}
        study = self._create_study(session)
        session.result.info["study_name"] = study.study_name
        if isinstance(self.storage, str):
            session.result.info["storage"] = self.storage
        self._check_study(study, session)
        with warnings.catch_warnings():  # experimental; acts only for storages with a heartbeat
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            optuna.storages.fail_stale_trials(study)
        self._load(study, session)
        if self.enqueue_baselines and not study.get_trials(deepcopy=False):
            for name, policy in baseline_policies(session):
                fits = all(policy[n] in distributions[n].choices for n in layers)
                if fits:
                    study.enqueue_trial(policy, user_attrs={"baseline": name}, skip_if_exists=True)

        repeats = 0
        try:
            while repeats < self.max_repeats:
                if _count(study, (TrialState.COMPLETE, TrialState.RUNNING)) >= session.budget:
                    return
                trial = study.ask(distributions)
                try:
                    states = (TrialState.COMPLETE, TrialState.RUNNING, TrialState.WAITING)
                    if _count(study, states, below=trial.number) >= session.budget:
                        trial.set_user_attr("autoprec_skipped", "budget reached by other workers")
                        study.tell(trial, state=TrialState.FAIL)
                        return
                    policy = {n: trial.params[n] for n in layers}
                    duplicate = self._duplicate(study, session, trial.number, policy)
                    if duplicate is not None:
                        trial.set_user_attr("duplicate_of", duplicate)
                        study.tell(trial, state=TrialState.PRUNED)
                        repeats += 1
                        continue
                    repeats = 0
                    attrs = {"optuna_trial": trial.number}
                    if "baseline" in trial.user_attrs:
                        attrs["name"] = trial.user_attrs["baseline"]
                    result = session.evaluate(policy, notify=False, **attrs)
                    for key, value in _user_attrs(result).items():
                        trial.set_user_attr(key, value)
                    study.tell(trial, self.values(result))
                except BaseException:
                    study.tell(trial, state=TrialState.FAIL, skip_if_finished=True)
                    raise
                session.notify(result)
        finally:
            self._load(study, session)  # what other workers finished meanwhile

    # --- helpers ------------------------------------------------------------------------------
    def _create_study(self, session: Session, retries: int = 4) -> Any:
        """Create or load the study. Workers starting together on a new RDB file race to create
        its tables (``table ... already exists`` from SQLAlchemy); the loser tries again."""
        import optuna

        def create() -> Any:
            return optuna.create_study(
                storage=self.storage,
                sampler=self.sampler if self.sampler is not None else self.make_sampler(session),
                study_name=self.study_name or self.default_study_name(session),
                directions=list(self.directions),
                load_if_exists=True,
            )

        for attempt in range(retries if isinstance(self.storage, str) else 0):
            try:
                return create()
            except Exception as exc:
                if type(exc).__module__.split(".")[0] != "sqlalchemy":
                    raise
                time.sleep(0.2 * (attempt + 1))
        return create()

    def default_study_name(self, session: Session) -> str:
        problem = session.problem
        return (
            f"autoprec-{self.name}-{problem.evaluator.spec.name}-"
            f"{problem.evaluator.device.name}-{problem.fidelity}"
        )

    @staticmethod
    def _check_study(study: Any, session: Session) -> None:
        """Refuse a study made for another model, target or fidelity."""
        problem = session.problem
        meta = {
            "model": problem.evaluator.spec.name,
            "target": problem.evaluator.device.name,
            "fidelity": problem.fidelity,
            "layers": problem.layers(),
        }
        stored = study.user_attrs.get("autoprec")
        if stored is None:
            study.set_user_attr("autoprec", meta)
            return
        differ = sorted(k for k in meta if stored.get(k) != meta[k])
        if differ:
            raise ValueError(
                f"study {study.study_name!r} was made for "
                + ", ".join(f"{k}={stored.get(k)!r}" for k in differ)
                + "; this search has "
                + ", ".join(f"{k}={meta[k]!r}" for k in differ)
                + "; pass another study_name"
            )

    @staticmethod
    def _load(study: Any, session: Session) -> None:
        """Add the study's COMPLETE trials that this search does not hold yet."""
        from optuna.trial import TrialState

        from autoprec.evaluate.metrics import Metrics

        for frozen in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
            if session.seen(frozen.params) is not None:
                continue
            attrs = frozen.user_attrs
            if "metrics" in attrs:
                metrics = Metrics.from_dict(attrs["metrics"])
            else:  # not written by autoprec: evaluate it (a cache hit if it was)
                metrics = session.problem.evaluate(session.problem.complete(frozen.params))
            extra = {"optuna_trial": frozen.number, "loaded": True}
            if "baseline" in attrs:
                extra["name"] = attrs["baseline"]
            session.load(frozen.params, metrics, float(attrs.get("wall_time_s", 0.0)), **extra)

    @staticmethod
    def _duplicate(
        study: Any, session: Session, number: int, policy: Mapping[str, str]
    ) -> int | None:
        """The optuna number of a trial with the same policy, COMPLETE or RUNNING, if any."""
        from optuna.trial import TrialState

        states = (TrialState.COMPLETE, TrialState.RUNNING)
        for frozen in study.get_trials(deepcopy=False, states=states):
            if frozen.number != number and frozen.params == dict(policy):
                return frozen.number
        earlier = session.seen(policy)
        if earlier is not None:
            return int(earlier.attrs.get("optuna_trial", -1))
        return None


def _count(study: Any, states: tuple[Any, ...], below: int | None = None) -> int:
    trials = study.get_trials(deepcopy=False, states=states)
    return sum(1 for t in trials if below is None or t.number < below)


def _user_attrs(trial: Trial) -> dict[str, Any]:
    return {
        "metrics": trial.metrics.to_dict(),
        "reward": trial.reward,
        "fidelity": trial.fidelity,
        "wall_time_s": trial.wall_time_s,
    }


def _finite(value: float, penalty: float) -> float:
    return float(value) if math.isfinite(value) else penalty


class TPEAgent(_OptunaAgent):
    """Optuna's TPE sampler, maximising the reward (single objective).

    Args:
        n_startup_trials: random (or enqueued) trials before TPE; None: a quarter of the
            budget, between 4 and 10.
        **kwargs: see :class:`_OptunaAgent` (``storage``, ``study_name``, ``sampler``,
            ``enqueue_baselines``, ``max_repeats``).
    """

    name = "tpe"
    directions = ("maximize",)

    def __init__(
        self,
        storage: Any = None,
        study_name: str | None = None,
        sampler: Any = None,
        enqueue_baselines: bool = True,
        max_repeats: int = 100,
        n_startup_trials: int | None = None,
    ) -> None:
        super().__init__(storage, study_name, sampler, enqueue_baselines, max_repeats)
        self.n_startup_trials = n_startup_trials

    def make_sampler(self, session: Session) -> Any:
        from optuna.samplers import TPESampler

        startup = self.n_startup_trials
        if startup is None:
            startup = max(4, min(10, session.budget // 4))
        return TPESampler(seed=session.seed, n_startup_trials=startup)

    def values(self, trial: Trial) -> list[float]:
        return [trial.reward]


class NSGA2Agent(_OptunaAgent):
    """Multi-objective: minimise ``loss_delta``, maximise ``speedup``, minimise
    ``memory_ratio``, with NSGA-II (or multi-objective TPE).

    Args:
        sampler: ``"nsga2"`` (default), ``"tpe"``, or an ``optuna.samplers.BaseSampler``.
        population_size: NSGA-II's population; None: a third of the budget, between 4 and 50.
        **kwargs: see :class:`_OptunaAgent`.
    """

    name = "nsga2"
    directions = ("minimize", "maximize", "minimize")

    def __init__(
        self,
        storage: Any = None,
        study_name: str | None = None,
        sampler: Any = "nsga2",
        enqueue_baselines: bool = True,
        max_repeats: int = 100,
        population_size: int | None = None,
    ) -> None:
        if isinstance(sampler, str) and sampler not in ("nsga2", "tpe"):
            raise ValueError(
                f"sampler must be 'nsga2', 'tpe' or an optuna sampler, got {sampler!r}"
            )
        super().__init__(
            storage,
            study_name,
            None if isinstance(sampler, str) else sampler,
            enqueue_baselines,
            max_repeats,
        )
        self.kind = sampler if isinstance(sampler, str) else "custom"
        self.population_size = population_size

    def make_sampler(self, session: Session) -> Any:
        from optuna.samplers import NSGAIISampler, TPESampler

        if self.kind == "tpe":
            return TPESampler(
                seed=session.seed, n_startup_trials=max(4, min(10, session.budget // 4))
            )
        size = self.population_size or max(4, min(50, session.budget // 3))
        return NSGAIISampler(seed=session.seed, population_size=size)

    def values(self, trial: Trial) -> list[float]:
        m = trial.metrics
        return [
            _finite(m.loss_delta, PENALTY_VALUES["loss_delta"]),
            _finite(m.speedup, PENALTY_VALUES["speedup"]),
            _finite(m.memory_ratio, PENALTY_VALUES["memory_ratio"]),
        ]
