"""LossScaler: checked step by step against torch.amp.GradScaler and a pure-Python oracle."""

from __future__ import annotations

import copy
import dataclasses
import itertools
import math
from types import SimpleNamespace

import pytest
import torch

from autoprec.kernels import fake_quantize
from autoprec.runtime.loss_scaler import LossScaler, ScaleRecord


def _model_and_opt(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _train_step(scaler, model, opt, x, poison: str | None, unscale_first: bool) -> bool:
    """One scaled iteration; returns whether the parameters changed."""
    opt.zero_grad()
    scaler.scale(model(x).pow(2).mean()).backward()
    if poison is not None:  # what an overflowing fp16 gradient looks like in fp32
        model[2].weight.grad[0, 1] = float(poison)
    before = _params(model)
    if unscale_first:
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
    scaler.step(opt)
    scaler.update()
    return not all(torch.equal(a, b) for a, b in zip(before, _params(model), strict=True))


# step -> poison; growth_interval 3 makes growth happen between the overflows
SCHEDULE = {0: "inf", 1: "nan", 5: "inf", 9: "-inf", 10: "nan", 17: "inf", 25: "nan"}
N_STEPS = 30


def _oracle_scales(init, growth, backoff, interval, overflows, n):
    """GradScaler's update rule in plain Python: the scale in effect at each step."""
    scale, tracker, out = init, 0, []
    for i in range(n):
        out.append(scale)
        if i in overflows:
            scale, tracker = scale * backoff, 0
        else:
            tracker += 1
            if tracker == interval:
                scale, tracker = scale * growth, 0
    return out, scale


def test_matches_torch_gradscaler_step_by_step():
    kw = dict(init_scale=2.0**10, growth_factor=2.0, backoff_factor=0.5, growth_interval=3)
    ref = torch.amp.GradScaler("cpu", **kw)
    ours = LossScaler(**kw)
    model_a, opt_a = _model_and_opt()
    model_b = copy.deepcopy(model_a)
    opt_b = torch.optim.SGD(model_b.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(1)

    scales_ref, scales_ours, stepped_ref, stepped_ours = [], [], [], []
    for i in range(N_STEPS):
        x = torch.randn(5, 3, generator=gen)
        unscale_first = i % 4 == 3
        scales_ref.append(ref.get_scale())
        scales_ours.append(ours.get_scale())
        stepped_ref.append(_train_step(ref, model_a, opt_a, x, SCHEDULE.get(i), unscale_first))
        stepped_ours.append(_train_step(ours, model_b, opt_b, x, SCHEDULE.get(i), unscale_first))

    expected, final = _oracle_scales(2.0**10, 2.0, 0.5, 3, set(SCHEDULE), N_STEPS)
    assert scales_ours == scales_ref == expected
    assert ours.get_scale() == ref.get_scale() == final
    assert ours.get_growth_tracker() == ref._get_growth_tracker()
    assert stepped_ours == stepped_ref == [i not in SCHEDULE for i in range(N_STEPS)]
    for a, b in zip(model_a.parameters(), model_b.parameters(), strict=True):
        assert torch.equal(a, b)
    assert all(torch.isfinite(p).all() for p in model_b.parameters())
    # the schedule exercises both growth and backoff
    assert any(b > a for a, b in itertools.pairwise(expected))
    assert any(b < a for a, b in itertools.pairwise(expected))

    assert ours.history == [ScaleRecord(i, expected[i], i in SCHEDULE) for i in range(N_STEPS)]
    assert ours.skipped_steps == ours.overflow_steps == len(SCHEDULE)
    assert ours.summary() == {
        "kind": "dynamic",
        "enabled": True,
        "init_scale": 2.0**10,
        "final_scale": final,
        "min_scale": min([*expected, final]),
        "updates": N_STEPS,
        "skipped_steps": len(SCHEDULE),
        "overflow_steps": len(SCHEDULE),
    }


def test_static_keeps_scale_and_skips_nonfinite_steps():
    scaler = LossScaler(init_scale=256.0, growth_interval=1, kind="static")
    model, opt = _model_and_opt()
    x = torch.ones(2, 3)
    changed = [_train_step(scaler, model, opt, x, SCHEDULE.get(i), False) for i in range(6)]
    assert changed == [False, False, True, True, True, False]
    assert [r.scale for r in scaler.history] == [256.0] * 6
    assert scaler.get_scale() == 256.0
    assert scaler.get_growth_tracker() == 0
    assert scaler.skipped_steps == 3
    # an explicit new scale is still honoured
    scaler.scale(torch.ones(()))
    scaler.update(new_scale=64.0)
    assert scaler.get_scale() == 64.0


@pytest.mark.parametrize("kw", [{"enabled": False}, {"kind": "none"}])
def test_disabled_is_a_pass_through(kw):
    scaler = LossScaler(**kw)
    assert not scaler.is_enabled()
    model, opt = _model_and_opt()
    loss = model(torch.ones(2, 3)).sum()
    assert scaler.scale(loss) is loss
    loss.backward()
    model[2].weight.grad[0, 0] = float("inf")
    before = _params(model)
    scaler.step(opt)  # steps even with an inf: nothing checks when disabled
    scaler.update()
    assert not torch.isfinite(model[2].weight).all()
    assert not torch.equal(before[0], model[0].weight)
    assert scaler.get_scale() == 1.0
    assert scaler.state_dict() == {}
    assert scaler.history == [] and scaler.skipped_steps == 0
    assert scaler.summary()["enabled"] is False


def test_step_returns_optimizer_value_or_none_when_skipped():
    scaler = LossScaler(init_scale=8.0)
    param = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([param], lr=0.1)
    opt.step = lambda *a, **k: ("stepped", a, k)  # type: ignore[method-assign]
    scaler.scale(param.sum()).backward()
    assert scaler.step(opt, 1, flag=True) == ("stepped", (1,), {"flag": True})
    scaler.update()
    opt.zero_grad()
    scaler.scale(param.sum()).backward()
    param.grad[0] = float("nan")
    assert scaler.step(opt) is None
    scaler.update()
    assert scaler.get_scale() == 4.0
    with pytest.raises(RuntimeError, match="[Cc]losure"):
        scaler.step(opt, closure=lambda: 0.0)


def test_scale_nested_outputs():
    scaler = LossScaler(init_scale=4.0)
    a, b, c = torch.tensor(1.0), torch.tensor([2.0, 3.0]), torch.tensor(-0.5)
    out = scaler.scale([a, (b, c)])
    assert isinstance(out, list) and isinstance(out[1], tuple)
    assert out[0].item() == 4.0
    assert out[1][0].tolist() == [8.0, 12.0]
    assert out[1][1].item() == -2.0


def test_lazy_and_explicit_device():
    lazy = LossScaler(init_scale=16.0)
    assert lazy.device is None
    assert lazy.get_scale() == 16.0  # readable before the first scale()
    lazy.scale(torch.ones(()))
    assert lazy.device == torch.device("cpu")
    explicit = LossScaler(device="cpu")
    assert explicit.device == torch.device("cpu")
    explicit.scale(torch.ones(()))
    assert explicit._scale.device == torch.device("cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_lazy_device_follows_cuda_tensor():
    scaler = LossScaler(init_scale=2.0**20)
    model = torch.nn.Linear(3, 1).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.scale(model(torch.ones(2, 3, device="cuda")).sum()).backward()
    assert scaler.device.type == "cuda"
    model.weight.grad[0, 0] = float("inf")
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 2.0**19 and scaler.skipped_steps == 1


def test_unscale_twice_raises():
    scaler = LossScaler()
    model, opt = _model_and_opt()
    scaler.scale(model(torch.ones(1, 3)).sum()).backward()
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="already been called"):
        scaler.unscale_(opt)


def test_update_without_step_raises():
    scaler = LossScaler()
    scaler.scale(torch.ones(()))
    with pytest.raises(RuntimeError, match="step"):
        scaler.update()


def test_state_dict_round_trip_and_torch_interop():
    scaler = LossScaler(init_scale=2.0**6, growth_interval=3)
    model, opt = _model_and_opt()
    for i in range(5):  # overflow at 0 and 1, then three good steps (growth), then one more
        _train_step(scaler, model, opt, torch.ones(2, 3), SCHEDULE.get(i), False)
    assert scaler.get_scale() == 2.0**5
    assert scaler.get_growth_tracker() == 0
    _train_step(scaler, model, opt, torch.ones(2, 3), None, False)
    state = scaler.state_dict()
    assert state["scale"] == 2.0**5 and state["_growth_tracker"] == 1
    assert state["kind"] == "dynamic" and state["updates"] == 6 and state["skipped_steps"] == 2

    restored = LossScaler(init_scale=1.0, growth_interval=100)
    restored.load_state_dict(state)
    assert restored.get_scale() == 2.0**5
    assert restored.get_growth_tracker() == 1
    assert restored.get_growth_interval() == 3
    assert restored.summary()["updates"] == 6 and restored.skipped_steps == 2
    # after a scale() the restored tensors carry on from the checkpoint
    restored.scale(torch.ones(()))
    assert restored.get_scale() == 2.0**5 and restored.get_growth_tracker() == 1

    ref = torch.amp.GradScaler("cpu")
    ref.load_state_dict(state)
    assert ref.get_scale() == 2.0**5 and ref._get_growth_tracker() == 1
    from_torch = LossScaler()
    from_torch.load_state_dict(ref.state_dict())
    assert from_torch.get_scale() == 2.0**5 and from_torch.get_growth_tracker() == 1


@dataclasses.dataclass(frozen=True)
class _Cfg:
    kind: str = "dynamic"
    init_scale: float = 32768.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000


def test_from_config():
    scaler = LossScaler.from_config(_Cfg(init_scale=1024.0, growth_interval=7, backoff_factor=0.25))
    assert scaler.kind == "dynamic" and scaler.is_enabled()
    assert scaler.get_scale() == 1024.0
    assert scaler.get_growth_interval() == 7
    assert scaler.get_backoff_factor() == 0.25
    assert scaler.get_growth_factor() == 2.0

    static = LossScaler.from_config(SimpleNamespace(kind="static", init_scale=8.0))
    assert static.kind == "static" and static.get_scale() == 8.0
    assert static.get_growth_interval() == 2000  # missing attribute -> default

    assert LossScaler.from_config({"kind": "dynamic", "init_scale": 4.0}).get_scale() == 4.0
    assert not LossScaler.from_config(_Cfg(kind="none")).is_enabled()
    disabled = LossScaler.from_config(None)
    assert not disabled.is_enabled() and disabled.kind == "none"
    with pytest.raises(ValueError, match="unknown loss scaling keys"):
        LossScaler.from_config({"init_scal": 4.0})
    with pytest.raises(ValueError, match="kind"):
        LossScaler.from_config(_Cfg(kind="adaptive"))


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"init_scale": 0.0}, "init_scale"),
        ({"init_scale": -1.0}, "init_scale"),
        ({"init_scale": math.inf}, "init_scale"),
        ({"init_scale": math.nan}, "init_scale"),
        ({"init_scale": "big"}, "init_scale"),
        ({"growth_factor": 0.5}, "growth_factor"),
        ({"backoff_factor": 0.0}, "backoff_factor"),
        ({"backoff_factor": 1.5}, "backoff_factor"),
        ({"growth_interval": 0}, "growth_interval"),
        ({"growth_interval": 2.5}, "growth_interval"),
        ({"growth_interval": True}, "growth_interval"),
        ({"kind": "adaptive"}, "expected one of dynamic, static, none"),
        ({"device": "not-a-device"}, "invalid device"),
        ({"device": 3.0}, "device"),
        ({"max_history": 0}, "max_history"),
    ],
)
def test_bad_arguments_raise_value_error(kw, match):
    with pytest.raises(ValueError, match=match):
        LossScaler(**kw)


def test_setters_validate_and_apply():
    scaler = LossScaler()
    scaler.set_growth_factor(4.0)
    scaler.set_backoff_factor(0.25)
    scaler.set_growth_interval(10)
    assert (scaler.get_growth_factor(), scaler.get_backoff_factor()) == (4.0, 0.25)
    assert scaler.get_growth_interval() == 10
    with pytest.raises(ValueError, match="backoff_factor"):
        scaler.set_backoff_factor(2.0)
    with pytest.raises(ValueError, match="growth_interval"):
        scaler.set_growth_interval(-1)


def test_history_is_bounded():
    scaler = LossScaler(init_scale=2.0**10, growth_interval=1000, max_history=5)
    param = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([param], lr=0.0)
    for _ in range(8):
        opt.zero_grad()
        scaler.scale(param.sum()).backward()
        param.grad[0] = float("inf")
        scaler.step(opt)
        scaler.update()
    assert [r.step for r in scaler.history] == [3, 4, 5, 6, 7]
    assert [r.scale for r in scaler.history] == [2.0 ** (10 - i) for i in range(3, 8)]
    assert all(r.skipped for r in scaler.history)
    summary = scaler.summary()
    assert summary["updates"] == 8 and summary["overflow_steps"] == 8
    assert summary["final_scale"] == summary["min_scale"] == 2.0**2  # beyond the kept history


def test_emulated_fp16_gradient_overflow_backs_off_then_trains():
    """Gradients rounded to fp16 in backward overflow to inf until the scale fits in fp16."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = LossScaler(init_scale=2.0**40, growth_interval=1000)
    x = torch.tensor([[0.5, -1.0, 2.0, 0.25], [1.0, 1.0, -0.5, 0.75]])

    changed = []
    for _ in range(28):
        opt.zero_grad()
        # d(loss)/d(out) is the scale; fp16 holds it only once it is <= 65504 (2**15)
        out = fake_quantize(model(x), None, "fp16")
        before = _params(model)
        scaler.scale(out.sum()).backward()
        scaler.step(opt)
        scaler.update()
        changed.append(
            not all(torch.equal(a, b) for a, b in zip(before, _params(model), strict=True))
        )

    overflowing = 40 - 15  # scales 2**40 ... 2**16 overflow fp16
    assert changed == [False] * overflowing + [True] * (28 - overflowing)
    assert [r.scale for r in scaler.history[: overflowing + 1]] == [
        2.0 ** (40 - i) for i in range(overflowing + 1)
    ]
    assert scaler.get_scale() == 2.0**15
    assert scaler.skipped_steps == overflowing
    assert all(torch.isfinite(p).all() for p in model.parameters())
    # the successful steps applied the true (unscaled) gradient: x summed over the batch
    torch.manual_seed(0)
    reference = torch.nn.Linear(4, 1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=1e-3)
    for _ in range(28 - overflowing):
        ref_opt.zero_grad()
        reference(x).sum().backward()
        ref_opt.step()
    torch.testing.assert_close(model.weight, reference.weight, rtol=0, atol=1e-6)
    torch.testing.assert_close(model.bias, reference.bias, rtol=0, atol=1e-6)


def test_from_policy_reads_the_loss_scaling_section():
    from autoprec.policy import LossScalingConfig, PrecisionPolicy

    with_scaling = PrecisionPolicy(
        default="fp16", loss_scaling=LossScalingConfig(kind="static", init_scale=256.0)
    )
    scaler = LossScaler.from_policy(with_scaling)
    assert scaler.kind == "static" and scaler.get_scale() == 256.0
    plain = LossScaler.from_policy(PrecisionPolicy(default="bf16"))
    assert not plain.is_enabled()


@pytest.mark.parametrize("scale", [1e-300, 1e-39, 1e300, 4e38])
def test_a_scale_a_float32_cannot_hold_is_refused(scale):
    """Below float32's smallest normal number the scale rounds to 0 (or its reciprocal to inf):
    unscaling then made zero gradients NaN after the inf/NaN check had passed them."""
    with pytest.raises(ValueError, match=r"init_scale must be in \[1\.18e-38, 3\.4e\+38\]"):
        LossScaler(init_scale=scale)


def test_backing_off_never_takes_the_scale_to_zero_nor_the_weights_to_nan():
    from autoprec.runtime.loss_scaler import SCALE_RANGE

    low = SCALE_RANGE[0]
    layer = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    scaler = LossScaler(init_scale=low, backoff_factor=0.5)
    for loss in (float("inf"), float("inf"), 0.0):  # two overflows, then a zero gradient
        optimizer.zero_grad()
        scaler.scale(layer(torch.ones(1, 2)).sum() * loss).backward()
        scaler.step(optimizer)
        scaler.update()
        assert scaler.get_scale() == pytest.approx(low)
    assert all(p.isfinite().all() for p in layer.parameters())
    # a checkpoint of a scale of 0 (an older autoprec's) loads at the floor
    scaler.load_state_dict({**scaler.state_dict(), "scale": 0.0})
    assert scaler.get_scale() == pytest.approx(low)
