"""``load_model`` and ``list_models``: one entry point for every model family.

Names are looked up in this order: the user's ``"package.module:factory"`` (any name with a
colon), the built-in models, the Hugging Face models, then torchvision's classification models.

Example:
    >>> spec = load_model("resnet18", num_classes=10, image_size=32)
    >>> spec.input_shape, spec.family
    ((3, 32, 32), 'torchvision')
"""

from __future__ import annotations

import difflib
from typing import Any

import torch

from autoprec._memory import check_fits
from autoprec.models.builtin import BUILTIN_MODELS
from autoprec.models.hf import HF_MODELS, build_hf, hf_available
from autoprec.models.spec import FAMILIES, ModelError, ModelSpec, Task, UnknownModelError
from autoprec.models.torchvision_models import (
    build_torchvision,
    default_image_size,
    torchvision_names,
)
from autoprec.models.user import build_user, is_user_path


def _known_names() -> list[str]:
    return [*BUILTIN_MODELS, *HF_MODELS, *torchvision_names()]


def _unknown(name: str) -> UnknownModelError:
    names = _known_names()
    close = difflib.get_close_matches(name.lower(), names, n=5, cutoff=0.6)
    close += [n for n in names if n.startswith(name.lower()) and n not in close][: 5 - len(close)]
    hint = f"did you mean {', '.join(close)}? " if close else ""
    return UnknownModelError(
        f"unknown model {name!r}; {hint}`autoprec models` lists them all, and "
        f"'package.module:factory' loads your own"
    )


def load_model(
    name: str,
    num_classes: int = 10,
    image_size: int | None = None,
    *,
    in_channels: int | None = None,
    seq_len: int | None = None,
    seed: int | None = 0,
    shape: str | None = None,
) -> ModelSpec:
    """Build a model by name, with random weights (nothing is downloaded).

    Args:
        name: a torchvision classification model (``resnet50``, ``vit_b_16``, ...), a built-in
            model (``mlp``, ``tinycnn``, ``tinytransformer``, ``llama``, ``llama-moe``), a
            Hugging Face model (``bert-tiny``, ``gpt2-small``; needs ``pip install
            autoprec[hf]``) or the user's own ``"package.module:factory"``.
        num_classes: size of the classification head.
        image_size: side ``S`` of square input images (``(C, S, S)``); None keeps the model's
            default (224 for torchvision, 8 for the built-in image models).
        in_channels: image channels, for the built-in image models and user factories.
        seq_len: sequence length, for token models (default 16 built-in, 128 Hugging Face).
        seed: the random initial weights are drawn from ``torch.manual_seed(seed)`` (the
            global RNG is left as it was), so the same call builds the same weights in every
            process; None draws from the global RNG as plain construction would.
        shape: a named production shape of the model (:func:`model_shapes`; ``llama``'s
            ``llama3-8b``, ..., ``llama-moe``'s ``mixtral-8x7b``): its widths, heads,
            vocabulary and sequence length with the default model's depth and layer names,
            for the cost model. Build it under
            ``with torch.device("meta"):``, as its weights can take many GB.

    Returns:
        The model with its input shape and dtype, task, loss and example batches.

    Raises:
        UnknownModelError: no family knows ``name``; the message suggests close names.
        ModelError: the model cannot be built as asked (image size, missing extra, a shape
            it does not have, ...).
        SizeError: its weights, or one input, would not fit in the machine's memory (the
            message names the setting to lower).
    """
    if not isinstance(num_classes, int) or num_classes < 1:
        raise ModelError(f"num_classes must be a positive int, got {num_classes!r}")
    for arg, value in (("image_size", image_size), ("in_channels", in_channels)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ModelError(f"{arg} must be a positive int or None, got {value!r}")
    if seq_len is not None and (not isinstance(seq_len, int) or seq_len < 1):
        raise ModelError(f"seq_len must be a positive int or None, got {seq_len!r}")
    if shape is not None:
        _check_shape(name.strip(), shape)
    args = (name.strip(), num_classes, image_size, in_channels, seq_len, shape)
    if torch.get_default_device().type != "meta":
        _check_parameters(*args)
    if seed is None:
        spec = _build(*args)
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            spec = _build(*args)
    if torch.get_default_device().type != "meta":
        spec.check_batch(1)  # e.g. image_size 100000, or a user's huge autoprec_input_shape
    return spec


def _check_parameters(name: str, num_classes: int, *args: Any) -> None:
    """Raise :class:`~autoprec._memory.SizeError` if the model's fp32 weights would not fit in
    the machine's memory, counted on a copy built on the meta device (which allocates
    nothing) before the real one is built; a user's factory is not built twice."""
    if is_user_path(name):
        return
    try:
        with torch.device("meta"):
            module = _build(name, num_classes, *args).module
    except Exception:  # noqa: BLE001 - the real build reports its own errors
        return
    params = list(module.parameters())
    total = sum(p.numel() for p in params)
    largest = max(params, key=lambda p: p.numel(), default=None)
    if largest is not None and num_classes in largest.shape and num_classes > 1:
        fix = f"lower num_classes ({num_classes:,}; its classifier alone has {largest.numel():,})"
    else:
        fix = "choose a smaller model, or a smaller image size or sequence length"
    check_fits(total * 4, f"model {name!r} with {total:,} parameters (fp32)", fix)


def model_shapes(name: str) -> dict[str, str]:
    """The named production shapes of zoo model ``name``, name to a one-line description;
    ``{}`` for a model without any (every model but ``llama`` and ``llama-moe`` today)."""
    entry = BUILTIN_MODELS.get(name.strip().lower())
    return dict(entry.shapes) if entry is not None else {}


def _check_shape(name: str, shape: str) -> None:
    shapes = model_shapes(name)
    if not shapes:
        having = [n for n, entry in BUILTIN_MODELS.items() if entry.shapes]
        raise ModelError(
            f"model {name!r} has no named shapes; models with named shapes: {', '.join(having)}"
            " (image models take a production image size instead)"
        )
    if shape not in shapes:
        raise ModelError(f"unknown shape {shape!r} for {name}; expected one of {', '.join(shapes)}")


def _build(
    name: str,
    num_classes: int,
    image_size: int | None,
    in_channels: int | None,
    seq_len: int | None,
    shape: str | None = None,
) -> ModelSpec:
    if shape is not None:
        build_shape = BUILTIN_MODELS[name.lower()].build_shape
        if build_shape is None:  # an entry with shapes and no builder for them
            raise ModelError(f"model {name!r} lists shapes but cannot build them")
        return build_shape(shape, image_size, in_channels, seq_len)
    if is_user_path(name):
        return build_user(name, num_classes, image_size, in_channels, seq_len)
    key = name.lower()
    if key in BUILTIN_MODELS:
        return BUILTIN_MODELS[key].build(num_classes, image_size, in_channels, seq_len)
    if key in HF_MODELS:
        if image_size is not None or in_channels is not None:
            raise ModelError(f"{key} reads token ids; image_size and in_channels do not apply")
        return build_hf(key, num_classes, seq_len)
    if key in torchvision_names():
        if seq_len is not None:
            raise ModelError(f"{key} reads images; seq_len does not apply (use image_size)")
        return build_torchvision(key, num_classes, image_size, in_channels)
    raise _unknown(name)


def model_task(name: str) -> str | None:
    """The task of zoo model ``name``, known without building it; None for the user's
    ``"package.module:factory"`` (known once built: ``spec.task``) and for unknown names."""
    if is_user_path(name):
        return None
    key = name.strip().lower()
    if key in BUILTIN_MODELS:
        return str(BUILTIN_MODELS[key].task)
    if key in HF_MODELS:
        return str(HF_MODELS[key].task)
    if key in torchvision_names():
        return Task.IMAGE_CLASSIFICATION.value
    return None


def list_models(family: str | None = None) -> list[dict[str, Any]]:
    """Every model ``load_model`` knows by name (user factories aside), without building any.

    Args:
        family: keep only ``builtin``, ``hf`` or ``torchvision``.

    Returns:
        One dict per model: ``name``, ``family``, ``task``, ``input_shape`` (default, without the
        batch) and ``available`` (False for Hugging Face models without transformers); a model
        with named production shapes also has ``shapes`` (name to description, see
        :func:`model_shapes`).
    """
    if family is not None and family not in FAMILIES:
        raise ModelError(f"unknown family {family!r}; expected one of {', '.join(FAMILIES)}")
    rows: list[dict[str, Any]] = []
    for name, entry in BUILTIN_MODELS.items():
        rows.append(_row(name, "builtin", entry.task, entry.input_shape))
        if entry.shapes:
            rows[-1]["shapes"] = dict(entry.shapes)
    have_hf = hf_available()
    for name, hf_entry in HF_MODELS.items():
        rows.append(_row(name, "hf", hf_entry.task, hf_entry.input_shape, available=have_hf))
    for name in torchvision_names():
        size = default_image_size(name)
        rows.append(_row(name, "torchvision", Task.IMAGE_CLASSIFICATION, (3, size, size)))
    return [r for r in rows if family is None or r["family"] == family]


def _row(
    name: str, family: str, task: str, shape: tuple[int, ...], available: bool = True
) -> dict[str, Any]:
    return {
        "name": name,
        "family": family,
        "task": str(task),
        "input_shape": list(shape),
        "available": available,
    }
