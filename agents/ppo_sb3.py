"""What the ``ppo`` agent asks of stable-baselines3: rollout sizes that keep every minibatch
full, the callback that records training episodes, and a logger that leaves no folder behind.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from autoprec.agents.base import Session, StopSearch

if TYPE_CHECKING:
    from autoprec.agents.result import Trial

MIN_ROLLOUT = 64

# The pool of proposals: {policy key: (best surrogate reward, policy)}, in first-seen order.
Pool = dict[tuple[str, ...], tuple[float, dict[str, str]]]


def rollout_sizes(
    n_layers: int,
    n_envs: int = 1,
    n_steps: int | None = None,
    batch_size: int | None = None,
    normalize_advantage: bool = True,
) -> tuple[int, int]:
    """``(n_steps, batch_size)`` for MaskablePPO on a model of ``n_layers`` tunable layers.

    The default rollout holds whole episodes: ``n_steps`` is the smallest multiple of the
    layer count of at least 64 steps that makes the rollout (``n_steps x n_envs``) even, and
    the minibatch is half the rollout. A given ``n_steps`` gets the largest divisor of the
    rollout up to half of it (the whole rollout when it is prime). Every minibatch is then
    full: a last minibatch of one sample has no standard deviation, and SB3's advantage
    normalisation turns it into NaN (the policy's probabilities with it).

    Raises:
        ValueError: ``n_steps`` below 1, or (with ``normalize_advantage``) a rollout of one
            step or a ``batch_size`` that leaves a minibatch of one sample.
    """
    if n_steps is None:
        n_steps = n_layers * math.ceil(MIN_ROLLOUT / n_layers)
        if n_steps * n_envs % 2:
            n_steps += n_layers  # n_layers is odd here: the rollout becomes even
    elif not isinstance(n_steps, int) or n_steps < 1:
        raise ValueError(f"n_steps must be an integer >= 1 or None, got {n_steps!r}")
    rollout = n_steps * n_envs
    if batch_size is None:
        batch_size = next((d for d in range(rollout // 2, 1, -1) if rollout % d == 0), rollout)
    if normalize_advantage and (batch_size < 2 or rollout % batch_size == 1):
        raise ValueError(
            f"batch_size {batch_size} leaves a minibatch of one sample in a rollout of "
            f"n_steps x n_envs = {rollout} steps, whose normalised advantage is NaN; choose a "
            "batch_size that divides the rollout (or leave it to the agent)"
        )
    return n_steps, batch_size


def callback_class() -> type:
    from stable_baselines3.common.callbacks import BaseCallback

    from autoprec.evaluate.metrics import Metrics

    class Collector(BaseCallback):
        """Records every finished episode as a surrogate trial; stops on StopSearch."""

        def __init__(self, session: Session, pool: Pool) -> None:
            super().__init__()
            self.session = session
            self.pool = pool
            self.stop: StopSearch | None = None

        def _on_step(self) -> bool:
            for info in self.locals.get("infos", ()):
                if "policy" not in info or "metrics" not in info:
                    continue
                metrics = Metrics.from_dict(info["metrics"])
                try:
                    trial = self.session.record_surrogate(
                        info["policy"], metrics, metrics.wall_time_s, phase="train"
                    )
                except StopSearch as exc:
                    self.stop = exc
                    return False
                add_to_pool(self.pool, self.session, trial)
            return True

    return Collector


def add_to_pool(pool: Pool, session: Session, trial: Trial) -> None:
    key = session.key(trial.policy)
    if key not in pool or trial.reward > pool[key][0]:
        pool[key] = (trial.reward, trial.policy)


def logger_without_folder(model: Any) -> None:
    """Without a tensorboard log, SB3 gives every ``learn`` a logger whose folder it makes in
    the temp directory (``SB3-<date>``, empty at verbose 0, never removed): one folder per
    round of every search. A logger of no folder instead, with SB3's table on stdout at
    verbose 1 or more, as before."""
    if model.tensorboard_log is not None:
        return
    import sys

    from stable_baselines3.common.logger import HumanOutputFormat, Logger

    formats = [HumanOutputFormat(sys.stdout)] if model.verbose >= 1 else []
    model.set_logger(Logger(folder=None, output_formats=formats))
