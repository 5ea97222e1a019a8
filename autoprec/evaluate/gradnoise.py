"""How large a policy's gradient error is against SGD's own minibatch noise: a training-free
accuracy signal.

SGD already follows a noisy gradient: on a minibatch it sees the full-batch gradient plus noise
whose size the spread of the minibatch gradients measures. A precision whose rounding changes
the gradient by far less than that noise should not change where training goes; one whose
error is as large as the noise, or larger, does. At the same weights and on the same ``B``
batches this measures, per parameter tensor ``t``:

- ``g_i``: the fp32 gradient on batch ``i``; ``h_i``: the gradient with the policy applied
  (its loss scaling too);
- ``noise_t = mean_i |g_i - mean(g)|^2``: the minibatch noise;
- ``error_t = mean_i |h_i - g_i|^2``: the precision's error;

and returns ``ratio = sum_t error_t / noise_t`` (a tensor whose gradient has no noise is left
out), the precision's error in units of the noise, summed over tensors so that a small layer's
error counts as much as a large one's. A non-finite gradient under the policy gives ``inf``.
It costs ``2 B`` forward and backward passes and no training.

experiments/full_training.py measures it against whole training runs next to the evaluator's
fidelities (docs/benchmarks.md, "Fidelities against full training").

Example:
    >>> bf16 = PrecisionPolicy.uniform("bf16")
    >>> signal, _ = gradient_noise(spec, data, bf16, state)  # doctest: +SKIP
    >>> signal.ratio  # doctest: +SKIP
    0.0031
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from autoprec.policy import PrecisionPolicy
from autoprec.runtime import LossScaler, apply_policy

if TYPE_CHECKING:  # pragma: no cover
    from autoprec.data import DataBundle
    from autoprec.models import ModelSpec
    from autoprec.training.trainer import Batch

__all__ = ["GradientNoise", "gradient_noise"]

DEFAULT_BATCHES = 8


@dataclass(frozen=True)
class GradientNoise:
    """A policy's gradient error against the minibatch noise at one set of weights.

    Attributes:
        ratio: ``sum_t error_t / noise_t`` over the parameter tensors (``inf``: the policy's
            gradient was not finite).
        error: ``sum_t error_t``, the squared gradient error summed over tensors.
        noise: ``sum_t noise_t``, the minibatch noise summed over tensors.
        batches: the number of batches measured.
    """

    ratio: float
    error: float
    noise: float
    batches: int


def _gradients(
    model: torch.nn.Module, spec: ModelSpec, batches: list[Batch], scaler: LossScaler | None
) -> list[list[torch.Tensor]]:
    """The gradient of every parameter on each batch (unscaled), in train mode."""
    params = [p for p in model.parameters() if p.requires_grad]
    out = []
    model.train()
    for x, y in batches:
        model.zero_grad(set_to_none=True)
        loss = spec.loss(model(x), y)
        scale = 1.0 if scaler is None else float(scaler.get_scale())
        (loss if scaler is None else scaler.scale(loss)).backward()
        out.append([
            (p.grad.detach() / scale).clone() if p.grad is not None else torch.zeros_like(p)
            for p in params
        ])  # fmt: skip
    return out


def gradient_noise(
    spec: ModelSpec,
    data: DataBundle,
    policy: PrecisionPolicy,
    state: dict[str, torch.Tensor],
    *,
    batches: int = DEFAULT_BATCHES,
    batch_size: int = 32,
    seed: int = 0,
    mode: str = "emulate",
    reference: list[list[torch.Tensor]] | None = None,
) -> tuple[GradientNoise, list[list[torch.Tensor]]]:
    """``policy``'s gradient error against the minibatch noise at the weights ``state``.

    Args:
        spec: a ModelSpec (``module``, ``loss``); its module is not changed.
        data: a DataBundle (``fixed_batches``).
        policy: the precision policy (applied with :func:`~autoprec.runtime.apply_policy`,
            its loss scaling's initial scale used as a static scale).
        state: the weights to measure at (the evaluator's warm start).
        batches, batch_size, seed: the fixed batches (``data.fixed_batches``).
        mode: runtime mode of the policy's pass.
        reference: the fp32 gradients of an earlier call with the same weights and batches
            (the second value this returns), so that they are computed once per model.

    Returns:
        The :class:`GradientNoise`, and the fp32 gradients for later calls.
    """
    model = copy.deepcopy(spec.module)
    model.load_state_dict(state)
    fixed = list(data.fixed_batches(batches, batch_size, seed=seed))
    torch.manual_seed(seed)
    if reference is None:
        reference = _gradients(model, spec, fixed, None)
    handle = apply_policy(model, policy, mode=mode)
    try:
        scaler = LossScaler.from_policy(policy)
        torch.manual_seed(seed)
        mine = _gradients(model, spec, fixed, scaler)
    finally:
        handle.remove()
    ratio = error_sum = noise_sum = 0.0
    for t in range(len(reference[0])):
        g = torch.stack([r[t] for r in reference]).double().flatten(1)
        h = torch.stack([m[t] for m in mine]).double().flatten(1)
        noise = float(((g - g.mean(0)) ** 2).sum(1).mean())
        error = float(((h - g) ** 2).sum(1).mean())
        if not math.isfinite(error):
            return GradientNoise(math.inf, math.inf, noise_sum, len(fixed)), reference
        error_sum += error
        noise_sum += noise
        if noise > 0:
            ratio += error / noise
    return GradientNoise(ratio, error_sum, noise_sum, len(fixed)), reference
