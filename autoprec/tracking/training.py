"""MLflow tracking of one training run (``autoprec train``).

:class:`TrainTracker` logs one run per training, in the experiment it is given (``autoprec
train`` uses ``autoprec/<model>`` and tags the run ``autoprec.kind=train``): the settings as
params, the policy file as an artifact, buffered metric values, a summary at the end. Its calls
go through the same :class:`~autoprec.tracking.client.GuardedClient` as the search tracker's,
so an unreachable store turns tracking off with one line, never the training.

Example:
    >>> from autoprec.tracking import TrainTracker
    >>> tracker = TrainTracker(experiment="autoprec/tinycnn", run_name="train-tinycnn",
    ...                        enabled=False)
    >>> tracker.log(1, {"train_loss": 2.3})  # disabled: nothing is logged
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from autoprec.tracking.client import CALL_LIMITS, CONNECT_LIMITS, GuardedClient

if TYPE_CHECKING:
    from autoprec.training.run import TrainResult

FLUSH_METRICS = 500  # buffered metric values that trigger a write to MLflow
FLUSH_SECONDS = 15.0  # ... or the time since the last write
BATCH_LIMIT = 1000  # metric values MLflow takes in one log_batch


class RunSettings:
    """What a tracker of parent runs is given: where it logs, under which names, whether at all.

    Args:
        experiment: the experiment's name.
        run_name: the (parent) run's name.
        tracking_uri: MLflow tracking URI; default ``$MLFLOW_TRACKING_URI``, else
            ``sqlite:///mlflow.db``.
        enabled: False makes every method of the tracker a no-op.
        tags: the run's tags.
        params: the run's params; values are turned into strings.
        echo: where the ``mlflow: run ...`` lines go (the CLI passes ``click.echo``).
    """

    def __init__(
        self,
        *,
        experiment: str,
        run_name: str,
        tracking_uri: str | None = None,
        enabled: bool = True,
        tags: Mapping[str, str] | None = None,
        params: Mapping[str, Any] | None = None,
        echo: Callable[[str], Any] = print,
    ) -> None:
        self.client = GuardedClient(tracking_uri)
        self.tracking_uri = self.client.tracking_uri
        self.enabled = enabled
        self.experiment, self.run_name = experiment, run_name
        self.tags, self.params = dict(tags or {}), dict(params or {})
        self.echo = echo
        self.run_id: str | None = None


class TrainTracker(RunSettings):
    """MLflow logging of one training run; every method is a no-op when disabled.

    The run starts with the first metrics (so settings that training refuses leave no run),
    metric values are buffered and written in batches, and any MLflow failure turns tracking
    off with one line (``autoprec: tracking off: <reason>``) instead of ending the training.

    Args:
        artifacts: files logged when the run starts (the policy file).
        **settings: :class:`RunSettings`' (only rank 0 of a DDP training is ``enabled``).

    Attributes:
        enabled: whether the run is (still) being logged.
        run_id: the run's id once started, else None.
    """

    def __init__(self, *, artifacts: Sequence[str] = (), **settings: Any) -> None:
        super().__init__(**settings)
        self.artifacts = list(artifacts)
        self._pending: list[Any] = []
        self._flushed = time.monotonic()

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Buffer ``train_loss``/``loss_scale`` or ``val_loss``/``val_accuracy``/``epoch``."""
        if not self._running():
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        for key, value in metrics.items():
            if key == "epoch" and "val_loss" not in metrics:
                continue  # the epoch goes with each validation, not with every step
            self._pending.append(Metric(key, float(value), now, step))
        due = time.monotonic() - self._flushed >= FLUSH_SECONDS
        if len(self._pending) >= FLUSH_METRICS or due:
            with self._guard("cannot log metrics"):
                self._flush()

    def finish(self, result: TrainResult) -> None:
        """Log the summary of ``result`` (a ``TrainResult``) and end the run as FINISHED."""
        if not self._running():
            return
        from mlflow.entities import Metric

        last = result.train_loss[-1] if result.train_loss else None
        summary = {
            "final_train_loss": last,
            "final_val_loss": result.val_loss,
            "final_val_accuracy": result.val_accuracy,
            "total_steps": result.steps,
            "epochs_done": result.epochs,
            "overflows": result.overflows,
            "skipped_steps": result.skipped_steps,
            "train_wall_time_s": result.wall_time_s,
        }
        now = int(time.time() * 1000)
        self._pending += [
            Metric(k, float(v), now, result.steps) for k, v in summary.items() if v is not None
        ]
        more = {"runtime_mode": result.mode, "resumed_from": result.resumed_from or 0}
        with self._guard("cannot finish the run"):
            self._flush()
            self.client.log(self.run_id, params=more)
            self.client.end_run(self.run_id)
            self.echo(f"mlflow: run {self.run_id} finished")
        self.enabled = False

    def close(self, status: str) -> None:
        """End the run with ``status`` (``FAILED``, ``KILLED``) after the buffered metrics."""
        if self.enabled and self.run_id is not None:
            with self._guard("cannot end the run"):
                self._flush()
                self.client.end_run(self.run_id, status)
        self.enabled = False

    def _running(self) -> bool:
        """Whether to log: enabled, and the run started (now, if it was not yet)."""
        if not self.enabled or self.run_id is not None:
            return self.enabled
        with self._guard("cannot start", CONNECT_LIMITS):
            experiment = self.client.connect(self.experiment)
            self.run_id = self.client.create_run(experiment, self.run_name, self.tags)
            self.client.log(self.run_id, params=self.params)
            for path in self.artifacts:
                self.client.mlflow.log_artifact(self.run_id, path)
            self.echo(
                f"mlflow: run {self.run_id} in experiment {self.experiment!r} at "
                f"{self.tracking_uri}"
            )
        return self.enabled

    def _flush(self) -> None:
        while self._pending:
            batch = self._pending[:BATCH_LIMIT]
            self._pending = self._pending[BATCH_LIMIT:]
            self.client.mlflow.log_batch(self.run_id, metrics=batch)
        self._flushed = time.monotonic()

    @contextlib.contextmanager
    def _guard(self, what: str, limits: Mapping[str, Any] = CALL_LIMITS) -> Iterator[None]:
        """The client's guard; a failure also stops this tracker and drops its buffer."""
        with self.client.guard(what, limits):
            yield
        if self.client.failed:
            self.enabled = False
            self._pending.clear()
