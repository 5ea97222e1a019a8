"""One optimizer step and one validation of :func:`autoprec.training.run.train`, over a DDP model
or not.

Gradients are accumulated over micro-batches (all-reduced once, on the last), scaled by the loss
scaler; validation scores every world-th example of the val split on each process and reduces the
sums, so that the figures do not depend on the number of processes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.data import Dataset, TensorDataset, default_collate

from autoprec.runtime import LossScaler

VAL_BATCH = 256

LogFn = Callable[[int, dict[str, float]], None]


class TrainLoop:
    """One optimizer step, validation and rank-0 logging, over a (possibly DDP) model.

    Args:
        spec: the model spec (``loss(out, y)``, ``logits(out)``).
        data: the data bundle; validation reads its val split.
        module: the bare module (validated, its buffers broadcast).
        model: ``module`` or its ``DistributedDataParallel`` wrapper (trained).
        optimizer: the optimizer over ``module``'s parameters.
        scaler: the loss scaler.
        dev: the device the batches are moved to.
        rank: this process's rank.
        world: the number of processes.
        log: called on rank 0 as ``log(step, metrics)``, or None.
    """

    def __init__(
        self,
        spec: Any,
        data: Any,
        module: nn.Module,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scaler: LossScaler,
        dev: torch.device,
        rank: int,
        world: int,
        log: LogFn | None,
    ) -> None:
        self.spec, self.data = spec, data
        self.module, self.model = module, model
        self.optimizer, self.scaler = optimizer, scaler
        self.dev, self.rank, self.world, self.log = dev, rank, world, log

    def step(self, dataset: Dataset, micro: list[list[int]]) -> float:
        """Accumulate gradients over ``micro`` (index lists), then one scaled optimizer step."""
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), device=self.dev)
        for i, idx in enumerate(micro):
            x, y = _batch(dataset, idx)
            x, y = x.to(self.dev, non_blocking=True), y.to(self.dev, non_blocking=True)
            last = i == len(micro) - 1
            sync = contextlib.nullcontext()
            if self.world > 1 and not last:
                sync = self.model.no_sync()  # all-reduce once, on the last micro-batch
            with sync:
                loss = self.spec.loss(self.model(x), y)
                self.scaler.scale(loss / len(micro)).backward()
            total += loss.detach()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        mean = total / len(micro)
        if self.world > 1:
            dist.all_reduce(mean)
            mean /= self.world
        return float(mean)

    @torch.no_grad()
    def validate(self) -> dict[str, float]:
        """Loss and accuracy over the val split, each process scoring every world-th example."""
        if self.world > 1:  # BatchNorm statistics of rank 0, as in the checkpoint
            for buf in self.module.buffers():
                dist.broadcast(buf, 0)
        self.module.eval()
        val = self.data.split("val")
        idx = list(range(self.rank, len(val), self.world))
        sums = torch.zeros(4, dtype=torch.float64, device=self.dev)
        for i in range(0, len(idx), VAL_BATCH):
            x, y = _batch(val, idx[i : i + VAL_BATCH])
            x, y = x.to(self.dev), y.to(self.dev)
            out = self.module(x)
            pred = self.spec.logits(out).argmax(-1)
            sums += torch.tensor(
                [
                    float(self.spec.loss(out, y)) * len(x),
                    len(x),
                    float((pred == y).sum()),
                    y.numel(),
                ],
                dtype=torch.float64,
                device=self.dev,
            )
        if self.world > 1:
            dist.all_reduce(sums)
        self.module.train()
        loss_sum, count, correct, labels = sums.tolist()
        return {"val_loss": loss_sum / max(count, 1), "val_accuracy": correct / max(labels, 1)}

    @torch.no_grad()
    def weights_finite(self) -> bool:
        """Whether every floating-point parameter and buffer of the module is finite (one
        reduction and one host sync; the same answer on every process under DDP)."""
        tensors = [t for t in self.module.state_dict().values() if t.is_floating_point()]
        if not tensors:
            return True
        return bool(torch.stack([torch.isfinite(t).all() for t in tensors]).all())

    def emit(self, step: int, metrics: dict[str, float]) -> None:
        """Hand ``metrics`` of ``step`` to ``log``, on rank 0 only."""
        if self.log is not None and self.rank == 0:
            self.log(step, metrics)


def _batch(dataset: Dataset, idx: list[int]) -> tuple[Tensor, Tensor]:
    if isinstance(dataset, TensorDataset):
        x, y = dataset.tensors
        index = torch.tensor(idx, dtype=torch.long)
        return x[index], y[index]
    x, y = default_collate([dataset[i] for i in idx])
    return x, y
