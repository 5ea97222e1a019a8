"""``teacher``: smooth random images labelled by a fixed random convolutional network.

A task harder than digits, made so that numeric precision visibly matters in a short
fine-tune. Each image is a sum of random fields at three scales (4x4, 8x8 and 16x16 noise,
upsampled bilinearly) plus white noise, standardised; its label is the argmax of a fixed random
teacher, two 3x3 convolutions with tanh (the second after a 2x2 average pool), a 2x2 adaptive
average pool and a linear layer, with each class's logit standardised over the set. The label
depends on local features at several places of the image, so a model has to learn
convolutional features, and does not saturate: a resnet18 at 32x32 reaches about 54%
validation accuracy after the evaluator's 200-step warm start (digits: 93%), so its loss stays
near 1.2 instead of 0.1 and spreads over many examples rather than a few hard ones. That makes
the loss after a short fine-tune repeatable from one batch order to another (docs/benchmarks.md,
"Policy evaluator").

Images are generated at ``min(H, 32) x min(W, 32)`` (the teacher sees that size) and upsampled
on access to a larger requested size, so resnet50's 224x224 costs no more memory than 32x32.
Everything is seeded by ``seed``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import Dataset, TensorDataset

from autoprec.data._base import (
    DataBundle,
    DataRequest,
    check_image_task,
    image_geometry,
    rng,
    split_indices,
    to_model_shape,
)

DEFAULT_SAMPLES = 4096
DEFAULT_CLASSES = 10
BASE_SIZE = 32  # largest side generated; bigger requests are upsampled on access
SCALES = ((4, 1.0), (8, 0.7), (16, 0.5))  # (noise grid side, weight) of the random fields
WHITE_NOISE = 0.3
TEACHER_WIDTH = 16
TEACHER_GAIN = 1.5  # pre-tanh gain: keeps the teacher's units in their non-linear range


def _images(n: int, shape: tuple[int, int, int], generator: torch.Generator) -> Tensor:
    channels, height, width = shape
    x = torch.zeros(n, channels, height, width)
    for side, weight in SCALES:
        coarse = torch.randn(n, channels, min(side, height), min(side, width), generator=generator)
        x += weight * F.interpolate(coarse, size=(height, width), mode="bilinear")
    x += WHITE_NOISE * torch.randn(n, channels, height, width, generator=generator)
    return (x - x.mean()) / x.std().clamp_min(1e-6)


@torch.no_grad()
def _teacher_labels(x: Tensor, num_classes: int, generator: torch.Generator) -> Tensor:
    channels, width = x.shape[1], TEACHER_WIDTH
    w1 = torch.randn(width, channels, 3, 3, generator=generator) / math.sqrt(channels * 9)
    w2 = torch.randn(2 * width, width, 3, 3, generator=generator) / math.sqrt(width * 9)
    w3 = torch.randn(num_classes, 2 * width * 4, generator=generator) / math.sqrt(2 * width * 4)
    h = torch.tanh(TEACHER_GAIN * F.conv2d(x, w1, padding=1))
    h = F.avg_pool2d(h, 2) if min(h.shape[-2:]) >= 2 else h
    h = torch.tanh(TEACHER_GAIN * F.conv2d(h, w2, padding=1))
    logits = F.adaptive_avg_pool2d(h, 2).flatten(1) @ w3.T
    logits = (logits - logits.mean(dim=0)) / logits.std(dim=0).clamp_min(1e-6)
    return logits.argmax(dim=1)


class _Upsampled(Dataset):
    """Base-size images upsampled to ``size`` (and reshaped to the model's input) on access."""

    def __init__(self, x: Tensor, y: Tensor, size: tuple[int, int], shape: tuple[int, ...]):
        self.x, self.y, self.size, self.shape = x, y, size, shape

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        image = F.interpolate(self.x[i : i + 1], size=self.size, mode="bilinear")[0]
        return to_model_shape(image, self.shape), self.y[i]


def load_teacher_bundle(req: DataRequest) -> DataBundle:
    """The teacher task shaped for ``req``; see the module docstring."""
    check_image_task(req)
    num_classes = req.num_classes or DEFAULT_CLASSES
    channels, height, width = image_geometry("teacher", req.input_shape)
    base = (channels, min(height, BASE_SIZE), min(width, BASE_SIZE))
    n = req.max_samples or DEFAULT_SAMPLES
    x = _images(n, base, rng(req.seed, "teacher-images"))
    y = _teacher_labels(x, num_classes, rng(req.seed, "teacher-net"))
    train_idx, val_idx = split_indices(n, seed=req.seed, val_fraction=req.val_fraction)

    def split(idx: Tensor) -> Dataset:
        if base[1:] == (height, width):
            return TensorDataset(to_model_shape(x[idx], req.input_shape), y[idx])
        return _Upsampled(x[idx], y[idx], (height, width), req.input_shape)

    return DataBundle(
        name="teacher",
        train=split(train_idx),
        val=split(val_idx),
        num_classes=num_classes,
        input_shape=req.input_shape,
        task="image-classification",
        key="",
    )
