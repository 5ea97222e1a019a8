"""The per-layer observation features of :class:`~autoprec.envs.PrecisionEnv`, in ``[0, 1]``.

Computed once per environment from the layer table and the sensitivity table; the cost so far
(the last two entries of an observation) is the environment's own, since it moves each step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from autoprec.precision import Precision

if TYPE_CHECKING:  # pragma: no cover
    from autoprec.graph.table import LayerRow
    from autoprec.sensitivities.grade import SensitivityTable

STATIC_FEATURES = (
    "log_forward_flops",
    "log_backward_flops",
    "log_params",
    "log_input_bytes",
    "log_weight_bytes",
    "log_output_bytes",
    "position",
    "is_conv",
    "is_linear",
    "is_attention",
    "is_first",
    "is_last",
)


def static_features(rows: Sequence[LayerRow]) -> np.ndarray:
    """[layer][feature] in the order of :data:`STATIC_FEATURES`.

    ``log`` features are ``log1p(x) / log1p(max over layers)``, so that a layer reads as its
    size relative to the model's largest, whatever the model.
    """

    def log_scaled(values: list[float]) -> np.ndarray:
        logs = np.log1p(np.maximum(np.asarray(values, dtype=np.float64), 0.0))
        top = logs.max()
        return logs / top if top > 0 else np.zeros_like(logs)

    columns = [
        log_scaled([r.forward_flops for r in rows]),
        log_scaled([r.backward_flops for r in rows]),
        log_scaled([r.params for r in rows]),
        log_scaled([r.input_bytes for r in rows]),
        log_scaled([r.weight_bytes for r in rows]),
        log_scaled([r.output_bytes for r in rows]),
        np.array([r.position for r in rows], dtype=np.float64),
        np.array([float("conv" in r.type.lower()) for r in rows]),
        np.array([float("linear" in r.type.lower()) for r in rows]),
        np.array([float("attention" in r.type.lower()) for r in rows]),
        np.array([float(r.first) for r in rows]),
        np.array([float(r.last) for r in rows]),
    ]
    features = np.stack(columns, axis=1)
    return np.clip(np.nan_to_num(features, nan=0.0), 0.0, 1.0).astype(np.float32)


def sensitivity_features(
    table: SensitivityTable, layers: Sequence[str], precisions: Sequence[Precision]
) -> np.ndarray:
    """[layer][action] gradient distance (1 - cosine) at that precision, log-scaled jointly.

    ``log1p(d) / log1p(max d over every layer and precision)``, so that both layers and
    precisions compare; fp32, a pair the table did not grade and a non-finite entry (the layer
    diverged alone: worst) are 0, 0 and 1.
    """
    raw = np.zeros((len(layers), len(precisions)), dtype=np.float64)
    worst = np.zeros_like(raw, dtype=bool)
    for i, layer in enumerate(layers):
        for k, p in enumerate(precisions):
            entry = None if p is Precision.FP32 else table.entry(layer, p)
            if entry is None:
                continue
            d = entry.grad_distance
            if math.isfinite(d):
                raw[i, k] = max(d, 0.0)
            else:
                worst[i, k] = True
    logs = np.log1p(raw)
    top = logs.max()
    scaled = logs / top if top > 0 else np.zeros_like(logs)
    scaled[worst] = 1.0
    return np.clip(scaled, 0.0, 1.0).astype(np.float32)
