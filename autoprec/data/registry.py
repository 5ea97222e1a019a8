"""Dataset names and the functions that load them for a model.

Example:
    >>> from autoprec.data import load_dataset
    >>> bundle = load_dataset("digits", input_shape=(1, 8, 8), seed=0)
    >>> len(bundle.train), len(bundle.val), bundle.num_classes
    (1438, 359, 10)
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from autoprec.data._base import DataBundle, DataRequest, DatasetError
from autoprec.data.digits import load_digits_bundle
from autoprec.data.folders import load_cifar_bundle, load_imagefolder_bundle
from autoprec.data.python_text import load_python_text_bundle
from autoprec.data.synthetic import load_synthetic_bundle, load_tokens_bundle
from autoprec.data.teacher import load_teacher_bundle
from autoprec.data.teacher_text import load_teacher_text_bundle
from autoprec.defaults import DEFAULT_DATASET, LANGUAGE_MODEL_DATASET

_IMAGE = ("image-classification",)
_TOKENS = ("sequence-classification", "token-classification")


@dataclass(frozen=True)
class _Entry:
    load: Callable[[DataRequest], DataBundle]
    description: str
    tasks: tuple[str, ...]
    num_classes: int | None  # None: any (the model's)
    needs_root: bool = False


_REGISTRY: dict[str, _Entry] = {
    "digits": _Entry(
        load_digits_bundle,
        "scikit-learn handwritten digits (1797 8x8 images), resized to the model; offline",
        _IMAGE,
        10,
    ),
    "teacher": _Entry(
        load_teacher_bundle,
        "smooth random images labelled by a fixed random conv network; harder than digits; offline",
        _IMAGE,
        None,
    ),
    "synthetic": _Entry(
        load_synthetic_bundle,
        "Gaussian inputs labelled by a fixed random teacher (tokens for text models); offline",
        _IMAGE + _TOKENS,
        None,
    ),
    "tokens": _Entry(
        load_tokens_bundle,
        "synthetic token sequences with learnable sequence or per-token labels; offline",
        _TOKENS,
        None,
    ),
    "teacher-text": _Entry(
        load_teacher_text_bundle,
        "token sequences from a fixed random recurrent teacher, labelled by the next token "
        "(language modelling); offline",
        ("token-classification",),
        None,
    ),
    "python-text": _Entry(
        load_python_text_bundle,
        "the Python standard library's own .py sources as bytes (vocabulary 256), labelled by "
        "the next byte (language modelling); split by file; offline",
        ("token-classification",),
        None,
    ),
    "cifar10": _Entry(
        load_cifar_bundle,
        "CIFAR-10 from --data-dir (train = official train, val = official test)",
        _IMAGE,
        10,
        needs_root=True,
    ),
    "cifar100": _Entry(
        load_cifar_bundle,
        "CIFAR-100 from --data-dir (train = official train, val = official test)",
        _IMAGE,
        100,
        needs_root=True,
    ),
    "imagefolder": _Entry(
        load_imagefolder_bundle,
        "root/<class>/<image> from --data-dir, seeded train/val split",
        _IMAGE,
        None,
        needs_root=True,
    ),
}


#: The dataset a command uses when none is named, by the model's task.
TASK_DATASETS: dict[str, str] = {
    "image-classification": DEFAULT_DATASET,
    "sequence-classification": "tokens",
    "token-classification": "tokens",
}


def default_dataset(task: str, *, language_model: bool = False) -> str:
    """The dataset for a model of ``task`` when none is named (:data:`TASK_DATASETS`).

    Args:
        task: the model's task.
        language_model: the model predicts tokens of its own vocabulary (see
            :func:`is_language_model`): a token-classification one then gets
            :data:`~autoprec.defaults.LANGUAGE_MODEL_DATASET` (next-token prediction).
    """
    key = getattr(task, "value", task)
    if key not in TASK_DATASETS:
        raise DatasetError(f"unknown task {key!r}; expected one of {', '.join(TASK_DATASETS)}")
    if language_model and key == "token-classification":
        return LANGUAGE_MODEL_DATASET
    return TASK_DATASETS[key]


def is_language_model(spec: Any) -> bool:
    """Whether ``spec`` (``task``, ``num_classes``, ``vocab_size``) predicts a token of its own
    vocabulary at each position: token-classification with as many classes as token ids."""
    task = getattr(spec, "task", None)
    vocab = getattr(spec, "vocab_size", None)
    return (
        getattr(task, "value", task) == "token-classification"
        and vocab is not None
        and getattr(spec, "num_classes", None) == vocab
    )


def list_datasets() -> list[dict[str, Any]]:
    """One dict per dataset: name, description, tasks, num_classes, needs_root, offline."""
    return [
        {
            "name": name,
            "description": entry.description,
            "tasks": list(entry.tasks),
            "num_classes": entry.num_classes,
            "needs_root": entry.needs_root,
            "offline": not entry.needs_root,
        }
        for name, entry in _REGISTRY.items()
    ]


def load_dataset(
    name: str,
    *,
    input_shape: tuple[int, ...],
    num_classes: int | None = None,
    task: str | None = None,
    root: str | os.PathLike[str] | None = None,
    download: bool = False,
    seed: int = 0,
    val_fraction: float = 0.2,
    max_samples: int | None = None,
    vocab_size: int | None = None,
) -> DataBundle:
    """Load dataset ``name`` shaped for a model with the given input and outputs.

    Args:
        name: one of :func:`list_datasets` (case-insensitive).
        input_shape: one example without the batch dimension, ``(C, H, W)`` (also ``(H, W)``
            or a flat ``(D,)`` for images) or ``(seq_len,)`` for token models.
        num_classes: the model's number of outputs; ``None`` takes the dataset's.
        task: the model's task; ``None`` infers it from the dataset.
        root: data directory for ``cifar10``, ``cifar100`` and ``imagefolder``.
        download: let torchvision fetch CIFAR into ``root``; nothing is downloaded otherwise.
        seed: seeds generated data, its teacher, and the train/val split.
        val_fraction: share of examples held out for validation.
        max_samples: cap on train + val examples (size of generated sets; default 2048).
        vocab_size: the model's vocabulary, for token tasks.

    Returns:
        A :class:`DataBundle` whose ``key`` identifies these settings.

    Raises:
        DatasetError: unknown name, missing files, or a request the dataset cannot satisfy.
    """
    key = name.strip().lower()
    entry = _REGISTRY.get(key)
    if entry is None:
        close = difflib.get_close_matches(key, list(_REGISTRY), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise DatasetError(
            f"unknown dataset {name!r}; {hint}expected one of {', '.join(_REGISTRY)}"
        )
    req = DataRequest(
        name=key,
        input_shape=tuple(input_shape),
        num_classes=num_classes,
        task=task,
        root=Path(root) if root is not None else None,
        download=download,
        seed=seed,
        val_fraction=val_fraction,
        max_samples=max_samples,
        vocab_size=vocab_size,
    )
    bundle = entry.load(req)
    cache_key = req.key(
        num_classes=bundle.num_classes,
        task=bundle.task,
        uses_root=entry.needs_root,
        uses_vocab=bundle.vocab_size is not None,
    )
    corpus = bundle.metadata.get("corpus")
    if corpus is not None:  # data read from files that can change: their hash is in the key
        cache_key = f"{cache_key}-{corpus['sha256'][:12]}"
    return dataclasses.replace(bundle, key=cache_key)


def load_dataset_for(spec: Any, name: str | None = None, **kwargs: Any) -> DataBundle:
    """Load ``name`` for a model spec (anything with ``input_shape``, ``num_classes``, ``task``,
    ``vocab_size`` attributes, e.g. ``autoprec.models.ModelSpec``).

    ``name`` None takes the default for the spec's task (:func:`default_dataset`: ``tokens``
    for models that read token ids, ``teacher-text`` for language models, see
    :func:`is_language_model`). Keyword arguments are passed to :func:`load_dataset` and
    override the spec's values.
    """
    settings: dict[str, Any] = {
        field: getattr(spec, field, None)
        for field in ("input_shape", "num_classes", "task", "vocab_size")
    }
    if settings["input_shape"] is None and "input_shape" not in kwargs:
        raise DatasetError(f"{type(spec).__name__} has no input_shape; pass input_shape=...")
    settings.update(kwargs)
    if name is None:
        language_model = is_language_model(SimpleNamespace(**settings))
        name = default_dataset(
            settings["task"] or "image-classification", language_model=language_model
        )
    return load_dataset(name, **settings)
