"""Models by name: torchvision's classifiers, small built-in models, Hugging Face models and
the user's own factories, each described by a :class:`ModelSpec` (module, input, task, loss).

Example:
    >>> from autoprec.models import load_model
    >>> spec = load_model("tinycnn", num_classes=10)
    >>> x, y = spec.example_batch(8)
    >>> x.shape, y.shape
    (torch.Size([8, 1, 8, 8]), torch.Size([8]))
"""

from __future__ import annotations

from autoprec.models.registry import list_models, load_model, model_shapes, model_task
from autoprec.models.spec import (
    InputShapeError,
    ModelError,
    ModelSpec,
    Task,
    UnknownModelError,
)

__all__ = [
    "InputShapeError",
    "ModelError",
    "ModelSpec",
    "Task",
    "UnknownModelError",
    "list_models",
    "load_model",
    "model_shapes",
    "model_task",
]
