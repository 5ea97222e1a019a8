"""A sensitivity-based predictor of a policy's ``loss_delta``: the ``surrogate`` fidelity.

A policy is reduced to five features computed from a per-layer
:class:`~autoprec.graph.grade.SensitivityTable` (every feature is 0 for uniform fp32):

0. ``grad_distance``: sum over layers of ``1 - gradient cosine`` at the layer's precision;
1. ``abs_loss_delta``: sum over layers of ``|loss_delta|`` at the layer's precision (a
   non-finite entry, a layer that diverged on its own, counts as 10);
2. ``fp8_fraction``: share of the table's layers in fp8;
3. ``fp16_fraction``: share of the table's layers in fp16;
4. ``lowered``: 1 if any layer is below fp32, else 0 (the bias term; it is 0 for fp32 so that
   uniform fp32, the reference itself, always predicts exactly 0).

The prediction is ``weights . features``. Before any :meth:`Surrogate.fit` the weights are
:data:`DEFAULT_WEIGHTS`: ``loss_delta ~= 1 x (sum of the layers' |loss_delta| sensitivities)``,
i.e. one-layer loss changes are assumed to add up. :meth:`Surrogate.fit` refits the weights on
real evaluations by ridge least squares on RMS-scaled features, shrunk towards the default
weights (not towards 0), so a handful of observations corrects the default without wild
extrapolation, and the in-sample squared error never exceeds the default's.

Example:
    >>> s = Surrogate(table)  # doctest: +SKIP
    >>> s.predict({"conv1": "fp8", "fc1": "bf16"})  # doctest: +SKIP
    0.0052
    >>> s.fit([({"conv1": "fp8"}, 0.01)])  # doctest: +SKIP
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from autoprec.precision import Precision, parse_precision

FEATURES = ("grad_distance", "abs_loss_delta", "fp8_fraction", "fp16_fraction", "lowered")
DEFAULT_WEIGHTS = np.array([0.0, 1.0, 0.0, 0.0, 0.0])
NONFINITE_LOSS_DELTA = 10.0  # |loss_delta| given to a table entry that is inf or nan


class Surrogate:
    """Linear predictor of ``loss_delta`` from a sensitivity table.

    Args:
        table: a SensitivityTable (``layers``, ``precisions``, ``matrix(...)``).
        ridge: strength of the pull towards :data:`DEFAULT_WEIGHTS` in :meth:`fit` (on
            features scaled to unit RMS over the fitted pairs).

    Attributes:
        weights: current weights, one per name in :data:`FEATURES`.
        n_fitted: how many pairs the last :meth:`fit` used (0: default weights).
    """

    def __init__(self, table: Any, *, ridge: float = 1e-2) -> None:
        if ridge < 0:
            raise ValueError(f"ridge must be >= 0, got {ridge!r}")
        self.table = table
        self.ridge = float(ridge)
        self.layers = tuple(table.layers)
        dist = table.matrix("grad_distance")
        loss = table.matrix("loss_delta")
        # layer -> precision value -> (grad distance, |loss delta|), sanitised to be finite
        self._lookup: dict[str, dict[str, tuple[float, float]]] = {}
        for i, layer in enumerate(self.layers):
            row: dict[str, tuple[float, float]] = {}
            for j, p in enumerate(table.precisions):
                d, ld = dist[i][j], abs(loss[i][j])
                d = d if math.isfinite(d) else 2.0
                ld = ld if math.isfinite(ld) else NONFINITE_LOSS_DELTA
                row[str(parse_precision(p).value)] = (d, ld)
            self._lookup[layer] = row
        self.weights = DEFAULT_WEIGHTS.copy()
        self.n_fitted = 0

    def features(self, precisions: Mapping[str, Any]) -> np.ndarray:
        """Feature vector (see :data:`FEATURES`) of ``{layer: precision}``.

        Layers missing from ``precisions`` count as fp32; layers not in the table are ignored.
        A precision the table did not grade contributes 0 sensitivity (its counts still apply).
        """
        n = max(len(self.layers), 1)
        dist = loss = 0.0
        fp8 = fp16 = 0
        lowered = 0.0
        for layer, value in precisions.items():
            row = self._lookup.get(layer)
            if row is None:
                continue
            p = parse_precision(value)
            if p is Precision.FP32:
                continue
            lowered = 1.0
            fp8 += p is Precision.FP8
            fp16 += p is Precision.FP16
            d, ld = row.get(p.value, (0.0, 0.0))
            dist += d
            loss += ld
        return np.array([dist, loss, fp8 / n, fp16 / n, lowered])

    def predict(self, precisions: Mapping[str, Any]) -> float:
        """Predicted ``loss_delta`` (relative loss change vs fp32) of ``{layer: precision}``."""
        return float(self.weights @ self.features(precisions))

    def fit(self, pairs: Iterable[tuple[Mapping[str, Any], float]]) -> np.ndarray:
        """Refit the weights on ``(precisions, observed loss_delta)`` pairs; returns them.

        Non-finite observations are skipped (pass only runs that did not diverge). With no
        usable pair the weights go back to :data:`DEFAULT_WEIGHTS`.
        """
        rows, ys = [], []
        for precisions, observed in pairs:
            if observed is None or not math.isfinite(observed):
                continue
            rows.append(self.features(precisions))
            ys.append(float(observed))
        if not rows:
            self.weights, self.n_fitted = DEFAULT_WEIGHTS.copy(), 0
            return self.weights
        x, y = np.stack(rows), np.array(ys)
        self.weights = _ridge_towards(x, y, DEFAULT_WEIGHTS, self.ridge)
        self.n_fitted = len(ys)
        return self.weights

    def explain(self, precisions: Mapping[str, Any]) -> dict[str, float]:
        """Each feature's contribution (``weight x value``) to :meth:`predict`."""
        return dict(zip(FEATURES, (self.weights * self.features(precisions)).tolist(), strict=True))


def _ridge_towards(x: np.ndarray, y: np.ndarray, prior: Sequence[float], lam: float) -> np.ndarray:
    """argmin_w ``|x w - y|^2 + lam |S (w - prior)|^2``, S = the columns' RMS (1 if zero).

    Solved in the scaled space ``x' = x / S`` (so ``lam`` means the same whatever the units),
    with a least-squares solve so that rank-deficient problems (few pairs) stay well defined.
    """
    scale = np.sqrt(np.mean(x**2, axis=0))
    scale = np.where(scale > 1e-12, scale, 1.0)
    xs = x / scale
    prior_s = np.asarray(prior, dtype=float) * scale
    k = xs.shape[1]
    a = np.vstack([xs, math.sqrt(lam) * np.eye(k)])
    b = np.concatenate([y, math.sqrt(lam) * prior_s])
    w_s, *_ = np.linalg.lstsq(a, b, rcond=None)
    return w_s / scale
