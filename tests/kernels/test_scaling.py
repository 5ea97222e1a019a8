from __future__ import annotations

import math

import pytest
import torch

from autoprec.kernels import ScaledCast, get_format, quantize


def test_first_call_scales_by_its_own_amax():
    x = torch.tensor([0.5, -2.0, 1.0])
    cast = ScaledCast("fp8_e4m3")
    out = cast(x)
    assert out.scale.item() == pytest.approx(448.0 / 2.0)
    assert torch.equal(out.data, quantize(x * out.scale, "fp8_e4m3", saturate=True))
    assert cast.overflows == 0 and cast.numel == 3


def test_delayed_scaling_uses_history_max_and_margin():
    cast = ScaledCast("fp8_e4m3", history_len=3, margin=1)
    amaxes = [1.0, 4.0, 2.0, 0.5, 0.25]
    scales = []
    for a in amaxes:
        scales.append(cast(torch.tensor([a, -a / 3])).scale.item())
    # step t uses max(amax[t-3:t]) (its own amax at t=0), with 2**margin head room
    expected = [448 / (2 * 1.0), 448 / (2 * 1.0), 448 / (2 * 4.0), 448 / (2 * 4.0), 448 / (2 * 4.0)]
    assert scales == pytest.approx(expected)
    # after 3 more small steps, the 4.0 has rolled out of the history
    for _ in range(3):
        cast(torch.tensor([0.25]))
    assert cast.compute_scale().item() == pytest.approx(448 / (2 * 0.25))


def test_most_recent_rule_and_power_of_two():
    cast = ScaledCast("fp8_e5m2", amax_rule="most_recent", power_of_two=True)
    cast(torch.tensor([8.0]))
    cast(torch.tensor([3.0]))
    scale = cast.compute_scale().item()
    assert scale == 2.0 ** math.floor(math.log2(57344 / 3.0))


def test_counts_overflows_and_underflows_exactly():
    fmt = get_format("fp8_e4m3")
    cast = ScaledCast(fmt, history_len=4)
    cast(torch.tensor([1.0]))  # scale = 448
    x = torch.tensor([0.5, 1.5, -3.0, 1e-6, -1e-7, 0.0, 2.0**-9 / 448 * 0.75])
    out = cast(x)
    scaled = x * out.scale
    assert cast.overflows == int((scaled.abs() > fmt.max_finite).sum()) == 2
    assert cast.underflows == int(((out.data == 0) & (x != 0)).sum()) == 2
    assert out.data.abs().max().item() == fmt.max_finite  # saturated, not inf/NaN
    assert cast.numel == 8


def test_dequantized_error_is_within_format_precision():
    torch.manual_seed(0)
    x = torch.randn(4096) * 3
    cast = ScaledCast("fp8_e4m3")
    back = cast(x).dequantize()
    big = x.abs() > x.abs().max() * 2.0**-6  # stays in the normal range after scaling
    rel = ((back - x).abs() / x.abs())[big]
    assert rel.max() <= get_format("fp8_e4m3").eps / 2 + 1e-7


def test_fp16_gradients_use_scaling_too():
    cast = ScaledCast("fp16")
    tiny = torch.full((16,), 1e-9)  # all of it underflows in plain fp16
    assert torch.all(quantize(tiny, "fp16") == 0)
    back = cast(tiny).dequantize()
    assert torch.allclose(back, tiny, rtol=1e-3)
    assert cast.underflows == 0


def test_non_finite_or_zero_amax_keeps_previous_scale():
    cast = ScaledCast("fp8_e4m3", history_len=1)
    cast(torch.tensor([2.0]))
    before = cast.compute_scale().item()
    cast(torch.tensor([0.0, 0.0]))
    assert cast.compute_scale().item() == before
    out = cast(torch.tensor([float("inf"), 1.0]))
    assert out.scale.item() == before
    assert cast.compute_scale().item() == before


def test_state_dict_round_trip():
    cast = ScaledCast("fp8_e5m2", history_len=4)
    for a in (1.0, 5.0, 2.0):
        cast(torch.tensor([a, 1e-12]))
    other = ScaledCast("fp8_e5m2", history_len=4)
    other.load_state_dict(cast.state_dict())
    x = torch.randn(32)
    assert torch.equal(cast(x).data, other(x).data)
    assert other.underflows == cast.underflows
    with pytest.raises(ValueError, match="history"):
        ScaledCast("fp8_e5m2", history_len=2).load_state_dict(cast.state_dict())


def test_bad_settings():
    with pytest.raises(ValueError, match="history_len"):
        ScaledCast(history_len=0)
    with pytest.raises(ValueError, match="amax_rule"):
        ScaledCast(amax_rule="mean")
    with pytest.raises(ValueError, match="unknown number format"):
        ScaledCast("int8")
