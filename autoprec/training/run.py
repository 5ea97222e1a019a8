"""Production training under a precision policy: ``train(spec, data, policy)``.

The policy is checked against the model first (a policy made for another model is refused), then
applied with :func:`~autoprec.runtime.apply_policy` and its loss scaling
(:class:`~autoprec.runtime.LossScaler`). The user's recipe
(:class:`~autoprec.training.recipe.TrainingRecipe`: SGD with momentum or AdamW, warm-up and
schedule; by default SGD at 0.05 with momentum 0.9), steps of the one trainer
(:mod:`autoprec.training.trainer`) and its divergence rule, gradient accumulation,
validation at every epoch end, atomic checkpoints that a later run resumes from, and DDP when
launched by ``torchrun``.

A checkpoint (:mod:`autoprec.training.checkpoint`) holds everything the next step depends on: the
weights and buffers, the optimizer's state, the loss scaler's (scale, growth tracker, counters),
every process's RNG states, the step (which fixes the data order) and the history so far. The
runtime itself carries no state from step to step that the result depends on: fp8 layers scale
by the current amax (torchao's tensorwise dynamic recipe, no amax history), and the overflow
guard only counts (training runs it without promotions; the count is checkpointed). A run
stopped at a step boundary (``stop``, which ``autoprec train`` sets on SIGTERM or Ctrl-C) writes
a checkpoint there and raises :class:`TrainInterrupted`.

Data order depends only on ``seed`` and the epoch (a seeded ``DistributedSampler`` per epoch,
also for one process), so a run resumed from a checkpoint ends with the same weights as one that
was never interrupted. One optimizer step uses ``batch_size * grad_accum`` examples per process;
an epoch is the whole number of such steps the process's shard of the train split holds (the
remainder is left out that epoch, and falls elsewhere in the next one).

Example:
    >>> from autoprec.data import load_dataset_for
    >>> from autoprec.models import load_model
    >>> spec = load_model("tinycnn")
    >>> data = load_dataset_for(spec, "digits")
    >>> result = train(spec, data, PrecisionPolicy(default="bf16"), steps=20)  # doctest: +SKIP
    >>> result.val_accuracy  # doctest: +SKIP
    0.71
"""

from __future__ import annotations

import math
import os
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DistributedSampler

from autoprec.cache import reason
from autoprec.layers import model_fingerprint
from autoprec.policy import PrecisionPolicy
from autoprec.policy.fields import COMPILED
from autoprec.runtime import LossScaler, apply_policy
from autoprec.runtime.compiled import compile_policy
from autoprec.training.checkpoint import (
    CHECKPOINT_NAME,
    CheckpointError,
    load_checkpoint,
    restore_rng,
    save_checkpoint,
)
from autoprec.training.checks import (
    PolicyMismatchError,
    TrainConfigError,
    check_batch_fits,
    check_policy,
    check_seed,
    check_settings,
    pick_device,
    pick_mode,
)
from autoprec.training.distributed import StopFn, any_rank, dist_env, leave_group, sum_over_ranks
from autoprec.training.recipe import (
    DEFAULT_RECIPE,
    TrainingRecipe,
    differs_from_default,
    fold_aliases,
)
from autoprec.training.trainer import (
    NONFINITE_LOSS,
    NONFINITE_WEIGHTS,
    TRAIN_SKIPS,
    Batch,
    DivergenceRule,
    Trainer,
    gather,
)

if TYPE_CHECKING:  # pragma: no cover
    from torch.utils.data import Dataset

    from autoprec.data import DataBundle
    from autoprec.models import ModelSpec
    from autoprec.runtime import CompiledPolicy, PolicyHandle

#: ``log(step, metrics)``, told each step's and each validation's figures on rank 0.
LogFn = Callable[[int, dict[str, float]], None]

__all__ = [
    "CHECKPOINT_NAME",
    "CheckpointError",
    "NONFINITE_STEPS",
    "PolicyMismatchError",
    "TrainConfigError",
    "TrainDivergedError",
    "TrainInterrupted",
    "TrainResult",
    "dist_env",
    "train",
]


# Steps in a row with an inf/NaN loss after which a run with loss scaling is diverged: the
# scaler skips each, but a loss that overflows in the forward pass stays so at any scale.
NONFINITE_STEPS = TRAIN_SKIPS


class TrainDivergedError(ValueError):
    """The loss became inf/NaN with no loss scaler to skip the step, or stayed so.

    Attributes:
        step: the optimizer step at which training stopped (None where not known).
    """

    def __init__(self, message: str, step: int | None = None) -> None:
        super().__init__(message)
        self.step = step


class TrainInterrupted(KeyboardInterrupt):
    """Training stopped at a step boundary because ``stop()`` asked it to.

    A ``KeyboardInterrupt``, so that code catching ``Exception`` does not swallow it.

    Attributes:
        step: optimizer steps done in total (the checkpoint's step).
        total: the steps the run was to reach.
        checkpoint: the checkpoint that holds ``step`` (written at the stop), or None without
            ``checkpoint_dir``.
    """

    def __init__(self, step: int, total: int, checkpoint: Path | None) -> None:
        super().__init__(f"interrupted at step {step} of {total}")
        self.step, self.total, self.checkpoint = step, total, checkpoint


@dataclass(frozen=True)
class TrainResult:
    """What :func:`train` did.

    Attributes:
        steps: optimizer steps done in total (including those before a resume).
        epochs: completed epochs.
        steps_per_epoch: optimizer steps in one epoch.
        train_loss: mean training loss of every optimizer step (over its micro-batches and
            all processes), from the first step on, resumed runs included.
        val_loss: validation loss after the last step.
        val_accuracy: validation accuracy after the last step.
        val_history: ``{"step", "epoch", "val_loss", "val_accuracy"}`` of every validation
            (epoch ends and the end), resumed runs included.
        overflows: values that overflowed the layers' formats (summed over processes; the
            count of the run that wrote a resumed checkpoint included).
        skipped_steps: optimizer steps the loss scaler skipped (inf/NaN gradients).
        wall_time_s: seconds this call took.
        checkpoint: the checkpoint file, or None without ``checkpoint_dir`` (or when none
            could be written).
        checkpoint_step: the step the checkpoint holds (below ``steps`` when the later writes
            failed: a full disk), or None.
        resumed_from: the step the run resumed from, or None for a fresh start.
        world_size: number of processes (1 without DDP).
        rank: this process's rank.
        mode: the runtime mode used (``"emulate"``, ``"native"`` or ``"compiled"``).
    """

    steps: int
    epochs: int
    steps_per_epoch: int
    train_loss: list[float]
    val_loss: float
    val_accuracy: float
    val_history: list[dict[str, float]] = field(default_factory=list)
    overflows: int = 0
    skipped_steps: int = 0
    wall_time_s: float = 0.0
    checkpoint: Path | None = None
    checkpoint_step: int | None = None
    resumed_from: int | None = None
    world_size: int = 1
    rank: int = 0
    mode: str = "emulate"

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of every field."""
        out = asdict(self)
        out["checkpoint"] = None if self.checkpoint is None else str(self.checkpoint)
        return out


def train(
    spec: ModelSpec,
    data: DataBundle,
    policy: PrecisionPolicy,
    *,
    steps: int | None = None,
    epochs: int | None = None,
    recipe: TrainingRecipe | None = None,
    batch_size: int | None = None,
    lr: float | None = None,
    momentum: float | None = None,
    grad_accum: int = 1,
    checkpoint_dir: str | os.PathLike[str] | None = None,
    checkpoint_every: int | None = None,
    device: str | torch.device | None = None,
    mode: str = "auto",
    seed: int = 0,
    log: LogFn | None = None,
    stop: StopFn | None = None,
) -> TrainResult:
    """Train ``spec.module`` on ``data`` with ``policy`` applied; the module is trained in place.

    Args:
        spec: a :class:`~autoprec.models.ModelSpec` (``module``, ``loss(out, y)``,
            ``logits(out)``, ``name``).
        data: a :class:`~autoprec.data.DataBundle`; its train split is sharded over processes.
        policy: the precision policy; checked against the model before anything else.
        steps: optimizer steps to train for in total. Give ``steps`` or ``epochs``, not both.
        epochs: epochs to train for (default 1 when neither is given).
        recipe: the optimizer, rate, weight decay, warm-up, schedule (over the whole run) and
            batch size (examples per micro-batch and process); None: the default recipe, SGD
            at 0.05 with momentum 0.9, batch 32.
        batch_size, lr, momentum: aliases of the recipe's fields; given, they replace them.
        grad_accum: micro-batches whose gradients make one optimizer step.
        checkpoint_dir: where ``last.pt`` is written (atomically) at every epoch end and at the
            end; when it already holds one, training resumes from it and continues to the same
            total. With DDP it must be a folder rank 0 can read; only rank 0 writes. A write
            that fails (a full disk) is one warning; training goes on.
        checkpoint_every: also write a checkpoint every this many optimizer steps.
        device: where to train (default: the local CUDA device, else the CPU); under DDP on
            CUDA the process's ``LOCAL_RANK`` picks the GPU.
        mode: runtime mode, ``"auto"`` (native on CUDA, emulated elsewhere), ``"emulate"``,
            ``"native"`` or ``"compiled"`` (native's program under ``torch.compile``, for
            policies of one 16-bit format and fp8 layers: :mod:`autoprec.runtime.compiled`).
            Native and compiled runs are checked against the local device's precisions.
        seed: seeds the data order (with the epoch) and the torch RNG of each process.
        log: called on rank 0 as ``log(step, metrics)`` after every optimizer step
            (``train_loss``, ``loss_scale``, ``epoch``) and after every validation
            (``val_loss``, ``val_accuracy``, ``epoch``).
        stop: polled before every optimizer step; once it returns True (on any process: under
            DDP the answers are reduced, one tiny collective per step), the run writes a
            checkpoint (with ``checkpoint_dir``) and raises :class:`TrainInterrupted`.

    Returns:
        A :class:`TrainResult`; the policy is removed from ``spec.module`` again.

    Raises:
        PolicyMismatchError: the policy names layers the model lacks, was made for another
            architecture, or holds precisions the device cannot run natively.
        TrainConfigError: inconsistent settings.
        RecipeError: a recipe field out of range.
        CheckpointError: ``checkpoint_dir`` holds a checkpoint of another run.
        TrainDivergedError: the divergence rule (:mod:`autoprec.training.trainer`, allowing
            :data:`NONFINITE_STEPS` skipped steps in a row) says the run diverged, or the
            weights (or the last validation loss) are no longer finite at the end: weights
            that are not numbers are never written to a checkpoint, nor returned as a result.
        TrainInterrupted: ``stop()`` returned True before the last step.
    """
    start = time.perf_counter()
    base = DEFAULT_RECIPE if recipe is None else recipe
    given = {"batch_size": batch_size, "lr": lr, "momentum": momentum}
    shown = {k: getattr(base, k) if v is None else v for k, v in given.items()}
    counts = dict(steps=steps, epochs=epochs, batch_size=shown["batch_size"], grad_accum=grad_accum)
    check_settings(counts, checkpoint_every, shown["lr"], shown["momentum"])
    recipe = fold_aliases(base, **given)
    check_seed(seed)
    check_batch_fits(spec, data, recipe.batch_size)  # beyond the machine's memory: one line, now
    rank, world, local_rank = dist_env()
    dev = pick_device(device, local_rank if world > 1 else None)
    run_mode = pick_mode(mode, dev)
    check_policy(spec, policy, dev, run_mode)  # before any process group or data work

    own_group = _join_group(world, dev)
    run = _TrainRun(spec, data, policy, recipe, grad_accum, seed, dev, rank, world, log)
    try:
        run.prepare(steps, epochs, checkpoint_dir)
        run.attach(run_mode)
        run.loop(checkpoint_every, stop)
        result = run.finish(run_mode, time.perf_counter() - start)
        if own_group:
            dist.barrier()  # no rank tears the group down while another still talks to it
        return result
    finally:
        run.detach()
        if own_group and dist.is_initialized():
            run = None  # type: ignore[assignment]  # DDP's reducer: see leave_group
            leave_group()


def _join_group(world: int, dev: torch.device) -> bool:
    """Start the process group of a ``torchrun`` launch unless one runs; whether it started."""
    if world <= 1 or dist.is_initialized():
        return False
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    return True


class _TrainRun:
    """The state of one :func:`train` call, from its data order to its result."""

    def __init__(
        self,
        spec: ModelSpec,
        data: DataBundle,
        policy: PrecisionPolicy,
        recipe: TrainingRecipe,
        grad_accum: int,
        seed: int,
        dev: torch.device,
        rank: int,
        world: int,
        log: LogFn | None,
    ) -> None:
        self.spec, self.data, self.policy, self.recipe = spec, data, policy, recipe
        self.grad_accum, self.seed, self.dev = grad_accum, seed, dev
        self.rank, self.world, self.log = rank, world, log
        self.module: nn.Module = spec.module
        self.handle: PolicyHandle | CompiledPolicy | None = None
        self.trainer: Trainer | None = None
        self.step, self.history, self.prior_overflows = 0, [], 0
        self.resumed_from: int | None = None
        self.val_history: list[dict[str, float]] = []
        self.val: dict[str, float] | None = None
        self.path: Path | None = None
        self.saved_at: int | None = None  # the step the file at `path` holds (rank 0 knows)
        self.tried_at: int | None = None  # the last step a write was tried at (every rank)
        self.failed_writes: list[int] = []  # steps whose checkpoint could not be written

    def prepare(
        self, steps: int | None, epochs: int | None, checkpoint_dir: str | os.PathLike[str] | None
    ) -> None:
        """The data order, the optimizer, the loss scaler and what a checkpoint resumes."""
        recipe, batch_size, world = self.recipe, self.recipe.batch_size, self.world
        self.dataset = self.data.split("train")
        self.sampler = DistributedSampler(
            self.dataset, num_replicas=world, rank=self.rank, shuffle=True, seed=self.seed,
            drop_last=False,
        )  # fmt: skip
        self.steps_per_epoch = (len(self.sampler) // batch_size) // self.grad_accum
        if self.steps_per_epoch < 1:
            raise TrainConfigError(
                f"one optimizer step needs batch_size x grad_accum = "
                f"{batch_size * self.grad_accum} examples per process, but each of the {world} "
                f"process(es) holds {len(self.sampler)} of the train split; lower --batch-size "
                "or --grad-accum"
            )
        self.total = steps if steps is not None else (epochs or 1) * self.steps_per_epoch
        self.config = {
            "batch_size": batch_size,
            "grad_accum": self.grad_accum,
            "world_size": world,
            "seed": self.seed,
            "lr": float(recipe.lr),
            "momentum": float(recipe.momentum),
            "policy": self.policy.digest(),
            "fingerprint": model_fingerprint(self.module),
        }
        other = differs_from_default(recipe, "lr", "momentum", "batch_size")
        if other is not None:  # the default recipe's checkpoints stay those made before
            self.config["recipe"] = other
        torch.manual_seed(self.seed + self.rank)
        self.module.to(self.dev)
        self.optimizer = recipe.make_optimizer(self.module.parameters())
        self.scaler = LossScaler.from_config(self.policy.loss_scaling, device=self.dev)
        if checkpoint_dir is not None:
            self.path = Path(checkpoint_dir) / CHECKPOINT_NAME
        self._resume(load_checkpoint(self.path, self.config, self.rank, world))

    def _resume(self, ckpt: dict[str, Any] | None) -> None:
        if ckpt is not None:
            self.module.load_state_dict(ckpt["model"])
            self.optimizer.load_state_dict(ckpt["optimizer"])
            if ckpt["scaler"]:
                self.scaler.load_state_dict(ckpt["scaler"])
            self.step = self.resumed_from = int(ckpt["step"])
            self.history = [float(v) for v in ckpt["train_loss"]]
            self.prior_overflows = int(ckpt["overflows"])
            self.val_history = [dict(v) for v in ckpt.get("val_history", [])]
            restore_rng(ckpt["rng"][self.rank], self.dev)
        self.saved_at = self.tried_at = self.resumed_from
        self.schedule = None
        if not self.recipe.constant_rate:
            self.schedule = self.recipe.make_schedule(self.optimizer, self.total, done=self.step)

    def attach(self, run_mode: str) -> None:
        """Wrap the module for DDP, apply the policy and make the trainer."""
        model: nn.Module = self.module
        if self.world > 1:
            ids = [self.dev.index] if self.dev.type == "cuda" else None
            model = nn.parallel.DistributedDataParallel(self.module, device_ids=ids)
        if run_mode == COMPILED:
            self.handle = compile_policy(self.module, self.policy)
        else:
            self.handle = apply_policy(self.module, self.policy, mode=run_mode)
        self.trainer = Trainer(
            self.spec, model, self.optimizer, self.scaler, self.dev, schedule=self.schedule,
            rule=DivergenceRule(skips=NONFINITE_STEPS), module=self.module, rank=self.rank,
            world=self.world,
        )  # fmt: skip

    def detach(self) -> None:
        """Remove the policy from the module (and drop the DDP wrapper)."""
        if self.handle is not None:
            self.handle.remove()
        self.trainer = None

    def loop(self, checkpoint_every: int | None, stop: StopFn | None) -> None:
        """Train to ``total`` steps, validating at epoch ends, checkpointing as asked."""
        per_epoch, total, accum = self.steps_per_epoch, self.total, self.grad_accum
        while self.step < total:
            self.sampler.set_epoch(self.step // per_epoch)
            order = list(self.sampler)
            first = (self.step % per_epoch) * accum
            micro = [
                order[i * self.recipe.batch_size : (i + 1) * self.recipe.batch_size]
                for i in range(first, per_epoch * accum)
            ]
            for group_start in range(0, len(micro), accum):
                if any_rank(stop, self.dev):  # a step boundary: the state is whole
                    if self.path is not None and self.tried_at != self.step:
                        self.save()
                    held = self.path if self.saved_at is not None else None
                    raise TrainInterrupted(self.step, total, held)
                self._one_step(_Batches(self.dataset, micro[group_start : group_start + accum]))
                epoch_end = self.step % per_epoch == 0
                if epoch_end or self.step == total:
                    self.val = self.trainer.validate(self.data)
                    record = {"step": self.step, "epoch": self.step / per_epoch, **self.val}
                    self.val_history.append(record)
                    self._emit({k: v for k, v in record.items() if k != "step"})
                due = checkpoint_every is not None and self.step % checkpoint_every == 0
                if self.path is not None and (epoch_end or self.step == total or due):
                    self.save()
                if self.step == total:
                    break

    def _one_step(self, micro: Sequence[Batch]) -> None:
        """One optimizer step, judged by the divergence rule, logged."""
        loss = self.trainer.step(micro)
        self.step += 1
        self.history.append(loss)
        verdict = self.trainer.verdict(loss)
        if verdict is not None:
            raise TrainDivergedError(self._diverged(verdict, loss), self.step)
        self._emit(
            {
                "train_loss": loss,
                "loss_scale": self.scaler.get_scale(),
                "epoch": self.step / self.steps_per_epoch,
            }
        )

    def _diverged(self, verdict: str, loss: float) -> str:
        """The one-line message of the divergence rule's ``verdict``."""
        step, kept = self.step, _kept(self.path, self.saved_at)
        if verdict == NONFINITE_LOSS:
            return (
                f"training diverged at step {step} (loss {loss}) without loss scaling; "
                "lower the learning rate, or give the policy a loss_scaling section so "
                "that steps with inf/NaN gradients are skipped" + kept
            )
        if verdict == NONFINITE_WEIGHTS:
            return _nan_weights(step, self.history, self.path, self.saved_at)
        in_a_row = self.trainer.in_a_row
        return (
            f"training diverged: the loss was inf/NaN in {in_a_row} steps in a row "
            f"(steps {step - in_a_row + 1}-{step}), each skipped by the loss "
            "scaler; the forward pass overflows, which loss scaling cannot fix: "
            "keep the overflowing layers at a wider precision" + kept
        )

    def _emit(self, metrics: dict[str, float]) -> None:
        if self.log is not None and self.rank == 0:
            self.log(self.step, metrics)

    def save(self) -> None:
        """Write the checkpoint of ``step``; a write that fails is one warning."""
        self.tried_at = self.step  # every rank alike: the next save is a collective for all
        if not self.trainer.weights_finite():  # never write weights that are no longer numbers
            message = _nan_weights(self.step, self.history, self.path, self.saved_at)
            raise TrainDivergedError(message, self.step)
        overflows = self.prior_overflows + sum_over_ranks(
            self.handle.totals()["overflows"], self.dev
        )
        state = (self.module, self.optimizer, self.scaler, self.step, self.config)
        try:
            save_checkpoint(self.path, *state, self.history, self.val_history, overflows, self.dev)
        except OSError as err:  # a full or read-only disk: the training itself goes on
            if not self.failed_writes:
                warnings.warn(_unwritten(self.path, err, self.saved_at), stacklevel=3)
            self.failed_writes.append(self.step)
            return
        self.saved_at = self.step

    def _overflows(self) -> int:
        """Overflows so far, over every process and the run a checkpoint resumed."""
        return self.prior_overflows + sum_over_ranks(self.handle.totals()["overflows"], self.dev)

    def finish(self, run_mode: str, wall_time_s: float) -> TrainResult:
        """The result, once the weights and the last validation are known to be finite."""
        if self.val is None:  # resumed at (or past) the end: nothing trained, validate once
            self.val = self.trainer.validate(self.data)
        if not (self.trainer.weights_finite() and math.isfinite(self.val["val_loss"])):
            message = _nan_weights(self.step, self.history, self.path, self.saved_at)
            raise TrainDivergedError(message, self.step)
        overflows = self.prior_overflows + sum_over_ranks(
            self.handle.totals()["overflows"], self.dev
        )
        return TrainResult(
            steps=self.step,
            epochs=self.step // self.steps_per_epoch,
            steps_per_epoch=self.steps_per_epoch,
            train_loss=self.history,
            val_loss=self.val["val_loss"],
            val_accuracy=self.val["val_accuracy"],
            val_history=self.val_history,
            overflows=overflows,
            skipped_steps=self.scaler.skipped_steps,
            wall_time_s=wall_time_s,
            checkpoint=self.path if self.saved_at is not None else None,
            checkpoint_step=self.saved_at if self.path is not None else None,
            resumed_from=self.resumed_from,
            world_size=self.world,
            rank=self.rank,
            mode=run_mode,
        )


class _Batches(Sequence[Batch]):
    """The micro-batches of one step, each gathered from ``dataset`` when the trainer asks."""

    def __init__(self, dataset: Dataset, micro: list[list[int]]) -> None:
        self.dataset, self.micro = dataset, micro

    def __len__(self) -> int:
        return len(self.micro)

    def __getitem__(self, i: int) -> Batch:  # type: ignore[override]
        return gather(self.dataset, self.micro[i])


def _kept(path: Path | None, saved_at: int | None) -> str:
    """What a diverged run leaves: ``"; <path> holds the last checkpoint (step n)"``, or ``""``."""
    if path is None or saved_at is None:
        return ""
    return f"; {path} holds the last checkpoint (step {saved_at})"


def _unwritten(path: Path, err: OSError, saved_at: int | None) -> str:
    """The one warning of a checkpoint that could not be written."""
    held = f"{path} still holds step {saved_at}" if saved_at is not None else "no checkpoint yet"
    return (
        f"cannot write the checkpoint {path} ({reason(err)}); training goes on without it "
        f"({held}; later writes are tried without another warning)"
    )


def _nan_weights(step: int, history: list[float], path: Path | None, saved_at: int | None) -> str:
    """The message of a run whose weights (or validation loss) are no longer finite."""
    loss = history[-1] if history else float("nan")
    return (
        f"training diverged by step {step} (loss {loss}): the weights are no longer finite "
        "numbers, so this run has no result; lower the learning rate, or keep the layers that "
        "overflow at a wider precision" + _kept(path, saved_at)
    )
