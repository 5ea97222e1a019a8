"""Datasets shaped for a model: offline ones (digits, teacher, synthetic, tokens, teacher-text,
python-text) and ones on disk (cifar10, cifar100, imagefolder).

Example:
    >>> from autoprec.data import load_dataset
    >>> bundle = load_dataset("synthetic", input_shape=(3, 16, 16), num_classes=10, seed=1)
    >>> x, y = bundle.fixed_batches(2, batch_size=8)[0]
    >>> tuple(x.shape), tuple(y.shape)
    ((8, 3, 16, 16), (8,))
"""

from __future__ import annotations

from autoprec.data._base import DataBundle, DatasetError
from autoprec.data.registry import (
    default_dataset,
    is_language_model,
    list_datasets,
    load_dataset,
    load_dataset_for,
)

__all__ = [
    "DataBundle",
    "DatasetError",
    "default_dataset",
    "is_language_model",
    "list_datasets",
    "load_dataset",
    "load_dataset_for",
]
