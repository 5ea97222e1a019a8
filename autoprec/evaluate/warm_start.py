"""The fp32 warm start every evaluation fine-tunes from: trained once, kept on disk.

The file's key covers the model's architecture *and* its initial weights (two specs of one
architecture built with different random weights must not share a warm start), the data, the
seed and the warm start's own settings; the fine-tuning settings are not in it, so that every
fine-tuning variant of one model (another batch order, another step count) starts from the
same weights.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
from pathlib import Path
from typing import Any

import torch
from torch import nn

from autoprec.evaluate._store import load_state, save_state_atomic
from autoprec.evaluate.config import EvaluatorConfig, digest


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
        self._state: dict[str, torch.Tensor] | None = None

    def state(self) -> dict[str, torch.Tensor]:
        """The weights (CPU tensors): from memory, else from the file, else trained and saved
        (a file that cannot be written costs a note; the weights stay in memory)."""
        if self._state is not None:
            return self._state
        state = load_state(self.path)  # None: missing, or damaged and discarded
        if state is None:
            state = self._train()
            save_state_atomic(self.path, state)
            self.trained = True
        self._state = state
        return state

    def _train(self) -> dict[str, torch.Tensor]:
        """``warm_start_steps`` fp32 SGD steps (momentum 0.9) from the spec's weights."""
        cfg = self.config
        torch.manual_seed(cfg.seed)
        model = copy.deepcopy(self.spec.module).cpu()
        model.train()
        opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=0.9)
        loader = self.data.loader("train", batch_size=cfg.batch_size, seed=cfg.seed)
        for x, y in itertools.islice(itertools.cycle(loader), cfg.warm_start_steps):
            opt.zero_grad(set_to_none=True)
            self.spec.loss(model(x), y).backward()
            opt.step()
        return {k: v.detach().clone() for k, v in model.state_dict().items()}
