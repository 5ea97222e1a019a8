"""What :func:`autoprec.verify.verify` measured: one run (:class:`RunResult`), one arm over the
seeds (:class:`ArmResult`, the policy file's :class:`~autoprec.policy.ArmSummary` with its runs)
and the whole comparison (:class:`VerifyResult`, whose :meth:`~VerifyResult.section` is the policy
file's ``verification`` section). Kept apart from the training that fills them."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from autoprec.policy import ArmSummary, PrecisionPolicy, VerificationInfo

if TYPE_CHECKING:
    from autoprec.verify.run import VerifyConfig

__all__ = ["ArmResult", "RunResult", "VerifyResult"]


@dataclass(frozen=True)
class RunResult:
    """One arm trained with one seed.

    Attributes:
        curve: the training loss of every optimizer step.
        val_curve: ``(step, val_loss, val_accuracy)`` of every validation.
    """

    arm: str
    seed: int
    final_loss: float
    val_loss: float
    val_accuracy: float
    steps: int
    curve: tuple[float, ...]
    val_curve: tuple[tuple[int, float, float], ...]
    skipped_steps: int = 0
    overflows: int = 0
    wall_time_s: float = 0.0
    diverged: str | None = None  # why training stopped (penalised run), None: it finished
    kept: bool = False  # read back from an earlier verification's store, not trained now


@dataclass(frozen=True)
class ArmResult(ArmSummary):
    """One arm over the seeds: its :class:`~autoprec.policy.ArmSummary` (mean and sample sd, 0
    for one seed, of the final values), the policy it trained and its runs."""

    policy: PrecisionPolicy
    runs: tuple[RunResult, ...]

    @classmethod
    def of(cls, arm: str, policy: PrecisionPolicy, runs: Sequence[RunResult]) -> ArmResult:
        losses = [r.final_loss for r in runs]
        accuracies = [r.val_accuracy for r in runs]
        diverged = sum(r.diverged is not None for r in runs)
        stats = (*_mean_sd(losses), *_mean_sd(accuracies))
        return cls(arm, *stats, policy, tuple(runs), diverged=diverged)

    @property
    def arm(self) -> str:
        """The arm's name (``policy``, ``fp32``, ``amp``, ...)."""
        return self.name

    def summary(self) -> ArmSummary:
        """The arm as the policy file keeps it."""
        return ArmSummary(self.name, **self.to_dict())

    @property
    def diverged_runs(self) -> tuple[RunResult, ...]:
        """The runs that diverged (penalised)."""
        return tuple(r for r in self.runs if r.diverged is not None)

    @property
    def label(self) -> str:
        """The arm's name, with its precision for ``amp`` (``"amp (bf16)"``)."""
        return f"amp ({self.policy.default.value})" if self.arm == "amp" else self.arm


@dataclass(frozen=True)
class VerifyResult:
    """What :func:`verify` measured; ``arms`` lists the policy's arm first; ``within``: the
    policy's relative loss delta to fp32 is at most the config's tolerance."""

    model: str
    config: VerifyConfig
    arms: tuple[ArmResult, ...]
    deltas: tuple[float, float]  # (loss delta, accuracy delta) of the policy to fp32
    within: bool
    dataset: str
    date: str
    wall_time_s: float = 0.0
    checkpoint: str | None = None

    @property
    def loss_delta(self) -> float:
        return self.deltas[0]

    @property
    def accuracy_delta(self) -> float:
        return self.deltas[1]

    @property
    def verdict(self) -> str:
        return "within" if self.within else "outside"

    def arm(self, name: str) -> ArmResult:
        """The arm called ``name``."""
        return next(a for a in self.arms if a.arm == name)

    def section(self) -> VerificationInfo:
        """The policy file's ``verification`` section."""
        from autoprec import __version__

        c = self.config
        trained = ("batch_size", "lr", "momentum")  # the file's fields (the recipe's SGD ones)
        return VerificationInfo(
            **{k: getattr(self, k) for k in ("verdict", "loss_delta", "accuracy_delta", "date")},
            **{k: getattr(c, k) for k in ("seeds", "tolerance")},
            **{k: getattr(c.recipe, k) for k in trained},
            **c.length,
            arms=tuple(a.summary() for a in self.arms),
            dataset=self.dataset,
            autoprec_version=__version__,
        )


def _mean_sd(values: Sequence[float]) -> tuple[float, float]:
    mean = statistics.fmean(values)
    return mean, statistics.stdev(values) if len(values) > 1 else 0.0
