"""The shared pieces of autoprec.data: the bundle a loader returns, its errors and helpers.

Every dataset loader turns a :class:`DataRequest` (what the model needs) into a
:class:`DataBundle` (train and val datasets plus what describes them). Randomness comes only from
``torch.Generator`` objects derived from the request's ``seed``, so the same request gives the
same tensors, split and batches on every machine.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, TensorDataset, default_collate

from autoprec._memory import check_fits, elements

TASKS = ("image-classification", "token-classification", "sequence-classification")
TOKEN_TASKS = ("token-classification", "sequence-classification")
SPLITS = ("train", "val")

# Bump when a loader changes the tensors it produces, so that cached results keyed by
# DataBundle.key are not reused across versions.
DATA_VERSION = 1


class DatasetError(ValueError):
    """A dataset that cannot be loaded as asked; the message says what to pass instead."""


@dataclass
class DataBundle:
    """Train and validation data for one model, with what describes them.

    Attributes:
        name: registry name of the dataset (``"digits"``, ``"cifar10"``, ...).
        train: the training split; a ``TensorDataset`` for in-memory sets, a torchvision
            dataset (or a ``Subset`` of one) for files on disk.
        val: the validation split, same kind as ``train``.
        num_classes: number of classes the labels are drawn from (the model's, when it has
            more than the dataset).
        input_shape: one example without the batch dimension, ``(C, H, W)`` or ``(seq_len,)``.
        task: one of ``image-classification``, ``token-classification``,
            ``sequence-classification``.
        key: a stable, file-name-safe cache key covering every setting that changes the data.
        vocab_size: token vocabulary size for token tasks, else ``None``.
        metadata: what else describes the data (``python-text``: ``{"corpus": fingerprint}``);
            a ``metadata["corpus"]["sha256"]`` is part of ``key``.

    Example:
        >>> b = load_dataset("digits", input_shape=(1, 8, 8))  # doctest: +SKIP
        >>> x, y = next(iter(b.loader("train", batch_size=4)))  # doctest: +SKIP
        >>> x.shape, y.dtype  # doctest: +SKIP
        (torch.Size([4, 1, 8, 8]), torch.int64)
    """

    name: str
    train: Dataset
    val: Dataset
    num_classes: int
    input_shape: tuple[int, ...]
    task: str
    key: str
    vocab_size: int | None = None
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.task = getattr(self.task, "value", self.task)  # a Task enum becomes its name
        if self.task not in TASKS:
            raise DatasetError(f"unknown task {self.task!r}; expected one of {', '.join(TASKS)}")
        self.input_shape = tuple(int(d) for d in self.input_shape)

    def check_batch(self, batch_size: int) -> None:
        """Raise unless ``batch_size`` is >= 1 and a batch of its inputs fits in the machine's
        memory (:class:`~autoprec._memory.SizeError` names what to lower); the loaders check
        it, and so should whatever draws batches of the splits itself."""
        if batch_size < 1:
            raise DatasetError(f"batch_size must be >= 1; got {batch_size}")
        itemsize = 8 if self.vocab_size is not None else 4  # token ids are int64
        check_fits(
            elements((batch_size, *self.input_shape)) * itemsize,
            f"{self.name}: a batch of {batch_size:,} inputs of shape {self.input_shape}",
            "lower the image size (or sequence length) or the batch size",
        )

    def split(self, split: str) -> Dataset:
        """The dataset of ``split`` (``"train"`` or ``"val"``)."""
        if split not in SPLITS:
            raise DatasetError(f"unknown split {split!r}; expected 'train' or 'val'")
        return self.train if split == "train" else self.val

    def loader(
        self,
        split: str = "train",
        batch_size: int = 32,
        shuffle: bool | None = None,
        seed: int = 0,
        drop_last: bool = False,
    ) -> DataLoader:
        """A single-process DataLoader over ``split``, deterministic given ``seed``.

        Args:
            split: ``"train"`` or ``"val"``.
            batch_size: examples per batch.
            shuffle: shuffle each epoch; ``None`` means shuffle the train split only.
            seed: seeds the loader's own ``torch.Generator``; a new loader with the same seed
                yields the same batches in the same order.
            drop_last: drop a final incomplete batch.
        """
        dataset = self.split(split)
        self.check_batch(batch_size)
        if shuffle is None:
            shuffle = split == "train"
        generator = torch.Generator().manual_seed(seed)
        return DataLoader(
            dataset,
            batch_size=batch_size,
            shuffle=shuffle,
            generator=generator,
            num_workers=0,
            drop_last=drop_last,
        )

    def fixed_batches(
        self, n: int, batch_size: int, split: str = "train", seed: int = 0
    ) -> list[tuple[Tensor, Tensor]]:
        """The same ``n`` full batches on every call with the same arguments.

        Examples are drawn without replacement from a seeded permutation of ``split``; when
        ``n * batch_size`` exceeds the split, further seeded permutations follow (so every
        batch is full). Useful for sensitivity probes and calibration.
        """
        dataset = self.split(split)
        self.check_batch(batch_size)
        if n < 1:
            raise DatasetError(f"fixed_batches needs n >= 1 batches; got {n}")
        size = len(dataset)  # type: ignore[arg-type]
        generator = torch.Generator().manual_seed(seed)
        needed = n * batch_size
        perms = [torch.randperm(size, generator=generator) for _ in range(math.ceil(needed / size))]
        order = torch.cat(perms)[:needed]
        return [_gather(dataset, idx) for idx in order.split(batch_size)]


def _gather(dataset: Dataset, idx: Tensor) -> tuple[Tensor, Tensor]:
    """Examples ``idx`` of ``dataset`` stacked into one ``(inputs, labels)`` batch."""
    if isinstance(dataset, TensorDataset):
        x, y = dataset.tensors
        return x[idx], y[idx]
    x, y = default_collate([dataset[i] for i in idx.tolist()])
    return x, y


@dataclass(frozen=True)
class DataRequest:
    """What a model asks of a dataset; every field of ``load_dataset`` after the name."""

    name: str
    input_shape: tuple[int, ...]
    num_classes: int | None = None
    task: str | None = None
    root: Path | None = None
    download: bool = False
    seed: int = 0
    val_fraction: float = 0.2
    max_samples: int | None = None
    vocab_size: int | None = None

    def __post_init__(self) -> None:
        # a ``Task`` enum (``spec.task``) becomes its plain name, so messages print the name
        object.__setattr__(self, "task", getattr(self.task, "value", self.task))
        shape = self.input_shape
        if not shape or any(int(d) < 1 for d in shape):
            raise DatasetError(f"{self.name}: input_shape must be positive sizes; got {shape!r}")
        object.__setattr__(self, "input_shape", tuple(int(d) for d in shape))
        if self.task is not None and self.task not in TASKS:
            raise DatasetError(f"unknown task {self.task!r}; expected one of {', '.join(TASKS)}")
        if self.num_classes is not None and self.num_classes < 2:
            raise DatasetError(f"{self.name}: num_classes must be >= 2; got {self.num_classes}")
        if not 0.0 < self.val_fraction < 1.0:
            raise DatasetError(
                f"{self.name}: val_fraction must be in (0, 1); got {self.val_fraction}"
            )
        if self.max_samples is not None and self.max_samples < 2:
            raise DatasetError(f"{self.name}: max_samples must be >= 2; got {self.max_samples}")
        if self.vocab_size is not None and self.vocab_size < 2:
            raise DatasetError(f"{self.name}: vocab_size must be >= 2; got {self.vocab_size}")

    def key(self, *, num_classes: int, task: str, uses_root: bool, uses_vocab: bool) -> str:
        """A file-name-safe key: name, shape, and a digest of every data-changing setting."""
        settings = {
            "version": DATA_VERSION,
            "name": self.name,
            "input_shape": list(self.input_shape),
            "num_classes": num_classes,
            "task": task,
            "seed": self.seed,
            "val_fraction": self.val_fraction,
            "max_samples": self.max_samples,
            "vocab_size": self.vocab_size if uses_vocab else None,
            "root": str(self.root.expanduser().resolve()) if uses_root and self.root else None,
        }
        digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
        shape = "x".join(str(d) for d in self.input_shape)
        return f"{self.name}-{shape}-c{num_classes}-s{self.seed}-{digest}"


def rng(seed: int, stream: str) -> torch.Generator:
    """An independent CPU generator for one named use (``"split"``, ``"teacher"``, ...)."""
    digest = hashlib.sha256(f"{seed}:{stream}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def split_indices(
    n: int, *, seed: int, val_fraction: float, max_samples: int | None = None
) -> tuple[Tensor, Tensor]:
    """Seeded ``(train, val)`` index tensors over ``n`` examples, capped at ``max_samples``.

    Raises:
        DatasetError: when either split would be empty.
    """
    perm = torch.randperm(n, generator=rng(seed, "split"))
    if max_samples is not None:
        perm = perm[:max_samples]
    n_val = round(len(perm) * val_fraction)
    if n_val < 1 or n_val >= len(perm):
        raise DatasetError(
            f"{len(perm)} examples with val_fraction={val_fraction} leave an empty split; "
            "raise max_samples or change val_fraction"
        )
    return perm[n_val:], perm[:n_val]


def image_geometry(name: str, shape: tuple[int, ...]) -> tuple[int, int, int]:
    """``(C, H, W)`` images that fill ``shape``: ``(C, H, W)``, ``(H, W)`` or a flat ``(D,)``.

    A flat ``D`` must be ``k*k`` (one channel) or ``3*k*k`` (three channels), as for an MLP on
    flattened images; :func:`to_model_shape` reshapes the images back.
    """
    if len(shape) == 3:
        return shape[0], shape[1], shape[2]
    if len(shape) == 2:
        return 1, shape[0], shape[1]
    if len(shape) == 1:
        for channels in (1, 3):
            side = math.isqrt(shape[0] // channels)
            if channels * side * side == shape[0]:
                return channels, side, side
    raise DatasetError(
        f"{name}: cannot make images of shape {shape!r}; expected (C, H, W), (H, W) or a flat "
        "(D,) with D = k*k or 3*k*k"
    )


def to_model_shape(images: Tensor, shape: tuple[int, ...]) -> Tensor:
    """Reshape ``(..., C, H, W)`` images to ``(..., *shape)``."""
    return images.reshape(*images.shape[:-3], *shape)


class ToModelShape:
    """A picklable transform: a ``(C, H, W)`` tensor reshaped to the model's input shape."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.shape = shape

    def __call__(self, image: Tensor) -> Tensor:
        return image.reshape(self.shape)

    def __repr__(self) -> str:
        return f"ToModelShape({self.shape})"


def check_image_task(req: DataRequest) -> None:
    """Refuse an image dataset for a model whose task is not image-classification."""
    if req.task not in (None, "image-classification"):
        raise DatasetError(
            f"{req.name} is an image-classification dataset; the model's task is {req.task} "
            "(use 'tokens' for models that read token ids)"
        )


def token_geometry(req: DataRequest) -> tuple[int, int]:
    """``(vocab_size, seq_len)`` of a token dataset for ``req``.

    Raises:
        DatasetError: no vocabulary, or an input shape that is not ``(seq_len,)``.
    """
    name = req.name
    if req.vocab_size is None:
        raise DatasetError(f"{name}: token data needs vocab_size (the model's vocabulary)")
    if len(req.input_shape) != 1:
        raise DatasetError(
            f"{name}: token data has input_shape (seq_len,); got {req.input_shape!r}"
        )
    return req.vocab_size, req.input_shape[0]


def next_token_task(req: DataRequest, unit: str = "token") -> str:
    """The task of a next-``unit`` prediction dataset for ``req``: token-classification.

    Raises:
        DatasetError: the model's task is another one.
    """
    task = req.task or "token-classification"
    if task != "token-classification":
        raise DatasetError(
            f"{req.name} labels every position with the next {unit}, for token-classification "
            f"models; the model's task is {task} (use 'tokens')"
        )
    return task


def check_num_classes(name: str, have: int, want: int | None) -> int:
    """The label count to report: ``want`` (the model's) if it covers the dataset's ``have``."""
    if want is None:
        return have
    if want < have:
        raise DatasetError(
            f"{name} has {have} classes but the model outputs {want}; "
            f"use a model with num_classes >= {have} or another dataset"
        )
    return want
