from __future__ import annotations

import pytest
import torch

from autoprec.kernels import ScaledCast, fake_quantize, quantize


def test_forward_and_backward_use_their_own_formats():
    torch.manual_seed(0)
    x = torch.randn(1000, requires_grad=True)
    upstream = torch.randn(1000) * 1e-3
    y = fake_quantize(x, "bf16", "fp8_e5m2")
    assert torch.equal(y, quantize(x.detach(), "bf16"))
    y.backward(upstream)
    assert torch.equal(x.grad, quantize(upstream, "fp8_e5m2"))
    assert not torch.equal(x.grad, upstream)  # rounding really happened


@pytest.mark.parametrize("side", [None, "fp32"])
def test_fp32_side_passes_straight_through(side):
    x = torch.randn(100, requires_grad=True)
    g = torch.randn(100)
    fake_quantize(x, "fp16", side).backward(g)
    assert torch.equal(x.grad, g)
    x.grad = None
    y = fake_quantize(x, side, "fp16")
    assert torch.equal(y, x)
    y.backward(g)
    assert torch.equal(x.grad, quantize(g, "fp16"))


def test_both_sides_fp32_is_identity():
    x = torch.randn(3, requires_grad=True)
    assert fake_quantize(x, None, "fp32") is x


def test_half_inputs_keep_their_dtype():
    x = torch.randn(64, dtype=torch.bfloat16, requires_grad=True)
    y = fake_quantize(x, "fp8_e4m3", "fp8_e5m2")
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert x.grad.dtype == torch.bfloat16


def test_scaled_backward_keeps_tiny_gradients():
    x = torch.randn(256, requires_grad=True)
    g = torch.randn(256) * 1e-7  # far below fp8_e5m2's smallest subnormal
    fake_quantize(x, "fp8_e4m3", "fp8_e5m2").backward(g)
    assert torch.all(x.grad == 0)
    x.grad = None
    grad_cast = ScaledCast("fp8_e5m2")
    fake_quantize(x, ScaledCast("fp8_e4m3"), grad_cast).backward(g)
    assert torch.allclose(x.grad, g, rtol=0.13, atol=0)  # e5m2: 2 mantissa bits
    assert grad_cast.numel == 256


def test_gradient_of_a_layer_built_on_it():
    """A linear layer with bf16 operands: the weight gradient is computed from the rounded
    operands and the rounded output gradient, accumulated in fp32."""
    torch.manual_seed(1)
    w = torch.randn(8, 16, requires_grad=True)
    x = torch.randn(4, 16)
    g = torch.randn(4, 8)
    out = fake_quantize(x, "bf16") @ fake_quantize(w, "bf16", "bf16").t()
    out = fake_quantize(out, None, "bf16")
    out.backward(g)
    gq = quantize(g, "bf16")
    want = quantize(gq.t() @ quantize(x, "bf16"), "bf16")
    assert torch.equal(w.grad, want)
