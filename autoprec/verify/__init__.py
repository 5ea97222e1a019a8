"""``autoprec verify``: a policy and the reference arms trained from scratch, side by side.

- :mod:`.run`: ``verify``, ``VerifyConfig``, ``run_arm`` (one arm, one seed).
- :mod:`.results`: ``RunResult``, ``ArmResult``, ``VerifyResult`` (per arm mean and sd, the
  deltas to fp32, the verdict).
- :mod:`.store`: each finished (arm, seed) run kept in the cache, so a rerun resumes.
"""

from __future__ import annotations

from autoprec.verify.results import VerifyResult
from autoprec.verify.run import (
    DEFAULT_ARMS,
    WARM_START_LR,
    VerifyConfig,
    VerifyError,
    run_arm,
    verify,
)

__all__ = [
    "DEFAULT_ARMS",
    "WARM_START_LR",
    "VerifyConfig",
    "VerifyError",
    "VerifyResult",
    "run_arm",
    "verify",
]
