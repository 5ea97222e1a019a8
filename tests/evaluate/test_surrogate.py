"""The surrogate fidelity: sensitivity features, default prediction, refit, evaluator wiring."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest

from autoprec.evaluate import Evaluator, EvaluatorConfig
from autoprec.evaluate.surrogate import SHARED_PRIOR_RATIO, Surrogate
from autoprec.policy import PrecisionPolicy
from autoprec.sensitivities.grade import SensitivityTable

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


def test_prior_prediction_spreads_each_precisions_summed_sensitivity_over_its_layers():
    s = Surrogate(_table())
    assert s.predict({"a": "fp32", "b": "fp32"}) == 0.0
    assert s.predict({}) == 0.0  # missing layers are fp32
    # uniform policies: the sum of the one-layer changes (signed)
    assert s.predict({"a": "bf16", "b": "bf16"}) == pytest.approx(0.001 - 0.002)
    assert s.predict({"a": "fp16", "b": "fp16"}) == pytest.approx(-0.0005 + 0.001)
    assert s.predict({"a": "fp8", "b": "fp8"}) == pytest.approx(0.01 + 10.0)  # inf -> 10
    # mixed: each precision's sum times the share of layers at it (no per-layer prior)
    assert s.predict({"a": "fp8"}) == pytest.approx(0.5 * 10.01)
    assert s.predict({"a": "fp8", "b": "bf16"}) == pytest.approx(0.5 * 10.01 + 0.5 * -0.001)
    f = s.features({"a": "fp8", "b": "fp16", "zzz": "fp8"})  # unknown layer ignored
    # shares (bf16, fp16, fp8), then indicators of layer a, then of layer b
    np.testing.assert_array_equal(f, [0, 0.5, 0.5, 0, 0, 1, 0, 1, 0])
    assert s.explain({"a": "fp8", "b": "fp32"}) == {"a": pytest.approx(0.5 * 10.01)}


def test_fit_is_the_bayesian_posterior_mean():
    s = Surrogate(_table(), noise_ratio=0.5)
    pairs = [
        ({"a": "bf16"}, 0.004),
        ({"a": "fp8"}, 0.03),
        ({"a": "fp16", "b": "fp16"}, 0.006),
        ({"a": "fp8", "b": "bf16"}, 0.05),
        ({"b": "bf16"}, math.nan),  # skipped
    ]
    usable = pairs[:4]
    w = s.fit(pairs)
    assert s.n_fitted == 4
    # oracle: the normal equations (x'x/noise^2 + D^-1) w = x'y/noise^2 + D^-1 prior
    x = np.stack([s.features(p) for p, _ in usable])
    y = np.array([v for _, v in usable])
    tau = np.sqrt(np.mean(np.array([[0.001, -0.0005, 0.01], [-0.002, 0.001, 10.0]]) ** 2, 0))
    sd = np.concatenate([np.full(3, SHARED_PRIOR_RATIO * tau.max()), np.tile(tau, 2)])
    noise = 0.5 * tau.max()
    lhs = x.T @ x / noise**2 + np.diag(1 / sd**2)
    rhs = x.T @ y / noise**2 + s.prior / sd**2
    np.testing.assert_allclose(w, np.linalg.solve(lhs, rhs), rtol=1e-6, atol=1e-9)
    before = Surrogate(_table(), noise_ratio=0.5)
    err = [sum((m.predict(p) - v) ** 2 for p, v in usable) for m in (before, s)]
    assert err[1] < 0.1 * err[0]
    assert s.predict({}) == 0.0  # fp32 stays exactly 0 whatever the weights
    s.fit([])
    np.testing.assert_array_equal(s.weights, s.prior)
    with pytest.raises(ValueError, match="noise_ratio"):
        Surrogate(_table(), noise_ratio=0)


def test_many_observations_learn_which_layer_hurts():
    """Per-layer terms: with enough pairs, the surrogate ranks policies by the layer that
    matters even though the prior knows nothing per layer."""
    layers = tuple(f"l{i}" for i in range(6))
    table = SensitivityTable(
        "sweep",
        "toy",
        "fp",
        "data",
        layers,
        ("fp32", "fp8"),
        tuple((0.0, 0.01) for _ in layers),
        tuple((1.0, 0.99) for _ in layers),
        1.0,
        0.0,
        {},
    )
    rng = np.random.default_rng(0)
    truth = np.array([0.0, 0.05, 0.0, 0.0, 0.02, 0.0])  # l1 and l4 hurt in fp8
    policies = [{n: ("fp8" if rng.random() < 0.5 else "fp32") for n in layers} for _ in range(40)]
    observed = [sum(truth[i] for i, n in enumerate(layers) if p[n] == "fp8") for p in policies]
    s = Surrogate(table)
    s.fit(zip(policies[:25], observed[:25], strict=True))
    held_out = [s.predict(p) for p in policies[25:]]
    from scipy.stats import spearmanr

    assert spearmanr(held_out, observed[25:]).statistic > 0.9
    assert s.predict({"l1": "fp8"}) > s.predict({"l0": "fp8"})


def test_surrogate_fidelity_is_fast_finite_ordered_and_not_stored(spec, data):
    ev = Evaluator(spec, data, TARGET, config=EvaluatorConfig(**SMALL))
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
    fresh = Evaluator(
        spec, data, TARGET, config=EvaluatorConfig(**SMALL)
    )  # the unfitted model: summed sensitivities
    table = fresh.surrogate().table
    for p in ("fp8", "bf16"):
        column = table.matrix("loss_delta")
        summed = sum(row[table.precisions.index(p)] for row in column)
        predicted = fresh.evaluate(p, fidelity="surrogate").loss_delta
        assert predicted == pytest.approx(min(max(summed, -0.99), 9.0))
    assert fp32.loss_delta == 0.0
    assert not fp8.feasible  # no fp8 on an A100: flagged as for real runs
    fp8_policy = PrecisionPolicy.coerce("fp8")
    assert ev._cache.store.get(ev._cache.key(fp8_policy, "surrogate")) is None  # not cached


def test_refit_on_real_evaluations_moves_predictions_towards_them(spec, data):
    ev = Evaluator(spec, data, TARGET, config=EvaluatorConfig(**SMALL))
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
    other = Evaluator(spec, data, TARGET, config=EvaluatorConfig(**SMALL))
    other.evaluate("bf16")
    assert other.surrogate().n_fitted == 1


def test_unknown_fidelity_raises_a_clear_error(spec, data):
    ev = Evaluator(spec, data, TARGET, config=EvaluatorConfig(**SMALL))
    with pytest.raises(ValueError, match="unknown fidelity 'medium'.*surrogate"):
        ev.evaluate("bf16", fidelity="medium")
    with pytest.raises(ValueError, match="unknown fidelity"):
        Evaluator(spec, data, TARGET, config=EvaluatorConfig(fidelity="fast"))
