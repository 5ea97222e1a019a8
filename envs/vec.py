"""Vectorised :class:`~autoprec.envs.PrecisionEnv` for Stable-Baselines3 (PPO, MaskablePPO).

Each environment is built by name by :func:`~autoprec.envs.factory.make_env_by_name` (the
registered factory), in its worker process.

``SubprocVecEnv`` starts its workers with ``spawn`` (or ``forkserver``): each worker imports
the script that created it, so a script that calls :func:`make_vec` with ``n_envs > 1`` must
guard its entry point, or every worker would start workers of its own::

    from autoprec.envs.vec import make_vec

    if __name__ == "__main__":
        venv = make_vec(4, model="tinycnn", target="h100-sxm")
        ...

All workers share the evaluator's cache (``$AUTOPREC_CACHE_DIR``, or ``cache_dir`` in
``evaluator_kwargs``), so the warm start is trained once and a policy evaluated by one worker
is served from the cache to the others. ``action_masks`` reaches every worker through
``env_method``, which is what ``sb3_contrib.common.maskable.utils.get_action_masks`` uses.
"""

from __future__ import annotations

import functools
import os
from typing import Any


def _make_env(env_kwargs: dict[str, Any], monitor: bool, torch_threads: int | None) -> Any:
    from stable_baselines3.common.monitor import Monitor

    from autoprec.envs.factory import make_env_by_name

    if torch_threads is not None:
        import torch

        torch.set_num_threads(torch_threads)

    env = make_env_by_name(**env_kwargs)
    return Monitor(env) if monitor else env


def make_vec(
    n_envs: int = 2,
    *,
    start_method: str = "spawn",
    monitor: bool = True,
    seed: int | None = None,
    torch_threads: int | None = None,
    env_seed: int | None = None,
    **env_kwargs: Any,
) -> Any:
    """``n_envs`` PrecisionEnvs in a ``SubprocVecEnv`` (a ``DummyVecEnv`` when ``n_envs == 1``).

    Args:
        n_envs: number of environments (worker processes when above 1).
        start_method: ``"spawn"`` or ``"forkserver"`` (``fork`` is unsafe once torch has
            started threads).
        monitor: wrap each env in SB3's ``Monitor`` (episode rewards and lengths in ``info``).
        seed: seeds the envs' ``reset`` (env ``i`` gets ``seed + i``); None leaves them unseeded.
        torch_threads: torch CPU threads per worker; None gives each of several workers an
            equal share of the cores (``os.cpu_count() // n_envs``, at least 1), so that the
            workers' fine-tuning runs do not oversubscribe the CPU, and leaves a single
            in-process env alone.
        env_seed: the environments' own ``seed`` argument (their evaluator's seed: warm
            start and data order), which ``seed`` above would otherwise shadow; None keeps
            :func:`~autoprec.envs.factory.make_env_by_name`'s default.
        **env_kwargs: keyword arguments of :func:`~autoprec.envs.factory.make_env_by_name` (all must
            be picklable when ``n_envs > 1``; an ``evaluator`` is copied into every worker).

    Raises:
        ValueError: ``n_envs`` below 1 or an unknown start method.
    """
    from stable_baselines3.common.vec_env import DummyVecEnv, SubprocVecEnv

    if not isinstance(n_envs, int) or isinstance(n_envs, bool) or n_envs < 1:
        raise ValueError(f"n_envs must be an integer >= 1, got {n_envs!r}")
    if start_method not in ("spawn", "forkserver"):
        raise ValueError(f"start_method must be 'spawn' or 'forkserver', got {start_method!r}")
    if torch_threads is None and n_envs > 1:
        torch_threads = max(1, (os.cpu_count() or 1) // n_envs)
    if env_seed is not None:
        env_kwargs["seed"] = env_seed
    factory = functools.partial(_make_env, dict(env_kwargs), monitor, torch_threads)
    if n_envs == 1:
        venv = DummyVecEnv([factory])
    else:
        venv = SubprocVecEnv([factory] * n_envs, start_method=start_method)
    if seed is not None:
        venv.seed(seed)
    return venv
