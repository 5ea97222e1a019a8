"""Per-layer output-gradient scaling, checked against torch's own fp16 cast.

A Linear layer fed one example has ``bias.grad == grad_output`` exactly, so the gradient the
layer received after scale -> round -> unscale can be read off and compared bit for bit with
``(g * s).half().float() / s``.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from autoprec.runtime import LossScaler, apply_policy
from autoprec.runtime.layer_scaling import DEFAULT_MARGIN, apply_layer_scaling

FP16_MAX = 65504.0
X = torch.randn(1, 16, generator=torch.Generator().manual_seed(2))


def _layer(seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(16, 64)


def _wide_gradient(seed: int = 1) -> torch.Tensor:
    """64 values, log-uniform in magnitude from 1e-12 to 1e2, random signs: far wider than fp16."""
    gen = torch.Generator().manual_seed(seed)
    mags = torch.logspace(-12, 2, 64)[torch.randperm(64, generator=gen)]
    signs = torch.where(torch.rand(64, generator=gen) < 0.5, -1.0, 1.0)
    return (mags * signs).float()


def _received(layer: nn.Linear, g: torch.Tensor) -> torch.Tensor:
    """The output gradient the layer's backward saw, for an upstream gradient ``g``."""
    layer.zero_grad(set_to_none=True)
    (layer(X) * g).sum().backward()
    return layer.bias.grad.detach().clone()


def _scale_for(amax: float, margin: int = DEFAULT_MARGIN) -> float:
    return 2.0 ** math.floor(math.log2(FP16_MAX / (amax * 2.0**margin)))


def _fp16(t: torch.Tensor) -> torch.Tensor:
    return t.half().float()  # torch's own cast: the oracle


def test_gradient_is_scaled_rounded_and_unscaled_exactly():
    layer, g = _layer(), _wide_gradient()
    handle = apply_policy(layer, "fp16", mode="emulate")
    plain = _received(layer, g)
    assert torch.equal(plain, _fp16(g))  # the runtime's own rounding, underflow included
    assert int((plain == 0).sum()) > 10

    scaling = apply_layer_scaling(handle)
    got = _received(layer, g)
    s = _scale_for(float(g.abs().max()))
    assert scaling.scales() == {"": s}
    assert torch.equal(got, _fp16(g * s) / s)
    assert int((got == 0).sum()) < int((plain == 0).sum())  # the scale rescued small values
    assert torch.isfinite(got).all()
    scaling.remove()
    assert torch.equal(_received(layer, g), plain)  # hooks gone: plain rounding again
    handle.remove()


def test_large_gradients_are_scaled_down_instead_of_overflowing():
    layer = _layer()
    g = torch.linspace(-3e5, 3e5, 64)  # beyond fp16's 65504
    with apply_policy(layer, "fp16", mode="emulate") as handle:
        assert torch.isinf(_received(layer, g)).any()
        with apply_layer_scaling(handle) as scaling:
            got = _received(layer, g)
            s = _scale_for(3e5)
            assert s < 1 and scaling.scales()[""] == s
            assert torch.equal(got, _fp16(g * s) / s)
            assert torch.isfinite(got).all()


def test_scale_is_delayed_and_an_overflow_feeds_the_next_one():
    layer, g = _layer(), _wide_gradient()
    a = float(g.abs().max())
    with apply_policy(layer, "fp16", mode="emulate") as handle:
        with apply_layer_scaling(handle, history_len=4) as scaling:
            _received(layer, g)  # first pass: its own amax
            assert scaling.scales()[""] == _scale_for(a)
            grown = _received(layer, 64 * g)  # delayed: the first scale, beyond the margin
            assert scaling.scales()[""] == _scale_for(a)
            assert torch.isinf(grown).any()
            again = _received(layer, 64 * g)  # the history now holds the larger amax
            assert scaling.scales()[""] == _scale_for(64 * a)
            assert torch.isfinite(again).all()
            for _ in range(4):  # four more passes push the large amaxes out of the history
                _received(layer, g)
            assert scaling.scales()[""] == _scale_for(64 * a)  # that pass still saw one
            _received(layer, g)
            assert scaling.scales()[""] == _scale_for(a)


def test_non_finite_gradients_are_not_recorded():
    layer, g = _layer(), _wide_gradient()
    with apply_policy(layer, "fp16", mode="emulate") as handle:
        with apply_layer_scaling(handle) as scaling:
            _received(layer, g)
            first = scaling.scales()[""]
            poisoned = g.clone()
            poisoned[3] = float("inf")
            _received(layer, poisoned)
            _received(layer, g)
            assert scaling.scales()[""] == first


def test_forward_values_and_other_precisions_are_untouched():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16), nn.Linear(16, 4))
    x = torch.randn(5, 8)
    policy = {"0": "fp16", "2": "bf16", "3": "fp32"}
    with apply_policy(model, policy, mode="emulate") as handle:
        before = model(x)
        with apply_layer_scaling(handle) as scaling:
            assert list(scaling.layers) == ["0"]  # fp16 layers only by default
            out = model(x)
            assert torch.equal(out, before)
            out.sum().backward()
        with apply_layer_scaling(handle, precisions=("fp16", "bf16")) as both:
            assert list(both.layers) == ["0", "2"]


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _train_tiny_gradients(mode: str) -> torch.Tensor:
    """Three SGD steps on a loss scaled by 1e-9 (gradients far below fp16's smallest
    subnormal), with a static unit LossScaler that skips steps with inf/NaN gradients."""
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=1e6)
    handle = None if mode == "fp32" else apply_policy(model, "fp16", mode="emulate")
    scaling = apply_layer_scaling(handle) if mode == "layer" else None
    scaler = LossScaler(kind="static", init_scale=1.0)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(3))
    for _ in range(3):
        opt.zero_grad()
        scaler.scale(model(x).mean() * 1e-9).backward()
        scaler.step(opt)
        scaler.update()
    assert scaler.skipped_steps == 0
    if scaling is not None:
        scaling.remove()
    if handle is not None:
        handle.remove()
    return _flat(model)


def test_training_on_tiny_gradients_matches_fp32_where_plain_fp16_underflows():
    start = _flat(_net())
    fp32 = _train_tiny_gradients("fp32")
    plain = _train_tiny_gradients("fp16")
    layer = _train_tiny_gradients("layer")
    assert torch.equal(plain, start)  # every gradient underflowed: no update at all
    moved = fp32 - start
    assert moved.abs().max() > 1e-3
    # what is left is fp16's rounding of operands and gradients (2**-11 relative each)
    assert torch.allclose(layer - start, moved, rtol=2e-2, atol=1e-3 * float(moved.abs().max()))


def test_state_dict_round_trip_gives_the_same_next_scale():
    layer, g = _layer(), _wide_gradient()
    with apply_policy(layer, "fp16", mode="emulate") as handle:
        with apply_layer_scaling(handle, history_len=3) as scaling:
            for k in (1.0, 8.0, 0.5):
                _received(layer, k * g)
            state = scaling.state_dict()
            _received(layer, g)
            expected = scaling.scales()
    other = _layer()
    with apply_policy(other, "fp16", mode="emulate") as handle:
        with apply_layer_scaling(handle, history_len=3) as scaling:
            scaling.load_state_dict(state)
            _received(other, g)
            assert scaling.scales() == expected
            with pytest.raises(ValueError, match="does not fit"):
                scaling.load_state_dict({"other": state[""]})


def test_refuses_native_removed_and_fp8():
    layer = _layer()
    native = apply_policy(layer, "fp16", mode="native")
    with pytest.raises(ValueError, match="emulate"):
        apply_layer_scaling(native)
    native.remove()
    with pytest.raises(ValueError, match="removed"):
        apply_layer_scaling(native)
    with apply_policy(layer, "fp8", mode="emulate") as handle:
        with pytest.raises(ValueError, match="fp8"):
            apply_layer_scaling(handle, precisions=("fp8",))
        with pytest.raises(ValueError, match="history_len"):
            apply_layer_scaling(handle, history_len=0)


def test_multihead_attention_keeps_its_tuple_output():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(2, 3, 8, requires_grad=True)
    with apply_policy(mha, "fp16", mode="emulate") as handle:
        ref_out, ref_weights = mha(x, x, x)
        with apply_layer_scaling(handle) as scaling:
            out, weights = mha(x, x, x)
            assert torch.equal(out, ref_out) and torch.equal(weights, ref_weights)
            (out * 1e-9).sum().backward()
            assert torch.isfinite(x.grad).all() and (x.grad != 0).any()
            assert scaling.scales()[""] > 1
