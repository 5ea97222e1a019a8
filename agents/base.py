"""What every search agent shares: the problem, trials, the result, the budget and callbacks.

An agent is one class with a :meth:`Agent.run` method that proposes policies to a
:class:`Session`; the session evaluates them through the problem's evaluator, counts the
budget (real evaluations only), skips policies already tried in this search, records
:class:`Trial` objects in the :class:`SearchResult` and calls the :class:`SearchCallback` s.
:func:`search` picks the agent by name and returns the result, also when a callback raises
:class:`StopSearch`.

Heavy imports (torch through the evaluator, optuna, stable-baselines3) happen inside functions,
so ``import autoprec.agents`` stays fast.
"""

from __future__ import annotations

import abc
import datetime
import inspect
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from autoprec.precision import PRECISION_NAMES, Precision, parse_precision

if TYPE_CHECKING:  # pragma: no cover
    from autoprec.evaluate import Evaluator, Metrics
    from autoprec.policy import PrecisionPolicy

# The environment's action set (autoprec.envs.precision_env.DEFAULT_PRECISIONS), without
# importing gymnasium here.
DEFAULT_PRECISIONS: tuple[str, ...] = PRECISION_NAMES
REAL_FIDELITIES = ("short", "full")
SURROGATE = "surrogate"


class StopSearch(Exception):
    """Raised by a :class:`SearchCallback` to end the search; :func:`search` returns the
    partial :class:`SearchResult` (with ``stopped=True``)."""


EMULATE_NOTE = (
    "searched in emulate target mode: layers may use formats the target cannot run natively; "
    "not for native training"
)


class BudgetSpent(Exception):
    """Raised by :meth:`Session.evaluate` for a new policy once the budget is used up; caught
    by :func:`search` (agents may also check :attr:`Session.exhausted` first)."""


@dataclass
class Problem:
    """What to search: an evaluator and how its results are scored.

    Args:
        evaluator: the :class:`~autoprec.evaluate.Evaluator` of the model, data and target.
        fidelity: the real fidelity (``"short"`` or ``"full"``); evaluations at it count
            against the budget.
        accuracy_tolerance: the ``loss_delta`` above which the reward is penalised (and which
            ``greedy`` never accepts).
        reward_weights: ``{"speedup", "memory", "accuracy"}`` weights of
            :func:`autoprec.envs.reward`; None keeps the defaults.
        precisions: the action set; each layer is restricted to those the target supports.
        env_kwargs: picklable keyword arguments that rebuild an equivalent
            :class:`~autoprec.envs.PrecisionEnv` in a worker process (``model``, ``dataset``,
            ``target``, ``image_size``, ``seed``, ``steps``, ``warm_start_steps``,
            ``evaluator_kwargs``); used by ``ppo`` with ``n_envs > 1``.

    Raises:
        ValueError: a surrogate or unknown fidelity, an unknown precision, a negative
            tolerance, an unknown reward weight, or no listed precision runs on the target.
    """

    evaluator: Evaluator
    fidelity: str = "short"
    accuracy_tolerance: float = 0.05
    reward_weights: dict[str, float] | None = None
    precisions: tuple[str, ...] = DEFAULT_PRECISIONS
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    _table: Any = field(default=None, init=False, repr=False, compare=False)
    _choices: dict[str, list[str]] | None = field(
        default=None, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        if self.fidelity not in REAL_FIDELITIES:
            raise ValueError(
                f"fidelity must be a real one, {' or '.join(REAL_FIDELITIES)}; got "
                f"{self.fidelity!r} (the surrogate is used by the agents that need it)"
            )
        if not self.accuracy_tolerance >= 0:
            raise ValueError(f"accuracy_tolerance must be >= 0, got {self.accuracy_tolerance!r}")
        allowed = ("speedup", "memory", "accuracy")
        unknown = sorted(set(self.reward_weights or {}) - set(allowed))
        if unknown:
            raise ValueError(
                f"unknown reward weight(s) {unknown}; expected keys {', '.join(allowed)}"
            )
        precisions = tuple(parse_precision(p).value for p in self.precisions)
        if not precisions or len(set(precisions)) != len(precisions):
            raise ValueError(
                f"precisions must be a non-empty list without repeats, got {self.precisions!r}"
            )
        self.precisions = precisions
        if not self.supported():
            device = self.evaluator.device
            raise ValueError(
                f"none of the precisions {', '.join(precisions)} runs on {device.name} (it "
                f"supports {', '.join(device.supported_precisions)}); add one of those"
            )

    @property
    def table(self) -> Any:
        """The model's :class:`~autoprec.graph.LayerTable` at the evaluator's batch size."""
        if self._table is None:
            from autoprec.graph import analyze

            self._table = analyze(self.evaluator.spec, self.evaluator.batch_size)
        return self._table

    def layers(self) -> list[str]:
        """Tunable layer names in execution order."""
        return list(self.table.names)

    def supported(self) -> list[str]:
        """The precisions of :attr:`precisions` the target runs, in action-set order."""
        return [p for p in self.precisions if self.evaluator.device.supports(p)]

    def choices(self, layer: str) -> list[str]:
        """Precisions ``layer`` may take: those of :attr:`precisions` the target runs for this
        layer (:mod:`autoprec.hardware.runnability`: e.g. no fp8 convolution natively).

        Raises:
            ValueError: no listed precision runs for some layer (the message names them).
        """
        if self._choices is None:
            self._choices = layer_choices(self.evaluator, self.layers(), self.supported())
        return list(self._choices.get(layer, self.supported()))

    def reward(self, metrics: Metrics) -> float:
        """:func:`autoprec.envs.reward` with this problem's weights and tolerance."""
        from autoprec.envs.precision_env import reward

        return reward(metrics, self.reward_weights, self.accuracy_tolerance)

    def to_policy(self, assignment: Mapping[str, str]) -> PrecisionPolicy:
        """The policy an agent's ``{layer: precision}`` is evaluated as.

        Default fp32, the layers as given, and dynamic loss scaling when a layer is fp16
        (see :func:`loss_scaling_for`).
        """
        from autoprec.policy import PrecisionPolicy

        return PrecisionPolicy(
            default=Precision.FP32,
            layers=dict(assignment),
            loss_scaling=loss_scaling_for(assignment),
        )

    def evaluate(self, policy: Any, fidelity: str | None = None) -> Metrics:
        """``evaluator.evaluate`` at ``fidelity`` (default :attr:`fidelity`); a mapping is
        first turned into a policy by :meth:`to_policy`."""
        if isinstance(policy, Mapping):
            policy = self.to_policy(policy)
        return self.evaluator.evaluate(policy, fidelity or self.fidelity)

    def complete(self, policy: Mapping[str, Any]) -> dict[str, str]:
        """``policy`` as ``{layer: precision}`` over every tunable layer, in execution order.

        Missing layers are fp32; a precision outside :meth:`choices` becomes the nearest wider
        one that is allowed (the environment's remapping).

        Raises:
            ValueError: a layer that is not a tunable layer of the model.
        """
        layers = self.layers()
        unknown = sorted(set(policy) - set(layers))
        if unknown:
            raise ValueError(
                f"unknown layer(s) {unknown} for {self.evaluator.spec.name!r}; tunable layers: "
                f"{', '.join(layers)}"
            )
        out = {}
        for name in layers:
            allowed = self.choices(name)
            out[name] = nearest_allowed(policy.get(name, Precision.FP32), allowed)
        return out


def layer_choices(evaluator: Any, layers: Sequence[str], precisions: Sequence[str]) -> dict:
    """``{layer: [precision, ...]}``: the ``precisions`` each layer runs at on the evaluator's
    target in its ``target_mode`` (:func:`autoprec.hardware.runnability.runnable_precisions`,
    the same masks as the environment's).

    Raises:
        ValueError: a layer for which none of ``precisions`` runs (named in the message).
    """
    if not hasattr(evaluator, "cost_table"):  # an evaluator-like test double
        return {name: list(precisions) for name in layers}
    from autoprec.hardware.runnability import runnable_precisions

    mode = getattr(evaluator, "target_mode", "native")
    table = evaluator.cost_table()
    allowed = runnable_precisions(table, evaluator.device, precisions, mode)
    return {name: [p.value for p in allowed.get(name, ())] or list(precisions) for name in layers}


def nearest_allowed(precision: Any, allowed: Sequence[str]) -> str:
    """``precision`` if allowed, else the nearest wider allowed one, else the widest allowed."""
    p: Precision | None = parse_precision(precision)
    while p is not None:
        if p.value in allowed:
            return p.value
        p = p.wider()
    return max(allowed, key=lambda q: parse_precision(q).width)


def loss_scaling_for(assignment: Mapping[str, Any]) -> Any:
    """Dynamic loss scaling (``LossScalingConfig()``) if a layer is fp16, else None.

    This is the rule of :func:`autoprec.hardware.amp_policy` and, for every device in the
    database (those whose rule asks for loss scaling run fp16 as their low precision), of
    :func:`autoprec.hardware.default_policy`; so the baselines evaluated as layer maps hit the
    same cache entries as the policies themselves.
    """
    from autoprec.policy import LossScalingConfig

    fp16 = any(parse_precision(p) is Precision.FP16 for p in assignment.values())
    return LossScalingConfig() if fp16 else None


@dataclass
class Trial:
    """One evaluated policy.

    Attributes:
        number: position in :attr:`SearchResult.trials`.
        policy: ``{layer: precision}`` over every tunable layer.
        metrics: the evaluator's :class:`~autoprec.evaluate.Metrics`.
        reward: :meth:`Problem.reward` of ``metrics``.
        fidelity: ``"surrogate"``, ``"short"`` or ``"full"``.
        wall_time_s: seconds the evaluation took in this search (about 0 for a cache hit).
        attrs: what the agent adds (e.g. ``optuna_trial``, ``name`` of a baseline).
    """

    number: int
    policy: dict[str, str]
    metrics: Metrics
    reward: float
    fidelity: str
    wall_time_s: float
    attrs: dict[str, Any] = field(default_factory=dict)

    @property
    def real(self) -> bool:
        """Whether the policy was trained (any fidelity but the surrogate)."""
        return self.fidelity != SURROGATE

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (``metrics`` as ``Metrics.to_dict()``)."""
        return {
            "number": self.number,
            "policy": dict(self.policy),
            "metrics": self.metrics.to_dict(),
            "reward": self.reward,
            "fidelity": self.fidelity,
            "wall_time_s": self.wall_time_s,
            "attrs": dict(self.attrs),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Trial:
        """Inverse of :meth:`to_dict`."""
        from autoprec.evaluate.metrics import Metrics

        return cls(
            number=int(data["number"]),
            policy=dict(data["policy"]),
            metrics=Metrics.from_dict(data["metrics"]),
            reward=float(data["reward"]),
            fidelity=str(data["fidelity"]),
            wall_time_s=float(data.get("wall_time_s", 0.0)),
            attrs=dict(data.get("attrs", {})),
        )


def _dominates(a: tuple[float, ...], b: tuple[float, ...]) -> bool:
    return all(x <= y for x, y in zip(a, b, strict=True)) and a != b


@dataclass
class SearchResult:
    """What a search found.

    Attributes:
        agent: the agent's name.
        trials: every trial in order, surrogate ones included.
        wall_time_s: seconds the search took.
        budget: the real-evaluation budget it was given.
        stopped: a callback ended the search early (:class:`StopSearch`).
        target: the target device's name (for :meth:`best_policy`).
        target_mode: ``"native"`` (the exported policy is for native training on the target)
            or ``"emulate"`` (a study of formats; the file says it is not for native training).
        info: what the agent reports (study name, checkpoint path, ...).
    """

    agent: str
    trials: list[Trial] = field(default_factory=list)
    wall_time_s: float = 0.0
    budget: int = 0
    stopped: bool = False
    target: str | None = None
    target_mode: str = "native"
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def real_trials(self) -> list[Trial]:
        """Trials whose fidelity is not ``"surrogate"``."""
        return [t for t in self.trials if t.real]

    @property
    def best(self) -> Trial | None:
        """The real trial with the highest reward (the earliest of equals); None if none."""
        best = None
        for trial in self.real_trials:
            if best is None or trial.reward > best.reward:
                best = trial
        return best

    @property
    def pareto(self) -> list[Trial]:
        """Non-dominated real trials that neither diverged nor were infeasible, over
        (minimise ``loss_delta``, maximise ``speedup``, minimise ``memory_ratio``)."""
        candidates = [
            t
            for t in self.real_trials
            if not t.metrics.diverged
            and t.metrics.feasible
            and all(math.isfinite(v) for v in _objectives(t))
        ]
        points = [_objectives(t) for t in candidates]
        return [
            t
            for t, p in zip(candidates, points, strict=True)
            if not any(_dominates(q, p) for q in points)
        ]

    def best_policy(self, spec_module: Any) -> PrecisionPolicy | None:
        """The best trial's policy, ready to save (:func:`autoprec.save_policy`).

        Args:
            spec_module: the searched model: a ModelSpec or its ``nn.Module`` (for the
                policy's ``model`` section: name, fingerprint, tunable layer count).

        Returns:
            ``PrecisionPolicy(default=fp32, layers=best.policy)`` with the loss scaling it was
            evaluated with, its metrics and provenance; None when no real trial exists.
        """
        best = self.best
        return None if best is None else self.policy_of(best, spec_module)

    def policy_of(self, best: Trial, spec_module: Any) -> PrecisionPolicy:
        """Any trial's policy as :meth:`best_policy` builds it (e.g. each Pareto point)."""
        import autoprec
        from autoprec.layers import model_fingerprint, tunable_layers
        from autoprec.policy import ModelInfo, PrecisionPolicy, TargetInfo

        module = getattr(spec_module, "module", spec_module)
        name = getattr(spec_module, "name", None)
        m = best.metrics
        metrics = {
            "loss_delta": m.loss_delta,
            "accuracy_delta": m.accuracy_delta,
            "speedup": m.speedup,
            "memory_ratio": m.memory_ratio,
            "speedup_vs_amp": m.speedup_vs_amp,
            "memory_ratio_vs_amp": m.memory_ratio_vs_amp,
            "reward": best.reward,
        }
        return PrecisionPolicy(
            default=Precision.FP32,
            layers=dict(best.policy),
            loss_scaling=loss_scaling_for(best.policy),
            model=ModelInfo(
                name=name if isinstance(name, str) else None,
                fingerprint=model_fingerprint(module),
                tunable_layers=sum(1 for _ in tunable_layers(module)),
            ),
            target=TargetInfo(device=self.target, mode=self.target_mode) if self.target else None,
            metrics={k: float(v) for k, v in metrics.items() if math.isfinite(v)},
            provenance={
                "agent": self.agent,
                "fidelity": best.fidelity,
                "trial": str(best.number),
                "autoprec_version": autoprec.__version__,
                "created": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                **({"note": EMULATE_NOTE} if self.target_mode == "emulate" else {}),
            },
        )

    def summary_rows(self, real_only: bool = True) -> list[dict[str, Any]]:
        """One flat dict per trial (for a table or a CSV): number, fidelity, reward,
        loss_delta, accuracy_delta, speedup, memory_ratio, diverged, pareto, policy."""
        front = {t.number for t in self.pareto}
        rows = []
        for t in self.real_trials if real_only else self.trials:
            rows.append(
                {
                    "number": t.number,
                    "fidelity": t.fidelity,
                    "reward": t.reward,
                    "loss_delta": t.metrics.loss_delta,
                    "accuracy_delta": t.metrics.accuracy_delta,
                    "speedup": t.metrics.speedup,
                    "memory_ratio": t.metrics.memory_ratio,
                    "diverged": t.metrics.diverged,
                    "pareto": t.number in front,
                    "policy": " ".join(t.policy.values()),
                }
            )
        return rows

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict: the fields, every trial, and the numbers of the best and Pareto
        trials."""
        best = self.best
        return {
            "agent": self.agent,
            "budget": self.budget,
            "wall_time_s": self.wall_time_s,
            "stopped": self.stopped,
            "target": self.target,
            "info": dict(self.info),
            "best": None if best is None else best.number,
            "pareto": [t.number for t in self.pareto],
            "trials": [t.to_dict() for t in self.trials],
        }


def _objectives(trial: Trial) -> tuple[float, float, float]:
    m = trial.metrics
    return (m.loss_delta, -m.speedup, m.memory_ratio)


class SearchCallback(Protocol):
    """Called after every trial, real or surrogate; may raise :class:`StopSearch`."""

    def on_trial(self, trial: Trial, result: SearchResult) -> None: ...


class Session:
    """One search in progress: evaluates proposals, keeps the budget, records trials.

    Attributes:
        problem: the :class:`Problem`.
        budget: real evaluations allowed.
        seed: the search's seed.
        result: the :class:`SearchResult` being built.
    """

    def __init__(
        self,
        problem: Problem,
        budget: int,
        seed: int,
        callbacks: Iterable[SearchCallback],
        agent: str,
    ) -> None:
        self.problem = problem
        self.budget = budget
        self.seed = seed
        self.callbacks = list(callbacks)
        self.result = SearchResult(
            agent=agent,
            budget=budget,
            target=problem.evaluator.device.name,
            target_mode=getattr(problem.evaluator, "target_mode", "native"),
        )
        self._seen: dict[tuple[str, ...], Trial] = {}

    @property
    def used(self) -> int:
        """Real trials so far (new or loaded)."""
        return len(self._seen)

    @property
    def remaining(self) -> int:
        """Real evaluations left."""
        return max(self.budget - self.used, 0)

    @property
    def exhausted(self) -> bool:
        """Whether the budget is used up."""
        return self.used >= self.budget

    def key(self, policy: Mapping[str, str]) -> tuple[str, ...]:
        """Identity of a completed policy (its precisions in layer order)."""
        return tuple(policy[name] for name in self.problem.layers())

    def seen(self, policy: Mapping[str, Any]) -> Trial | None:
        """The real trial of ``policy`` in this search, if any."""
        return self._seen.get(self.key(self.problem.complete(policy)))

    def evaluate(self, policy: Mapping[str, Any], notify: bool = True, **attrs: Any) -> Trial:
        """Evaluate ``policy`` at the real fidelity, unless this search already did.

        Args:
            policy: ``{layer: precision}`` (completed by :meth:`Problem.complete`).
            notify: call the callbacks now; False leaves it to the agent (:meth:`notify`),
                e.g. after it has stored the result where a resumed search finds it.
            **attrs: stored in the new trial's ``attrs``.

        Returns:
            The new trial, or the earlier one of the same policy (not counted again).

        Raises:
            BudgetSpent: the policy is new and the budget is used up.
            StopSearch: from a callback.
        """
        full = self.problem.complete(policy)
        key = self.key(full)
        if key in self._seen:
            return self._seen[key]
        if self.exhausted:
            raise BudgetSpent
        start = time.perf_counter()
        metrics = self.problem.evaluate(full)
        trial = self._new(full, metrics, time.perf_counter() - start, attrs)
        self._seen[key] = trial
        if notify:
            self.notify(trial)
        return trial

    def record_surrogate(
        self, policy: Mapping[str, Any], metrics: Metrics, wall_time_s: float = 0.0, **attrs: Any
    ) -> Trial:
        """Record a surrogate-fidelity evaluation (not counted against the budget)."""
        trial = self._new(self.problem.complete(policy), metrics, wall_time_s, attrs)
        self.notify(trial)
        return trial

    def load(
        self, policy: Mapping[str, Any], metrics: Metrics, wall_time_s: float = 0.0, **attrs: Any
    ) -> Trial | None:
        """Add a real trial evaluated before this search (a resumed or shared study).

        It counts against the budget; callbacks are not called. Returns None (and adds
        nothing) when this search already holds the policy.
        """
        full = self.problem.complete(policy)
        key = self.key(full)
        if key in self._seen:
            return None
        trial = self._new(full, metrics, wall_time_s, attrs)
        self._seen[key] = trial
        return trial

    def _new(
        self, policy: dict[str, str], metrics: Metrics, wall: float, attrs: dict[str, Any]
    ) -> Trial:
        trial = Trial(
            number=len(self.result.trials),
            policy=policy,
            metrics=metrics,
            reward=self.problem.reward(metrics),
            fidelity=metrics.fidelity,
            wall_time_s=wall,
            attrs=dict(attrs),
        )
        self.result.trials.append(trial)
        return trial

    def notify(self, trial: Trial) -> None:
        """Call every callback's ``on_trial`` (which may raise :class:`StopSearch`)."""
        for callback in self.callbacks:
            callback.on_trial(trial, self.result)


class Agent(abc.ABC):
    """A search strategy. Subclasses take their options as keyword arguments of
    ``__init__`` and implement :meth:`run`.

    ``run`` proposes policies to ``session.evaluate`` until ``session.exhausted`` (or the
    strategy is done); it may let :class:`BudgetSpent` and :class:`StopSearch` propagate.
    """

    name: ClassVar[str] = ""

    @abc.abstractmethod
    def run(self, session: Session) -> None:
        """Search, recording trials through ``session``."""


def search(
    problem: Problem,
    budget: int,
    seed: int = 0,
    callbacks: Iterable[SearchCallback] = (),
    agent: str = "ppo",
    **agent_kwargs: Any,
) -> SearchResult:
    """Search precision policies for ``problem`` with ``agent``.

    Args:
        problem: what to search (:class:`Problem`).
        budget: real (non-surrogate) evaluations allowed; a policy evaluated twice in one
            search counts once. Evaluations served from the evaluator's cache count too.
        seed: seeds the agent.
        callbacks: :class:`SearchCallback` s, called after every trial.
        agent: one of :data:`autoprec.agents.AGENTS`.
        **agent_kwargs: the agent's options (see its class).

    Returns:
        The :class:`SearchResult`; partial, with ``stopped=True``, if a callback raised
        :class:`StopSearch`.

    Raises:
        ValueError: an unknown agent, an option the agent does not take, or a budget below 1.
    """
    from autoprec.agents import AGENTS

    if agent not in AGENTS:
        raise ValueError(f"unknown agent {agent!r}; expected one of {', '.join(AGENTS)}")
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
        raise ValueError(f"budget must be an integer >= 1, got {budget!r}")
    cls = AGENTS[agent]
    parameters = inspect.signature(cls).parameters
    unknown = sorted(set(agent_kwargs) - set(parameters))
    if unknown:
        accepted = ", ".join(parameters) or "none"
        raise ValueError(f"agent {agent!r} takes no option(s) {unknown}; it takes: {accepted}")
    strategy = cls(**agent_kwargs)
    session = Session(problem, budget, seed, callbacks, agent)
    start = time.perf_counter()
    try:
        strategy.run(session)
    except BudgetSpent:
        pass
    except StopSearch:
        session.result.stopped = True
    finally:
        session.result.wall_time_s = time.perf_counter() - start
    return session.result
