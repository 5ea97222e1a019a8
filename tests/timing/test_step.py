"""Whole training steps timed on this CPU as production runs them (issue 37): real kernels,
side by side, the program that ran and a failure as a row's error, never an exception."""

from __future__ import annotations

import math

import pytest
import torch

from autoprec.models import load_model
from autoprec.policy import PrecisionPolicy
from autoprec.timing import StepTiming, time_step, time_steps
from autoprec.timing.step import memory_format_for


@pytest.fixture(scope="module")
def mlp():
    return load_model("mlp")


def test_steps_are_timed_side_by_side_with_the_programs_they_ran(mlp):
    fp32, bf16 = time_steps(mlp, ["fp32", "bf16"], batch_size=16, warmup=1, steps=4)
    for t in (fp32, bf16):
        assert t.ok and t.error is None
        assert len(t.seconds) == 4 and all(s > 0 for s in t.seconds)
        assert min(t.seconds) <= t.step_s <= max(t.seconds)  # their median
        assert t.execution == "eager" and t.memory_format == "contiguous"
        assert t.memory_bytes is None  # the CPU has no resettable peak


def test_the_spec_module_is_not_changed(mlp):
    before = {k: v.clone() for k, v in mlp.module.state_dict().items()}
    time_step(mlp, "bf16", batch_size=8, warmup=1, steps=2)
    after = mlp.module.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert not any(type(m).__name__ == "Float8Linear" for m in mlp.module.modules())


def test_convolutional_models_train_channels_last():
    spec = load_model("tinycnn", num_classes=10)
    assert memory_format_for(spec) == "channels_last"
    assert memory_format_for(load_model("mlp")) == "contiguous"
    t = time_step(spec, "bf16", batch_size=8, warmup=1, steps=2)
    assert t.ok and t.memory_format == "channels_last"


def test_a_policy_that_cannot_run_is_its_rows_error_not_an_exception(mlp):
    bad, good = time_steps(mlp, [{"fc1": "nvfp4"}, "fp32"], batch_size=8, warmup=1, steps=2)
    assert not bad.ok and math.isnan(bad.step_s)
    assert "\n" not in bad.error and "nvfp4" in bad.error
    assert good.ok  # the other rows go on


def test_a_policy_torch_compile_cannot_trace_is_timed_eager_and_says_so(mlp):
    mixed = PrecisionPolicy(default="bf16", layers={"fc1": "fp32"})  # two formats: hooks
    t = time_step(mlp, mixed, batch_size=8, execution="compiled", warmup=1, steps=2)
    assert t.ok and t.execution == "eager" and t.note.startswith("not compilable, timed eager")


@pytest.mark.slow
def test_a_compiled_step_runs_under_torch_compile(mlp):
    t = time_step(mlp, "bf16", batch_size=8, execution="compiled", warmup=2, steps=2)
    assert t.ok and t.execution == "compiled" and t.note is None


def test_unknown_execution_is_one_line(mlp):
    with pytest.raises(ValueError, match="unknown execution 'jit'; expected one of eager"):
        time_step(mlp, "fp32", batch_size=8, execution="jit")


def test_timings_round_trip_through_their_dict(mlp):
    t = time_step(mlp, "fp32", batch_size=8, warmup=1, steps=2)
    assert StepTiming.from_dict(t.to_dict()) == t


def test_a_production_shape_built_on_meta_is_timed_with_seeded_weights():
    with torch.device("meta"):  # as production_spec builds a named shape
        spec = load_model("tinycnn", num_classes=10)
    t = time_step(spec, "bf16", batch_size=4, warmup=1, steps=2)
    assert t.ok, t.error
    from autoprec.timing.step import materialize

    a, b = (materialize(spec.module, "cpu").state_dict() for _ in range(2))
    assert all(torch.equal(a[k], b[k]) for k in a)  # seeded
    assert all(torch.isfinite(v).all() for v in a.values() if v.is_floating_point())


def test_one_at_a_time_times_the_same_programs(mlp):
    both = time_steps(mlp, ["fp32", "bf16"], batch_size=8, warmup=1, steps=3, side_by_side=False)
    assert [t.ok for t in both] == [True, True] and all(len(t.seconds) == 3 for t in both)
