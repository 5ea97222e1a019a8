"""``digits``: scikit-learn's handwritten digits (1797 real 8x8 images, shipped offline).

The images are scaled from 0..16 to [0, 1], resized bilinearly to the model's H x W, repeated
to its channels, then standardised with the train split's mean and standard deviation.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from autoprec.data._base import (
    DataBundle,
    DataRequest,
    check_image_task,
    check_num_classes,
    image_geometry,
    split_indices,
    to_model_shape,
)

NUM_CLASSES = 10


@functools.lru_cache(maxsize=1)
def _raw_digits() -> tuple[torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.as_tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.as_tensor(digits.target, dtype=torch.int64)
    return images, labels


def load_digits_bundle(req: DataRequest) -> DataBundle:
    """The digits dataset resized to ``req.input_shape``; see the module docstring."""
    check_image_task(req)
    num_classes = check_num_classes("digits", NUM_CLASSES, req.num_classes)
    channels, height, width = image_geometry("digits", req.input_shape)
    images, labels = _raw_digits()
    train_idx, val_idx = split_indices(
        len(labels), seed=req.seed, val_fraction=req.val_fraction, max_samples=req.max_samples
    )

    def resized(idx: torch.Tensor) -> torch.Tensor:
        out = images[idx]
        if (height, width) != (8, 8):
            out = F.interpolate(out, size=(height, width), mode="bilinear", align_corners=False)
        return out

    train_x, val_x = resized(train_idx), resized(val_idx)
    mean, std = train_x.mean(), train_x.std().clamp_min(1e-6)

    def examples(x: torch.Tensor) -> torch.Tensor:
        # one stored channel, repeated as a stride-0 view: large inputs stay cheap in memory
        x = x.sub_(mean).div_(std).expand(-1, channels, -1, -1)
        return to_model_shape(x, req.input_shape)

    return DataBundle(
        name="digits",
        train=TensorDataset(examples(train_x), labels[train_idx]),
        val=TensorDataset(examples(val_x), labels[val_idx]),
        num_classes=num_classes,
        input_shape=req.input_shape,
        task="image-classification",
        key="",
    )
