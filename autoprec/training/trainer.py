"""The one training engine: a step, the divergence rule, the split scorer and step timing.

Every training in autoprec runs through :class:`Trainer`: the fine-tunes that score a policy
(:mod:`autoprec.evaluate.finetune`), the fp32 warm start (:mod:`autoprec.training.pretrain`),
``autoprec train`` (:mod:`autoprec.training.run`) and, through it, the arms of ``autoprec
verify``. The optimizer and its rate schedule come from the user's
:class:`~autoprec.training.recipe.TrainingRecipe`; the caller makes them (the order of their
making, before or after a policy is applied, is the caller's) and hands them over.

One step: zero the gradients, forward each micro-batch (under DDP, all-reduced once, on the
last), backward through the loss scaler (:class:`~autoprec.runtime.LossScaler`; a disabled one
is a plain pass-through), the scaler's optimizer step and update, then the schedule's step.

The divergence rule (:class:`DivergenceRule`), the same everywhere, with one parameter: how many
steps in a row the loss scaler may skip. A step's loss (its mean over micro-batches and
processes) that is inf/NaN diverges the run unless an enabled loss scaler skips that step and
fewer than ``skips`` steps in a row were skipped so; a skipped step that leaves the weights
non-finite diverges it too. ``skips = 0`` (the fine-tunes and the warm start: a few steps, where
one skipped step already makes a policy's loss another run's) stops at the first inf/NaN loss,
before its backward pass; ``autoprec train`` allows :data:`TRAIN_SKIPS` (a dynamic scaler
backs off over a few skipped steps; a loss that overflows in the forward pass stays so).

Example:
    >>> rule = DivergenceRule(skips=0)
    >>> rule.verdict(float("nan"), scaled=True, in_a_row=1, weights_finite=lambda: True)
    'nonfinite_loss'
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn

if TYPE_CHECKING:  # pragma: no cover
    from torch.utils.data import Dataset

    from autoprec.data import DataBundle
    from autoprec.models import ModelSpec
    from autoprec.runtime import LossScaler

#: Examples per batch when a split is scored.
SCORE_BATCH = 256
#: Steps of a timed run left untimed: the first ones warm up kernels and the allocator.
UNTIMED_STEPS = 2
#: ``autoprec train``'s (and verify's) steps in a row with an inf/NaN loss, each skipped by the
#: loss scaler, after which the run is diverged.
TRAIN_SKIPS = 20

#: The verdicts of :meth:`DivergenceRule.verdict`.
NONFINITE_LOSS = "nonfinite_loss"  # an inf/NaN loss that no loss scaler skipped (or may skip)
NONFINITE_WEIGHTS = "nonfinite_weights"  # a skipped step left the weights inf/NaN
SKIPPED_IN_A_ROW = "skipped_in_a_row"  # the scaler skipped ``skips`` steps in a row

Batch = tuple[Tensor, Tensor]


class LossSpec(Protocol):
    """What a trainer's step reads of its spec: the loss of a model's output (a
    :class:`~autoprec.models.ModelSpec`, or the warm start's loss alone)."""

    def loss(self, output: Any, target: Tensor) -> Tensor: ...


@dataclass(frozen=True)
class DivergenceRule:
    """When a training run has diverged (see the module's docstring).

    Args:
        skips: steps in a row with an inf/NaN loss that an enabled loss scaler may skip
            before the run is diverged; 0: the first inf/NaN loss diverges it, checked before
            its backward pass.
    """

    skips: int = 0

    @property
    def checks_before_backward(self) -> bool:
        """Whether a step's loss is judged before its backward pass (no skip allowed)."""
        return self.skips == 0

    def verdict(
        self, loss: float, *, scaled: bool, in_a_row: int, weights_finite: Callable[[], bool]
    ) -> str | None:
        """None while the run goes on, else why it diverged.

        Args:
            loss: the step's loss.
            scaled: whether an enabled loss scaler saw the step (and skipped it if inf/NaN).
            in_a_row: steps in a row, this one included, whose loss was inf/NaN.
            weights_finite: called only for a skipped step: whether the weights are finite.
        """
        if math.isfinite(loss):
            return None
        if self.skips == 0 or not scaled:
            return NONFINITE_LOSS
        if not weights_finite():
            return NONFINITE_WEIGHTS
        if in_a_row >= self.skips:
            return SKIPPED_IN_A_ROW
        return None


class Trainer:
    """Steps, judges, times and scores one model.

    Args:
        spec: the model spec (``loss(out, y)``, ``logits(out)``).
        model: what is trained: the module, or its ``DistributedDataParallel`` wrapper.
        optimizer: over the module's parameters (:meth:`TrainingRecipe.make_optimizer`).
        scaler: the loss scaler (a disabled one: plain steps).
        device: where the batches are moved.
        schedule: the rate schedule (:meth:`TrainingRecipe.make_schedule`), stepped after
            every optimizer step; None: the rate stays as the optimizer was made.
        rule: the divergence rule.
        module: the bare module under ``model`` (default ``model``): validated, checked.
        rank, world: this process's rank and the number of processes.
        timed: time each step with CUDA events (:attr:`step_times`, the first
            :data:`UNTIMED_STEPS` left out).

    Attributes:
        steps: optimizer steps taken (or refused by the rule) by this trainer.
        in_a_row: the latest steps in a row whose loss was inf/NaN.
        step_times: seconds of the timed steps.
    """

    def __init__(
        self,
        spec: LossSpec,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scaler: LossScaler,
        device: torch.device,
        *,
        schedule: torch.optim.lr_scheduler.LRScheduler | None = None,
        rule: DivergenceRule | None = None,
        module: nn.Module | None = None,
        rank: int = 0,
        world: int = 1,
        timed: bool = False,
    ) -> None:
        self.spec, self.model = spec, model
        self.module = model if module is None else module
        self.optimizer, self.scaler, self.schedule = optimizer, scaler, schedule
        self.device, self.rank, self.world = device, rank, world
        self.rule = DivergenceRule() if rule is None else rule
        self.timed = timed
        self.steps = 0
        self.in_a_row = 0
        self.step_times: list[float] = []

    def step(self, micro: Sequence[Batch]) -> float:
        """One optimizer step over the micro-batches ``micro`` (``(x, y)`` each, moved to the
        device here); returns the step's loss, the mean over micro-batches and processes.

        Under a rule that allows no skip (one process, one micro-batch), an inf/NaN loss ends
        the step before its backward pass; :meth:`verdict` then says the run diverged.
        """
        self.model.train()
        self.steps += 1
        begin = end = None
        if self.timed:
            begin = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
        if not micro:
            raise ValueError("a training step needs at least one micro-batch; got none")
        total = torch.zeros((), device=self.device)
        for i, (x, y) in enumerate(micro):
            x = x.to(self.device, non_blocking=True)
            y = y.to(self.device, non_blocking=True)
            if i == 0:
                if begin is not None:
                    begin.record()
                self.optimizer.zero_grad(set_to_none=True)
            last = i == len(micro) - 1
            sync = contextlib.nullcontext()
            if self.world > 1 and not last:
                sync = self.model.no_sync()  # all-reduce once, on the last micro-batch
            with sync:
                loss = self.spec.loss(self.model(x), y)
                if self.rule.checks_before_backward and not torch.isfinite(loss.detach()):
                    return float(loss.detach())  # judged by verdict(): nothing stepped with it
                self.scaler.scale(loss if len(micro) == 1 else loss / len(micro)).backward()
            total += loss.detach()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        if self.schedule is not None:
            with warnings.catch_warnings():  # a first step the scaler skipped: not a misuse
                warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step", Warning)
                self.schedule.step()
        if end is not None:
            end.record()
            torch.cuda.synchronize(self.device)
            if self.steps > UNTIMED_STEPS:
                self.step_times.append(begin.elapsed_time(end) / 1e3)
        mean = total / len(micro)
        if self.world > 1:
            dist.all_reduce(mean)
            mean /= self.world
        return float(mean)

    def verdict(self, loss: float) -> str | None:
        """The divergence rule applied to the step that returned ``loss`` (None: go on)."""
        self.in_a_row = 0 if math.isfinite(loss) else self.in_a_row + 1
        scaled = self.scaler.is_enabled() and not self.rule.checks_before_backward
        return self.rule.verdict(
            loss, scaled=scaled, in_a_row=self.in_a_row, weights_finite=self.weights_finite
        )

    @torch.no_grad()
    def weights_finite(self) -> bool:
        """Whether every floating-point parameter and buffer of the module is finite (one
        reduction and one host sync; the same answer on every process under DDP)."""
        tensors = [t for t in self.module.state_dict().values() if t.is_floating_point()]
        if not tensors:
            return True
        return bool(torch.stack([torch.isfinite(t).all() for t in tensors]).all())

    def validate(self, data: DataBundle) -> dict[str, float]:
        """``val_loss`` and ``val_accuracy`` of the module over ``data``'s val split (under
        DDP, with rank 0's BatchNorm statistics, as the checkpoint holds them)."""
        if self.world > 1:
            for buf in self.module.buffers():
                dist.broadcast(buf, 0)
        loss, accuracy = score_split(
            self.module, self.spec, data, "val", self.device, rank=self.rank, world=self.world
        )
        return {"val_loss": loss, "val_accuracy": accuracy}


@torch.no_grad()
def score_split(
    model: nn.Module,
    spec: ModelSpec,
    data: DataBundle,
    split: str,
    device: torch.device | str | None = None,
    *,
    rank: int = 0,
    world: int = 1,
    index: list[int] | None = None,
) -> tuple[float, float]:
    """Mean loss (per example) and accuracy (per label) of ``model`` over ``split`` (or its
    examples ``index``): the one split scorer of autoprec.

    In eval mode, whatever policy is applied staying applied; back in train mode after. Under
    DDP (``world > 1``) each process scores every ``world``-th example and the sums are
    reduced, so that the figures do not depend on the number of processes.
    """
    model.eval()
    dataset = data.split(split)
    index = (list(range(len(dataset))) if index is None else index)[rank::world]
    sums = [0.0, 0.0, 0.0, 0.0]  # loss x examples, examples, correct labels, labels
    for start in range(0, len(index), SCORE_BATCH):
        x, y = gather(dataset, index[start : start + SCORE_BATCH])
        if device is not None:
            x, y = x.to(device), y.to(device)
        out = model(x)
        pred = spec.logits(out).argmax(-1)
        sums[0] += float(spec.loss(out, y)) * len(x)
        sums[1] += len(x)
        sums[2] += float((pred == y).sum())
        sums[3] += y.numel()
    if world > 1:
        reduced = torch.tensor(sums, dtype=torch.float64, device=device)
        dist.all_reduce(reduced)
        sums = reduced.tolist()
    model.train()
    loss_sum, count, correct, labels = sums
    return loss_sum / max(count, 1), correct / max(labels, 1)


def gather(dataset: Dataset, idx: list[int]) -> Batch:
    """Examples ``idx`` of ``dataset`` as one ``(x, y)`` batch."""
    from torch.utils.data import TensorDataset, default_collate

    if isinstance(dataset, TensorDataset):
        x, y = dataset.tensors
        index = torch.tensor(idx, dtype=torch.long)
        return x[index], y[index]
    x, y = default_collate([dataset[i] for i in idx])
    return x, y
