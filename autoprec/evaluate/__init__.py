"""Policy evaluation: fine-tune from a cached fp32 warm start, score against fp32, cost.

The evaluator loads on first use, so that the torch-free parts (the reward, the config, the
metrics) import without torch.

Example:
    >>> from autoprec.evaluate import Evaluator  # doctest: +SKIP
    >>> Evaluator(spec, data, target="h100-sxm").evaluate("bf16").loss_delta  # doctest: +SKIP
    0.0013
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from autoprec._lazy import lazy_getattr
from autoprec.evaluate.config import EvaluatorConfig
from autoprec.evaluate.metrics import Metrics
from autoprec.evaluate.reward import RewardConfig

if TYPE_CHECKING:  # pragma: no cover
    from autoprec.evaluate.evaluator import Evaluator
    from autoprec.evaluate.scoring import ReferenceDivergedError
    from autoprec.evaluate.warm_start import WarmStartError

_LAZY = {  # these import torch
    "Evaluator": "autoprec.evaluate.evaluator",
    "ReferenceDivergedError": "autoprec.evaluate.scoring",
    "WarmStartError": "autoprec.evaluate.warm_start",
}

__all__ = [
    "Evaluator",
    "EvaluatorConfig",
    "Metrics",
    "ReferenceDivergedError",
    "RewardConfig",
    "WarmStartError",
]


__getattr__ = lazy_getattr(globals(), _LAZY)
