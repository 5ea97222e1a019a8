"""The few collectives training needs, each a no-op in a single process.

``torchrun`` sets ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK``; these helpers read them and, when a
process group of more than one process is up, reduce over it. :mod:`autoprec.training.run`, its
loop and its checkpoints share them, so that "is this a multi-process run" is decided in one place.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable

import torch
import torch.distributed as dist

StopFn = Callable[[], bool]


def dist_env() -> tuple[int, int, int]:
    """``(rank, world_size, local_rank)`` as ``torchrun`` sets them; ``(0, 1, 0)`` otherwise."""
    if dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    return rank, world, int(os.environ.get("LOCAL_RANK", "0"))


def is_multiprocess() -> bool:
    """Whether a process group of more than one process is up (collectives are needed)."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def any_rank(stop: StopFn | None, dev: torch.device) -> bool:
    """``stop()``, true on every process once it is true on one (a collective under DDP)."""
    if stop is None:
        return False
    flag = bool(stop())
    if is_multiprocess():
        t = torch.tensor([int(flag)], dtype=torch.int64, device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        flag = bool(t.item())
    return flag


def sum_over_ranks(value: int, dev: torch.device) -> int:
    """``value`` summed over every process (``value`` itself in a single process)."""
    if not is_multiprocess():
        return value
    t = torch.tensor([value], dtype=torch.int64, device=dev)
    dist.all_reduce(t)
    return int(t.item())


def leave_group() -> None:
    """Destroy the process group, once the caller has dropped its ``DistributedDataParallel``
    wrapper: the wrapper's reducer holds the group and gloo's last work, and freed only after the
    group (at the caller's return, or at interpreter exit) gloo's threads can abort the process
    (SIGABRT, "terminate called without an active exception", seen in CI); collected here first."""
    gc.collect()
    dist.destroy_process_group()
