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
and ignores every later call. MLflow (and matplotlib) are imported only when tracking starts.

Example:
    >>> from autoprec.tracking import SearchTracker
    >>> tracker = SearchTracker("tinycnn", agent="random", target="h100-sxm", budget=3)
    >>> with tracker:  # doctest: +SKIP
    ...     result = search(problem, budget=3, agent="random", callbacks=[tracker])
    ...     tracker.finish(result, best_policy_path="best_policy.yaml")
"""

from __future__ import annotations

import contextlib
import csv
import hashlib
import io
import json
import math
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"
STATUSES = ("FINISHED", "KILLED", "FAILED")
# HTTP limits for the tracker's own calls, where the user has not set them: the first contact
# fails fast (an unreachable server costs a moment, not MLflow's minutes of retries); later
# calls retry a little, so one hiccup does not end tracking.
_CONNECT_LIMITS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "5"}
_CALL_LIMITS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "30",
}
_TRIAL_METRICS = (
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
_BITS = {"fp32": 32, "tf32": 19, "bf16": 16, "fp16": 16, "fp8": 8}
_COLOURS = {
    "fp32": "#4c72b0",
    "tf32": "#64b5cd",
    "bf16": "#55a868",
    "fp16": "#dd8452",
    "fp8": "#c44e52",
}


EXPERIMENT_TAGS = {
    # MLflow 3's UI opens an experiment of this kind on its "Model training" runs table
    "mlflow.experimentKind": "custom_model_development",
}


def experiment_id(client: Any, name: str) -> str:
    """The id of experiment ``name``, created (with :data:`EXPERIMENT_TAGS`) if missing.

    Raises:
        RuntimeError: the experiment exists but is deleted.
    """
    found = client.get_experiment_by_name(name)
    if found is None:
        try:
            return client.create_experiment(name, tags=EXPERIMENT_TAGS)
        except Exception:  # noqa: BLE001 - created meanwhile by another process?
            found = client.get_experiment_by_name(name)
            if found is None:
                raise
    if found.lifecycle_stage == "deleted":
        raise RuntimeError(
            f"experiment {name!r} is deleted; restore it (`mlflow experiments restore`) or "
            "choose another one (--experiment)"
        )
    return found.experiment_id


class SearchTracker:
    """Logs one search to MLflow; see the module docstring for what goes where.

    Args:
        model: the searched model's name.
        dataset: the fine-tuning data.
        target: the target accelerator's name.
        agent: the search agent's name.
        budget: real evaluations allowed.
        seed: the search's seed.
        fidelity: the real fidelity (``"short"`` or ``"full"``).
        reward_weights: ``{"speedup", "memory", "accuracy"}`` weights of the reward.
        accuracy_tolerance: the loss delta above which the reward is penalised.
        tracking_uri: MLflow tracking URI; default ``$MLFLOW_TRACKING_URI``, else
            ``sqlite:///mlflow.db`` (in the working folder).
        experiment: experiment name; default ``autoprec/<model>``.
        enabled: False makes every method a no-op (and imports nothing).
        run_name: the parent run's name; default ``<agent>-<target>-seed<seed>``.
        params: more parent params (e.g. steps, precisions); values are turned into strings.

    Attributes:
        active: whether runs are being logged (False once disabled, failed or finished).
        run_id: the parent run's id once started, else None.
        experiment_id: the experiment's id once started, else None.
    """

    def __init__(
        self,
        model: str,
        *,
        dataset: str = "",
        target: str = "",
        agent: str = "",
        budget: int = 0,
        seed: int = 0,
        fidelity: str = "short",
        reward_weights: Mapping[str, float] | None = None,
        accuracy_tolerance: float = 0.05,
        tracking_uri: str | None = None,
        experiment: str | None = None,
        enabled: bool = True,
        run_name: str | None = None,
        params: Mapping[str, Any] | None = None,
    ) -> None:
        self.model = model
        self.dataset = dataset
        self.target = target
        self.agent = agent
        self.budget = budget
        self.seed = seed
        self.fidelity = fidelity
        self.reward_weights = dict(reward_weights or {})
        self.accuracy_tolerance = accuracy_tolerance
        self.tracking_uri = (
            tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI
        )
        self.experiment = experiment or f"autoprec/{model}"
        self.enabled = enabled
        self.run_name = run_name or f"{agent}-{target}-seed{seed}"
        self.extra_params = dict(params or {})
        self.active = False
        self.run_id: str | None = None
        self.experiment_id: str | None = None
        self.trial_runs: dict[int, str] = {}  # trial number -> nested run id
        self._last_step = 0  # real evaluations at the last progress point on the parent
        self._client: Any = None
        self._open: list[str] = []  # runs created and not yet terminated, parent first
        self._closed = not enabled

    # -- lifecycle --
    def __enter__(self) -> SearchTracker:
        self.start()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close("FINISHED")
        else:
            self.close("KILLED" if issubclass(exc_type, KeyboardInterrupt) else "FAILED")

    def start(self) -> bool:
        """Create the experiment (if new) and the parent run; returns :attr:`active`.

        A second call does nothing. A failure turns tracking off (one line on stderr).
        """
        if self._closed or self.run_id is not None:
            return self.active
        with self._guard("cannot start", _CONNECT_LIMITS):
            self._client = self._connect()
            self.experiment_id = self._experiment_id()
            run = self._client.create_run(
                self.experiment_id,
                run_name=self.run_name,
                tags={
                    "autoprec.agent": self.agent,
                    "autoprec.target": self.target,
                    "autoprec.model": self.model,
                },
            )
            self.run_id = run.info.run_id
            self._open.append(self.run_id)
            self.active = True
            self._log(self.run_id, params=self._parent_params())
        return self.active

    def close(self, status: str = "FAILED") -> None:
        """End the runs still open with ``status`` (no final metrics); a no-op after
        :meth:`finish` or when tracking is off."""
        if self.active:
            with self._guard("cannot end the run", _CALL_LIMITS):
                self._terminate(status)
        self.active = False
        self._closed = True

    # -- the callback --
    def on_trial(self, trial: Any, result: Any) -> None:
        """Log a real trial as a nested run and the parent's progress (``SearchCallback``)."""
        if not self.active or not trial.real or trial.number in self.trial_runs:
            return
        with self._guard(f"cannot log trial {trial.number}", _CALL_LIMITS):
            client = self._client
            run = client.create_run(
                self.experiment_id,
                run_name=f"trial-{trial.number:03d}",
                tags={
                    "mlflow.parentRunId": self.run_id,
                    "autoprec.trial": str(trial.number),
                    "autoprec.agent": self.agent,
                },
            )
            run_id = run.info.run_id
            self._open.append(run_id)
            metrics = {name: getattr(trial.metrics, name) for name in _TRIAL_METRICS}
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
                "lowered_layers": _lowered(trial.policy),
            }
            self._log(run_id, metrics=metrics, params=params)
            client.log_text(run_id, json.dumps(dict(trial.policy), indent=2), "policy.json")
            client.set_terminated(run_id, "FINISHED")
            self._open.remove(run_id)
            self.trial_runs[trial.number] = run_id
            step = len(result.real_trials)
            best = result.best
            progress = {"evaluations": step, "trial_reward": trial.reward}
            if best is not None:
                progress["best_reward"] = best.reward
            self._log(self.run_id, metrics=progress, step=step)
            self._last_step = step

    # -- the end --
    def finish(
        self,
        result: Any,
        best_policy_path: str | os.PathLike[str] | None = None,
        amp_metrics: Any = None,
        fp32_metrics: Any = None,
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
            self._closed = True
            return
        with self._guard("cannot finish the run", _CALL_LIMITS):
            reals = result.real_trials
            final = self._final_metrics(result, amp_metrics, fp32_metrics)
            if self._last_step == len(reals):  # already the last point of their history
                final.pop("best_reward", None)
                final.pop("evaluations", None)
            self._log(self.run_id, metrics=final, step=len(reals))
            with tempfile.TemporaryDirectory(prefix="autoprec-mlflow-") as tmp:
                folder = Path(tmp)
                files = []
                if best_policy_path is not None and Path(best_policy_path).is_file():
                    files.append(folder / "best_policy.yaml")
                    shutil.copyfile(best_policy_path, files[-1])
                files.append(_write_csv(folder / "pareto.csv", self._pareto_rows(result)))
                files.append(_write_csv(folder / "trials.csv", result.summary_rows(False)))
                if reals:
                    files.append(
                        _save_png(folder / "pareto.png", self._pareto_figure(result, amp_metrics))
                    )
                if result.best is not None:
                    best = result.best
                    title = f"best policy: trial {best.number}, reward {best.reward:.3f}\n"
                    figure = _precision_map(best.policy, title + self._title(result))
                    files.append(_save_png(folder / "precision_map.png", figure))
                for path in files:
                    self._client.log_artifact(self.run_id, str(path))
            self._terminate(status)
        self.active = False
        self._closed = True

    # -- helpers --
    def _connect(self) -> Any:
        """An MlflowClient whose store answers. Processes that open one new SQLite database
        together (workers started at once) take turns: MLflow's table creation is not safe
        to run twice at the same time."""
        from mlflow import MlflowClient

        with _sqlite_lock(self.tracking_uri):
            client = MlflowClient(tracking_uri=self.tracking_uri)
            client.get_experiment_by_name(self.experiment)
        return client

    def _experiment_id(self) -> str:
        return experiment_id(self._client, self.experiment)

    def _parent_params(self) -> dict[str, Any]:
        import autoprec

        try:
            import torch

            torch_version = torch.__version__
        except ImportError:  # pragma: no cover - torch is a dependency
            torch_version = "none"
        params: dict[str, Any] = {
            "model": self.model,
            "dataset": self.dataset,
            "target": self.target,
            "agent": self.agent,
            "budget": self.budget,
            "seed": self.seed,
            "fidelity": self.fidelity,
            "accuracy_tolerance": self.accuracy_tolerance,
            "autoprec_version": autoprec.__version__,
            "torch_version": torch_version,
        }
        for key, weight in self.reward_weights.items():
            params[f"w_{key}"] = weight
        params.update(self.extra_params)
        return params

    def _final_metrics(self, result: Any, amp: Any, fp32: Any) -> dict[str, Any]:
        reals = result.real_trials
        out: dict[str, Any] = {
            "evaluations": len(reals),
            "surrogate_episodes": len(result.trials) - len(reals),
            "search_wall_time_s": result.wall_time_s,
            "pareto_size": len(result.pareto),
        }
        best = result.best
        if best is not None:
            m = best.metrics
            out.update(
                best_reward=best.reward,
                best_accuracy_delta=m.accuracy_delta,
                best_loss_delta=m.loss_delta,
                best_speedup=m.speedup,
                best_memory_ratio=m.memory_ratio,
                best_accuracy=m.accuracy,
                best_lowered_layers=_lowered(best.policy),
            )
        reference = fp32 if fp32 is not None else (best.metrics if best is not None else None)
        if reference is not None:
            out.update(fp32_accuracy=reference.fp32_accuracy, fp32_loss=reference.fp32_loss)
        if amp is not None:
            from autoprec.envs.precision_env import reward

            out.update(
                amp_reward=reward(amp, self.reward_weights or None, self.accuracy_tolerance),
                amp_speedup=amp.speedup,
                amp_memory_ratio=amp.memory_ratio,
                amp_loss_delta=amp.loss_delta,
                amp_accuracy_delta=amp.accuracy_delta,
            )
        return out

    def _pareto_rows(self, result: Any) -> list[dict[str, Any]]:
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

    def _title(self, result: Any) -> str:
        return (
            f"{self.model} on {self.target or result.target}: {self.agent or result.agent}, "
            f"{len(result.real_trials)} evaluations"
        )

    def _pareto_figure(self, result: Any, amp: Any) -> Any:
        from matplotlib.figure import Figure

        fig = Figure(figsize=(7, 5), dpi=100, layout="constrained")
        ax = fig.add_subplot()
        points = [
            (t.metrics.speedup, t.metrics.loss_delta)
            for t in result.real_trials
            if math.isfinite(t.metrics.speedup) and math.isfinite(t.metrics.loss_delta)
        ]
        if points:
            ax.scatter(*zip(*points, strict=True), c="0.65", s=22, label="evaluated policies")
        front = sorted(result.pareto, key=lambda t: t.metrics.speedup)
        if front:
            xs = [t.metrics.speedup for t in front]
            ys = [t.metrics.loss_delta for t in front]
            ax.scatter(xs, ys, c="#c44e52", s=40, zorder=3, label="Pareto front")
        best = result.best
        if best is not None and math.isfinite(best.metrics.loss_delta):
            ax.scatter(
                [best.metrics.speedup],
                [best.metrics.loss_delta],
                marker="*",
                s=220,
                c="#dd8452",
                edgecolors="black",
                zorder=4,
                label=f"best (reward {best.reward:.3f})",
            )
        references = [("fp32", 1.0, 0.0)]
        if amp is not None and math.isfinite(amp.speedup) and math.isfinite(amp.loss_delta):
            references.append(("AMP", amp.speedup, amp.loss_delta))
        for name, x, y in references:
            ax.scatter([x], [y], marker="X", s=90, c="black", zorder=5)
            ax.annotate(name, (x, y), textcoords="offset points", xytext=(6, 6))
        ax.axhline(self.accuracy_tolerance, color="0.4", linestyle="--", linewidth=0.8)
        ax.annotate(
            "accuracy tolerance",
            (0.01, self.accuracy_tolerance),
            xycoords=("axes fraction", "data"),
            textcoords="offset points",
            xytext=(0, 3),
            fontsize=8,
            color="0.4",
        )
        ax.set_xlabel("speedup over fp32 (x)")
        ax.set_ylabel("loss delta (relative to fp32)")
        ax.set_title(self._title(result))
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize=8)
        return fig

    def _log(
        self,
        run_id: str,
        metrics: Mapping[str, Any] | None = None,
        params: Mapping[str, Any] | None = None,
        step: int = 0,
    ) -> None:
        from mlflow.entities import Metric, Param

        now = int(time.time() * 1000)
        metric_list = [
            Metric(key, float(value), now, step)
            for key, value in (metrics or {}).items()
            if value is not None
        ]
        param_list = [Param(key, str(value)) for key, value in (params or {}).items()]
        self._client.log_batch(run_id, metrics=metric_list, params=param_list)

    def _terminate(self, status: str) -> None:
        while self._open:  # nested runs first, the parent last
            self._client.set_terminated(self._open[-1], status)
            self._open.pop()

    @contextlib.contextmanager
    def _guard(self, what: str, limits: Mapping[str, str]) -> Iterator[None]:
        """Run MLflow calls; any exception turns tracking off instead of propagating."""
        try:
            with _http_limits(limits):
                yield
        except Exception as err:  # noqa: BLE001 - tracking must never end a search
            self._disable(f"{what} ({self.tracking_uri}): {_one_line(err)}")

    def _disable(self, reason: str) -> None:
        was_active = self.active
        self.active = False
        self._closed = True
        print(f"autoprec: tracking off: {reason}", file=sys.stderr, flush=True)
        if was_active and self._open:
            with contextlib.suppress(Exception), _http_limits(_CONNECT_LIMITS):
                self._terminate("FAILED")


def policy_digest(policy: Mapping[str, Any]) -> str:
    """Short SHA-256 of a ``{layer: precision}`` map, independent of its order.

    Example:
        >>> policy_digest({"fc": "bf16", "conv1": "fp32"}) == policy_digest(
        ...     {"conv1": "fp32", "fc": "bf16"})
        True
    """
    text = json.dumps(sorted((str(k), str(v)) for k, v in policy.items()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _lowered(policy: Mapping[str, Any]) -> int:
    """Layers whose precision is not fp32."""
    return sum(1 for p in policy.values() if getattr(p, "value", p) != "fp32")


def _precision_map(policy: Mapping[str, Any], title: str) -> Any:
    """Bar per layer in execution order: length the format's bits, colour its precision."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    from autoprec.precision import parse_precision

    names = [str(k) for k in policy]
    values = []
    for value in policy.values():
        try:
            values.append(parse_precision(value).value)
        except ValueError:
            values.append(str(value))
    widths = [_BITS.get(v, 32) for v in values]
    n = len(names)
    fig = Figure(figsize=(7, min(max(2.5, 0.25 * n + 1.2), 60)), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    ys = list(range(n))
    ax.barh(ys, widths, color=[_COLOURS.get(v, "0.6") for v in values], edgecolor="white")
    ax.set_yticks(ys, names if n <= 200 else [""] * n, fontsize=8 if n <= 60 else 5)
    ax.invert_yaxis()  # execution order from the top
    ax.set_xlabel("bits per value of the layer's matrix work (operands)")
    ax.set_xticks([0, 8, 16, 19, 32])
    ax.set_title(title, fontsize=10)
    present = list(dict.fromkeys(values))
    handles = [Patch(color=_COLOURS.get(v, "0.6"), label=v) for v in present]
    ax.legend(
        handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8, title="precision"
    )
    return fig


def _save_png(path: Path, figure: Any) -> Path:
    from autoprec.cache import write_atomic

    write_atomic(path, lambda fh: figure.savefig(fh, format="png"), binary=True)
    path.chmod(0o644)  # mkstemp's 0600 would hide the artifact from a shared store's readers
    return path


def _write_csv(path: Path, rows: list[dict[str, Any]]) -> Path:
    fields: list[str] = []
    for row in rows:
        fields += [k for k in row if k not in fields]
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=fields or ["number"])
    writer.writeheader()
    writer.writerows(rows)
    path.write_text(buffer.getvalue())
    return path


def _one_line(err: BaseException) -> str:
    """``err`` as one short line; for a connection failure, just its cause."""
    text = " ".join(str(err).split()) or type(err).__name__
    refused = re.search(r"\[Errno -?\d+\][^'\")\]]*", text)
    if refused:
        return f"cannot connect: {refused.group(0).strip()}"
    if "timed out" in text.lower():
        return "cannot connect: timed out"
    if len(text) > 300:
        text = text[:297] + "..."
    return f"{type(err).__name__}: {text}"


@contextlib.contextmanager
def _sqlite_lock(uri: str) -> Iterator[None]:
    """An exclusive lock per SQLite database file (no-op for other URIs or without fcntl)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        fcntl = None  # type: ignore[assignment]
    if fcntl is None or not uri.startswith("sqlite:///"):
        yield
        return
    database = Path(uri[len("sqlite:///") :].split("?")[0]).resolve()
    key = hashlib.sha256(str(database).encode()).hexdigest()[:16]
    try:
        handle = open(Path(tempfile.gettempdir()) / f"autoprec-mlflow-{key}.lock", "a")
    except OSError:
        yield
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextlib.contextmanager
def _http_limits(limits: Mapping[str, str]) -> Iterator[None]:
    """Set MLflow's HTTP retry/timeout variables the user has not set, for the block."""
    added = [key for key in limits if key not in os.environ]
    for key in added:
        os.environ[key] = limits[key]
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)
