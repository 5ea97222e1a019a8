"""The evaluator: warm start, fp32 reference, cache, divergence, feasibility, determinism."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch

from autoprec.evaluate import (
    Evaluator,
    EvaluatorConfig,
    Metrics,
    ReferenceDivergedError,
    WarmStartError,
)
from autoprec.layers import tunable_layers

SMALL = {"steps": 6, "warm_start_steps": 30}
TARGET = "a100-40gb-sxm"  # no fp8; a GPU name, so costs come from the model on this machine


def _finite(m: Metrics) -> bool:
    values = [v for v in m.to_dict().values() if isinstance(v, (int, float))]
    return all(math.isfinite(v) for v in values)


def test_warm_start_is_trained_once_and_reused(spec, data):
    first = Evaluator(spec, data, TARGET, config=EvaluatorConfig(**SMALL))
    first.reference()
    assert first.warm_start_trained and first.warm_start_path.exists()
    mtime = first.warm_start_path.stat().st_mtime_ns
    second = Evaluator(spec, data, TARGET, config=EvaluatorConfig(**SMALL))
    assert second.warm_start_path == first.warm_start_path
    second.evaluate("bf16")  # a new policy: fine-tunes, so it needs the warm start
    assert second.runs == 1
    assert not second.warm_start_trained
    assert second.warm_start_path.stat().st_mtime_ns == mtime


def test_fp32_is_its_own_reference(spec, data):
    m = Evaluator(spec, data, TARGET, config=EvaluatorConfig(**SMALL)).evaluate("fp32")
    assert m.loss_delta == 0.0 and m.accuracy_delta == 0.0
    assert m.speedup == 1.0 and m.memory_ratio == 1.0
    assert m.loss == m.fp32_loss and m.accuracy == m.fp32_accuracy
    assert not m.diverged and m.feasible and m.steps == SMALL["steps"]


def test_repeated_policy_is_served_from_cache_also_across_instances(spec, data, tmp_path):
    ev = Evaluator(spec, data, TARGET, config=EvaluatorConfig(**SMALL))
    first = ev.evaluate("bf16")
    runs = ev.runs
    assert runs == 2  # fp32 reference + bf16
    assert ev.evaluate("bf16") == first
    every_layer = {name: "bf16" for name, _ in tunable_layers(spec.module)}
    assert ev.evaluate(every_layer) == first  # resolves alike -> same cache entry
    assert ev.runs == runs
    assert (tmp_path / "cache" / "evaluations.sqlite").exists()

    fresh = Evaluator(spec, data, TARGET, config=EvaluatorConfig(**SMALL))
    assert fresh.evaluate("bf16") == first
    assert fresh.runs == 0
    other = Evaluator(
        spec, data, TARGET, config=EvaluatorConfig(steps=SMALL["steps"] + 1, warm_start_steps=30)
    )
    assert other.evaluate("bf16").steps == SMALL["steps"] + 1  # other settings, other key
    assert other.runs == 2


def test_nan_loss_gives_diverged_finite_metrics(spec, data, monkeypatch):
    ev = Evaluator(spec, data, TARGET, config=EvaluatorConfig(**SMALL))
    ref = ev.reference()
    loss = spec.loss
    monkeypatch.setattr(spec, "loss", lambda out, y: loss(out, y) * float("nan"))
    m = ev.evaluate("bf16")
    assert m.diverged and _finite(m)
    assert m.accuracy == 0.0 and m.loss_delta == 10.0
    assert m.loss == pytest.approx(11 * ref.loss)


def test_exception_in_training_is_diverged_not_raised(spec, data, monkeypatch):
    ev = Evaluator(spec, data, TARGET, config=EvaluatorConfig(**SMALL))
    ev.reference()

    def broken(out, y):
        raise RuntimeError("boom")

    monkeypatch.setattr(spec, "loss", broken)
    m = ev.evaluate("fp16")
    assert m.diverged and _finite(m) and m.loss_delta == 10.0


def test_fp8_on_a100_is_infeasible_but_finite_and_modelled(spec, data):
    ev = Evaluator(spec, data, TARGET, config=EvaluatorConfig(**SMALL))
    m = ev.evaluate("fp8")
    assert not m.feasible and _finite(m)
    assert m.source == "model" and m.step_time_s > 0 and m.memory_bytes > 0
    assert ev.evaluate("bf16").feasible


def test_same_policy_in_fresh_evaluators_is_deterministic(spec, data, tmp_path):
    a = Evaluator(
        copy.deepcopy(spec), data, TARGET, cache_dir=tmp_path / "a", config=EvaluatorConfig(**SMALL)
    )
    b = Evaluator(
        copy.deepcopy(spec), data, TARGET, cache_dir=tmp_path / "b", config=EvaluatorConfig(**SMALL)
    )
    ma, mb = a.evaluate("fp16"), b.evaluate("fp16")
    assert a.runs == b.runs == 2
    assert ma.loss == mb.loss and ma.accuracy == mb.accuracy and ma.val_loss == mb.val_loss


def test_fp8_moves_the_loss_more_than_bf16_on_tinycnn(spec, data):
    # Default steps and warm start, init seed 0 (deterministic). Even with scales taken from
    # the current amax (torchao's tensorwise recipe), three mantissa bits move the fine-tune
    # further from fp32's than seven do.
    # fp8 on tinycnn's convolutions is a study of formats (emulate target mode): natively the
    # H100 has no fp8 convolution, so there the same policy is infeasible
    ev = Evaluator(spec, data, "h100-sxm", config=EvaluatorConfig(target_mode="emulate"))
    bf16, fp8 = ev.evaluate("bf16"), ev.evaluate("fp8")
    assert bf16.feasible and fp8.feasible
    assert abs(fp8.loss_delta) > abs(bf16.loss_delta)
    assert abs(bf16.loss_delta) < 0.1
    native = Evaluator(spec, data, "h100-sxm")
    assert native.unrunnable({"conv1": "fp8", "fc1": "fp8"}) == {
        "conv1": "no fp8 convolution kernel (torchao float8 is Linear-only)"
    }
    assert not native.evaluate("fp8").feasible and native.evaluate("bf16").feasible


def test_metrics_round_trip_and_bad_arguments(spec, data):
    ev = Evaluator(spec, data, TARGET, config=EvaluatorConfig(**SMALL))
    m = ev.reference()
    assert Metrics.from_dict(m.to_dict()) == m
    assert dataclasses.replace(m, source="model").source == "model"
    with pytest.raises(ValueError, match="surrogate"):  # the message lists the fidelities
        ev.evaluate("bf16", fidelity="bogus")
    with pytest.raises(TypeError, match="PrecisionPolicy"):
        ev.evaluate(3)
    with pytest.raises(ValueError, match="source"):
        dataclasses.replace(m, source="guess")


def test_cost_comes_from_the_production_shape_not_the_fine_tuning_one(spec, data):
    from autoprec.models import load_model

    small = Evaluator(spec, data, "h100-sxm", config=EvaluatorConfig(**SMALL))
    big_spec = load_model("tinycnn", num_classes=10, image_size=64)
    big = Evaluator(
        spec,
        data,
        "h100-sxm",
        cost_spec=big_spec,
        config=EvaluatorConfig(cost_batch_size=256, **SMALL),
    )
    s, b = small.evaluate("bf16"), big.evaluate("bf16")
    assert s.loss == b.loss  # the same fine-tuning
    assert b.step_time_s > 2 * s.step_time_s and b.memory_bytes > 10 * s.memory_bytes
    with pytest.raises(ValueError, match="cost_batch_size"):
        Evaluator(spec, data, "h100-sxm", config=EvaluatorConfig(cost_batch_size=0))


def test_other_initial_weights_get_their_own_warm_start(spec, data):
    from autoprec.models import load_model

    a = Evaluator(spec, data, TARGET, config=EvaluatorConfig(**SMALL))
    same = Evaluator(copy.deepcopy(spec), data, TARGET, config=EvaluatorConfig(**SMALL))
    other = Evaluator(
        load_model("tinycnn", num_classes=10, seed=7), data, TARGET, config=EvaluatorConfig(**SMALL)
    )
    assert a.warm_start_path == same.warm_start_path != other.warm_start_path
    assert a.settings_key == same.settings_key != other.settings_key


def test_replicates_average_fine_tunes_on_batches_of_their_own(spec, data):
    from autoprec.evaluate.config import REPLICATE_SEED_STRIDE

    # every example scored: a replicate's estimate would share the first one's subset
    small = SMALL | {"score_examples": None}
    single = [
        Evaluator(spec, data, TARGET, config=EvaluatorConfig(batch_seed=s, **small)).evaluate("fp8")
        for s in (0, REPLICATE_SEED_STRIDE)
    ]
    assert single[0].loss != single[1].loss  # another batch order, another score
    both = Evaluator(spec, data, TARGET, config=EvaluatorConfig(replicates=2, **small))
    m = both.evaluate("fp8")
    assert m.loss == pytest.approx((single[0].loss + single[1].loss) / 2, rel=1e-12)
    assert m.accuracy == pytest.approx((single[0].accuracy + single[1].accuracy) / 2)
    # one warm start for every batch order: batch_seed does not retrain it
    assert {
        Evaluator(spec, data, TARGET, config=EvaluatorConfig(batch_seed=7, **SMALL)).warm_start_path
    } == {both.warm_start_path}
    with pytest.raises(ValueError, match="replicates"):
        Evaluator(spec, data, TARGET, config=EvaluatorConfig(replicates=0))


def test_a_calibration_changes_the_cache_key(spec, data):
    """The cost model reads the device's calibration from the cache folder; after
    ``autoprec hardware calibrate`` the evaluation store must not serve speedups priced
    before it (issue 16's bug)."""
    import json

    from autoprec.hardware import get_device
    from autoprec.hardware.calibration import Calibration, calibration_path

    before = Evaluator(spec, data, TARGET, config=EvaluatorConfig(**SMALL))
    device = get_device(TARGET)
    rates = {p: 0.5 for p in device.peak_tflops}
    calibration = Calibration(
        device=device.name,
        torch_device="cuda",
        matmul_size=4096,
        achieved_tflops={p: device.peak_tflops[p] * 0.5 for p in rates},
        bandwidth_gbs=device.memory_bandwidth_gbs * 0.5,
        compute_efficiency=rates,
        bandwidth_efficiency=0.5,
        created="2026-12-01T00:00:00+00:00",
    )
    path = calibration_path(device.name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(calibration.to_dict()))
    try:
        after = Evaluator(spec, data, TARGET, config=EvaluatorConfig(**SMALL))
        assert after._costs.model.efficiency.bandwidth == 0.5
        assert after.settings_key != before.settings_key
        again = Evaluator(spec, data, TARGET, config=EvaluatorConfig(**SMALL))
        assert again.settings_key == after.settings_key  # the key is still deterministic
    finally:
        path.unlink()


def test_the_config_is_the_only_way_in_and_equal_configs_share_a_key(spec, data):
    config = EvaluatorConfig(**SMALL)
    by_config = Evaluator(spec, data, TARGET, config=config)
    again = Evaluator(spec, data, TARGET, config=EvaluatorConfig(**SMALL))
    assert by_config.config == again.config == config
    assert by_config.settings_key == again.settings_key
    assert by_config.evaluate("bf16") == again.evaluate("bf16")
    assert again.runs == 0  # served from the cache the first one filled
    with pytest.raises(TypeError):  # no settings beside the config, no positional fidelity
        Evaluator(spec, data, TARGET, steps=6)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        Evaluator(spec, data, TARGET, "full")  # type: ignore[misc]
    # another setting, another key; the default fidelity is not part of the key
    other = Evaluator(
        spec, data, TARGET, config=dataclasses.replace(config, fidelity="full", momentum=0.5)
    )
    assert other.config == dataclasses.replace(config, fidelity="full", momentum=0.5)
    assert other.settings_key != by_config.settings_key
    full = Evaluator(spec, data, TARGET, config=dataclasses.replace(config, fidelity="full"))
    assert full.settings_key == by_config.settings_key
    # a None and the value it stands for are one setting
    resolved = dataclasses.replace(config, finetune_lr=None, lr=0.01, cost_batch_size=32)
    assert resolved.canonical() == dataclasses.replace(config, lr=0.01).canonical()
    assert by_config.steps == {"short": 6, "full": 30} and by_config.finetune_lr == 0.01
    with pytest.raises(ValueError, match="target_mode"):
        EvaluatorConfig(target_mode="auto")


def test_the_runnability_table_is_part_of_the_key(spec, data):
    ev = Evaluator(spec, data, TARGET, config=EvaluatorConfig(**SMALL))
    identity = ev._cache.identity
    assert set(identity.costs["runnability"]) == {"float8", "rules"}
    changed = {**identity.costs, "runnability": {"float8": True, "rules": "another table"}}
    assert dataclasses.replace(identity, costs=changed).key() != ev.settings_key


def test_a_diverging_reference_is_a_clear_error(spec, data, monkeypatch):
    ev = Evaluator(spec, data, TARGET, config=EvaluatorConfig(**SMALL))
    ev.warm_start_state()  # learnt; the fine-tunes after it diverge
    loss = spec.loss
    monkeypatch.setattr(spec, "loss", lambda out, y: loss(out, y) * float("nan"))
    with pytest.raises(ReferenceDivergedError, match="fp32 reference run diverged") as err:
        ev.evaluate("bf16")
    assert isinstance(err.value, ValueError) and "\n" not in str(err.value)


def test_a_warm_start_that_does_not_learn_is_retried_at_a_lower_rate(spec, data, monkeypatch):
    # tinycnn on digits diverges at lr 5 and 1.25 (30 steps) and learns at 0.3125
    ev = Evaluator(spec, data, TARGET, config=EvaluatorConfig(steps=6, warm_start_steps=30, lr=5.0))
    with pytest.warns(UserWarning, match=r"did not learn at lr 5: .*trained at lr 0.3125"):
        ev.warm_start_state()
    attempts = ev._warm.attempts
    assert [a.lr for a in attempts] == [5.0, 1.25, 0.3125]
    assert [a.learned for a in attempts] == [False, False, True]
    assert attempts[0].diverged and attempts[-1].last_loss < attempts[-1].first_loss
    assert ev._warm.lr_scale == 0.0625 and ev.warm_start_lr == 0.3125
    # the rate is saved with the weights: another evaluator loads both, trains nothing, and
    # fine-tunes at the same fraction of its own rate
    again = Evaluator(
        spec, data, TARGET, config=EvaluatorConfig(steps=6, warm_start_steps=30, lr=5.0)
    )
    rates = []
    sgd = torch.optim.SGD

    def spy(params, lr, **kwargs):
        rates.append(lr)
        return sgd(params, lr=lr, **kwargs)

    monkeypatch.setattr(torch.optim, "SGD", spy)
    again.evaluate("bf16")
    assert not again.warm_start_trained and again._warm.lr_scale == 0.0625
    assert rates and set(rates) == {again.config.resolved_finetune_lr * 0.0625}
    assert "autoprec.warm_start_lr" not in again.warm_start_state()


def test_a_warm_start_that_learns_at_no_rate_is_a_clear_error(spec, data, monkeypatch):
    ev = Evaluator(spec, data, TARGET, config=EvaluatorConfig(**SMALL))
    loss = spec.loss
    monkeypatch.setattr(spec, "loss", lambda out, y: loss(out, y) * float("nan"))
    with pytest.raises(WarmStartError, match="learnt at no learning rate tried") as err:
        ev.warm_start_state()
    assert isinstance(err.value, ValueError) and "\n" not in str(err.value)
    assert not ev.warm_start_path.exists()  # nothing saved


def test_surrogate_episodes_price_fp32_and_amp_once(spec, data):
    ev = Evaluator(spec, data, TARGET, config=EvaluatorConfig(**SMALL))
    ev.evaluate("bf16", fidelity="surrogate")  # builds the table, the reference, the surrogate
    step = ev._costs.model.step
    calls = []

    def counted(*args, **kwargs):
        calls.append(args)
        return step(*args, **kwargs)

    ev._costs.model.step = counted
    for policy in ("fp16", {"conv1": "bf16"}, "tf32"):
        ev.evaluate(policy, fidelity="surrogate")
    assert len(calls) == 3  # the policy's own estimate only
