"""Gymnasium environments of autoprec (see DESIGN.md, "Environment").

Importing this package registers ``autoprec/PrecisionSearch-v0`` (once; importing it again
does nothing):

    >>> import gymnasium
    >>> import autoprec.envs
    >>> env = gymnasium.make("autoprec/PrecisionSearch-v0", model="tinycnn")  # doctest: +SKIP
"""

from __future__ import annotations

import gymnasium

from autoprec.envs.precision_env import DEFAULT_REWARD_WEIGHTS, PrecisionEnv, reward

ENV_ID = "autoprec/PrecisionSearch-v0"


def _register() -> None:
    if ENV_ID in gymnasium.registry:
        return
    gymnasium.register(
        id=ENV_ID,
        entry_point="autoprec.envs.precision_env:PrecisionEnv",
        # The evaluator's measured step times (on a local GPU) vary from run to run.
        nondeterministic=True,
    )


_register()

__all__ = ["DEFAULT_REWARD_WEIGHTS", "ENV_ID", "PrecisionEnv", "reward"]
