"""The fp32 warm start every evaluation fine-tunes from: trained once, kept on disk.

The file's key covers the model's architecture *and* its initial weights (two specs of one
architecture built with different random weights must not share a warm start), the data, the
seed and the warm start's own settings; the fine-tuning settings are not in it, so that every
fine-tuning variant of one model (another batch order, another step count) starts from the
same weights.

A warm start must learn, or every evaluation fine-tunes noise: it is trained by
:func:`autoprec.training.pretrain.train_fp32`, which backs off to lower rates until the model
learns; the rate that learnt is saved with the weights, and fine-tuning scales its own rate by the
same factor. A model that learns at no rate is a one-line error.
"""

from __future__ import annotations

import copy
import hashlib
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from autoprec._periodic import Progress
from autoprec.cache import digest
from autoprec.evaluate._store import load_state, save_state_atomic
from autoprec.evaluate.config import EvaluatorConfig
from autoprec.training.pretrain import Attempt, WarmStartError, backoff_note, train_fp32

if TYPE_CHECKING:  # pragma: no cover
    from autoprec.data import DataBundle
    from autoprec.models import ModelSpec

__all__ = ["Attempt", "WarmStart", "WarmStartError", "weights_digest"]

LR_KEY = "autoprec.warm_start_lr"  # the rate that learnt, saved with the weights
WHAT = "the fp32 warm start"  # as its error and its back-off warning name it


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
        spec: ModelSpec,
        data: DataBundle,
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
        self._lr = config.recipe.lr

    def state(self, progress: Progress | None = None) -> dict[str, torch.Tensor]:
        """The weights (CPU tensors): from memory, else from the file, else trained and saved
        (a file that cannot be written costs a note; the weights stay in memory); a training's
        steps are told to ``progress(stage, done, total)`` (see :func:`train_fp32`)."""
        if self._state is not None:
            return self._state
        like = {**self.spec.module.state_dict(), LR_KEY: torch.tensor(1.0, dtype=torch.float64)}
        saved = load_state(self.path, like)  # None: missing, or damaged (not like) and discarded
        if saved is None:
            saved = self._train(progress)
            save_state_atomic(self.path, saved)
            self.trained = True
        rate = saved.get(LR_KEY)
        self._lr = float(rate) if rate is not None else self.config.recipe.lr
        self._state = {k: v for k, v in saved.items() if k != LR_KEY}
        return self._state

    @property
    def lr_scale(self) -> float:
        """The rate the warm start learnt at over the configured rate (1: no back-off); loads
        or trains the weights."""
        self.state()
        return self._lr / self.config.recipe.lr

    def _train(self, progress: Progress | None = None) -> dict[str, torch.Tensor]:
        """``warm_start_steps`` fp32 steps of the recipe (SGD at 0.05 with momentum 0.9 by
        default) from the spec's weights, at the recipe's rate or a backed-off one; the rate is
        saved under :data:`LR_KEY`."""
        cfg = self.config
        torch.manual_seed(cfg.seed)
        model = copy.deepcopy(self.spec.module).cpu()
        self.attempts = train_fp32(
            model,
            self.spec.loss,
            lambda: self.data.loader("train", batch_size=cfg.recipe.batch_size, seed=cfg.seed),
            cfg.warm_start_steps,
            cfg.recipe.lr,
            cfg.seed,
            what=WHAT,
            progress=progress,
            recipe=cfg.recipe,
        )
        note = backoff_note(WHAT, self.attempts)
        if note is not None:
            warnings.warn(note + "; fine-tuning scales its rate by the same factor", stacklevel=3)
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        state[LR_KEY] = torch.tensor(self.attempts[-1].lr, dtype=torch.float64)
        return state
