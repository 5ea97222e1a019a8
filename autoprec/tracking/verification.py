"""MLflow tracking of one verification (``autoprec verify``).

:class:`VerifyTracker` logs a parent run (tag ``autoprec.kind=verify``: the settings as params,
the verdict and every arm's mean and sd at the end, the policy file and the learning curves as
artifacts) and a nested run per arm and seed (params ``arm``, ``seed``, ``steps``; the training
loss per step, the validation per validation, the final values). It is a
:class:`~autoprec.verify.VerifyCallback`. Its calls go through the same
:class:`~autoprec.tracking.client.GuardedClient` as the other trackers', so an unreachable store
turns tracking off with one line, never the verification.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from autoprec.tracking.client import CONNECT_LIMITS
from autoprec.tracking.training import BATCH_LIMIT, RunSettings


class VerifyTracker(RunSettings):
    """A parent run per verification, a nested run per arm and seed; no-ops when disabled.

    Args:
        length: the nested runs' ``steps`` param (``"20"`` or ``"2 epochs"``).
        **settings: :class:`~autoprec.tracking.training.RunSettings`' (the experiment:
            ``autoprec/<model>`` for ``autoprec verify``).

    Attributes:
        run_id: the parent run's id once started.
        runs: ``{(arm, seed): run id}`` of the nested runs.
    """

    def __init__(self, *, length: str = "", **settings: Any) -> None:
        super().__init__(**settings)
        self.length = length
        self.experiment_id: str | None = None
        self.runs: dict[tuple[str, int], str] = {}
        self._pending: dict[tuple[str, int], list[Any]] = {}

    @property
    def active(self) -> bool:
        return self.enabled and not self.client.failed

    def start(self) -> bool:
        """Open the parent run; whether tracking is on."""
        if not self.active or self.run_id is not None:
            return self.active
        with self.client.guard("cannot start", CONNECT_LIMITS):
            self.experiment_id = self.client.connect(self.experiment)
            self.run_id = self.client.create_run(self.experiment_id, self.run_name, self.tags)
            self.client.log(self.run_id, params=self.params)
            self.echo(
                f"mlflow: run {self.run_id} in experiment {self.experiment!r} at "
                f"{self.tracking_uri}"
            )
        return self.active

    # -- the callback --
    def run_started(self, arm: str, seed: int) -> None:
        if not self.start():
            return
        with self.client.guard(f"cannot start the run of {arm}, seed {seed}"):
            tags = {"mlflow.parentRunId": self.run_id, "autoprec.arm": arm}
            run_id = self.client.create_run(self.experiment_id, f"{arm}-seed{seed}", tags)
            self.client.log(run_id, params={"arm": arm, "seed": seed, "steps": self.length})
            self.runs[(arm, seed)] = run_id
            self._pending[(arm, seed)] = []

    def log(self, arm: str, seed: int, step: int, metrics: Mapping[str, float]) -> None:
        if not self.active or (arm, seed) not in self.runs:
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        kept = ("train_loss", "loss_scale", "val_loss", "val_accuracy")
        pending = self._pending[(arm, seed)]
        pending += [Metric(k, float(v), now, step) for k, v in metrics.items() if k in kept]

    def run_finished(self, run: Any) -> None:
        key = (run.arm, run.seed)
        if not self.active or key not in self.runs:
            return
        with self.client.guard(f"cannot finish the run of {run.arm}, seed {run.seed}"):
            if getattr(run, "kept", False):  # read back from the store: log its curves now
                for step, loss in enumerate(run.curve, 1):
                    self.log(run.arm, run.seed, step, {"train_loss": loss})
                for step, val_loss, val_accuracy in run.val_curve:
                    metrics = {"val_loss": val_loss, "val_accuracy": val_accuracy}
                    self.log(run.arm, run.seed, step, metrics)
            self._flush(key)
            final = {
                "final_train_loss": run.final_loss,
                "final_val_loss": run.val_loss,
                "final_val_accuracy": run.val_accuracy,
                "skipped_steps": run.skipped_steps,
                "overflows": run.overflows,
                "train_wall_time_s": run.wall_time_s,
            }
            if run.diverged is not None:  # penalised: its loss and accuracy are the penalty's
                final["diverged"] = 1.0
                self.client.mlflow.set_tag(self.runs[key], "autoprec.diverged", run.diverged[:500])
            self.client.log(self.runs[key], metrics=final, step=run.steps)
            self.client.end_run(self.runs[key])

    # -- the end --
    def finish(self, result: Any, artifacts: Sequence[Path] = ()) -> None:
        """The verdict and each arm's statistics on the parent run, the files; it ends."""
        if not self.active or self.run_id is None:
            return
        with self.client.guard("cannot finish the run"):
            metrics: dict[str, float] = {
                "loss_delta": result.loss_delta,
                "accuracy_delta": result.accuracy_delta,
                "within_tolerance": float(result.within),
                "verify_wall_time_s": result.wall_time_s,
            }
            for arm in result.arms:
                for stat, value in arm.to_dict().items():  # with diverged where not 0
                    metrics[f"{arm.arm}_{stat}"] = value
            self.client.log(self.run_id, metrics=metrics)
            self.client.mlflow.set_tag(self.run_id, "autoprec.verdict", result.verdict)
            for path in artifacts:
                if Path(path).exists():
                    self.client.mlflow.log_artifact(self.run_id, str(path))
            self.client.end_run(self.run_id)
            self.echo(f"mlflow: run {self.run_id} finished")
        self.enabled = False

    def close(self, status: str) -> None:
        """End the open runs with ``status`` (``FAILED``, ``KILLED``)."""
        if self.active and self.client.open_runs:
            with self.client.guard("cannot end the runs"):
                self.client.end_open_runs(status)
        self.enabled = False

    def _flush(self, key: tuple[str, int]) -> None:
        pending = self._pending.pop(key, [])
        for begin in range(0, len(pending), BATCH_LIMIT):
            batch = pending[begin : begin + BATCH_LIMIT]
            self.client.mlflow.log_batch(self.runs[key], metrics=batch)
