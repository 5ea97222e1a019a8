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
  On SQLite, workers of one host ask one at a time (``optuna_study.ask_lock``: Optuna pops
  an enqueued trial with a row lock SQLite lacks).
  Give the workers different seeds, or their samplers propose the same policies.

A policy already COMPLETE or RUNNING in the study (or evaluated in this search) is not
evaluated again: its trial is told PRUNED with the user attr ``duplicate_of``. Diverged
policies are COMPLETE trials with the penalised values. Each COMPLETE trial has the user attrs
``metrics`` (``Metrics.to_dict()``), ``reward``, ``fidelity`` and ``wall_time_s``.

A trial whose worker dies is failed and retried (enqueued again, as Optuna's
``RetryFailedTrialCallback`` does, at most
:data:`~autoprec.agents.optuna_study.MAX_RETRY` times), so that the budget is spent in full
and a resumed search goes on as an uninterrupted one:

* interrupted (Ctrl-C, SIGTERM, an exception): the worker tells FAIL and enqueues the retry;
* killed (SIGKILL, a lost machine): the trial stays RUNNING. Every trial carries the user attr
  ``autoprec_worker`` (host, pid, process start); a worker fails at once a RUNNING trial of its
  own host whose process is gone. A storage URL is opened as an ``RDBStorage`` with a heartbeat
  (:data:`~autoprec.agents.optuna_study.HEARTBEAT_INTERVAL`,
  :data:`~autoprec.agents.optuna_study.GRACE_PERIOD` seconds), which fails the trials of other
  machines whose heartbeat stopped (``optuna.storages.fail_stale_trials``); a worker that finds
  the budget taken only thanks to RUNNING trials of other machines waits until they finish or
  go stale (at most the grace period and two heartbeats). A live worker's trials are never
  failed: its process is there, and its heartbeat is recorded while it evaluates.

The sampler the agent makes is made again before each ``ask``, seeded from the search's seed
and the number of finished (COMPLETE or PRUNED) trials, so that a proposal depends on the
study's history, not on how many processes the search took.

A storage that cannot be opened (its database driver missing, the server unreachable, a
malformed URL) raises :class:`StorageError`, which names the URL with its password hidden
(:func:`shown_storage`).
"""

from __future__ import annotations

import hashlib
import math
import time
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from autoprec.agents.base import Agent, Session, Trial
from autoprec.agents.naming import search_name
from autoprec.agents.optuna_study import (
    WORKER,
    WORKER_ATTR,
    StorageError,
    ask_lock,
    check_study,
    count,
    dead,
    heartbeat,
    heartbeat_interval,
    load_trials,
    open_storage,
    quiet_optuna,
    retry_callback,
    shown_storage,
    storage_error,
    study_name_for,
    tell,
    user_attrs,
    worker_of,
)
from autoprec.agents.simple import baseline_policies

if TYPE_CHECKING:
    import optuna
    from optuna.distributions import BaseDistribution
    from optuna.samplers import BaseSampler
    from optuna.storages import BaseStorage

PENALTY_VALUES = {"loss_delta": 10.0, "speedup": 0.0, "memory_ratio": 10.0}
POLL_S = 1.0  # how often a waiting worker looks at the study again
__all__ = ["NSGA2Agent", "PENALTY_VALUES", "StorageError", "TPEAgent", "shown_storage"]


class _OptunaAgent(Agent):
    """Shared ask/tell loop of the Optuna agents.

    Args:
        storage: an Optuna storage URL or object; None keeps the study in memory.
        study_name: the study, used as it is (loaded if it exists); None: the study of the
            search's ``name`` (:func:`~autoprec.agents.optuna_study.study_name_for`: a new
            one unless ``resume``).
        sampler: an ``optuna.samplers.BaseSampler`` to use instead of the default.
        enqueue_baselines: enqueue fp32, AMP and the default rule in a new study.
        max_repeats: stop after this many proposals in a row that were duplicates (the space
            may be smaller than the budget).
        resume: continue the study of ``name`` rather than start a new one beside it.
        name: the search's name; None: :func:`~autoprec.agents.naming.search_name` of the
            model, data, target, agent and seed.
    """

    directions: ClassVar[tuple[str, ...]] = ()

    def __init__(
        self,
        storage: str | BaseStorage | None = None,
        study_name: str | None = None,
        sampler: BaseSampler | None = None,
        enqueue_baselines: bool = True,
        max_repeats: int = 100,
        *,
        resume: bool = False,
        name: str | None = None,
    ) -> None:
        super().__init__(resume=resume, name=name)
        self.storage = storage
        self.study_name = study_name
        self.sampler = sampler
        self.enqueue_baselines = enqueue_baselines
        self.max_repeats = max_repeats

    # --- what the subclasses define -----------------------------------------------------------
    def make_sampler(self, session: Session, seed: int) -> Any:
        """The agent's own sampler, seeded with ``seed``."""
        raise NotImplementedError

    def values(self, trial: Trial) -> list[float]:
        raise NotImplementedError

    # --- the loop -----------------------------------------------------------------------------
    def run(self, session: Session) -> None:
        with quiet_optuna():  # the progress of the search is the caller's to show
            self._run(session)

    def _run(self, session: Session) -> None:
        from optuna.distributions import CategoricalDistribution
        from optuna.trial import TrialState

        problem = session.problem
        layers = problem.layers()
        distributions = {n: CategoricalDistribution(problem.choices(n)) for n in layers}
        self._retry = retry_callback()
        study = self._create_study(session)
        storage = self._opened
        session.result.info["study_name"] = study.study_name
        if isinstance(self.storage, str):
            session.result.info["storage"] = self.storage
        check_study(study, session)
        load_trials(study, session)
        if self.enqueue_baselines and not study.get_trials(deepcopy=False):
            for name, policy in baseline_policies(session):
                fits = all(policy[n] in distributions[n].choices for n in layers)
                if fits:
                    study.enqueue_trial(policy, user_attrs={"baseline": name}, skip_if_exists=True)

        repeats = 0
        try:
            while repeats < self.max_repeats:
                if not self._budget_left(study, session.budget):
                    self._drop_waiting(study, session)
                    return
                if self.sampler is None:  # a proposal depends on the history only
                    study.sampler = self.make_sampler(session, self._seed(study, session))
                evaluating = False
                trial = self._ask(study, distributions)
                try:  # straight after the ask: an interrupt from here on fails the trial
                    states = (TrialState.COMPLETE, TrialState.RUNNING, TrialState.WAITING)
                    if count(study, states, below=trial.number) >= session.budget:
                        trial.set_user_attr("autoprec_skipped", "budget reached by other workers")
                        study.tell(trial, state=TrialState.FAIL)
                        self._drop_waiting(study, session)
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
                    evaluating = True
                    with heartbeat(storage, trial):
                        result = session.evaluate(policy, notify=False, **attrs)
                    evaluating = False
                    tell(study, trial, self.values(result), user_attrs(result))
                except BaseException:
                    frozen = study.tell(trial, state=TrialState.FAIL, skip_if_finished=True)
                    if evaluating and frozen.state == TrialState.FAIL:
                        self._retry(study, frozen)  # a resumed search evaluates it first
                    raise
                session.notify(result)
        finally:
            load_trials(study, session)  # what other workers finished meanwhile

    # --- helpers ------------------------------------------------------------------------------
    def _ask(self, study: optuna.Study, distributions: dict[str, BaseDistribution]) -> optuna.Trial:
        """A new RUNNING trial carrying this worker's identity. An interrupt that lands before
        the identity is written fails the trial here: a RUNNING trial of no known worker would
        never be failed as a dead worker's, and a resumed search would count it against the
        budget for ever."""
        from optuna.trial import TrialState

        with ask_lock(self.storage), warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "heartbeat ... optimize"
            trial = study.ask(distributions)
            try:
                trial.set_user_attr(WORKER_ATTR, WORKER)
            except BaseException:
                study.tell(trial, state=TrialState.FAIL, skip_if_finished=True)
                raise
        return trial

    def _drop_waiting(self, study: optuna.Study, session: Session) -> None:
        """Tell PRUNED (``duplicate_of``) each enqueued (WAITING) trial of a policy the study
        already holds, as an ``ask`` would: workers starting together on a new study both
        enqueue the baselines (Optuna's ``skip_if_exists`` is not atomic across processes),
        and the copies left when the budget is spent would wait for a worker that never comes.
        Other enqueued trials (baselines beyond the budget, retries) stay for a resumed search.
        A trial is taken as ``ask`` takes it (WAITING to RUNNING, refused if another worker
        was first), so it is dropped by one worker only."""
        from optuna.trial import TrialState

        storage = study._storage
        for frozen in study.get_trials(deepcopy=False, states=(TrialState.WAITING,)):
            policy = frozen.system_attrs.get("fixed_params") or {}
            twin = self._duplicate(study, session, frozen.number, policy)
            if twin is None or not storage.set_trial_state_values(
                frozen._trial_id, TrialState.RUNNING
            ):
                continue
            storage.set_trial_user_attr(frozen._trial_id, "duplicate_of", twin)
            storage.set_trial_state_values(frozen._trial_id, TrialState.PRUNED)

    def _budget_left(self, study: optuna.Study, budget: int) -> bool:
        """Whether another trial may be asked, once the trials of dead workers are failed.

        While the budget is taken only thanks to RUNNING trials of other machines, which may
        be stale without a heartbeat to tell yet, waits for them (see the module docstring).
        """
        from optuna.trial import TrialState

        deadline = None
        while True:
            self._fail_stale(study)
            trials = study.get_trials(
                deepcopy=False, states=(TrialState.COMPLETE, TrialState.RUNNING)
            )
            running = [t for t in trials if t.state == TrialState.RUNNING]
            if len(trials) < budget:
                return True
            if len(trials) - len(running) >= budget or heartbeat_interval(self._opened) is None:
                return False
            if all(worker_of(t).get("host") == WORKER["host"] for t in running):
                return False  # all alive (the dead ones of this host were failed)
            if deadline is None:
                interval = heartbeat_interval(self._opened) or 0
                grace = getattr(self._opened, "grace_period", None) or 2 * interval
                deadline = time.monotonic() + grace + 2 * interval
            if time.monotonic() > deadline:
                return False  # alive: their heartbeat goes on
            time.sleep(POLL_S)

    def _fail_stale(self, study: optuna.Study) -> None:
        """Fail (and retry) the RUNNING trials of dead workers: this host's at once, others'
        when their heartbeat is older than the grace period."""
        import optuna
        from optuna.trial import TrialState

        for frozen in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            if not dead(worker_of(frozen)):
                continue
            try:  # not study.tell: the trial is another process's
                failed = study._storage.set_trial_state_values(frozen._trial_id, TrialState.FAIL)
            except optuna.exceptions.UpdateFinishedTrialError:
                continue  # another worker was first, or it finished meanwhile
            if failed:
                self._retry(study, study._storage.get_trial(frozen._trial_id))
        with warnings.catch_warnings():  # experimental; acts only for storages with a heartbeat
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            optuna.storages.fail_stale_trials(study)

    def _seed(self, study: optuna.Study, session: Session) -> int:
        """The seed of the next proposal: the search's seed and the finished trials."""
        from optuna.trial import TrialState

        done = count(study, (TrialState.COMPLETE, TrialState.PRUNED))
        digest = hashlib.sha256(f"{session.seed}:{done}".encode()).digest()
        return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF

    def _create_study(self, session: Session, retries: int = 4) -> Any:
        """Create or load the study. Workers starting together on a new RDB file race to create
        its tables (``table ... already exists`` from SQLAlchemy); the loser tries again."""
        import optuna

        study_name = self.study_name or self.default_study_name(session)

        def create() -> Any:
            self._opened = open_storage(self.storage, self._retry)
            return optuna.create_study(
                storage=self._opened,
                sampler=self.sampler
                if self.sampler is not None
                else self.make_sampler(session, session.seed),
                study_name=study_name,
                directions=list(self.directions),
                load_if_exists=True,
            )

        attempts = retries if isinstance(self.storage, str) else 0
        for attempt in range(attempts + 1):
            try:
                return create()
            except ImportError as exc:
                raise storage_error(self.storage, exc) from None
            except Exception as exc:
                if type(exc).__module__.split(".")[0] != "sqlalchemy":
                    raise
                if attempt == attempts:
                    raise storage_error(self.storage, exc) from None
                time.sleep(0.2 * (attempt + 1))
        raise AssertionError("unreachable")  # the loop returns or raises

    def default_study_name(self, session: Session) -> str:
        """The study of this search: :func:`~autoprec.agents.optuna_study.study_name_for`
        the search's name (a new study unless resuming)."""
        name = self.search_name
        if name is None:
            evaluator = session.problem.evaluator
            name = search_name(
                evaluator.spec.name,
                evaluator.data.name,
                evaluator.device.name,
                self.name,
                session.seed,
            )
        return study_name_for(self.storage, name, self.resume)

    @staticmethod
    def _duplicate(
        study: optuna.Study, session: Session, number: int, policy: Mapping[str, str]
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


def _finite(value: float, penalty: float) -> float:
    return float(value) if math.isfinite(value) else penalty


class TPEAgent(_OptunaAgent):
    """Optuna's TPE sampler, maximising the reward (single objective).

    Args:
        n_startup_trials: random (or enqueued) trials before TPE; None: a quarter of the
            budget, between 4 and 10.
        **kwargs: see :class:`_OptunaAgent` (``storage``, ``study_name``, ``sampler``,
            ``enqueue_baselines``, ``max_repeats``, ``resume``, ``name``).
    """

    name = "tpe"
    directions = ("maximize",)

    def __init__(self, *, n_startup_trials: int | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.n_startup_trials = n_startup_trials

    def make_sampler(self, session: Session, seed: int) -> Any:
        from optuna.samplers import TPESampler

        startup = self.n_startup_trials
        if startup is None:
            startup = max(4, min(10, session.budget // 4))
        return TPESampler(seed=seed, n_startup_trials=startup)

    def values(self, trial: Trial) -> list[float]:
        return [trial.reward]


class NSGA2Agent(_OptunaAgent):
    """Multi-objective: minimise ``loss_delta``, maximise ``speedup``, minimise
    ``memory_ratio``, with NSGA-II (or multi-objective TPE).

    Args:
        sampler: ``"nsga2"`` (default), ``"tpe"``, or an ``optuna.samplers.BaseSampler``.
        population_size: NSGA-II's population; None: a third of the budget, between 4 and 50.
        **kwargs: see :class:`_OptunaAgent` (``storage``, ``study_name``,
            ``enqueue_baselines``, ``max_repeats``, ``resume``, ``name``).
    """

    name = "nsga2"
    directions = ("minimize", "maximize", "minimize")

    def __init__(
        self,
        *,
        sampler: BaseSampler | str = "nsga2",
        population_size: int | None = None,
        **kwargs: Any,
    ) -> None:
        if isinstance(sampler, str) and sampler not in ("nsga2", "tpe"):
            raise ValueError(
                f"sampler must be 'nsga2', 'tpe' or an optuna sampler, got {sampler!r}"
            )
        super().__init__(sampler=None if isinstance(sampler, str) else sampler, **kwargs)
        self.kind = sampler if isinstance(sampler, str) else "custom"
        self.population_size = population_size

    def make_sampler(self, session: Session, seed: int) -> Any:
        from optuna.samplers import NSGAIISampler, TPESampler

        if self.kind == "tpe":
            return TPESampler(seed=seed, n_startup_trials=max(4, min(10, session.budget // 4)))
        size = self.population_size or max(4, min(50, session.budget // 3))
        return NSGAIISampler(seed=seed, population_size=size)

    def values(self, trial: Trial) -> list[float]:
        m = trial.metrics
        return [
            _finite(m.loss_delta, PENALTY_VALUES["loss_delta"]),
            _finite(m.speedup, PENALTY_VALUES["speedup"]),
            _finite(m.memory_ratio, PENALTY_VALUES["memory_ratio"]),
        ]
