"""Gymnasium environments of autoprec (see docs/architecture.md).

Importing this package registers ``autoprec/PrecisionSearch-v0`` (once; importing it again
does nothing), built by name by :func:`~autoprec.envs.factory.make_env_by_name` (the keyword
form of :func:`~autoprec.envs.factory.make_env`, which takes a workload and the evaluator's and
reward's configs):

    >>> import gymnasium
    >>> import autoprec.envs
    >>> env = gymnasium.make("autoprec/PrecisionSearch-v0", model="tinycnn")  # doctest: +SKIP
"""

from __future__ import annotations

import gymnasium

from autoprec.envs.factory import make_env, make_env_by_name
from autoprec.envs.precision_env import PrecisionEnv
from autoprec.evaluate.reward import reward

ENV_ID = "autoprec/PrecisionSearch-v0"


def _register() -> None:
    if ENV_ID in gymnasium.registry:
        return
    gymnasium.register(
        id=ENV_ID,
        entry_point="autoprec.envs.factory:make_env_by_name",
        # The evaluator's measured step times (on a local GPU) vary from run to run.
        nondeterministic=True,
    )


_register()

__all__ = ["ENV_ID", "PrecisionEnv", "make_env", "make_env_by_name", "reward"]
