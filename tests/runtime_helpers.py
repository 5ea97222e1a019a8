"""Helpers for the runtime tests."""

from __future__ import annotations

import torch
from torch import nn


def step_gradients(model: nn.Module, x: torch.Tensor, g: torch.Tensor) -> list[torch.Tensor]:
    """Output, input gradient and every parameter gradient of one backward of ``g``."""
    model.zero_grad()
    x = x.detach().clone().requires_grad_()
    out = model(x)
    out.backward(g)
    return [out.detach(), x.grad, *(p.grad.clone() for p in model.parameters())]
