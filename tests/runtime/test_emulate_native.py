"""Emulate mode against the native programs it stands for: torchao's Float8Linear (tensorwise,
dynamic scaling) for fp8 and torch.autocast for bf16, on this CPU.

Native code is the oracle: torchao's own module on a copy of the layer, torch's own autocast.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from autoprec.kernels import DynamicScaledCast, amax_to_scale, quantize
from autoprec.precision import Precision
from autoprec.runtime import apply_policy
from autoprec.runtime.casting import LayerCasts

float8 = pytest.importorskip("torchao.float8")


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want|."""
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


def _bf16_ulp(t: torch.Tensor) -> torch.Tensor:
    """Spacing of the bf16 grid at each value of ``t`` (normal range)."""
    return torch.exp2(torch.floor(torch.log2(t.float().abs().clamp_min(2.0**-126))) - 7)


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("power_of_two", [False, True])
def test_dynamic_scaled_cast_is_torchaos_cast_bit_for_bit(fmt, power_of_two):
    from torchao.float8.float8_utils import amax_to_scale as ao_amax_to_scale
    from torchao.float8.float8_utils import to_fp8_saturated

    dtype = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[fmt]
    gen = torch.Generator().manual_seed(0)
    for x in (torch.randn(257, generator=gen) * 3, torch.randn(64, generator=gen) * 1e-6):
        amax = x.abs().max()
        want_scale = ao_amax_to_scale(amax, dtype, round_scales_to_power_of_2=power_of_two)
        assert torch.equal(amax_to_scale(amax, fmt, power_of_two), want_scale)
        got = DynamicScaledCast(fmt, power_of_two=power_of_two)(x)
        assert torch.equal(got.data, to_fp8_saturated(x * want_scale, dtype).float())
    zero = DynamicScaledCast(fmt)(torch.zeros(4))  # amax clamped to 1e-12: a finite scale
    assert torch.isfinite(zero.scale) and torch.equal(zero.dequantize(), torch.zeros(4))


def test_dynamic_scaled_cast_counts_what_it_loses():
    cast = DynamicScaledCast("fp8_e4m3")
    cast(torch.tensor([448.0, 1.0, 1e-7, 0.0]))  # 1e-7 is 2**-32 of the amax: flushed
    assert (cast.overflows, cast.underflows) == (0, 1)
    cast(torch.tensor([float("inf"), 1.0]))  # an inf takes the whole tensor with it
    assert (cast.overflows, cast.underflows) == (1, 2)


def _fp8_pair(seed: int = 0, bias: bool = True) -> tuple[nn.Sequential, nn.Sequential]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 32, bias=bias))
    ref = float8.convert_to_float8_training(copy.deepcopy(model))  # default: tensorwise
    assert type(ref[0]).__name__ == "Float8Linear"
    return model, ref


def _step(model: nn.Module, x: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, ...]:
    x = x.clone().requires_grad_()
    model.zero_grad(set_to_none=True)
    out = model(x)
    out.backward(g)
    return out.detach(), x.grad, model[0].weight.grad.clone()


def test_fp8_linear_matches_torchaos_float8_linear():
    """Output, input gradient and weight gradient of an emulated fp8 Linear equal torchao's
    Float8Linear on the same inputs to 1e-6 relative (max |diff| / max |value|).

    Measured on this CPU: 0.0 for all three (bit for bit): emulation casts exactly as torchao
    (same scale, same saturating cast), dequantises by multiplying with ``scale.reciprocal()``,
    which is what torchao hands ``torch._scaled_mm``, and CPU ``_scaled_mm`` multiplies the
    dequantised fp32 operands in the same fp32 GEMM. Dividing by the scale instead gave 3e-7
    (output), 2e-7 and 9e-8 (gradients); a GPU fp8 GEMM accumulates in another order, which
    the 1e-6 bound leaves room for.

    The bias gradient too: as torchao, the runtime adds an fp8 layer's bias after the fp8 GEMM,
    so its gradient sums the unrounded output gradient (when the bias went through the layer,
    the e5m2-rounded gradient made it differ by 5% relative here).
    """
    model, ref = _fp8_pair()
    torch.manual_seed(1)
    x, g = torch.randn(16, 64) * 3, torch.randn(16, 32)
    want = _step(ref, x, g)
    with apply_policy(model, {"0": "fp8"}, mode="emulate"):
        got = _step(model, x, g)
    for name, a, b in zip(("output", "grad_input", "grad_weight"), got, want, strict=True):
        assert a.dtype == b.dtype == torch.float32
        assert _rel(a, b) <= 1e-6, name
    assert _rel(model[0].bias.grad, ref[0].bias.grad) <= 1e-6


def test_fp8_training_keeps_no_history():
    """Several SGD steps with inputs and gradients whose range jumps by 2**10 from step to step:
    delayed scaling would saturate or flush after each jump, current scaling follows it, and
    the emulated run stays with torchao's, step after step, its bias included."""
    model, ref = _fp8_pair(seed=3)
    opts = [torch.optim.SGD(m.parameters(), lr=0.01) for m in (model, ref)]
    gen = torch.Generator().manual_seed(4)
    with apply_policy(model, {"0": "fp8"}, mode="emulate") as handle:
        for step, k in enumerate((0, 10, -10, 5)):
            x = torch.randn(8, 64, generator=gen) * 2.0**k
            g = torch.randn(8, 32, generator=gen) * 2.0 ** (-k)
            results = []
            for m, opt in zip((model, ref), opts, strict=True):
                results.append(_step(m, x, g))
                opt.step()
            for a, b in zip(*results, strict=True):
                assert _rel(a, b) <= 1e-6, step
            assert _rel(model[0].weight.detach(), ref[0].weight.detach()) <= 1e-6
        assert handle.stats()["0"].overflows == 0


def test_bf16_linear_matches_autocast():
    """A bias-free bf16 Linear under emulation gives autocast's output (stored in bf16) and
    gradients bit for bit: operands, output and the backward GEMMs' results are rounded where
    autocast rounds them, and the GEMMs accumulate in fp32 as its CPU kernels do."""
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(64, 32, bias=False))
    ref = copy.deepcopy(model)
    x, g = torch.randn(16, 64), torch.randn(16, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = _step(ref, x, g)
    assert want[0].dtype == torch.bfloat16  # autocast stores the output in bf16
    with apply_policy(model, {"0": "bf16"}, mode="emulate"):
        got = _step(model, x, g)
    assert got[0].dtype == torch.float32
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b.float())


def test_bf16_bias_is_exact_when_passed_through_and_within_its_rounding_when_not():
    """Autocast rounds the bias to bf16 before adding it. Through ``forward_operand(bias,
    "bias")`` the emulated layer matches bit for bit, bias gradient included; through the
    runtime's hooks, which leave the bias in fp32, each output is within one bf16 step of
    autocast's plus half a bf16 step of the bias (up to 24 output steps measured where the
    output is near zero)."""
    torch.manual_seed(6)
    layer = nn.Linear(64, 32)
    x, g = torch.randn(16, 64), torch.randn(16, 32)
    ref = copy.deepcopy(layer)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = ref(x)
    want.backward(g.bfloat16())

    casts = LayerCasts(Precision.BF16)
    weight, bias = (
        casts.forward_operand(p, s) for p, s in ((layer.weight, "weight"), (layer.bias, "bias"))
    )
    out = casts.backward_gradient(F.linear(casts.forward_operand(x, "input"), weight, bias))
    out.backward(g)
    assert torch.equal(out.detach(), want.float())
    assert torch.equal(layer.weight.grad, ref.weight.grad)
    assert torch.equal(layer.bias.grad, ref.bias.grad)

    with apply_policy(layer, {"": "bf16"}, mode="emulate"):
        hooked = layer(x).detach()
    bound = _bf16_ulp(want.detach()) + _bf16_ulp(layer.bias.detach()) / 2
    assert ((hooked - want.detach().float()).abs() <= bound).all()


def test_in_place_relu_after_an_emulated_bf16_conv_trains():
    """The bf16 conv's output is rounded by a function returning a fresh tensor (not a view),
    so ReLU(inplace=True) may modify it; training runs and equals the out-of-place model."""

    def net(inplace: bool) -> nn.Module:
        torch.manual_seed(7)
        return nn.Sequential(
            nn.Conv2d(3, 8, 3), nn.ReLU(inplace=inplace), nn.Flatten(), nn.Linear(128, 5)
        )

    x, y = torch.randn(8, 3, 6, 6), torch.randint(0, 5, (8,))
    runs = []
    for inplace in (False, True):
        model = net(inplace)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        with apply_policy(model, {"0": "bf16"}, mode="emulate"):
            for _ in range(5):
                opt.zero_grad()
                h = model[1](model[0](x))
                assert torch.equal(h, quantize(h, "bf16"))  # stored in bf16
                loss = F.cross_entropy(model[3](model[2](h)), y)
                loss.backward()
                opt.step()
                losses.append(loss.item())
        runs.append((losses, [p.detach().clone() for p in model.parameters()]))
    (losses_a, params_a), (losses_b, params_b) = runs
    assert losses_b == losses_a and losses_b[-1] < losses_b[0]
    assert all(torch.equal(a, b) for a, b in zip(params_a, params_b, strict=True))
