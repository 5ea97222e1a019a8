"""What :func:`autoprec.training.run.train` checks before it starts: its settings, the device, the
runtime mode and whether the policy fits the model (and, natively, the device); each refusal is
a one-line error of its own class."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from autoprec._values import SEED_RANGE
from autoprec.policy import PolicyMismatchError, PrecisionPolicy, resolve_mode
from autoprec.policy.fields import COMPILED
from autoprec.runtime.compiled import NotCompilableError, check_compilable

if TYPE_CHECKING:  # pragma: no cover
    from autoprec.data import DataBundle
    from autoprec.models import ModelSpec

__all__ = [
    "PolicyMismatchError",
    "TrainConfigError",
    "check_policy",
    "check_seed",
    "check_settings",
    "pick_device",
    "pick_mode",
]


class TrainConfigError(ValueError):
    """Training settings that cannot work (both steps and epochs, a batch larger than the data)."""


def check_settings(
    counts: dict[str, int | None], checkpoint_every: int | None, lr: float, momentum: float
) -> None:
    """``counts``: ``steps``, ``epochs``, ``batch_size`` and ``grad_accum``."""
    steps, epochs = counts["steps"], counts["epochs"]
    if steps is not None and epochs is not None:
        raise TrainConfigError(
            f"give steps or epochs, not both (got steps={steps}, epochs={epochs})"
        )
    for name, value in {**counts, "checkpoint_every": checkpoint_every}.items():
        if value is None and name in ("steps", "epochs", "checkpoint_every"):
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise TrainConfigError(f"{name} must be an integer >= 1, got {value!r}")
    if not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0):
        raise TrainConfigError(f"lr must be a finite number > 0, got {lr!r}")
    if not (isinstance(momentum, (int, float)) and 0 <= momentum < 1):
        raise TrainConfigError(f"momentum must be in [0, 1), got {momentum!r}")


def check_batch_fits(spec: ModelSpec, data: DataBundle, batch_size: int) -> None:
    """Raise :class:`~autoprec._memory.SizeError` (one line naming the setting) unless a batch
    of ``batch_size`` examples of ``data``, and a training step of ``spec`` on it with the
    activations its backward keeps, fit in the machine's memory."""
    data.check_batch(batch_size)
    spec.check_batch(batch_size, activations=True)


def check_seed(seed: Any, error: type[ValueError] | None = None, name: str = "seed") -> int:
    """``seed`` if it lies in :data:`~autoprec._values.SEED_RANGE`, the rule of every
    command's seed (``search`` checks its option by it too).

    Raises:
        error: (:class:`TrainConfigError` by default) naming ``name`` and the range.
    """
    problem = SEED_RANGE.problem(seed)
    if problem is not None:
        raise (error or TrainConfigError)(f"{name} must be {problem}")
    return seed


def pick_device(device: str | torch.device | None, local_rank: int | None) -> torch.device:
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except RuntimeError as err:
        raise TrainConfigError(f"invalid device {device!r}: {err}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise TrainConfigError("device cuda was asked for, but CUDA is not available")
        if dev.index is None:
            dev = torch.device("cuda", local_rank if local_rank is not None else 0)
    return dev


def pick_mode(mode: str, dev: torch.device) -> str:
    """The runtime mode of a run: :func:`resolve_mode`'s, or ``compiled`` (native's program
    under ``torch.compile``, :mod:`autoprec.runtime.compiled`)."""
    if mode == COMPILED:
        return mode
    try:
        return resolve_mode(mode, dev.type)
    except ValueError as err:  # a user's setting: the one-line error of the other settings
        raise TrainConfigError(str(err)) from None


def check_policy(spec: ModelSpec, policy: PrecisionPolicy, dev: torch.device, mode: str) -> None:
    """Raise :class:`PolicyMismatchError` unless ``policy`` fits the model (and device)."""
    target = None
    if mode in ("native", COMPILED):  # emulation runs every precision anywhere
        from autoprec.runtime.native import local_device  # what apply_policy will check
        from autoprec.runtime.native_blocks import refuse_block

        target = local_device(dev.type)
        modules = dict(spec.module.named_modules())  # nvfp4, fp8_block: one line naming a backend
        refuse_block({n: (modules[n], p) for n, p in policy.resolve(spec.module).items()}, dev.type)
    report = policy.validate(spec.module, target)
    if report.ok:
        if mode == COMPILED:
            try:
                check_compilable(spec.module, policy)
            except NotCompilableError as err:
                raise PolicyMismatchError(f"mode {COMPILED}: {err}") from None
        return
    where = f" on {target.name} (native mode)" if target is not None and report.unsupported else ""
    raise report.error(policy, getattr(spec, "name", "?"), where)
