"""Verify a policy over whole training runs: ``verify(policy, "tinycnn", VerifyConfig(...))``.

The policy and the reference arms (``fp32`` and the target's blanket AMP by default) are each
trained from scratch, or from the weights of a checkpoint, with :func:`autoprec.training.run.train`
(the runtime and loss scaling of ``autoprec train``) for the same length, with the same seeds:
for each seed every arm starts from the same initial weights (``load_model(..., seed=seed)``)
and sees the same batches in the same order (the data order depends only on the seed). The
result has, per arm and seed, the final training loss, the validation accuracy and the learning
curve; per arm their mean and sample standard deviation over the seeds; the policy's loss delta
to fp32 (relative, as the evaluator's: :func:`~autoprec.evaluate.scoring.relative_loss_delta`),
its accuracy delta, and the verdict: within the tolerance when the loss delta is at most it.

The final training loss of a run is the mean of its last :data:`FINAL_WINDOW` of steps (at
least one step): one minibatch's loss is too noisy to compare, and the batches are the same in
every arm, so the window compares like with like.

A run of the policy or of a reference arm other than fp32 that diverges (its loss inf/NaN:
:class:`~autoprec.training.run.TrainDivergedError`) is a result, not an error: it is penalised as
the evaluator penalises a diverged fine-tune (:mod:`autoprec.evaluate.scoring`: final and
validation loss at ``1 +`` :data:`~autoprec.evaluate.scoring.PENALTY_LOSS_DELTA` times that
seed's fp32 run, accuracy 0), its arm counts the seeds that diverged, and a policy that diverged
in any seed is outside the tolerance; so is a run whose final training or validation loss is
inf/NaN. fp32 diverging is an error: there is nothing to compare with.

Each finished run is kept in the cache (:mod:`autoprec.verify.store`, keyed by all that
determines it), so a verification stopped part way (``stop``, a crash) resumes where it stopped.

Example:
    >>> from autoprec.policy import PrecisionPolicy
    >>> config = VerifyConfig(steps=20, seeds=(0, 1), dataset="digits")
    >>> result = verify(PrecisionPolicy(default="bf16"), "tinycnn", config,
    ...                 target="h100-sxm")  # doctest: +SKIP
    >>> result.verdict, round(result.loss_delta, 4)  # doctest: +SKIP
    ('within', 0.0003)
"""

from __future__ import annotations

import datetime
import math
import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import InitVar, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from autoprec.evaluate.reward import DEFAULT_TOLERANCE
from autoprec.evaluate.workload import Workload, training_spec, workload_data
from autoprec.policy import PrecisionPolicy
from autoprec.precision import PRECISION_NAMES
from autoprec.training.recipe import TrainingRecipe, fold_aliases
from autoprec.verify.results import ArmResult, RunResult, VerifyResult
from autoprec.verify.store import load_run, run_key, store_run

__all__ = [
    "DEFAULT_ARMS",
    "FINAL_WINDOW",
    "POLICY_ARM",
    "ArmResult",
    "RunResult",
    "VerifyCallback",
    "VerifyConfig",
    "VerifyError",
    "VerifyResult",
    "arm_policy",
    "penalised_run",
    "run_arm",
    "verify",
]

POLICY_ARM = "policy"  # the arm that trains the policy being verified
DEFAULT_ARMS = ("fp32", "amp")  # the reference arms: fp32, and the target's blanket AMP
FINAL_WINDOW = 0.1  # the share of the last steps whose mean loss is a run's final loss


# The policy file's provenance key holding the SGD rate the search's warm start learnt at:
# `autoprec verify` trains at it unless given --lr (a rate at which fp32 learns the model).
WARM_START_LR = "warm_start_lr"


class VerifyError(ValueError):
    """Settings a verification cannot run with (no fp32 arm, an unknown arm, no target)."""


@dataclass(frozen=True)
class VerifyConfig:
    """Every setting of a verification.

    Args:
        steps: optimizer steps per run; give ``steps`` or ``epochs`` (default: 1 epoch).
        epochs: epochs per run.
        seeds: the seeds; each arm is trained once per seed.
        arms: the reference arms: ``fp32``, ``amp`` (the target's blanket AMP,
            :func:`autoprec.hardware.defaults.amp_policy`) or a precision name for a uniform
            policy. ``fp32`` must be one of them (the deltas are to it).
        recipe: how every run trains (:func:`autoprec.training.run.train`'s recipe).
        batch_size, lr, momentum: aliases of the recipe's fields: given, they replace them
            (read them from ``recipe``; see :func:`~autoprec.training.recipe.fold_aliases`).
        tolerance: the largest relative loss delta to fp32 that is within.
        dataset: the data (None: the default for the model's task).
        data_dir: folder for cifar/imagefolder data.
        num_classes, image_size: as :func:`autoprec.models.load_model`.
        device, mode: as :func:`autoprec.training.run.train`.
    """

    steps: int | None = None
    epochs: int | None = None
    seeds: tuple[int, ...] = (0, 1, 2)
    arms: tuple[str, ...] = DEFAULT_ARMS
    recipe: TrainingRecipe = field(default_factory=TrainingRecipe)
    batch_size: InitVar[int | None] = None
    lr: InitVar[float | None] = None
    momentum: InitVar[float | None] = None
    tolerance: float = DEFAULT_TOLERANCE
    dataset: str | None = None
    data_dir: str | None = None
    num_classes: int = 10
    image_size: int | None = None
    device: str | None = None
    mode: str = "auto"

    def __post_init__(
        self, batch_size: int | None, lr: float | None, momentum: float | None
    ) -> None:
        put = object.__setattr__
        put(
            self,
            "recipe",
            fold_aliases(self.recipe, batch_size=batch_size, lr=lr, momentum=momentum),
        )
        put(self, "seeds", tuple(self.seeds))
        put(self, "arms", tuple(a.strip() for a in self.arms if a.strip()))
        if self.steps is not None and self.epochs is not None:
            raise VerifyError(f"give steps or epochs, not both (got {self.steps}, {self.epochs})")
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise VerifyError(f"seeds must be distinct and at least one; got {list(self.seeds)}")
        from autoprec.training.checks import check_seed  # torch: not at the CLI's start

        for seed in self.seeds:
            check_seed(seed, VerifyError)
        known = ("fp32", "amp", *PRECISION_NAMES)
        for arm in self.arms:
            if arm not in known and not is_policy_arm(arm):
                raise VerifyError(
                    f"unknown arm {arm!r}; expected one of {', '.join(known)}, or a policy file "
                    "(.yaml, .yml, .json) that exists"
                )
        if "fp32" not in self.arms or len(set(self.arms)) != len(self.arms):
            raise VerifyError(
                f"the arms must include fp32 (the deltas are to it), each once; got "
                f"{', '.join(self.arms) or 'none'}"
            )
        if not (math.isfinite(self.tolerance) and self.tolerance >= 0):
            raise VerifyError(f"tolerance must be a finite number >= 0, got {self.tolerance!r}")

    def workload(self, model: str, seed: int = 0) -> Workload:
        """What ``model`` trains on, data seeded by ``seed``: the dataset, its folder, the
        classes and the image size (None: the model's own; never a smaller one)."""
        return Workload(
            model, self.dataset, self.data_dir, self.num_classes, self.image_size,
            small_image=False, seed=seed,
        )  # fmt: skip

    @property
    def length(self) -> dict[str, int]:
        """``{"steps": n}`` or ``{"epochs": n}``: the training length as given."""
        return {"steps": self.steps} if self.steps is not None else {"epochs": self.epochs or 1}


class VerifyCallback(Protocol):
    """What :func:`verify` tells as it goes (the MLflow tracker, the CLI's progress)."""

    def run_started(self, arm: str, seed: int) -> None: ...

    def log(self, arm: str, seed: int, step: int, metrics: Mapping[str, float]) -> None: ...

    def run_finished(self, run: RunResult) -> None: ...


POLICY_SUFFIXES = (".yaml", ".yml", ".json")


def is_policy_arm(arm: str) -> bool:
    """Whether ``arm`` names a policy file (a hand rule's, another search's export)."""
    return arm.lower().endswith(POLICY_SUFFIXES) and Path(arm).is_file()


def arm_policy(arm: str, policy: PrecisionPolicy, target: Any) -> PrecisionPolicy:
    """The policy an arm trains: the policy itself, fp32, the target's AMP, a uniform one, or
    the policy in a file (``autoprec search --pareto-dir`` writes each hand rule's under
    ``rules/``).

    Raises:
        VerifyError: a policy file that cannot be read (the reason in one line).
    """
    if arm == POLICY_ARM:
        return policy
    if arm == "amp":
        from autoprec.hardware.defaults import amp_policy

        return amp_policy(target)
    if is_policy_arm(arm):
        from autoprec.policy import PolicyError
        from autoprec.policy.io import load_policy

        try:
            return load_policy(arm)
        except PolicyError as err:
            raise VerifyError(f"arm {arm}: {err}") from None
    return PrecisionPolicy.uniform(arm)


def verify(
    policy: PrecisionPolicy,
    model: str,
    config: VerifyConfig,
    *,
    target: Any = None,
    checkpoint: str | os.PathLike[str] | None = None,
    callback: VerifyCallback | None = None,
    stop: Callable[[], bool] | None = None,
) -> VerifyResult:
    """Train ``policy`` and the reference arms from scratch (or ``checkpoint``) and compare.

    Args:
        policy: the policy to verify; checked against the model before any training.
        model: a model name (:func:`autoprec.models.load_model`).
        config: lengths, seeds, arms and training settings.
        target: the device whose AMP is the ``amp`` arm (a name or ``DeviceSpec``; default the
            policy's ``target.device``).
        checkpoint: a checkpoint of ``autoprec train`` (``last.pt``) or a state dict file whose
            weights every run starts from, instead of fresh ones.
        callback: told of every run's start, step and end (a run kept from an earlier
            verification too: its ``kept`` is True).
        stop: polled before every optimizer step; once it returns True the run in progress
            stops (:class:`~autoprec.training.run.TrainInterrupted`); the finished runs are kept.

    Every finished run is kept in the cache as it finishes (:mod:`autoprec.verify.store`), so
    the same verification run again trains only the runs that did not finish.

    Each seed trains fp32 first; an fp32 run whose final loss is not below its first step's, or
    that diverges, is an error (every delta would be to a model that did not learn). Another
    arm's run that diverges is penalised (see the module docstring).

    Raises:
        VerifyError: no target for the ``amp`` arm, an unreadable checkpoint, an fp32 run that
            did not learn or diverged.
        PolicyMismatchError: the policy does not fit the model.
        ModelError, DatasetError, TrainConfigError: as :func:`autoprec.training.run.train`.
        TrainInterrupted: ``stop()`` returned True.
    """
    from autoprec.evaluate.scoring import relative_loss_delta

    start = time.perf_counter()
    if target is None and "amp" in config.arms:
        target = policy.target.device if policy.target is not None else None
        if target is None:
            raise VerifyError("the policy names no target device; give the target for AMP")
    arms = {arm: arm_policy(arm, policy, target) for arm in (POLICY_ARM, *config.arms)}
    weights = _read_weights(checkpoint) if checkpoint is not None else None
    runs: dict[str, list[RunResult]] = {arm: [] for arm in arms}
    dataset = ""
    for seed in config.seeds:
        where = _Seed(model, config, seed, checkpoint, callback, stop)
        dataset = where.train_arms(arms, weights, runs)
    results = tuple(ArmResult.of(arm, arms[arm], runs[arm]) for arm in arms)
    mine, fp32 = results[0], next(a for a in results if a.arm == "fp32")
    loss_delta = relative_loss_delta(mine.loss_mean, fp32.loss_mean)
    return VerifyResult(
        model=model,
        dataset=dataset,
        config=config,
        arms=results,
        deltas=(loss_delta, mine.accuracy_mean - fp32.accuracy_mean),
        within=math.isfinite(loss_delta) and loss_delta <= config.tolerance and not mine.diverged,
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        wall_time_s=time.perf_counter() - start,
        checkpoint=None if checkpoint is None else str(checkpoint),
    )


@dataclass(frozen=True)
class _Seed:
    """One seed of a verification: its model and data, every arm trained (or kept) on them."""

    model: str
    config: VerifyConfig
    seed: int
    checkpoint: Any
    callback: VerifyCallback | None
    stop: Callable[[], bool] | None

    def train_arms(
        self,
        arms: Mapping[str, PrecisionPolicy],
        weights: Mapping[str, Any] | None,
        runs: dict[str, list[RunResult]],
    ) -> str:
        """Every arm's run of this seed (fp32 first: it must learn) appended to ``runs``;
        returns the data's name."""
        config, seed = self.config, self.seed
        workload = config.workload(self.model, seed)
        spec = training_spec(workload, seed=seed)  # every seed: its own initial weights
        data = workload_data(spec, workload)
        initial = weights if weights is not None else spec.module.state_dict()
        initial = {k: v.detach().clone() for k, v in initial.items()}
        for arm in sorted(arms, key=lambda a: a != "fp32"):  # fp32 first: it must learn
            key = run_key(self.model, arm, arms[arm].digest(), seed, config, self.checkpoint)
            if self.callback is not None:
                self.callback.run_started(arm, seed)
            run = load_run(key)
            if run is None:
                _load(spec.module, initial, self.checkpoint)  # every arm: the same weights
                reference = None if arm == "fp32" else runs["fp32"][-1]  # a divergence's penalty
                run = self._train(spec, data, arm, arms[arm], reference)
                store_run(key, run)
            runs[arm].append(run)
            if self.callback is not None:
                self.callback.run_finished(run)
            if arm == "fp32" and not run.final_loss < run.curve[0]:
                raise VerifyError(
                    f"fp32 did not learn (seed {seed}: training loss {run.curve[0]:.3g} at the "
                    f"first step, {run.final_loss:.3g} at the end, lr {config.recipe.lr:g}): a "
                    "verdict against it would measure noise; give a lower --lr or a longer run"
                )
        return data.name

    def _train(
        self, spec: Any, data: Any, arm: str, policy: PrecisionPolicy, reference: Any
    ) -> RunResult:
        """One arm's run (:func:`run_arm`); fp32 diverging is a :class:`VerifyError`."""
        from autoprec.training.run import TrainDivergedError

        try:
            return run_arm(
                spec, data, arm, policy, self.seed, self.config, self.callback,
                penalise_against=reference, stop=self.stop,
            )  # fmt: skip
        except TrainDivergedError as err:  # fp32's: there is nothing to compare with
            raise VerifyError(
                f"fp32 diverged (seed {self.seed}, lr {self.config.recipe.lr:g}): {err}; a "
                "verdict needs an fp32 run that learns: give a lower --lr"
            ) from None


def run_arm(
    spec: Any,
    data: Any,
    arm: str,
    policy: PrecisionPolicy,
    seed: int,
    config: VerifyConfig,
    callback: VerifyCallback | None = None,
    *,
    penalise_against: RunResult | None = None,
    stop: Callable[[], bool] | None = None,
) -> RunResult:
    """One arm trained with one seed by :func:`autoprec.training.run.train`, as :func:`verify` does.

    ``spec.module`` is trained in place from the weights it holds (:func:`verify` loads the
    seed's initial weights first); the final loss is the mean of the last :data:`FINAL_WINDOW`
    of steps. experiments/full_training.py trains its ground truth through this.

    Args:
        penalise_against: the seed's fp32 run: a run that diverges (or ends with an inf/NaN
            loss) is returned penalised against it (:func:`penalised_run`) instead of raising.
        stop: as :func:`autoprec.training.run.train`'s.

    Raises:
        TrainDivergedError: the run diverged (or its final loss is inf/NaN) and there is nothing
            to penalise it against.
        TrainInterrupted: ``stop()`` returned True.
        PolicyMismatchError, TrainConfigError: as :func:`autoprec.training.run.train`.
    """
    from autoprec.training.run import TrainDivergedError, train

    val_curve: list[tuple[int, float, float]] = []
    curve: list[float] = []
    started = time.perf_counter()

    def log(step: int, metrics: dict[str, float]) -> None:
        if "train_loss" in metrics:
            curve.append(metrics["train_loss"])
        if "val_loss" in metrics:
            val_curve.append((step, metrics["val_loss"], metrics["val_accuracy"]))
        if callback is not None:
            callback.log(arm, seed, step, metrics)

    settings = {"recipe": config.recipe, "device": config.device, "mode": config.mode}
    try:
        done = train(spec, data, policy, **config.length, **settings, seed=seed, log=log, stop=stop)
        window = max(1, round(len(done.train_loss) * FINAL_WINDOW))
        final_loss = statistics.fmean(done.train_loss[-window:])
        if not (math.isfinite(final_loss) and math.isfinite(done.val_loss)):
            raise TrainDivergedError(
                f"training diverged: its final training loss is {final_loss} and its "
                f"validation loss {done.val_loss} (inf/NaN losses in its last {window} steps)",
                done.steps,
            )
    except TrainDivergedError as err:
        if penalise_against is None:
            raise
        took = time.perf_counter() - started
        steps = err.step if err.step is not None else len(curve)
        return penalised_run(arm, seed, str(err), curve, penalise_against, steps, took)
    return RunResult(
        arm=arm,
        seed=seed,
        final_loss=final_loss,
        val_loss=done.val_loss,
        val_accuracy=done.val_accuracy,
        steps=done.steps,
        curve=tuple(done.train_loss),
        val_curve=tuple(val_curve),
        skipped_steps=done.skipped_steps,
        overflows=done.overflows,
        wall_time_s=done.wall_time_s,
    )


def penalised_run(
    arm: str,
    seed: int,
    why: str,
    curve: Sequence[float],
    fp32: RunResult,
    steps: int,
    wall_time_s: float = 0.0,
) -> RunResult:
    """A run that diverged at optimizer step ``steps``, as the evaluator scores a diverged
    fine-tune: final and validation loss at ``1 +``
    :data:`~autoprec.evaluate.scoring.PENALTY_LOSS_DELTA` times ``fp32``'s (the same seed's),
    accuracy 0; ``curve`` is its training loss of the steps before."""
    from autoprec.evaluate.scoring import PENALTY_LOSS_DELTA

    factor = 1.0 + PENALTY_LOSS_DELTA
    return RunResult(
        arm=arm,
        seed=seed,
        final_loss=factor * fp32.final_loss,
        val_loss=factor * fp32.val_loss,
        val_accuracy=0.0,
        steps=steps,
        curve=tuple(curve),
        val_curve=(),
        wall_time_s=wall_time_s,
        diverged=why,
    )


def _load(module: Any, weights: Mapping[str, Any], checkpoint: Any) -> None:
    from autoprec.training.checkpoint import load_model_weights

    load_model_weights(module, dict(weights), checkpoint, VerifyError)


def _read_weights(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The model weights of a checkpoint of ``autoprec train`` (its ``model``) or a state dict."""
    from autoprec.training.checkpoint import read_model_weights

    return read_model_weights(path, VerifyError)
