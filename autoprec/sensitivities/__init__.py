"""Per-layer sensitivity: how much each layer's loss moves at each precision.

It sits above the runtime (the sweep runs the model under ``apply_policy``) and the fp32 warm
start of ``autoprec.training.pretrain``, and below the evaluator, whose surrogate it anchors.

- :mod:`.grade`: ``sensitivity(spec, data, formats) -> SensitivityTable``.
- :mod:`.measure`: the passes behind it (the sweep's, the Taylor estimate's).
- :mod:`.budget`: each method's predicted cost, and the choice of one within a time budget.

Names load on first use: ``import autoprec.sensitivities`` does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from autoprec._lazy import lazy_getattr

if TYPE_CHECKING:  # pragma: no cover
    from autoprec.sensitivities.budget import (  # noqa: F401
        DEFAULT_TIME_BUDGET_S,
        METHODS,
        SensitivityPlan,
    )
    from autoprec.sensitivities.grade import (  # noqa: F401
        Sensitivity,
        SensitivityTable,
        sensitivity,
    )

_LAZY = {
    "DEFAULT_TIME_BUDGET_S": "autoprec.sensitivities.budget",
    "METHODS": "autoprec.sensitivities.budget",
    "SensitivityPlan": "autoprec.sensitivities.budget",
    "Sensitivity": "autoprec.sensitivities.grade",
    "SensitivityTable": "autoprec.sensitivities.grade",
    "sensitivity": "autoprec.sensitivities.grade",
}

__all__ = sorted(_LAZY)

__getattr__ = lazy_getattr(globals(), _LAZY)
