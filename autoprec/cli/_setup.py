"""What ``autoprec search`` and ``autoprec migrate`` both build before their first evaluation."""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

import click

from autoprec.defaults import DEFAULT_DATASET

F = TypeVar("F", bound=Callable[..., Any])

FALLBACK_TARGET = "h100-sxm"
SMALL_IMAGE = 32  # fine-tuning image size for torchvision models on a CPU


def model_shape_options(command: F) -> F:
    """``--data-dir``, ``--num-classes`` and ``--image-size`` of ``train`` and ``verify``."""
    for option in reversed(
        [
            click.option(
                "--data-dir", type=click.Path(), default=None, help="Folder for cifar/imagefolder."
            ),
            click.option("--num-classes", type=int, default=10, show_default=True),
            click.option(
                "--image-size", type=int, default=None, help="Input image size (model default)."
            ),
        ]
    ):
        command = option(command)
    return command


def file_option(flag: str, help: str, default: str | None = None) -> Any:
    """A ``--flag FILE`` option (a file path, not a folder)."""
    return click.option(
        flag,
        type=click.Path(dir_okay=False),
        default=default,
        show_default=default is not None,
        help=help,
    )


def fallback_note(doing: str) -> str:
    """The line that says a CPU-only run targets :data:`FALLBACK_TARGET` (``doing``:
    ``"optimising"``, ``"migrating"``)."""
    return (
        f"no GPU here: {doing} for {FALLBACK_TARGET} (choose with --target); precisions are "
        "emulated and costs predicted by the cost model"
    )


def resolve_target(name: str | None) -> tuple[Any, bool]:
    """``(device, fell_back)``: ``name``, else the local GPU, else :data:`FALLBACK_TARGET`."""
    from autoprec.hardware import detect, get_device

    if name is not None:
        return get_device(name), False
    local = detect()
    if local.name != "cpu":
        return local, False
    return get_device(FALLBACK_TARGET), True


def model_options(*, required: bool, purpose: str) -> Callable[[F], F]:
    """``--model``, ``--dataset``, ``--data-dir`` and ``--target``: what to build.

    Args:
        required: whether ``--model`` must be given (``search`` can read it from ``--config``).
        purpose: what the target is for, as ``--help`` says it (``"optimise"``, ``"migrate"``).
    """
    options = [
        click.option(
            "--model",
            "model_name",
            required=required,
            default=None,
            help="Model name (see `autoprec models`).",
        ),
        click.option(
            "--dataset",
            default=None,
            help=f"Data for fine-tuning (default: {DEFAULT_DATASET}; tokens for token models).",
        ),
        click.option(
            "--data-dir", type=click.Path(), default=None, help="Folder for cifar/imagefolder."
        ),
        click.option(
            "--target",
            default=None,
            help=f"Accelerator to {purpose} for (default: the local GPU; without one, "
            f"{FALLBACK_TARGET}).",
        ),
    ]
    return lambda command: _apply(options, command)


def evaluator_options(command: F) -> F:
    """The options :func:`build_evaluator` reads beside the model, data and target: ``--seed``,
    ``--num-classes``, ``--image-size``, ``--train-batch-size``, ``--train-image-size``."""
    options = [
        click.option("--seed", type=int, default=0, show_default=True),
        click.option("--num-classes", type=int, default=10, show_default=True),
        click.option(
            "--image-size",
            type=int,
            default=None,
            help=f"Fine-tuning image size (default {SMALL_IMAGE} for torchvision models).",
        ),
        click.option(
            "--train-batch-size",
            type=int,
            default=256,
            show_default=True,
            help="Production batch size: the step time and memory are predicted for it.",
        ),
        click.option(
            "--train-image-size",
            type=int,
            default=None,
            help="Production image size for the cost (default: the model's own, 224 for "
            "torchvision).",
        ),
    ]
    return _apply(options, command)


def _apply(options: list[Callable[[F], F]], command: F) -> F:
    """``options`` on ``command``, listed by ``--help`` in the order given."""
    for option in reversed(options):  # decorators apply bottom-up
        command = option(command)
    return command


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
