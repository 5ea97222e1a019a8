"""What a search records: one :class:`Trial` per evaluated policy, and the
:class:`SearchResult` (the best trial, the Pareto front, the exported policies)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from autoprec.agents.export import export_policy, layer_policy, policy_metrics

if TYPE_CHECKING:  # pragma: no cover
    from torch import nn

    from autoprec.evaluate import Metrics
    from autoprec.policy import PrecisionPolicy, TargetInfo

SURROGATE = "surrogate"
EMULATE_NOTE = (
    "searched in emulate target mode: layers may use formats the target cannot run natively; "
    "not for native training"
)


@dataclass
class Trial:
    """One evaluated policy.

    Attributes:
        number: position in :attr:`SearchResult.trials`.
        policy: ``{layer: precision}`` over every tunable layer.
        metrics: the evaluator's :class:`~autoprec.evaluate.Metrics`.
        reward: the problem's reward of ``metrics``, computed once when the trial is made.
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

    def row(self) -> dict[str, Any]:
        """One flat dict for a table or a CSV: number, fidelity, reward, loss_delta,
        accuracy_delta, speedup, memory_ratio, diverged, policy (precisions in layer order)."""
        m = self.metrics
        return {
            "number": self.number,
            "fidelity": self.fidelity,
            "reward": self.reward,
            "loss_delta": m.loss_delta,
            "accuracy_delta": m.accuracy_delta,
            "speedup": m.speedup,
            "memory_ratio": m.memory_ratio,
            "diverged": m.diverged,
            "policy": " ".join(self.policy.values()),
        }

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


def _objectives(trial: Trial) -> tuple[float, float, float]:
    m = trial.metrics
    return (m.loss_delta, -m.speedup, m.memory_ratio)


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
        stopped: a callback ended the search early (:class:`~autoprec.agents.StopSearch`).
        target: the target device's name (for :meth:`best_policy`).
        target_mode: ``"native"`` (the exported policy is for native training on the target)
            or ``"emulate"`` (a study of formats; the file says it is not for native training).
        info: what the agent reports (study name, checkpoint path, ...).
        chosen: the number of the trial chosen after the search (the best of the finalists
            timed as whole steps on the target: :mod:`autoprec.pipeline.evaluations`); None:
            the real trial with the highest reward.
        execution: the program the policies were priced for (``"eager"`` or
            ``"compiled"``; the exported ``target.execution``), None: not stated.
    """

    agent: str
    trials: list[Trial] = field(default_factory=list)
    wall_time_s: float = 0.0
    budget: int = 0
    stopped: bool = False
    target: str | None = None
    target_mode: str = "native"
    info: dict[str, Any] = field(default_factory=dict)
    chosen: int | None = None
    execution: str | None = None

    @property
    def real_trials(self) -> list[Trial]:
        """Trials whose fidelity is not ``"surrogate"``."""
        return [t for t in self.trials if t.real]

    @property
    def best(self) -> Trial | None:
        """The :attr:`chosen` trial, else the real trial with the highest reward (the earliest
        of equals); None if none."""
        if self.chosen is not None:
            return self.trials[self.chosen]
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

    def best_policy(self, spec_module: nn.Module) -> PrecisionPolicy | None:
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

    def policy_of(self, trial: Trial, spec_module: nn.Module) -> PrecisionPolicy:
        """Any trial's policy as :meth:`best_policy` builds it (e.g. each Pareto point)."""
        return export_policy(
            layer_policy(trial.policy),
            spec_module,
            target=self.target_info(),
            metrics={**policy_metrics(trial.metrics), "reward": trial.reward},
            provenance={
                "agent": self.agent,
                "fidelity": trial.fidelity,
                "trial": trial.number,
            },
            note=EMULATE_NOTE if self.target_mode == "emulate" else None,
        )

    def target_info(self) -> TargetInfo | None:
        """The exported files' ``target`` section (None without a target)."""
        from autoprec.policy import TargetInfo

        if not self.target:
            return None
        return TargetInfo(device=self.target, mode=self.target_mode, execution=self.execution)

    def summary_rows(self, real_only: bool = True) -> list[dict[str, Any]]:
        """One flat dict per trial (for a table or a CSV): :meth:`Trial.row` with ``pareto``
        (whether the trial is on the front) before ``policy``."""
        front = {t.number for t in self.pareto}
        rows = []
        for t in self.real_trials if real_only else self.trials:
            row = t.row()
            policy = row.pop("policy")
            rows.append({**row, "pareto": t.number in front, "policy": policy})
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
