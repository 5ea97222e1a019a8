"""A policy's loss over the whole training split, from a subset of it and one shared pass.

Scoring a fine-tuned policy over the whole training split is most of a ``short`` evaluation's
time (docs/benchmarks.md, "Where an evaluation's time goes"), and a subset alone adds noise as
large as the differences between policies: each example's loss moves far more than their mean
does. Nearly all of that movement, though, is the weights' difference from the fp32
reference's, first order in it: ``l_i(w) ~ l_i(w_ref) + grad l_i(w_ref) . (w - w_ref)``. So one
pass over the whole split at the reference's weights (its mean loss ``L`` and gradient ``g``,
and the same over a fixed random subset ``S``: ``L_S``, ``g_S``), shared by every policy, turns
the subset's loss into an estimate of the whole split's:

    loss(policy) = L_S(policy, w) + (L - L_S) + (g - g_S) . (w - w_ref)

where ``L_S(policy, w)`` is the subset's loss at the policy's fine-tuned weights ``w`` with the
policy applied, as the whole split was scored before. It is exact for the reference itself,
unbiased over the choice of the subset, and what remains of the subset's noise is the part of
each example's change that is not first order in the weights (the policy's rounding in the
scoring pass, curvature): ``experiments/bench_scoring.py`` measures it against the whole split.

What it measured (``experiments/bench_scoring.py``; docs/benchmarks.md, "Where an evaluation's
time goes"): on resnet18 the weights' part is exact to about 1e-7 of the loss, but the policy's
rounding in the scoring pass, which moves every example's loss a little and their mean by the
policy's whole effect, is not first order in the weights, and its mean over 512 or 1,024 examples
strays from the whole split's by as much as the policies differ. So the evaluator scores every
example unless ``EvaluatorConfig.score_examples`` asks for the estimate.

BatchNorm's running statistics are weights too (a policy's fine-tune moves them), but autograd
has no derivative for them; in eval mode they follow from the affine ones:
``dL/dmean = -gamma s dL/dbeta`` and ``dL/dvar = -gamma s^2 dL/dgamma / 2``, with
``s = (var + eps) ** -0.5``. A BatchNorm without its affine weights keeps its statistics' part
in the subset's noise.

Example:
    >>> estimate = SplitEstimate.measure(reference_model, spec, data, examples=512, seed=0)
    >>> estimate.full_loss  # the reference's own loss over the whole split  # doctest: +SKIP
    2.0213
    >>> estimate.loss(policy_model, spec, data)  # doctest: +SKIP
    2.0219
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from autoprec.training.trainer import gather, score_split

if TYPE_CHECKING:  # pragma: no cover
    from autoprec.data import DataBundle
    from autoprec.models import ModelSpec

__all__ = ["GRADIENT_BATCH", "SplitEstimate", "subset_index"]

GRADIENT_BATCH = 64  # examples per backward pass of the shared pass (a scoring batch's quarter)
_OFFSET, _FULL, _INDEX = "autoprec.offset", "autoprec.full_loss", "autoprec.index"


def subset_index(size: int, examples: int, seed: int) -> list[int]:
    """``examples`` of the ``size`` examples of a split, drawn without replacement with
    ``seed``, in ascending order."""
    gen = torch.Generator().manual_seed(seed)
    return sorted(torch.randperm(size, generator=gen)[:examples].tolist())


def _batchnorms(model: nn.Module) -> Iterator[tuple[str, nn.modules.batchnorm._BatchNorm]]:
    """``(state-dict prefix, module)`` of each BatchNorm of ``model`` with affine weights and
    running statistics (those whose statistics are taken to first order)."""
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.affine:
            if module.running_mean is not None and module.running_var is not None:
                yield (f"{name}." if name else ""), module


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors of ``model``'s state that a fine-tune moves and a loss depends on: the
    parameters that train, and BatchNorm's running mean and variance (on the CPU)."""
    out = {n: p.detach().cpu() for n, p in model.named_parameters() if p.requires_grad}
    for prefix, module in _batchnorms(model):
        out[prefix + "running_mean"] = module.running_mean.detach().cpu()
        out[prefix + "running_var"] = module.running_var.detach().cpu()
    return out


def _gradients(
    model: nn.Module, spec: ModelSpec, data: DataBundle, index: list[int], device: torch.device
) -> tuple[float, dict[str, torch.Tensor]]:
    """The mean loss over examples ``index`` of the training split (eval mode, as scored) and
    its gradient with respect to :func:`_weights` (float64, on the CPU)."""
    dataset = data.split("train")
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    total = 0.0
    sums = {n: torch.zeros(p.shape, dtype=torch.float64) for n, p in params.items()}
    model.eval()
    try:
        for start in range(0, len(index), GRADIENT_BATCH):
            x, y = gather(dataset, index[start : start + GRADIENT_BATCH])
            x, y = x.to(device), y.to(device)
            model.zero_grad(set_to_none=True)
            loss = spec.loss(model(x), y) * len(x)
            loss.backward()
            total += float(loss.detach())
            for n, p in params.items():
                if p.grad is not None:
                    sums[n] += p.grad.detach().cpu().double()
    finally:
        model.zero_grad(set_to_none=True)
        model.train()
    grads = {n: s / max(len(index), 1) for n, s in sums.items()}
    for prefix, module in _batchnorms(model):  # BatchNorm's statistics, from its affine ones
        gamma = module.weight.detach().cpu().double()
        s = (module.running_var.detach().cpu().double() + module.eps).rsqrt()
        grads[prefix + "running_mean"] = -gamma * s * grads[prefix + "bias"]
        grads[prefix + "running_var"] = -0.5 * gamma * s * s * grads[prefix + "weight"]
    return total / max(len(index), 1), grads


@dataclass
class SplitEstimate:
    """The shared pass at the reference's weights that estimates any policy's loss over the
    whole training split from its subset (see the module's docstring).

    Attributes:
        index: the subset ``S`` (example indices of the training split).
        anchor: the reference's weights ``w_ref`` (:func:`_weights`' tensors).
        correction: ``g - g_S`` for each of those tensors (float32).
        offset: ``L - L_S`` at the reference's weights.
        full_loss: ``L``, the reference's mean loss over the whole split.
    """

    index: list[int]
    anchor: dict[str, torch.Tensor]
    correction: dict[str, torch.Tensor]
    offset: float
    full_loss: float

    @classmethod
    def measure(
        cls,
        model: nn.Module,
        spec: ModelSpec,
        data: DataBundle,
        examples: int,
        seed: int,
        device: torch.device | str = "cpu",
    ) -> SplitEstimate:
        """The pass over the whole training split at ``model``'s weights (the fp32
        reference's), with ``examples`` of it, drawn with ``seed``, as the subset."""
        device = torch.device(device)
        size = len(data.split("train"))
        index = subset_index(size, examples, seed)
        chosen = set(index)
        rest = [i for i in range(size) if i not in chosen]
        subset_loss, subset_grads = _gradients(model, spec, data, index, device)
        rest_loss, rest_grads = _gradients(model, spec, data, rest, device)
        share = len(index) / size
        full_loss = share * subset_loss + (1 - share) * rest_loss
        correction = {
            n: ((1 - share) * (rest_grads[n] - subset_grads[n])).float() for n in subset_grads
        }  # g - g_S, with g = share g_S + (1 - share) g_rest
        return cls(index, _weights(model), correction, full_loss - subset_loss, full_loss)

    def first_order(self, model: nn.Module) -> float | None:
        """``(g - g_S) . (w - w_ref)`` at ``model``'s weights (summed in float64); None when
        its weights are not the reference's tensors (a runtime that replaced a module's
        parameters by others)."""
        weights = _weights(model)
        if {n: t.shape for n, t in weights.items()} != {n: t.shape for n, t in self.anchor.items()}:
            return None
        total = 0.0
        for name, c in self.correction.items():
            delta = weights[name] - self.anchor[name]
            total += float((c.double() * delta.double()).sum())
        return total

    def loss(
        self,
        model: nn.Module,
        spec: ModelSpec,
        data: DataBundle,
        device: torch.device | str | None = None,
    ) -> float:
        """The estimate of ``model``'s mean loss over the whole training split (with whatever
        policy is applied to it staying applied in the subset's scoring); a model whose
        weights are not the reference's tensors is scored on every example."""
        first_order = self.first_order(model)
        if first_order is None:
            return score_split(model, spec, data, "train", device)[0]
        subset, _ = score_split(model, spec, data, "train", device, index=self.index)
        return subset + self.offset + first_order

    # -- on disk: one dict of tensors (autoprec.evaluate._store) --
    def to_state(self) -> dict[str, torch.Tensor]:
        """The estimate as one dict of tensors (for :func:`~autoprec.evaluate._store
        .save_state_atomic`)."""
        return {
            **{f"anchor.{n}": t for n, t in self.anchor.items()},
            **{f"correction.{n}": t for n, t in self.correction.items()},
            _OFFSET: torch.tensor(self.offset, dtype=torch.float64),
            _FULL: torch.tensor(self.full_loss, dtype=torch.float64),
            _INDEX: torch.tensor(self.index, dtype=torch.long),
        }

    @classmethod
    def from_state(cls, state: dict[str, torch.Tensor], model: nn.Module) -> SplitEstimate | None:
        """The estimate :meth:`to_state` saved, if it fits ``model`` (the same tensors of the
        same shapes); else None."""
        want = {n: t.shape for n, t in _weights(model).items()}
        anchor = {n[7:]: t for n, t in state.items() if n.startswith("anchor.")}
        correction = {n[11:]: t for n, t in state.items() if n.startswith("correction.")}
        if any(k not in state for k in (_OFFSET, _FULL, _INDEX)):
            return None
        for part in (anchor, correction):
            if {n: t.shape for n, t in part.items()} != want:
                return None
        return cls(
            state[_INDEX].tolist(),
            anchor,
            correction,
            float(state[_OFFSET]),
            float(state[_FULL]),
        )
