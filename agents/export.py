"""Policies from layer maps: the one way an agent's ``{layer: precision}`` becomes a policy,
evaluated or exported.

:func:`layer_policy` is what every agent (and ``migrate``) evaluates, so that they share the
evaluator's cache; :func:`export_policy` adds what a policy file carries for production
training (model, target, metrics, provenance).
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING

from autoprec.policy.fields import loss_scaling_for
from autoprec.precision import Precision

if TYPE_CHECKING:  # pragma: no cover
    from torch import nn

    from autoprec.evaluate import Metrics
    from autoprec.policy import PrecisionPolicy, TargetInfo


#: The metrics an exported policy records (with the reward where a search scored it).
POLICY_METRICS = (
    "loss_delta",
    "accuracy_delta",
    "speedup",
    "memory_ratio",
    "speedup_vs_amp",
    "memory_ratio_vs_amp",
)


def layer_policy(assignment: Mapping[str, str]) -> PrecisionPolicy:
    """Default fp32, the layers as given, dynamic loss scaling when a layer is fp16 (see
    :func:`loss_scaling_for`)."""
    from autoprec.policy import PrecisionPolicy

    return PrecisionPolicy(
        default=Precision.FP32, layers=dict(assignment), loss_scaling=loss_scaling_for(assignment)
    )


def policy_metrics(metrics: Metrics) -> dict[str, float]:
    """``{name: value}`` of :data:`POLICY_METRICS` (non-finite values included)."""
    return {key: float(getattr(metrics, key)) for key in POLICY_METRICS}


def export_policy(
    policy: PrecisionPolicy,
    spec_module: nn.Module,
    *,
    target: TargetInfo | None,
    metrics: Mapping[str, float],
    provenance: Mapping[str, str],
    note: str | None = None,
) -> PrecisionPolicy:
    """``policy`` ready to save for production training, stating per layer the backend and
    recipe to run it with (the file's ``run_with`` section).

    Args:
        policy: the evaluated policy (its layers and loss scaling).
        spec_module: the model: a ModelSpec or its ``nn.Module`` (for the ``model`` section:
            name, fingerprint, tunable layer count).
        target: the ``target`` section.
        metrics: recorded where finite (a file holds no NaN).
        provenance: who made it; ``autoprec_version`` and ``created`` follow, then ``note``.
        note: what a user must know before adopting it (e.g. an emulate-mode search).
    """
    from autoprec import __version__
    from autoprec.layers import model_fingerprint, tunable_layers
    from autoprec.policy import ModelInfo

    module = getattr(spec_module, "module", spec_module)
    name = getattr(spec_module, "name", None)
    return policy.replace(
        state_backends=True,
        model=ModelInfo(
            name=name if isinstance(name, str) else None,
            fingerprint=model_fingerprint(module),
            tunable_layers=sum(1 for _ in tunable_layers(module)),
        ),
        target=target,
        metrics={k: float(v) for k, v in metrics.items() if math.isfinite(v)},
        provenance={
            **provenance,
            "autoprec_version": __version__,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            **({"note": note} if note else {}),
        },
    )
