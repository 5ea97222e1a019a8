"""Production training under a precision policy: ``train(spec, data, policy)``.

The policy is checked against the model first (a policy made for another model is refused), then
applied with :func:`~autoprec.runtime.apply_policy` and its loss scaling
(:class:`~autoprec.runtime.LossScaler`). Plain SGD with momentum, gradient accumulation,
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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

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
from autoprec.training.loop import LogFn, TrainLoop

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
NONFINITE_STEPS = 20


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
    spec: Any,
    data: Any,
    policy: PrecisionPolicy,
    *,
    steps: int | None = None,
    epochs: int | None = None,
    batch_size: int = 32,
    lr: float = 0.05,
    momentum: float = 0.9,
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
        batch_size: examples per micro-batch and process.
        lr: SGD learning rate.
        momentum: SGD momentum.
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
        CheckpointError: ``checkpoint_dir`` holds a checkpoint of another run.
        TrainDivergedError: the loss became inf/NaN and no loss scaler skipped the step, or it
            was inf/NaN in :data:`NONFINITE_STEPS` steps in a row (all skipped), or the weights
            (or the last validation loss) are no longer finite: weights that are not numbers
            are never written to a checkpoint, nor returned as a result.
        TrainInterrupted: ``stop()`` returned True before the last step.
    """
    start = time.perf_counter()
    counts = dict(steps=steps, epochs=epochs, batch_size=batch_size, grad_accum=grad_accum)
    check_settings(counts, checkpoint_every, lr, momentum)
    check_seed(seed)
    check_batch_fits(spec, data, batch_size)  # beyond the machine's memory: one line, now
    rank, world, local_rank = dist_env()
    dev = pick_device(device, local_rank if world > 1 else None)
    run_mode = pick_mode(mode, dev)
    check_policy(spec, policy, dev, run_mode)  # before any process group or data work

    own_group = False
    if world > 1 and not dist.is_initialized():
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
        own_group = True
    module: nn.Module = spec.module
    handle = None
    try:
        dataset = data.split("train")
        sampler = DistributedSampler(
            dataset, num_replicas=world, rank=rank, shuffle=True, seed=seed, drop_last=False
        )
        steps_per_epoch = (len(sampler) // batch_size) // grad_accum
        if steps_per_epoch < 1:
            raise TrainConfigError(
                f"one optimizer step needs batch_size x grad_accum = {batch_size * grad_accum} "
                f"examples per process, but each of the {world} process(es) holds {len(sampler)} "
                "of the train split; lower --batch-size or --grad-accum"
            )
        total = steps if steps is not None else (epochs or 1) * steps_per_epoch
        config = {
            "batch_size": batch_size,
            "grad_accum": grad_accum,
            "world_size": world,
            "seed": seed,
            "lr": float(lr),
            "momentum": float(momentum),
            "policy": policy.digest(),
            "fingerprint": model_fingerprint(module),
        }

        torch.manual_seed(seed + rank)
        module.to(dev)
        optimizer = torch.optim.SGD(module.parameters(), lr=lr, momentum=momentum)
        scaler = LossScaler.from_config(policy.loss_scaling, device=dev)
        path = Path(checkpoint_dir) / CHECKPOINT_NAME if checkpoint_dir is not None else None
        ckpt = load_checkpoint(path, config, rank, world)
        step, history, prior_overflows, resumed_from = 0, [], 0, None
        val_history: list[dict[str, float]] = []
        if ckpt is not None:
            module.load_state_dict(ckpt["model"])
            optimizer.load_state_dict(ckpt["optimizer"])
            if ckpt["scaler"]:
                scaler.load_state_dict(ckpt["scaler"])
            step = resumed_from = int(ckpt["step"])
            history = [float(v) for v in ckpt["train_loss"]]
            prior_overflows = int(ckpt["overflows"])
            val_history = [dict(v) for v in ckpt.get("val_history", [])]
            restore_rng(ckpt["rng"][rank], dev)
        saved_at = resumed_from  # the step the file at `path` holds (rank 0 knows)
        tried_at = resumed_from  # the last step a checkpoint was written at or tried (every rank)

        model: nn.Module = module
        if world > 1:
            ids = [dev.index] if dev.type == "cuda" else None
            model = nn.parallel.DistributedDataParallel(module, device_ids=ids)
        if run_mode == COMPILED:
            handle = compile_policy(module, policy)
        else:
            handle = apply_policy(module, policy, mode=run_mode)
        loop = TrainLoop(spec, data, module, model, optimizer, scaler, dev, rank, world, log)
        val = None

        def save() -> None:
            """Write the checkpoint of ``step``; a write that fails is one warning."""
            nonlocal saved_at, tried_at
            tried_at = step  # every rank alike: the next save is a collective for all
            if not loop.weights_finite():  # never write weights that are no longer numbers
                raise TrainDivergedError(_nan_weights(step, history, path, saved_at), step)
            overflows = prior_overflows + sum_over_ranks(handle.totals()["overflows"], dev)
            state = (module, optimizer, scaler, step, config, history, val_history, overflows)
            try:
                save_checkpoint(path, *state, dev)
            except OSError as err:  # a full or read-only disk: the training itself goes on
                if not failed_writes:
                    warnings.warn(_unwritten(path, err, saved_at), stacklevel=2)
                failed_writes.append(step)
                return
            saved_at = step

        failed_writes: list[int] = []  # steps whose checkpoint could not be written

        nonfinite = 0  # steps in a row whose loss was inf/NaN
        while step < total:
            epoch = step // steps_per_epoch
            sampler.set_epoch(epoch)
            order = list(sampler)
            first = (step % steps_per_epoch) * grad_accum
            micro = [
                order[i * batch_size : (i + 1) * batch_size]
                for i in range(first, steps_per_epoch * grad_accum)
            ]
            for group_start in range(0, len(micro), grad_accum):
                if any_rank(stop, dev):  # a step boundary: the state is whole
                    if path is not None and tried_at != step:
                        save()
                    raise TrainInterrupted(step, total, path if saved_at is not None else None)
                loss = loop.step(dataset, micro[group_start : group_start + grad_accum])
                step += 1
                history.append(loss)
                nonfinite = 0 if math.isfinite(loss) else nonfinite + 1
                kept = _kept(path, saved_at)
                if nonfinite and not scaler.is_enabled():
                    raise TrainDivergedError(
                        f"training diverged at step {step} (loss {loss}) without loss scaling; "
                        "lower the learning rate, or give the policy a loss_scaling section so "
                        "that steps with inf/NaN gradients are skipped" + kept,
                        step,
                    )
                if nonfinite and not loop.weights_finite():  # the step itself broke them
                    raise TrainDivergedError(_nan_weights(step, history, path, saved_at), step)
                if nonfinite >= NONFINITE_STEPS:  # every one skipped: nothing trains any more
                    raise TrainDivergedError(
                        f"training diverged: the loss was inf/NaN in {nonfinite} steps in a row "
                        f"(steps {step - nonfinite + 1}-{step}), each skipped by the loss "
                        "scaler; the forward pass overflows, which loss scaling cannot fix: "
                        "keep the overflowing layers at a wider precision" + kept,
                        step,
                    )
                loop.emit(
                    step,
                    {
                        "train_loss": loss,
                        "loss_scale": scaler.get_scale(),
                        "epoch": step / steps_per_epoch,
                    },
                )
                epoch_end = step % steps_per_epoch == 0
                if epoch_end or step == total:
                    val = loop.validate()
                    record = {"step": step, "epoch": step / steps_per_epoch, **val}
                    val_history.append(record)
                    loop.emit(step, {k: v for k, v in record.items() if k != "step"})
                due = checkpoint_every is not None and step % checkpoint_every == 0
                if path is not None and (epoch_end or step == total or due):
                    save()
                if step == total:
                    break

        if val is None:  # resumed at (or past) the end: nothing trained, validate once
            val = loop.validate()
        if not (loop.weights_finite() and math.isfinite(val["val_loss"])):  # never a success
            raise TrainDivergedError(_nan_weights(step, history, path, saved_at), step)
        overflows = prior_overflows + sum_over_ranks(handle.totals()["overflows"], dev)
        if own_group:
            dist.barrier()  # no rank tears the group down while another still talks to it
        return TrainResult(
            steps=step,
            epochs=step // steps_per_epoch,
            steps_per_epoch=steps_per_epoch,
            train_loss=history,
            val_loss=val["val_loss"],
            val_accuracy=val["val_accuracy"],
            val_history=val_history,
            overflows=overflows,
            skipped_steps=scaler.skipped_steps,
            wall_time_s=time.perf_counter() - start,
            checkpoint=path if saved_at is not None else None,
            checkpoint_step=saved_at if path is not None else None,
            resumed_from=resumed_from,
            world_size=world,
            rank=rank,
            mode=run_mode,
        )
    finally:
        if handle is not None:
            handle.remove()
        if own_group and dist.is_initialized():
            model = loop = None  # type: ignore[assignment]  # DDP's reducer: see leave_group
            leave_group()


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
