"""MLflow tracking of precision searches: a parent run per search, a nested run per evaluation.

:class:`SearchTracker` is a search callback (``on_trial(trial, result)``, the agents'
``SearchCallback``) and a context manager. It logs through :class:`mlflow.MlflowClient` with
explicit run ids, so it never touches MLflow's active-run stack:

* the parent run (``<agent>-<target>-seed<seed>`` in experiment ``autoprec/<model>``) holds the
  search's settings as params, ``best_reward`` and ``evaluations`` per real evaluation (step =
  real evaluations so far), the final metrics, and the artifacts: ``best_policy.yaml``,
  ``pareto.csv``, ``trials.csv``, ``pareto.png`` and ``precision_map.png``;
* every real evaluation (fidelity other than ``surrogate``) gets a nested run with its metrics,
  a digest of its policy and the policy itself as ``policy.json``; surrogate episodes are only
  counted (parent metric ``surrogate_episodes``).

Tracking never ends a search: if the server cannot be reached, the URI is malformed or any
MLflow call fails, the tracker prints one line (``autoprec: tracking off: <reason>``) to stderr
and ignores every later call (:class:`~autoprec.tracking.client.GuardedClient`). MLflow (and
matplotlib) are imported only when tracking starts.

Example:
    >>> from autoprec.tracking import SearchRunInfo, SearchTracker
    >>> info = SearchRunInfo("tinycnn", agent="random", target="h100-sxm", budget=3)
    >>> tracker = SearchTracker(info)
    >>> with tracker:  # doctest: +SKIP
    ...     result = search(problem, budget=3, agent="random", callbacks=[tracker])
    ...     tracker.finish(result, best_policy_path="best_policy.yaml")
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autoprec.tracking.client import CONNECT_LIMITS, STATUSES, GuardedClient
from autoprec.tracking.plots import pareto_figure, precision_map, save_png

if TYPE_CHECKING:
    from types import TracebackType

    from autoprec.agents.result import SearchResult, Trial
    from autoprec.evaluate import Metrics
    from autoprec.evaluate.reward import RewardConfig

TRIAL_METRICS = (
    "accuracy",
    "loss",
    "val_loss",
    "accuracy_delta",
    "loss_delta",
    "speedup",
    "memory_ratio",
    "speedup_vs_amp",
    "memory_ratio_vs_amp",
    "step_time_s",
    "memory_bytes",
    "overflows",
    "underflows",
    "diverged",
    "feasible",
)
#: The best trial's metrics logged on the parent run (as ``best_<name>``), and the AMP
#: baseline's (as ``amp_<name>``).
_BEST_METRICS = ("accuracy_delta", "loss_delta", "speedup", "memory_ratio", "accuracy")
_AMP_METRICS = ("speedup", "memory_ratio", "loss_delta", "accuracy_delta")


@dataclass(frozen=True)
class SearchRunInfo:
    """What a tracked search is: its parent run's params and tags.

    Args:
        model: the searched model's name.
        dataset: the fine-tuning data.
        target: the target accelerator's name.
        agent: the search agent's name.
        budget: real evaluations allowed.
        seed: the search's seed.
        fidelity: the real fidelity (``"short"`` or ``"full"``).
        reward: the search's reward (its weights and tolerance become parent params, and it
            scores the AMP reference); None is ``RewardConfig()``.
        params: more parent params (e.g. steps, precisions); values are turned into strings.
    """

    model: str
    dataset: str = ""
    target: str = ""
    agent: str = ""
    budget: int = 0
    seed: int = 0
    fidelity: str = "short"
    reward: RewardConfig | None = None
    params: Mapping[str, Any] = field(default_factory=dict)


class SearchTracker:
    """Logs one search to MLflow; see the module docstring for what goes where.

    Args:
        info: what the search is (model, data, target, agent, budget, seed, fidelity,
            reward, more params).
        tracking_uri: MLflow tracking URI; default ``$MLFLOW_TRACKING_URI``, else
            ``sqlite:///mlflow.db`` (in the working folder).
        experiment: experiment name; default ``autoprec/<model>``.
        enabled: False makes every method a no-op (and imports nothing).
        run_name: the parent run's name; default ``<agent>-<target>-seed<seed>``.

    Attributes:
        info: the search's :class:`SearchRunInfo`.
        active: whether runs are being logged (False once disabled, failed or finished).
        run_id: the parent run's id once started, else None.
        experiment_id: the experiment's id once started, else None.
        client: the :class:`~autoprec.tracking.client.GuardedClient` the calls go through.
    """

    def __init__(
        self,
        info: SearchRunInfo,
        *,
        tracking_uri: str | None = None,
        experiment: str | None = None,
        enabled: bool = True,
        run_name: str | None = None,
    ) -> None:
        self.info = info
        self._reward = info.reward
        self.client = GuardedClient(tracking_uri)
        self.tracking_uri = self.client.tracking_uri
        self.experiment = experiment or f"autoprec/{info.model}"
        self.enabled = enabled
        self.run_name = run_name or f"{info.agent}-{info.target}-seed{info.seed}"
        self.run_id: str | None = None
        self.experiment_id: str | None = None
        self.trial_runs: dict[int, str] = {}  # trial number -> nested run id
        self._last_step = 0  # real evaluations at the last progress point on the parent
        self._ended = not enabled  # closed, finished or never enabled

    @property
    def reward(self) -> RewardConfig:
        """The search's reward (``RewardConfig()`` when none was given)."""
        if self._reward is None:
            from autoprec.evaluate.reward import RewardConfig

            self._reward = RewardConfig()
        return self._reward

    @property
    def active(self) -> bool:
        """Whether runs are being logged (started, and neither failed nor ended)."""
        return self.run_id is not None and not (self._ended or self.client.failed)

    # -- lifecycle --
    def __enter__(self) -> SearchTracker:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.close("FINISHED")
        else:
            self.close("KILLED" if issubclass(exc_type, KeyboardInterrupt) else "FAILED")

    def start(self) -> bool:
        """Create the experiment (if new) and the parent run; returns :attr:`active`.

        A second call does nothing. A failure turns tracking off (one line on stderr).
        """
        if self._ended or self.client.failed or self.run_id is not None:
            return self.active
        with self.client.guard("cannot start", CONNECT_LIMITS):
            self.experiment_id = self.client.connect(self.experiment)
            tags = {
                "autoprec.agent": self.info.agent,
                "autoprec.target": self.info.target,
                "autoprec.model": self.info.model,
            }
            self.run_id = self.client.create_run(self.experiment_id, self.run_name, tags)
            self.client.log(self.run_id, params=self._parent_params())
        return self.active

    def close(self, status: str = "FAILED") -> None:
        """End the runs still open with ``status`` (no final metrics); a no-op after
        :meth:`finish` or when tracking is off."""
        if self.active:
            with self.client.guard("cannot end the run"):
                self.client.end_open_runs(status)
        self._ended = True

    # -- the callback --
    def on_trial(self, trial: Trial, result: SearchResult) -> None:
        """Log a real trial as a nested run and the parent's progress (``SearchCallback``)."""
        if not self.active or not trial.real or trial.number in self.trial_runs:
            return
        with self.client.guard(f"cannot log trial {trial.number}"):
            tags = {
                "mlflow.parentRunId": self.run_id,
                "autoprec.trial": str(trial.number),
                "autoprec.agent": self.info.agent,
            }
            run_id = self.client.create_run(self.experiment_id, f"trial-{trial.number:03d}", tags)
            metrics = {name: getattr(trial.metrics, name) for name in TRIAL_METRICS}
            metrics.update(
                reward=trial.reward,
                wall_time_s=trial.wall_time_s,
                evaluation_wall_time_s=trial.metrics.wall_time_s,
            )
            params = {
                "trial": trial.number,
                "fidelity": trial.fidelity,
                "policy_digest": policy_digest(trial.policy),
                "layers": len(trial.policy),
                "lowered_layers": lowered_layers(trial.policy),
            }
            self.client.log(run_id, metrics=metrics, params=params)
            policy = json.dumps(dict(trial.policy), indent=2)
            self.client.mlflow.log_text(run_id, policy, "policy.json")
            self.client.end_run(run_id)
            self.trial_runs[trial.number] = run_id
            step = len(result.real_trials)
            best = result.best
            progress = {"evaluations": step, "trial_reward": trial.reward}
            if best is not None:
                progress["best_reward"] = best.reward
            self.client.log(self.run_id, metrics=progress, step=step)
            self._last_step = step

    # -- the end --
    def finish(
        self,
        result: SearchResult,
        best_policy_path: str | os.PathLike[str] | None = None,
        amp_metrics: Metrics | None = None,
        fp32_metrics: Metrics | None = None,
        status: str = "FINISHED",
    ) -> None:
        """Log the final metrics and artifacts on the parent run and end it with ``status``.

        Args:
            result: the search's ``SearchResult`` (partial for an interrupted search).
            best_policy_path: the exported best policy, logged as ``best_policy.yaml``.
            amp_metrics: ``Metrics`` of the target's blanket AMP policy (``amp_*`` metrics and
                a point on ``pareto.png``).
            fp32_metrics: ``Metrics`` of the fp32 reference (``fp32_*`` metrics).
            status: ``"FINISHED"``, ``"KILLED"`` (interrupted) or ``"FAILED"``.

        Raises:
            ValueError: an unknown ``status``.
        """
        if status not in STATUSES:
            raise ValueError(f"unknown run status {status!r}; expected one of {STATUSES}")
        if not self.active:
            self._ended = True
            return
        with self.client.guard("cannot finish the run"):
            reals = result.real_trials
            final = self._final_metrics(result, amp_metrics, fp32_metrics)
            if self._last_step == len(reals):  # already the last point of their history
                final.pop("best_reward", None)
                final.pop("evaluations", None)
            self.client.log(self.run_id, metrics=final, step=len(reals))
            with tempfile.TemporaryDirectory(prefix="autoprec-mlflow-") as tmp:
                for path in self._artifacts(Path(tmp), result, best_policy_path, amp_metrics):
                    self.client.mlflow.log_artifact(self.run_id, str(path))
            self.client.end_open_runs(status)
        self._ended = True

    # -- helpers --
    def _artifacts(
        self,
        folder: Path,
        result: SearchResult,
        best_policy_path: str | os.PathLike[str] | None,
        amp: Metrics | None,
    ) -> list[Path]:
        """The parent's artifacts, written into ``folder``."""
        from autoprec.cache import write_csv

        files = []
        if best_policy_path is not None and Path(best_policy_path).is_file():
            files.append(folder / "best_policy.yaml")
            shutil.copyfile(best_policy_path, files[-1])
        for name, rows in (
            ("pareto.csv", self._pareto_rows(result)),
            ("trials.csv", result.summary_rows(False)),
        ):
            files.append(write_csv(folder / name, rows, None if rows else ["number"]))
        if result.real_trials:
            figure = pareto_figure(result, amp, self.reward.tolerance, self._title(result))
            files.append(save_png(folder / "pareto.png", figure))
        if result.best is not None:
            best = result.best
            title = f"best policy: trial {best.number}, reward {best.reward:.3f}\n"
            figure = precision_map(best.policy, title + self._title(result))
            files.append(save_png(folder / "precision_map.png", figure))
        return files

    def _parent_params(self) -> dict[str, Any]:
        from autoprec import __version__

        try:
            import torch

            torch_version = torch.__version__
        except ImportError:  # pragma: no cover - torch is a dependency
            torch_version = "none"
        params: dict[str, Any] = {
            "model": self.info.model,
            "dataset": self.info.dataset,
            "target": self.info.target,
            "agent": self.info.agent,
            "budget": self.info.budget,
            "seed": self.info.seed,
            "fidelity": self.info.fidelity,
            **self.reward.params(),
            "autoprec_version": __version__,
            "torch_version": torch_version,
        }
        params.update(self.info.params)
        return params

    def _final_metrics(
        self, result: SearchResult, amp: Metrics | None, fp32: Metrics | None
    ) -> dict[str, Any]:
        reals = result.real_trials
        out: dict[str, Any] = {
            "evaluations": len(reals),
            "surrogate_episodes": len(result.trials) - len(reals),
            "search_wall_time_s": result.wall_time_s,
            "pareto_size": len(result.pareto),
        }
        best = result.best
        if best is not None:
            out["best_reward"] = best.reward
            out.update(_prefixed("best_", best.metrics, _BEST_METRICS))
            out["best_lowered_layers"] = lowered_layers(best.policy)
        reference = fp32 if fp32 is not None else (best.metrics if best is not None else None)
        if reference is not None:
            out.update(fp32_accuracy=reference.fp32_accuracy, fp32_loss=reference.fp32_loss)
        if amp is not None:
            out["amp_reward"] = self.reward(amp)
            out.update(_prefixed("amp_", amp, _AMP_METRICS))
        return out

    def _pareto_rows(self, result: SearchResult) -> list[dict[str, Any]]:
        rows = []
        for trial in result.pareto:
            m = trial.metrics
            rows.append(
                {
                    "number": trial.number,
                    "reward": trial.reward,
                    "loss_delta": m.loss_delta,
                    "accuracy_delta": m.accuracy_delta,
                    "speedup": m.speedup,
                    "memory_ratio": m.memory_ratio,
                    "policy_digest": policy_digest(trial.policy),
                    "run_id": self.trial_runs.get(trial.number, ""),
                }
            )
        return rows

    def _title(self, result: SearchResult) -> str:
        info = self.info
        return (
            f"{info.model} on {info.target or result.target}: {info.agent or result.agent}, "
            f"{len(result.real_trials)} evaluations"
        )


def _prefixed(prefix: str, metrics: Metrics, names: Sequence[str]) -> dict[str, Any]:
    """``{prefix + name: metrics.<name>}`` for each of ``names``, in that order."""
    return {prefix + name: getattr(metrics, name) for name in names}


def policy_digest(policy: Mapping[str, Any]) -> str:
    """Short SHA-256 of a ``{layer: precision}`` map, independent of its order.

    Example:
        >>> policy_digest({"fc": "bf16", "conv1": "fp32"}) == policy_digest(
        ...     {"conv1": "fp32", "fc": "bf16"})
        True
    """
    text = json.dumps(sorted((str(k), str(v)) for k, v in policy.items()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def lowered_layers(policy: Mapping[str, Any]) -> int:
    """Layers whose precision is not fp32."""
    return sum(1 for p in policy.values() if getattr(p, "value", p) != "fp32")
