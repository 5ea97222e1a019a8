"""Every torchvision classification model, built without weights (nothing is downloaded).

Input images are ``(3, S, S)``: ``S`` is 224 by default (299 for ``inception_v3``) and any
``image_size`` the architecture can run. Each architecture's smallest size was measured with
torchvision 0.29 (a forward pass on the meta device); Vision Transformers need a multiple of
their patch size and MaxViT a multiple of 224 (its 7x7 partitions at every stage).
"""

from __future__ import annotations

import re
from functools import cache
from typing import Any

from autoprec.models.spec import ModelError, ModelSpec, Task

DEFAULT_IMAGE_SIZE = 224
_NATIVE_SIZE = {"inception_v3": 299}

# smallest square input each architecture runs (by name prefix); absent means 1
_MIN_SIZE = {
    "alexnet": 63,
    "convnext_": 32,
    "densenet": 29,
    "googlenet": 15,
    "inception_v3": 75,
    "squeezenet1_0": 21,
    "squeezenet1_1": 17,
    "swin_": 4,
    "vgg": 32,
}
# builders that want extra arguments to build without pretrained weights
_EXTRA_KWARGS: dict[str, dict[str, Any]] = {
    # no auxiliary heads: forward returns plain logits in training too
    "googlenet": {"aux_logits": False, "init_weights": True},
    "inception_v3": {"aux_logits": False, "init_weights": True},
}
_VIT = re.compile(r"vit_[a-z]_(\d+)")


@cache
def torchvision_names() -> tuple[str, ...]:
    """Names of torchvision's classification models (``torchvision.models`` itself)."""
    import torchvision

    return tuple(sorted(torchvision.models.list_models(module=torchvision.models)))


def default_image_size(name: str) -> int:
    return _NATIVE_SIZE.get(name, DEFAULT_IMAGE_SIZE)


def _size_kwargs(name: str, size: int) -> dict[str, Any]:
    """Check ``size`` for architecture ``name``; the builder arguments that set it, if any."""
    if size < 1:
        raise ModelError(f"image_size must be a positive int, got {size}")
    vit = _VIT.fullmatch(name)
    if vit:
        patch = int(vit.group(1))
        if size % patch:
            lower, upper = max(size // patch, 1) * patch, (size // patch + 1) * patch
            raise ModelError(
                f"{name} cuts images into {patch}x{patch} patches, so image_size must be a "
                f"multiple of {patch}; got {size} (try {lower} or {upper})"
            )
        return {"image_size": size}
    if name.startswith("maxvit"):
        if size % 224:
            raise ModelError(
                f"{name} needs image_size a multiple of 224 (7x7 partitions at strides 4 to 32); "
                f"got {size}"
            )
        return {"input_size": (size, size)}
    low = next((v for k, v in _MIN_SIZE.items() if name.startswith(k)), 1)
    if size < low:
        raise ModelError(f"{name} needs image_size >= {low} (its feature maps vanish), got {size}")
    return {}


def build_torchvision(
    name: str, num_classes: int, image_size: int | None = None, in_channels: int | None = None
) -> ModelSpec:
    """Build torchvision model ``name`` with random weights and a ``num_classes`` head.

    Raises:
        ModelError: ``image_size`` the architecture cannot run, or ``in_channels`` other than 3.
    """
    from torchvision.models import get_model_builder

    if in_channels not in (None, 3):
        raise ModelError(f"{name} takes 3-channel images; got in_channels={in_channels}")
    size = default_image_size(name) if image_size is None else image_size
    kwargs = {**_EXTRA_KWARGS.get(name, {}), **_size_kwargs(name, size)}
    module = get_model_builder(name)(weights=None, num_classes=num_classes, **kwargs)
    return ModelSpec(
        name, module, (3, size, size), Task.IMAGE_CLASSIFICATION, num_classes, family="torchvision"
    )
