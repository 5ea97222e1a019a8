"""Synthetic, learnable datasets: ``synthetic`` (any input shape) and ``tokens`` (text models).

``synthetic`` inputs are standard normal in every element, but not independent: each example is
``sqrt(1 - s^2) * signal + s * noise``, where the signal is a fixed random mix of a small latent
vector ``z`` (a few smooth random patterns for images, random directions for vectors) and ``s``
the noise level. The label is a fixed random teacher, a 2-layer tanh MLP on ``z`` with the
per-class mean logit removed (so that classes are roughly balanced), argmax over
``num_classes``. Everything is seeded by ``seed``: same seed, same data, teacher and split. A
linear model on the flattened input learns it well above chance in a few hundred steps.

``tokens`` draws ids in ``[0, vocab_size)`` of length ``seq_len = input_shape[0]``. Token ``t``
belongs to bucket ``t % num_classes``.

* ``sequence-classification``: the label is the most frequent bucket in the sequence (ties go
  to the lowest bucket). Sequences are drawn so that one bucket usually dominates, which keeps
  the task learnable by a bag-of-words model or a small transformer.
* ``token-classification``: the label of position ``i`` is the bucket of token ``i - 1`` (a
  virtual token 0 precedes the sequence), so a model has to look one token back. Labels have
  shape ``(seq_len,)`` per example.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import TensorDataset

from autoprec.data._base import (
    TOKEN_TASKS,
    DataBundle,
    DataRequest,
    DatasetError,
    rng,
    split_indices,
    token_geometry,
)

DEFAULT_SAMPLES = 2048
DEFAULT_CLASSES = 10
LATENT_DIM = 8
TEACHER_HIDDEN = 32
NOISE = 0.5
TOKEN_DOMINANCE = 0.3  # share of a sequence's tokens drawn from its dominant bucket


def _signal_basis(shape: tuple[int, ...], latent: int, generator: torch.Generator) -> Tensor:
    """``(latent, D)`` patterns with unit norm per input element (so the signal is N(0, 1))."""
    if len(shape) == 3:
        channels, height, width = shape
        coarse = torch.randn(latent, channels, min(height, 4), min(width, 4), generator=generator)
        smooth = F.interpolate(coarse, size=(height, width), mode="bilinear", align_corners=False)
        basis = smooth.reshape(latent, -1)
    else:
        basis = torch.randn(latent, math.prod(shape), generator=generator)
    return basis / basis.norm(dim=0, keepdim=True).clamp_min(1e-6)


def _teacher_labels(z: Tensor, num_classes: int, generator: torch.Generator) -> Tensor:
    """Labels from a fixed random 2-layer tanh MLP on the latents, centred per class."""
    latent = z.shape[1]
    w1 = torch.randn(latent, TEACHER_HIDDEN, generator=generator) * (1.0 / math.sqrt(latent))
    b1 = torch.randn(TEACHER_HIDDEN, generator=generator) * 0.5
    w2 = torch.randn(TEACHER_HIDDEN, num_classes, generator=generator)
    logits = torch.tanh(z @ w1 + b1) @ w2
    logits = logits - logits.mean(dim=0, keepdim=True)
    logits = logits / logits.std(dim=0, keepdim=True).clamp_min(1e-6)
    return logits.argmax(dim=1)


def load_synthetic_bundle(req: DataRequest) -> DataBundle:
    """Teacher-labelled Gaussian inputs of ``req.input_shape``; token tasks go to ``tokens``."""
    if req.task in TOKEN_TASKS or (req.task is None and req.vocab_size is not None):
        return load_tokens_bundle(req)
    num_classes = req.num_classes or DEFAULT_CLASSES
    n = req.max_samples or DEFAULT_SAMPLES
    latent = min(LATENT_DIM, math.prod(req.input_shape))
    data_gen = rng(req.seed, "synthetic-data")
    z = torch.randn(n, latent, generator=data_gen)
    basis = _signal_basis(req.input_shape, latent, rng(req.seed, "synthetic-basis"))
    noise = torch.randn(n, basis.shape[1], generator=data_gen)
    x = math.sqrt(1.0 - NOISE**2) * (z @ basis) + NOISE * noise
    y = _teacher_labels(z, num_classes, rng(req.seed, "synthetic-teacher"))
    return _bundle(req, x.reshape(n, *req.input_shape), y, num_classes, "image-classification")


def load_tokens_bundle(req: DataRequest) -> DataBundle:
    """Token sequences with a learnable label; see the module docstring."""
    name = req.name
    task = req.task or "sequence-classification"
    if task not in TOKEN_TASKS:
        raise DatasetError(
            f"{name}: token data is for token-classification or sequence-classification; "
            f"the model's task is {task}"
        )
    vocab, seq_len = token_geometry(req)
    num_classes = req.num_classes or 2
    if vocab < num_classes:
        raise DatasetError(
            f"{name}: vocab_size {vocab} is smaller than num_classes {num_classes}; "
            "every class needs at least one token"
        )
    n = req.max_samples or DEFAULT_SAMPLES
    gen = rng(req.seed, "tokens")
    ids = torch.randint(0, vocab, (n, seq_len), generator=gen)
    if task == "sequence-classification":
        # move a share of each sequence into one random bucket, then label by the true count
        dominant = torch.randint(0, num_classes, (n, 1), generator=gen)
        in_bucket = ids - ids % num_classes + dominant
        in_bucket = torch.where(in_bucket < vocab, in_bucket, dominant)
        pick = torch.rand(n, seq_len, generator=gen) < TOKEN_DOMINANCE
        ids = torch.where(pick, in_bucket, ids)
        counts = F.one_hot(ids % num_classes, num_classes).sum(dim=1)
        y = counts.argmax(dim=1)
    else:
        previous = torch.cat([torch.zeros(n, 1, dtype=ids.dtype), ids[:, :-1]], dim=1)
        y = previous % num_classes
    return _bundle(req, ids, y, num_classes, task, vocab_size=vocab)


def _bundle(
    req: DataRequest,
    x: Tensor,
    y: Tensor,
    num_classes: int,
    task: str,
    vocab_size: int | None = None,
) -> DataBundle:
    train_idx, val_idx = split_indices(len(y), seed=req.seed, val_fraction=req.val_fraction)
    return DataBundle(
        name=req.name,
        train=TensorDataset(x[train_idx], y[train_idx]),
        val=TensorDataset(x[val_idx], y[val_idx]),
        num_classes=num_classes,
        input_shape=req.input_shape,
        task=task,
        key="",
        vocab_size=vocab_size,
    )
