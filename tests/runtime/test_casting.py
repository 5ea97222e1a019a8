"""A layer's overflow/underflow counts are the rounding kernel's counts, summed over its calls
(read back on the host for CPU tensors): the oracle is each tensor counted on its own by the
eager kernel, ``quantize_with_counts`` and the two-step ``DynamicScaledCast``."""

from __future__ import annotations

import pytest
import torch

from autoprec.kernels import DynamicScaledCast, quantize_with_counts
from autoprec.precision import Precision
from autoprec.runtime.casting import LayerCasts

SPECIALS = torch.tensor([float("inf"), -float("inf"), float("nan"), 0.0, 1e-45])


def _tensors(n: int = 3) -> list[torch.Tensor]:
    """Values over fp32's binades (overflowing and flushing fp16), specials in some."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        x = torch.randn(40, 30, generator=gen)
        x = x * 10.0 ** torch.randint(-45, 39, x.shape, generator=gen)
        out.append(torch.cat([x.flatten(), SPECIALS]) if i else x)
    return out


@pytest.mark.parametrize("setting", ["0", "1"])  # eager kernels; compiled at the first call
@pytest.mark.parametrize("precision", [Precision.FP16, Precision.BF16])
def test_counts_are_the_kernels_counts_summed(monkeypatch, setting, precision):
    monkeypatch.setenv("AUTOPREC_COMPILE", setting)
    casts = LayerCasts(precision)
    fmt = precision.forward_format
    want = [0, 0]
    for x in _tensors():
        casts.forward_operand(x, "input")
        casts.backward_gradient(x.clone())  # the output: non-finite values that arrive are
        arrived = int((~torch.isfinite(x)).sum())  # not this layer's overflows
        _, over, under = quantize_with_counts(x, fmt, backend="eager")
        want = [want[0] + 2 * int(over) - arrived, want[1] + 2 * int(under)]
    assert want[0] > 0 and want[1] > 0  # the oracle sees both
    assert casts.counts() == tuple(want)


@pytest.mark.parametrize("setting", ["0", "1"])
def test_fp8_counts_are_the_two_step_casts_counts_summed(monkeypatch, setting):
    monkeypatch.setenv("AUTOPREC_COMPILE", setting)
    casts = LayerCasts(Precision.FP8)
    oracle = DynamicScaledCast("fp8_e4m3")
    for x in _tensors():
        casts.forward_operand(x, "input")
        oracle(x)
    assert oracle.overflows > 0 and oracle.underflows > 0
    assert casts.counts() == (oracle.overflows, oracle.underflows)
