"""The fp32 warm start every evaluation fine-tunes from: trained once, kept on disk.

The file's key covers the model's architecture *and* its initial weights (two specs of one
architecture built with different random weights must not share a warm start), the data, the
seed and the warm start's own settings; the fine-tuning settings are not in it, so that every
fine-tuning variant of one model (another batch order, another step count) starts from the
same weights.

A warm start must learn, or every evaluation fine-tunes noise: a fixed SGD rate that trains one
model diverges on another (torchvision's resnet50 at 32x32 starts with gradients many times
resnet18's, and at the default rate its loss climbs far above chance). A run whose loss turns
non-finite or climbs past :data:`DIVERGED_FACTOR` times its first, or that ends no lower than
it began (judged on runs of at least two :data:`LOSS_WINDOW`), is retried from the same
weights at a quarter of the rate, up to :data:`MAX_BACKOFFS` times; the rate that learnt is
saved with the weights, and fine-tuning scales its own rate by the same factor. A model that
learns at no rate is a one-line error.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import math
import statistics
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from autoprec.evaluate._store import load_state, save_state_atomic
from autoprec.evaluate.config import (
    DIVERGED_FACTOR,
    LOSS_WINDOW,
    LR_BACKOFF,
    MAX_BACKOFFS,
    EvaluatorConfig,
    digest,
)

LR_KEY = "autoprec.warm_start_lr"  # the rate that learnt, saved with the weights


class WarmStartError(ValueError):
    """The fp32 warm start learnt at no learning rate tried."""


@dataclass(frozen=True)
class Attempt:
    """One fp32 training attempt: its rate, first loss, last windowed loss and verdict."""

    lr: float
    first_loss: float
    last_loss: float
    steps: int
    diverged: bool

    @property
    def learned(self) -> bool:
        """Not diverged, and ended lower than it began (a run shorter than two windows, whose
        last window overlaps its start, is only asked not to diverge)."""
        if self.diverged:
            return False
        return self.steps < 2 * LOSS_WINDOW or self.last_loss < self.first_loss

    def describe(self) -> str:
        """``lr 0.05: loss 2.79 -> 37.6 (diverged at step 10)``."""
        how = f" (diverged at step {self.steps})" if self.diverged else ""
        return f"lr {self.lr:g}: loss {self.first_loss:.3g} -> {self.last_loss:.3g}{how}"


def train_fp32(
    model: nn.Module,
    loss: Callable[[Any, Any], torch.Tensor],
    batches: Callable[[], Iterable[Any]],
    steps: int,
    lr: float,
    seed: int,
    momentum: float = 0.9,
) -> list[Attempt]:
    """Train ``model`` in place for ``steps`` fp32 SGD steps at ``lr``, backing off until it
    learns (see the module's docstring).

    Args:
        batches: a fresh iterator of ``(x, y)`` batches (called once per attempt).
        seed: ``torch.manual_seed`` before each attempt (so the first attempt is exactly the
            plain loop's, and each retry is reproducible).

    Returns:
        Every attempt, the last one the one that learnt (its weights are in ``model``).

    Raises:
        WarmStartError: no rate down to ``lr / LR_BACKOFF**MAX_BACKOFFS`` learnt.
    """
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    attempts: list[Attempt] = []
    for retry in range(MAX_BACKOFFS + 1):
        rate = lr / LR_BACKOFF**retry
        if retry:
            model.load_state_dict(initial)
        torch.manual_seed(seed)
        attempts.append(_attempt(model, loss, batches(), steps, rate, momentum))
        if steps <= 0 or attempts[-1].learned:
            return attempts
    raise WarmStartError(
        "the fp32 warm start learnt at no learning rate tried ("
        + "; ".join(a.describe() for a in attempts)
        + "): the model does not train on this data at these settings"
    )


def _attempt(
    model: nn.Module,
    loss: Callable[[Any, Any], torch.Tensor],
    batches: Iterable[Any],
    steps: int,
    lr: float,
    momentum: float,
) -> Attempt:
    """One run of at most ``steps`` steps, stopped as soon as it diverges."""
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    losses: list[float] = []
    for x, y in itertools.islice(itertools.cycle(batches), steps):
        opt.zero_grad(set_to_none=True)
        value = loss(model(x), y)
        value.backward()
        opt.step()
        losses.append(float(value.detach()))
        window = statistics.fmean(losses[-LOSS_WINDOW:])
        if not math.isfinite(window) or window > DIVERGED_FACTOR * losses[0]:
            return Attempt(lr, losses[0], window, len(losses), diverged=True)
    if not losses:
        return Attempt(lr, math.nan, math.nan, 0, diverged=False)
    return Attempt(lr, losses[0], statistics.fmean(losses[-LOSS_WINDOW:]), steps, False)


def weights_digest(module: nn.Module) -> str:
    """SHA-256 (hex, 32 characters) of every tensor of the module's state, in order."""
    sha = hashlib.sha256()
    for name, tensor in module.state_dict().items():
        t = tensor.detach().cpu().contiguous().reshape(-1)
        sha.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        sha.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return sha.hexdigest()[:32]


class WarmStart:
    """The warm-start weights of one model, data and configuration (loaded or trained once).

    Args:
        spec: a ModelSpec (``module``, ``loss``); its module is not changed.
        data: a DataBundle (``loader``, ``key``).
        config: the evaluator's settings (``seed``, ``lr``, ``batch_size``,
            ``warm_start_steps``).
        cache_dir: the folder holding ``warmstart/<key>.pt``.
        model: the model's identity, ``(architecture fingerprint, initial weights digest)``.

    Attributes:
        key: the digest naming the file (also the sensitivity cache's key of these weights).
        path: the file holding the weights.
        trained: whether this instance trained them (False: loaded, or not needed yet).
        attempts: the training attempts when this instance trained them (else empty).
    """

    def __init__(
        self,
        spec: Any,
        data: Any,
        config: EvaluatorConfig,
        cache_dir: Path,
        model: tuple[str, str],
    ) -> None:
        self.spec = spec
        self.data = data
        self.config = config
        self.key = digest([*model, data.key, config.seed, config.warm_start_settings()])
        self.path = Path(cache_dir) / "warmstart" / f"{self.key}.pt"
        self.trained = False
        self.attempts: list[Attempt] = []
        self._state: dict[str, torch.Tensor] | None = None
        self._lr = config.lr

    def state(self) -> dict[str, torch.Tensor]:
        """The weights (CPU tensors): from memory, else from the file, else trained and saved
        (a file that cannot be written costs a note; the weights stay in memory)."""
        if self._state is not None:
            return self._state
        saved = load_state(self.path)  # None: missing, or damaged and discarded
        if saved is None:
            saved = self._train()
            save_state_atomic(self.path, saved)
            self.trained = True
        rate = saved.get(LR_KEY)
        self._lr = float(rate) if rate is not None else self.config.lr
        self._state = {k: v for k, v in saved.items() if k != LR_KEY}
        return self._state

    @property
    def lr_scale(self) -> float:
        """The rate the warm start learnt at over the configured rate (1: no back-off); loads
        or trains the weights."""
        self.state()
        return self._lr / self.config.lr

    def _train(self) -> dict[str, torch.Tensor]:
        """``warm_start_steps`` fp32 SGD steps (momentum 0.9) from the spec's weights, at the
        configured rate or a backed-off one; the rate is saved under :data:`LR_KEY`."""
        cfg = self.config
        torch.manual_seed(cfg.seed)
        model = copy.deepcopy(self.spec.module).cpu()
        self.attempts = train_fp32(
            model,
            self.spec.loss,
            lambda: self.data.loader("train", batch_size=cfg.batch_size, seed=cfg.seed),
            cfg.warm_start_steps,
            cfg.lr,
            cfg.seed,
        )
        if len(self.attempts) > 1:
            warnings.warn(
                "the fp32 warm start did not learn at "
                + "; ".join(a.describe() for a in self.attempts[:-1])
                + f"; trained at lr {self.attempts[-1].lr:g} instead ("
                f"{self.attempts[-1].describe()}); fine-tuning scales its rate by the same "
                "factor",
                stacklevel=3,
            )
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        state[LR_KEY] = torch.tensor(self.attempts[-1].lr, dtype=torch.float64)
        return state
