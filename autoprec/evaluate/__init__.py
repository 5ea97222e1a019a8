"""Policy evaluation: fine-tune from a cached fp32 warm start, score against fp32, cost.

Example:
    >>> from autoprec.evaluate import Evaluator  # doctest: +SKIP
    >>> Evaluator(spec, data, target="h100-sxm").evaluate("bf16").loss_delta  # doctest: +SKIP
    0.0013
"""

from __future__ import annotations

from autoprec.evaluate.evaluator import Evaluator
from autoprec.evaluate.metrics import Metrics

__all__ = ["Evaluator", "Metrics"]
