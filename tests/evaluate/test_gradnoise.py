"""The gradient-noise signal: a policy's gradient error against the minibatch noise."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from autoprec.evaluate import Evaluator, EvaluatorConfig
from autoprec.evaluate.gradnoise import gradient_noise
from autoprec.policy import PrecisionPolicy


class _Spec:
    """A one-layer linear model with a mean-squared loss, whose gradients are known in closed
    form."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.module = nn.Linear(6, 3)

    def loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((out - y) ** 2).mean()


class _Data:
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(40, 6, generator=g)
        self.y = torch.randn(40, 3, generator=g)

    def fixed_batches(self, n, batch_size, seed=0):
        return [
            (
                self.x[i * batch_size : (i + 1) * batch_size],
                self.y[i * batch_size : (i + 1) * batch_size],
            )
            for i in range(n)
        ]


def _closed_form_grads(spec, data, batches, batch_size):
    """d/dW and d/db of mean((Wx + b - y)^2) on each batch, in float64."""
    w, b = spec.module.weight.detach().double(), spec.module.bias.detach().double()
    out = []
    for x, y in data.fixed_batches(batches, batch_size):
        pred = x.double() @ w.T + b
        d = 2 * (pred - y.double()) / pred.numel()
        out.append((d.T @ x.double(), d.sum(0)))
    return out


def test_fp32_has_no_error_and_the_noise_is_the_spread_of_minibatch_gradients():
    spec, data = _Spec(), _Data()
    state = spec.module.state_dict()
    measured, reference = gradient_noise(spec, data, PrecisionPolicy.uniform("fp32"), state,
                                         batches=4, batch_size=10)  # fmt: skip
    assert measured.ratio == 0.0 and measured.error == 0.0 and measured.batches == 4
    grads = _closed_form_grads(spec, data, 4, 10)
    noise = 0.0
    for t in range(2):
        g = torch.stack([gr[t].flatten() for gr in grads])
        noise += float(((g - g.mean(0)) ** 2).sum(1).mean())
    assert measured.noise == pytest.approx(noise, rel=1e-5)
    assert len(reference) == 4 and reference[0][0].shape == (3, 6)


def test_wider_formats_err_less_on_tinycnn(spec, data):
    ev = Evaluator(
        spec,
        data,
        "h100-sxm",
        config=EvaluatorConfig(steps=4, warm_start_steps=20, target_mode="emulate"),
    )
    state = ev.warm_start_state()
    ratios, reference = {}, None
    for p in ("fp32", "tf32", "bf16", "fp8"):
        measured, reference = gradient_noise(
            spec, data, PrecisionPolicy.uniform(p), state, batches=4, reference=reference
        )
        ratios[p] = measured.ratio
    assert ratios["fp32"] == 0.0
    assert 0 < ratios["tf32"] < ratios["bf16"] < ratios["fp8"]
    assert spec.module.state_dict().keys() == state.keys()  # the spec's module is untouched


def test_a_non_finite_gradient_is_infinite(spec, data, monkeypatch):
    ev = Evaluator(
        spec,
        data,
        "h100-sxm",
        config=EvaluatorConfig(steps=4, warm_start_steps=20, target_mode="emulate"),
    )
    state = dict(ev.warm_start_state())
    name = next(k for k in state if k.endswith("weight"))
    state[name] = state[name] * 1e5  # fp16 overflows on these weights; fp32 does not
    measured, _ = gradient_noise(spec, data, PrecisionPolicy.uniform("fp16"), state, batches=2)
    assert math.isfinite(measured.noise) and math.isinf(measured.ratio)
