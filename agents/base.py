"""What every search agent shares: the problem, the session, the budget and callbacks.

An agent is one class with a :meth:`Agent.run` method that proposes policies to a
:class:`Session`; the session evaluates them through the problem's evaluator, counts the
budget (real evaluations only), skips policies already tried in this search, records
:class:`~autoprec.agents.result.Trial` objects in the
:class:`~autoprec.agents.result.SearchResult` and calls the :class:`SearchCallback` s.
:func:`autoprec.agents.search` picks the agent by name and runs it.

Heavy imports (torch through the evaluator, optuna, stable-baselines3) happen inside functions,
so ``import autoprec.agents`` stays fast.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from autoprec.agents.export import layer_policy, loss_scaling_for
from autoprec.agents.result import SURROGATE, SearchResult, Trial
from autoprec.evaluate.reward import RewardConfig
from autoprec.precision import PRECISION_NAMES, Precision, parse_precision

if TYPE_CHECKING:  # pragma: no cover
    from autoprec.evaluate import Evaluator, Metrics
    from autoprec.policy import PrecisionPolicy

REAL_FIDELITIES = ("short", "full")
__all__ = [  # what the agents import from here (loss_scaling_for, SURROGATE, ... re-exported)
    "REAL_FIDELITIES",
    "SURROGATE",
    "Agent",
    "BudgetSpent",
    "Problem",
    "SearchCallback",
    "SearchResult",
    "Session",
    "StopSearch",
    "Trial",
    "layer_choices",
    "loss_scaling_for",
    "nearest_allowed",
]


class StopSearch(Exception):
    """Raised by a :class:`SearchCallback` to end the search; :func:`search` returns the
    partial :class:`SearchResult` (with ``stopped=True``)."""


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
        reward: how metrics are scored (:class:`~autoprec.evaluate.reward.RewardConfig`:
            the weights, and the tolerance that ``greedy`` never exceeds); called as
            ``problem.reward(metrics)``.
        precisions: the action set; each layer is restricted to those the target supports.
        env_kwargs: picklable keyword arguments that rebuild an equivalent
            :class:`~autoprec.envs.PrecisionEnv` in a worker process (``model``, ``dataset``,
            ``target``, ``image_size``, ``seed``, ``steps``, ``warm_start_steps``,
            ``evaluator_kwargs``); used by ``ppo`` with ``n_envs > 1``.

    Raises:
        ValueError: a surrogate or unknown fidelity, an unknown precision, or no listed
            precision runs on the target.
        NoTunableLayerError: no layer of the model can be tuned (checked on the evaluator's
            layer table, before any training).
    """

    evaluator: Evaluator
    fidelity: str = "short"
    reward: RewardConfig = field(default_factory=RewardConfig)
    precisions: tuple[str, ...] = PRECISION_NAMES
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    _choices: dict[str, list[str]] | None = field(
        default=None, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        if self.fidelity not in REAL_FIDELITIES:
            raise ValueError(
                f"fidelity must be a real one, {' or '.join(REAL_FIDELITIES)}; got "
                f"{self.fidelity!r} (the surrogate is used by the agents that need it)"
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
        if not self.layers():
            from autoprec.layers import NoTunableLayerError

            raise NoTunableLayerError.of(self.table.model)
        self.evaluator.grade(self.supported())  # the surrogate knows every format offered

    @property
    def table(self) -> Any:
        """The model's :class:`~autoprec.graph.LayerTable`: the evaluator's one
        (``cost_table()``, which the masks and the cost model read too)."""
        return self.evaluator.cost_table()

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

    def to_policy(self, assignment: Mapping[str, str]) -> PrecisionPolicy:
        """The policy an agent's ``{layer: precision}`` is evaluated as.

        Default fp32, the layers as given, and dynamic loss scaling when a layer is fp16
        (:func:`~autoprec.agents.export.layer_policy`).
        """
        return layer_policy(assignment)

    def evaluate(
        self, policy: PrecisionPolicy | Mapping[str, str], fidelity: str | None = None
    ) -> Metrics:
        """``evaluator.evaluate`` at ``fidelity`` (default :attr:`fidelity`); a mapping is
        first turned into a policy by :meth:`to_policy`."""
        if isinstance(policy, Mapping):
            policy = self.to_policy(policy)
        return self.evaluator.evaluate(policy, fidelity or self.fidelity)

    def prefetch(self, policies: Sequence[Mapping[str, str]]) -> None:
        """Start real evaluations of these completed policies at :attr:`fidelity` in the
        evaluator's worker processes, if it has any (:meth:`Evaluator.prefetch`)."""
        prefetch = getattr(self.evaluator, "prefetch", None)  # test doubles have none
        if prefetch is not None and policies:
            prefetch([self.to_policy(p) for p in policies], self.fidelity)

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


def nearest_allowed(precision: str | Precision, allowed: Sequence[str]) -> str:
    """``precision`` if allowed, else the nearest wider allowed one, else the widest allowed."""
    p: Precision | None = parse_precision(precision)
    while p is not None:
        if p.value in allowed:
            return p.value
        p = p.wider()
    return max(allowed, key=lambda q: parse_precision(q).width)


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

    def prefetch(self, policies: Iterable[Mapping[str, Any]]) -> None:
        """Let the evaluator's workers start on the policies the agent will :meth:`evaluate`
        next, in that order (those this search has not tried, as many as the budget has
        left); a later :meth:`evaluate` of one of them waits for its run."""
        todo: dict[tuple[str, ...], dict[str, str]] = {}
        for policy in policies:
            full = self.problem.complete(policy)
            key = self.key(full)
            if key not in self._seen and len(todo) < self.remaining:
                todo.setdefault(key, full)
        self.problem.prefetch(list(todo.values()))

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

    An agent that keeps state between runs (a study, a checkpoint) keeps it under the search's
    name and owns it: every agent takes ``resume`` and ``name``.

    Args:
        resume: continue the saved state of the search called ``name``; False starts anew.
        name: the search's name (:func:`autoprec.agents.naming.search_name`); None: the
            agent's own default.
    """

    name: ClassVar[str] = ""  # the agent's name in the registry (``"tpe"``, ...)

    def __init__(self, *, resume: bool = False, name: str | None = None) -> None:
        self.resume = resume
        self.search_name = name

    @abc.abstractmethod
    def run(self, session: Session) -> None:
        """Search, recording trials through ``session``."""
