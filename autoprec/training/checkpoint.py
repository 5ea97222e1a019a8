"""Training checkpoints: one atomic file holding all that the next step depends on.

A checkpoint holds the weights and buffers, the optimizer's state, the loss scaler's, every
process's RNG states, the step (which fixes the data order), the history so far and the settings
that must not change across a resume (:data:`RESUME_KEYS`, the policy digest and the model
fingerprint). Under DDP every rank hands in its RNG state and rank 0 alone reads and writes the
file; :func:`load_checkpoint` refuses, with the reason, a file another run wrote.
"""

from __future__ import annotations

import io
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from autoprec.cache import reason, write_atomic
from autoprec.training.distributed import is_multiprocess

if TYPE_CHECKING:  # pragma: no cover
    from autoprec.runtime import LossScaler

CHECKPOINT_NAME = "last.pt"
CHECKPOINT_VERSION = 1
# Settings a resumed run must share with the run that wrote the checkpoint.
RESUME_KEYS = ("batch_size", "grad_accum", "world_size", "seed", "lr", "momentum")
# The class torch's weights-only unpickler refused, in its error text.
_UNSAFE = re.compile(r"Unsupported global: GLOBAL ([\w.]+)")
_UNPICKLER = re.compile(r"WeightsUnpickler error: (.{1,120}?)\s*(?:Check the documentation|$)")


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed by this run; the message says why and what to do."""


def _rng_state(dev: torch.device) -> dict[str, Tensor | None]:
    cuda = torch.cuda.get_rng_state(dev) if dev.type == "cuda" else None
    return {"cpu": torch.get_rng_state(), "cuda": cuda}


def restore_rng(state: dict[str, Tensor | None], dev: torch.device) -> None:
    """Set this process's torch RNGs (CPU, and ``dev``'s on CUDA) to a checkpointed state."""
    torch.set_rng_state(state["cpu"])
    if dev.type == "cuda" and state.get("cuda") is not None:
        torch.cuda.set_rng_state(state["cuda"], dev)


def save_checkpoint(
    path: Path,
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: LossScaler,
    step: int,
    config: dict[str, Any],
    history: list[float],
    val_history: list[dict[str, float]],
    overflows: int,
    dev: torch.device,
) -> None:
    """Every rank hands in its RNG state (a collective); rank 0 writes the file atomically.

    Raises:
        OSError: the file cannot be written (a full disk, a read-only folder); the file there
            before, if any, is left as it was.
    """
    rng = [_rng_state(dev)]
    if is_multiprocess():
        rng = [None] * dist.get_world_size()
        dist.all_gather_object(rng, _rng_state(dev))
        if dist.get_rank() != 0:
            return
    state = {
        "version": CHECKPOINT_VERSION,
        "step": step,
        "model": module.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scaler": scaler.state_dict(),
        "rng": [{k: (v.cpu() if v is not None else None) for k, v in r.items()} for r in rng],
        "train_loss": list(history),
        "val_history": [dict(v) for v in val_history],
        "overflows": overflows,
        "config": config,
    }
    # serialised first: torch's writer turns a full disk into a RuntimeError of its own, a file
    # object's write raises the OSError (ENOSPC) that the caller knows to take as a warning
    data = io.BytesIO()
    torch.save(state, data)
    write_atomic(path, lambda fh: fh.write(data.getbuffer()), binary=True)


def load_checkpoint(
    path: Path | None, config: dict[str, Any], rank: int, world: int
) -> dict[str, Any] | None:
    """Rank 0 reads ``path`` (if it exists) and hands it to the other ranks.

    Raises:
        CheckpointError: the file cannot be read, or another model, policy or settings wrote it.
    """
    ckpt = None
    problem = None
    if path is not None and rank == 0 and path.exists():
        try:
            ckpt = read_torch_file(path)
        except CheckpointError as err:
            problem = f"{err}; use another checkpoint folder, or delete {path} to start afresh"
        else:
            problem = _resume_problem(ckpt, config, path)
    if world > 1:
        box = [(ckpt, problem)]
        dist.broadcast_object_list(box, src=0)
        ckpt, problem = box[0]
    if problem:
        raise CheckpointError(problem)
    return ckpt


def read_torch_file(path: str | os.PathLike[str], error: type[ValueError] = CheckpointError) -> Any:
    """``torch.load(path)`` of tensors and plain data only (``weights_only``), on the CPU.

    Raises:
        error: (:class:`CheckpointError` by default) the file is not a regular file, is empty,
            is damaged, or holds Python objects of other kinds; the message says which, in
            autoprec's words (not torch's advice to load it with ``weights_only=False``, which
            would run whatever code the file holds).
    """
    file = Path(path)
    if not file.is_file():
        what = "a folder" if file.is_dir() else "not a regular file" if file.exists() else "missing"
        raise error(f"cannot read checkpoint {file}: it is {what}")
    if file.stat().st_size == 0:
        raise error(
            f"cannot read checkpoint {file}: it is empty (0 bytes), a write that never finished"
        )
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - whatever is wrong, one line of our own
        text = " ".join(str(err).split())
        found = _UNSAFE.search(text)
        if found is not None:
            raise error(
                f"cannot read checkpoint {file}: it holds Python objects ({found.group(1)}) "
                "besides tensors and plain data, which autoprec does not load (loading them "
                "could run code): it is not a checkpoint of `autoprec train` or a state dict"
            ) from None
        detail = _UNPICKLER.search(text)  # torch's own reason, inside its advice
        why = detail.group(1).strip() if detail is not None else reason(err).split(". ")[0]
        raise error(
            f"cannot read checkpoint {file}: it is damaged or not a torch file ({why}); a "
            "truncated copy or another program's file"
        ) from None


def read_model_weights(
    path: str | os.PathLike[str], error: type[ValueError] = CheckpointError
) -> dict[str, Tensor]:
    """The model weights in ``path``: a checkpoint of ``autoprec train`` (its ``model``) or a
    state dict (``--init-weights``, ``autoprec verify --checkpoint``).

    Raises:
        error: as :func:`read_torch_file`, or the file holds no model weights.
    """
    from collections.abc import Mapping

    data = read_torch_file(path, error)
    weights = data.get("model", data) if isinstance(data, Mapping) else None
    if not isinstance(weights, Mapping) or not all(
        isinstance(k, str) and isinstance(v, Tensor) for k, v in weights.items()
    ):
        raise error(
            f"checkpoint {path} holds no model weights; expected a file of `autoprec train` "
            "(last.pt) or a state dict"
        )
    return dict(weights)


def load_model_weights(
    module: nn.Module, weights: dict[str, Tensor], where: object, error: type[ValueError]
) -> None:
    """``weights`` into ``module`` in place, or ``error`` naming ``where`` (the file) and the
    first names or shapes that do not fit (another model's or another size's weights)."""
    try:
        module.load_state_dict(weights)
    except RuntimeError as err:  # another architecture's weights
        text = " ".join(str(err).split())[:200]
        raise error(f"checkpoint {where} does not fit the model: {text}") from None


def _resume_problem(ckpt: Any, config: dict[str, Any], path: Path) -> str | None:
    fix = f"use another checkpoint folder, or delete {path} to start afresh"
    if not isinstance(ckpt, dict) or ckpt.get("version") != CHECKPOINT_VERSION:
        return (
            f"{path} is not an autoprec training checkpoint (version {CHECKPOINT_VERSION}); {fix}"
        )
    saved = ckpt["config"]
    if saved.get("fingerprint") != config["fingerprint"]:
        return f"{path} was written for another model architecture; {fix}"
    if saved.get("policy") != config["policy"]:
        return f"{path} was written with another policy ({saved.get('policy')}); {fix}"
    changed = [
        f"{key} {saved.get(key)!r} -> {config[key]!r}"
        for key in RESUME_KEYS
        if saved.get(key) != config[key]
    ]
    if changed:
        return f"{path} was written with other settings ({', '.join(changed)}); {fix}"
    return None
