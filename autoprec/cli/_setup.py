"""What ``autoprec search`` and ``autoprec migrate`` both build before their first evaluation."""

from __future__ import annotations

import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

FALLBACK_TARGET = "h100-sxm"
SMALL_IMAGE = 32  # fine-tuning image size for torchvision models on a CPU


def resolve_target(name: str | None) -> tuple[Any, bool]:
    """``(device, fell_back)``: ``name``, else the local GPU, else :data:`FALLBACK_TARGET`."""
    from autoprec.hardware import detect, get_device

    if name is not None:
        return get_device(name), False
    local = detect()
    if local.name != "cpu":
        return local, False
    return get_device(FALLBACK_TARGET), True


def check_writable(folders: Iterable[Path], error: type[Exception]) -> None:
    """Raise ``error`` before any work if a file cannot be created in one of ``folders``."""
    for folder in folders:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=folder, prefix=".autoprec-probe-"):
                pass
        except OSError as err:
            raise error(f"cannot write to {folder}: {err.strerror or err}") from None


def build_evaluator(o: dict[str, Any], device: Any, fidelity: str = "short") -> Any:
    """Model, data and evaluator from the shared options: fine-tuning at ``--image-size``
    (:data:`SMALL_IMAGE` for torchvision models) on ``--dataset`` (None: the default for the
    model's task, written back into ``o["dataset"]`` for what is printed and logged), costs at
    ``--train-batch-size`` and ``--train-image-size`` (default: the model's own), feasibility
    in ``--target-mode``."""
    from autoprec.data import default_dataset, load_dataset_for
    from autoprec.evaluate import Evaluator
    from autoprec.models import load_model

    name, classes = o["model_name"], o["num_classes"]
    spec = load_model(name, num_classes=classes)
    image_size = o["image_size"]
    if image_size is None and len(spec.input_shape) == 3 and spec.input_shape[-1] == 224:
        image_size = SMALL_IMAGE
    cost_spec = spec
    if o["train_image_size"] is not None and len(spec.input_shape) == 3:
        cost_spec = load_model(name, num_classes=classes, image_size=o["train_image_size"])
    if image_size is not None:
        spec = load_model(name, num_classes=classes, image_size=image_size)
    data_kwargs: dict[str, Any] = {"seed": o["seed"]}
    if o["data_dir"]:
        data_kwargs["root"] = o["data_dir"]
    if o["dataset"] is None:
        o["dataset"] = default_dataset(spec.task)
    data = load_dataset_for(spec, o["dataset"], **data_kwargs)
    return Evaluator(
        spec,
        data,
        target=device,
        fidelity=fidelity,
        steps=o["steps"],
        seed=o["seed"],
        cost_spec=cost_spec,
        cost_batch_size=o["train_batch_size"],
        target_mode=o.get("target_mode") or "native",
    )
