"""Policy files and the one reading of a policy.

- :mod:`.fields`: the field checks and the sections (``PolicyError``, ``LossScalingConfig``,
  ``TargetInfo``, ``ModelInfo``, ...).
- :mod:`.verification`: the ``verification`` section (``VerificationInfo``, ``ArmSummary``).
- :mod:`.precision_policy`: ``PrecisionPolicy`` (frozen; ``coerce`` is the one reading of a
  policy, a precision name or a ``{name or re:pattern: precision}`` map), ``resolve_mode``.
- :mod:`.io`: ``load_policy`` and ``save_policy``.
"""

from __future__ import annotations

from autoprec.policy.fields import (
    LOSS_SCALING_KINDS,
    PATTERN_PREFIX,
    TARGET_MODES,
    LossScalingConfig,
    ModelInfo,
    PolicyError,
    TargetInfo,
)
from autoprec.policy.precision_policy import (
    PolicyMismatchError,
    PolicyReport,
    PrecisionPolicy,
    policy_from_data,
    resolve_mode,
)
from autoprec.policy.verification import ArmSummary, VerificationInfo

__all__ = [
    "LOSS_SCALING_KINDS",
    "PATTERN_PREFIX",
    "TARGET_MODES",
    "ArmSummary",
    "LossScalingConfig",
    "ModelInfo",
    "PolicyError",
    "PolicyMismatchError",
    "PolicyReport",
    "PrecisionPolicy",
    "TargetInfo",
    "VerificationInfo",
    "policy_from_data",
    "resolve_mode",
]
