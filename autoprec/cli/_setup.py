"""What ``autoprec search`` and ``autoprec migrate`` both build before their first evaluation."""

from __future__ import annotations

import errno
import os
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

import click

from autoprec.defaults import DEFAULT_DATASET, LANGUAGE_MODEL_DATASET

F = TypeVar("F", bound=Callable[..., Any])
#: The production batch the cost model prices when none is named (a common per-GPU batch of
#: the image models it was first built for).
DEFAULT_TRAIN_BATCH = 256

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
            help=f"Data for fine-tuning (default: {DEFAULT_DATASET}; tokens for token models, "
            f"{LANGUAGE_MODEL_DATASET} for language models).",
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


def train_shape_option(command: F) -> F:
    """``--train-shape NAME``: a named production shape of the model for the cost."""
    return click.option(
        "--train-shape",
        default=None,
        metavar="NAME",
        help="Production shape for the cost, for models that have named ones (llama: "
        "llama3-8b, ...; see `autoprec models`): the model's own depth and layer names at that "
        "model's widths, heads, vocabulary and sequence length.",
    )(command)


def evaluator_options(command: F) -> F:
    """The options :func:`build_evaluator` reads beside the model, data and target: ``--seed``,
    ``--num-classes``, ``--image-size``, ``--train-batch-size``, ``--train-image-size``,
    ``--train-shape``."""
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
            default=None,
            help="Production batch size: the step time and memory are predicted for it "
            f"(default {DEFAULT_TRAIN_BATCH}; at a --train-shape, that shape's per-GPU batch).",
        ),
        click.option(
            "--train-image-size",
            type=int,
            default=None,
            help="Production image size for the cost (default: the model's own, 224 for "
            "torchvision).",
        ),
        train_shape_option,
    ]
    return _apply(options, command)


def _apply(options: list[Callable[[F], F]], command: F) -> F:
    """``options`` on ``command``, listed by ``--help`` in the order given."""
    for option in reversed(options):  # decorators apply bottom-up
        command = option(command)
    return command


#: Bytes the pre-flight probe writes (and syncs) in each output folder: an empty file can be
#: created on a full disk, a block of data cannot.
PROBE_BYTES = 64 << 10


def check_writable(folders: Iterable[Path], error: type[Exception], prefix: str = "") -> None:
    """Raise ``error`` before any work if :data:`PROBE_BYTES` cannot be written and synced in
    one of ``folders`` (read-only, full, not a folder); one line naming the folder, after
    ``prefix`` (e.g. ``"--csv runs.csv: "``)."""
    for folder in folders:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=folder, prefix=".autoprec-probe-") as probe:
                probe.write(bytes(PROBE_BYTES))
                probe.flush()
                os.fsync(probe.fileno())
        except OSError as err:
            full = err.errno in (errno.ENOSPC, errno.EDQUOT)
            fix = "free some space or choose another folder" if full else "choose another folder"
            why = err.strerror or err
            raise error(f"{prefix}cannot write to {folder}: {why}; {fix}") from None


def production_spec(
    spec: Any,
    name: str,
    num_classes: int,
    train_shape: str | None = None,
    train_image_size: int | None = None,
) -> Any:
    """The model ``name`` as production trains it, for the cost model: at the named shape
    ``train_shape`` (built on the meta device: only its shapes are analysed, and its weights
    could take many GB), else, for an image model, at ``train_image_size``; else ``spec``.

    Raises:
        autoprec.models.ModelError: the model has no shape ``train_shape`` (the message lists
            the valid names).
    """
    from autoprec.models import load_model

    if train_shape is not None:
        import torch

        with torch.device("meta"):
            return load_model(name, num_classes=num_classes, shape=train_shape)
    if train_image_size is not None and len(spec.input_shape) == 3:
        return load_model(name, num_classes=num_classes, image_size=train_image_size)
    return spec


def _cost_batch(o: dict[str, Any]) -> int:
    """``--train-batch-size``, else the named shape's per-GPU batch, else
    :data:`DEFAULT_TRAIN_BATCH`; written back into ``o`` for what is printed and logged."""
    if o.get("train_batch_size") is None:
        from autoprec.models.llama import PRODUCTION_BATCH

        o["train_batch_size"] = PRODUCTION_BATCH if o.get("train_shape") else DEFAULT_TRAIN_BATCH
    return o["train_batch_size"]


def build_evaluator(o: dict[str, Any], device: Any, fidelity: str = "short") -> Any:
    """Model, data and evaluator from the shared options: fine-tuning at ``--image-size``
    (:data:`SMALL_IMAGE` for torchvision models and for a user's factory that needs a size)
    on ``--dataset`` (None: the default for the model's task, written back into
    ``o["dataset"]`` for what is printed and logged), costs at ``--train-batch-size`` and
    ``--train-shape`` or ``--train-image-size`` (default: the model's own;
    :func:`production_spec`), feasibility in ``--target-mode``."""
    from autoprec.data import load_dataset_for
    from autoprec.evaluate import Evaluator
    from autoprec.models import InputShapeError, load_model

    name, classes = o["model_name"], o["num_classes"]
    image_size = o["image_size"]
    try:
        spec = load_model(name, num_classes=classes)
    except InputShapeError:
        # a user's factory that builds at the size it is given: --image-size, else the small
        # size analyze offers it; that is its own size (the costs' too, but for
        # --train-image-size or --train-shape)
        image_size = image_size or SMALL_IMAGE
        spec = load_model(name, num_classes=classes, image_size=image_size)
    if image_size is None and len(spec.input_shape) == 3 and spec.input_shape[-1] == 224:
        image_size = SMALL_IMAGE
    cost_spec = production_spec(
        spec, name, classes, o.get("train_shape"), o.get("train_image_size")
    )
    if image_size is not None:
        spec = load_model(name, num_classes=classes, image_size=image_size)
    data_kwargs: dict[str, Any] = {"seed": o["seed"]}
    if o["data_dir"]:
        data_kwargs["root"] = o["data_dir"]
    data = load_dataset_for(spec, o["dataset"], **data_kwargs)
    if o["dataset"] is None:  # the default for the model's task, named for what is printed
        o["dataset"] = data.name
    return Evaluator(
        spec,
        data,
        target=device,
        fidelity=fidelity,
        steps=o["steps"],
        seed=o["seed"],
        cost_spec=cost_spec,
        cost_batch_size=_cost_batch(o),
        target_mode=o.get("target_mode") or "native",
    )
