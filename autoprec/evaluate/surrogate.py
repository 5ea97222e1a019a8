"""A predictor of a policy's ``loss_delta`` from per-layer sensitivities: the ``surrogate``
fidelity.

The model is additive over layers, the structure the real evaluations have (on resnet18 with
the default task, which layers run in fp8 explains most of the differences between random
policies; docs/benchmarks.md, "Policy evaluator"):

    loss_delta(policy) = sum_p a[p] * share_p(policy) + sum_l b[l, policy[l]]

with ``share_p`` the share of the table's layers at precision ``p``, one shared term ``a[p]``
per precision and one term ``b[l, p]`` per layer and precision (fp32 terms are 0, so uniform
fp32, the reference itself, always predicts exactly 0). It is a Bayesian linear regression:

- prior means from a :class:`~autoprec.sensitivities.grade.SensitivityTable` ``s[l, p]`` (the signed
  one-layer loss change; a non-finite entry, a layer that diverged on its own, counts as 10):
  ``a[p] = sum_l s[l, p]`` (the uniform policy at ``p`` is predicted as the sum of its
  one-layer changes) and ``b[l, p] = 0``. The table's per-layer deviations are not used as
  means: on resnet18 they did not rank the per-layer terms that real evaluations reveal, and
  using them made the refit surrogate worse (docs/benchmarks.md). The exception is a fragile
  layer: a *measured* (swept) layer whose one-layer change stands out of its column's mean by
  more than :data:`FRAGILE_RATIO` times the column's RMS starts with that excess as its own
  term (and ``a[p]`` without it, so that the uniform policy's prediction is unchanged). On
  llama-small under nvfp4 that is the output head (+0.0048 alone, against +0.0003 for a
  block's layer), the layer the published rules keep out of 4-bit; spread evenly over the
  layers, its share was invisible to the search;
- prior standard deviations: ``b[l, p]`` has ``tau[p]``, the RMS of the table's column ``p``,
  so precisions whose one-layer effects are tiny (tf32, fp16) keep per-layer terms near 0 and
  precisions with large effects (fp8) are learnt layer by layer from real evaluations;
  ``a[p]`` is broad (:data:`SHARED_PRIOR_RATIO` times the largest ``tau``);
- observation noise ``noise_ratio`` times the largest ``tau``.

:meth:`Surrogate.fit` sets the weights to the posterior mean given real evaluations (the
evaluator refits on every one), so a handful of observations corrects the shared terms and
more of them the layers that matter.

Example:
    >>> s = Surrogate(table)  # doctest: +SKIP
    >>> s.predict({"conv1": "fp8", "fc1": "bf16"})  # doctest: +SKIP
    0.0052
    >>> s.fit([({"conv1": "fp8"}, 0.01)])  # doctest: +SKIP
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from autoprec.precision import Precision, parse_precision

if TYPE_CHECKING:
    from autoprec.sensitivities.grade import Sensitivity, SensitivityTable

NONFINITE_LOSS_DELTA = 10.0  # loss delta given to a table entry that is inf or nan
SHARED_PRIOR_RATIO = 30.0  # prior sd of a[p] / largest tau
# Observation noise sd / largest tau. The measurements are deterministic: the "noise" is what an
# additive model cannot follow, and with fewer real evaluations than terms a larger value
# (more shrinkage) predicts better. Chosen from (0.1, 0.2, 1/3, 0.5, 1, 2) by leave-one-out
# rank correlation on the 30 training policies of experiments/bench_evaluator.py (resnet18,
# teacher, 10 steps; a one-off check, 1.0 best of the six), never on its held-out ones.
DEFAULT_NOISE_RATIO = 1.0
# A swept layer whose one-layer loss change exceeds its precision column's mean by more than this
# many times the column's RMS keeps the excess as its prior mean (module docstring).
FRAGILE_RATIO = 3.0
TAU_FLOOR = 1e-9


def _prior_change(entry: Sensitivity | None) -> float:
    """The one-layer loss change the prior starts from: :data:`NONFINITE_LOSS_DELTA` for a
    layer that diverged on its own, 0 for a pair the table did not grade."""
    if entry is None:
        return 0.0
    return entry.loss_delta if math.isfinite(entry.loss_delta) else NONFINITE_LOSS_DELTA


def _fragile(s: np.ndarray, tau: np.ndarray, swept: list[bool]) -> np.ndarray:
    """Per-layer prior means (layers x precisions): the excess of a swept layer's one-layer
    change over its column's mean where it exceeds :data:`FRAGILE_RATIO` times ``tau``, else 0."""
    if not len(s):
        return np.zeros_like(s)
    excess = s - s.mean(axis=0)
    stands_out = (excess > FRAGILE_RATIO * tau) & np.array(swept, dtype=bool)[:, None]
    return np.where(stands_out, excess, 0.0)


class Surrogate:
    """Additive Bayesian predictor of ``loss_delta`` (see the module docstring).

    Args:
        table: a SensitivityTable (``layers``, ``precisions``, ``entry(layer, precision)``).
        noise_ratio: observation noise relative to the largest per-layer prior scale; larger
            trusts the sensitivity prior more and the real evaluations less.

    Attributes:
        precisions: the non-fp32 precisions of the table, the order of the shared terms.
        weights: the current weights: ``len(precisions)`` shared terms, then ``layers x
            precisions`` per-layer terms (row-major by layer).
        prior: the prior means (the weights before any fit).
        n_fitted: how many pairs the last :meth:`fit` used (0: the prior).
    """

    def __init__(
        self, table: SensitivityTable, *, noise_ratio: float = DEFAULT_NOISE_RATIO
    ) -> None:
        if not noise_ratio > 0:
            raise ValueError(f"noise_ratio must be > 0, got {noise_ratio!r}")
        self.table = table
        self.noise_ratio = float(noise_ratio)
        self.layers = tuple(table.layers)
        self._layer_index = {name: i for i, name in enumerate(self.layers)}
        self._share = 1.0 / max(len(self.layers), 1)  # a layer's share of the table
        graded = [parse_precision(p) for p in table.precisions]
        self.precisions = tuple(p for p in graded if p is not Precision.FP32)
        self._precision_index = {p: j for j, p in enumerate(self.precisions)}
        n_layers, n_prec = len(self.layers), len(self.precisions)
        s = np.array(
            [
                [_prior_change(table.entry(layer, p)) for p in self.precisions]
                for layer in self.layers
            ],
            dtype=float,
        ).reshape(n_layers, n_prec)
        rms = np.sqrt(np.mean(s**2, axis=0)) if n_layers else np.zeros(n_prec)
        tau = np.maximum(rms, TAU_FLOOR)
        own = _fragile(s, tau, [table.is_measured(layer) for layer in self.layers])
        self.prior = np.concatenate([s.sum(axis=0) - own.sum(axis=0), own.ravel()])
        largest = float(tau.max()) if n_prec else 1.0
        self._prior_sd = np.concatenate(
            [np.full(n_prec, SHARED_PRIOR_RATIO * largest), np.tile(tau, n_layers)]
        )
        self._noise_sd = self.noise_ratio * largest
        self.weights = self.prior.copy()
        self.n_fitted = 0

    def features(self, precisions: Mapping[str, Any]) -> np.ndarray:
        """The feature vector of ``{layer: precision}`` (shares, then per-layer indicators).

        Layers missing from ``precisions`` count as fp32; layers not in the table are ignored,
        and so are precisions the table did not grade.
        """
        x = np.zeros(len(self.precisions) * (1 + len(self.layers)))
        for _, j, own in self._terms(precisions):
            x[j] += self._share
            x[own] = 1.0
        return x

    def predict(self, precisions: Mapping[str, Any]) -> float:
        """Predicted ``loss_delta`` (relative loss change vs fp32) of ``{layer: precision}``."""
        return float(self.weights @ self.features(precisions))

    def fit(self, pairs: Iterable[tuple[Mapping[str, Any], float]]) -> np.ndarray:
        """Posterior-mean weights given ``(precisions, observed loss_delta)`` pairs.

        Non-finite observations are skipped (pass only runs that did not diverge). With no
        usable pair the weights go back to the prior. Returns the weights.
        """
        rows, ys = [], []
        for precisions, observed in pairs:
            if observed is None or not math.isfinite(observed):
                continue
            rows.append(self.features(precisions))
            ys.append(float(observed))
        if not rows:
            self.weights, self.n_fitted = self.prior.copy(), 0
            return self.weights
        x, y = np.stack(rows), np.array(ys)
        # MAP of y ~ N(x w, noise^2), w ~ N(prior, diag(sd^2)), in the residual form
        # w = prior + D x^T (x D x^T + noise^2 I)^-1 (y - x prior): one solve of size n pairs
        d = self._prior_sd**2
        gram = (x * d) @ x.T + self._noise_sd**2 * np.eye(len(y))
        residual = y - x @ self.prior
        self.weights = self.prior + d * (x.T @ np.linalg.solve(gram, residual))
        self.n_fitted = len(ys)
        return self.weights

    def explain(self, precisions: Mapping[str, Any]) -> dict[str, float]:
        """Each layer's contribution to :meth:`predict` (its share of the shared terms plus its
        own term), by layer name; fp32 and unknown layers contribute nothing."""
        return {
            layer: float(self._share * self.weights[j] + self.weights[own])
            for layer, j, own in self._terms(precisions)
        }

    def _terms(self, precisions: Mapping[str, Any]) -> Iterator[tuple[str, int, int]]:
        """``(layer, shared-term index, own-term index)`` of each lowered layer the table
        knows, at a precision it graded (an fp8 recipe it did not grade counts as tensorwise
        fp8, as :meth:`SensitivityTable.entry` reads it)."""
        n_prec = len(self.precisions)
        for layer, value in precisions.items():
            i = self._layer_index.get(layer)
            p = parse_precision(value)
            j = self._precision_index.get(p)
            if j is None and p.is_fp8:  # a recipe the table did not grade: tensorwise's terms
                j = self._precision_index.get(Precision.FP8)
            if i is not None and j is not None:
                yield layer, j, n_prec + i * n_prec + j
