"""The surrogate fidelity: sensitivity features, default prediction, refit, evaluator wiring."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest

from autoprec.evaluate import Evaluator
from autoprec.evaluate.surrogate import DEFAULT_WEIGHTS, Surrogate
from autoprec.graph.grade import SensitivityTable

SMALL = {"steps": 6, "warm_start_steps": 30}
TARGET = "a100-40gb-sxm"


def _table() -> SensitivityTable:
    """Two layers; fp8 hurts "b" most, one entry is non-finite (a layer that diverged alone)."""
    precisions = ("fp32", "bf16", "fp16", "fp8")
    loss = ((0.0, 0.001, -0.0005, 0.01), (0.0, -0.002, 0.001, math.inf))
    cosine = ((1.0, 0.9999, 0.99995, 0.99), (1.0, 0.9998, 0.9999, 0.95))
    return SensitivityTable(
        "sweep", "toy", "fp", "data", ("a", "b"), precisions, loss, cosine, 1.0, 0.0, {}
    )


def test_default_prediction_sums_sensitivity_magnitudes():
    s = Surrogate(_table())
    assert s.predict({"a": "fp32", "b": "fp32"}) == 0.0
    assert s.predict({}) == 0.0  # missing layers are fp32
    assert s.predict({"a": "bf16", "b": "bf16"}) == pytest.approx(0.003)
    assert s.predict({"a": "fp8"}) == pytest.approx(0.01)
    assert s.predict({"b": "fp8"}) == pytest.approx(10.0)  # non-finite entry -> 10
    f = s.features({"a": "fp8", "b": "fp16", "zzz": "fp8"})  # unknown layer ignored
    np.testing.assert_allclose(f, [0.01 + 0.0001, 0.011, 0.5, 0.5, 1.0])
    assert set(s.explain({"a": "fp8"})) >= {"abs_loss_delta", "lowered"}


def test_fit_reduces_error_and_resets_without_pairs():
    s = Surrogate(_table())
    pairs = [
        ({"a": "bf16"}, 0.004),
        ({"a": "fp8"}, 0.03),
        ({"a": "fp16", "b": "fp16"}, 0.006),
        ({"a": "fp8", "b": "bf16"}, 0.05),
        ({"b": "bf16"}, math.nan),  # skipped
    ]
    usable = pairs[:4]

    def sq_error():
        return sum((s.predict(p) - y) ** 2 for p, y in usable)

    before = sq_error()
    s.fit(pairs)
    assert s.n_fitted == 4
    assert sq_error() < 0.5 * before
    assert s.predict({}) == 0.0  # fp32 stays exactly 0 whatever the weights
    s.fit([])
    np.testing.assert_array_equal(s.weights, DEFAULT_WEIGHTS)
    with pytest.raises(ValueError, match="ridge"):
        Surrogate(_table(), ridge=-1)


def test_surrogate_fidelity_is_fast_finite_ordered_and_not_stored(spec, data):
    ev = Evaluator(spec, data, TARGET, **SMALL)
    first = ev.evaluate("bf16", fidelity="surrogate")  # fp32 short reference + sensitivities
    runs = ev.runs
    start = time.perf_counter()
    again = ev.evaluate("bf16", fidelity="surrogate")
    elapsed = time.perf_counter() - start
    assert elapsed < 0.05, elapsed
    assert again.loss_delta == first.loss_delta
    assert ev.runs == runs  # no training for a surrogate evaluation
    for m in (first, again):
        values = [v for v in m.to_dict().values() if isinstance(v, (int, float))]
        assert all(math.isfinite(v) for v in values)
        assert m.fidelity == "surrogate" and m.steps == 0 and not m.diverged
        assert m.source == "model" and m.accuracy == m.fp32_accuracy
    reference = ev.reference("surrogate")
    assert reference == ev.reference("short")
    assert first.loss == pytest.approx(reference.loss * (1 + first.loss_delta))
    real_cost = ev.evaluate("bf16")  # costs as for real runs (cost model on this target)
    assert first.speedup == pytest.approx(real_cost.speedup)
    assert first.memory_ratio == pytest.approx(real_cost.memory_ratio)

    fp8 = ev.evaluate("fp8", fidelity="surrogate")
    fp32 = ev.evaluate("fp32", fidelity="surrogate")
    fresh = Evaluator(spec, data, TARGET, **SMALL)  # ordering of the default (unfitted) model
    default = {p: fresh.evaluate(p, fidelity="surrogate").loss_delta for p in ("fp8", "bf16")}
    assert default["fp8"] > default["bf16"] > 0.0
    assert fp32.loss_delta == 0.0 and fp8.loss_delta > 0.0
    assert not fp8.feasible  # no fp8 on an A100: flagged as for real runs
    assert ev._store.get(ev._key(ev._as_policy("fp8"), "surrogate")) is None  # not cached


def test_refit_on_real_evaluations_moves_predictions_towards_them(spec, data):
    ev = Evaluator(spec, data, TARGET, **SMALL)
    policies = ["bf16", "fp8", {"conv1": "fp8"}, {"fc2": "fp8", "fc1": "bf16"}]
    before = [ev.evaluate(p, fidelity="surrogate").loss_delta for p in policies]
    assert ev.surrogate().n_fitted == 0
    observed = [ev.evaluate(p, fidelity="short").loss_delta for p in policies]
    assert len(ev.surrogate_pairs) == len(policies) and ev.surrogate().n_fitted == len(policies)
    after = [ev.evaluate(p, fidelity="surrogate").loss_delta for p in policies]

    def sq_error(pred):
        return sum((a - b) ** 2 for a, b in zip(pred, observed, strict=True))

    assert sq_error(after) < sq_error(before)
    ev.evaluate("bf16", fidelity="short")  # a cache hit is not a new pair
    assert len(ev.surrogate_pairs) == len(policies)

    # pairs made before the surrogate exists are used when it is built
    other = Evaluator(spec, data, TARGET, **SMALL)
    other.evaluate("bf16")
    assert other.surrogate().n_fitted == 1


def test_unknown_fidelity_raises_a_clear_error(spec, data):
    ev = Evaluator(spec, data, TARGET, **SMALL)
    with pytest.raises(ValueError, match="unknown fidelity 'medium'.*surrogate"):
        ev.evaluate("bf16", fidelity="medium")
    with pytest.raises(ValueError, match="unknown fidelity"):
        Evaluator(spec, data, TARGET, fidelity="fast")
