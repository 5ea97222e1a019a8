"""What ``autoprec search`` and ``autoprec migrate`` both build before their first evaluation."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import click

from autoprec.defaults import DEFAULT_DATASET, LANGUAGE_MODEL_DATASET
from autoprec.evaluate.config import EvaluatorConfig
from autoprec.evaluate.workload import (
    DEFAULT_TRAIN_BATCH,
    FALLBACK_TARGET,
    SMALL_IMAGE,
    Workload,
    fallback_note,
    production_spec,
    resolve_target,
)
from autoprec.pipeline.checks import check_writable
from autoprec.pipeline.config import DEFAULTS

if TYPE_CHECKING:  # pragma: no cover
    from autoprec.evaluate import Evaluator
    from autoprec.hardware import DeviceSpec

__all__ = [
    "SMALL_IMAGE",
    "build_evaluator",
    "check_writable",
    "evaluator_options",
    "fallback_note",
    "file_option",
    "model_options",
    "model_shape_options",
    "production_spec",
    "resolve_target",
    "init_weights_option",
    "train_shape_option",
]
F = TypeVar("F", bound=Callable[..., Any])


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


def init_weights_option(command: F) -> F:
    """``--init-weights FILE``: continued training from a checkpoint (``Workload.init_weights``)."""
    return click.option(
        "--init-weights",
        default=None,
        metavar="FILE",
        type=click.Path(dir_okay=False),
        help="Start from these weights (a state_dict, or an `autoprec train` checkpoint) "
        "instead of fresh ones: continued training from a checkpoint.",
    )(command)


def evaluator_options(command: F) -> F:
    """The options :func:`build_evaluator` reads beside the model, data and target: ``--seed``,
    ``--num-classes``, ``--image-size``, ``--train-batch-size``, ``--train-image-size``,
    ``--train-shape``, ``--init-weights``, ``--max-samples``."""
    options = [
        click.option("--seed", type=int, default=DEFAULTS["seed"], show_default=True),
        click.option("--num-classes", type=int, default=DEFAULTS["num_classes"], show_default=True),
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
        init_weights_option,
        click.option(
            "--max-samples",
            type=int,
            default=None,
            metavar="N",
            help="Keep N examples of the fine-tuning data, train and validation together "
            "(default: the dataset's own size; python-text: 32768 windows).",
        ),
    ]
    return _apply(options, command)


def _apply(options: list[Callable[[F], F]], command: F) -> F:
    """``options`` on ``command``, listed by ``--help`` in the order given."""
    for option in reversed(options):  # decorators apply bottom-up
        command = option(command)
    return command


def build_evaluator(
    o: dict[str, Any], device: DeviceSpec | str, fidelity: str = "short"
) -> Evaluator:
    """Model, data and evaluator from the shared options of ``search`` and ``migrate``
    (:func:`autoprec.evaluate.workload.build_evaluator`); the dataset and the costing batch
    chosen for them are written back into ``o`` for what is printed and logged."""
    from autoprec.evaluate.workload import build_evaluator as build

    workload = Workload(
        o["model_name"], o["dataset"], o["data_dir"], o["num_classes"], o["image_size"],
        train_shape=o.get("train_shape"), train_image_size=o.get("train_image_size"),
        cost_batch_size=o.get("train_batch_size"), seed=o["seed"],
        init_weights=o.get("init_weights"), max_samples=o.get("max_samples"),
    ).resolved()  # fmt: skip
    settings = EvaluatorConfig(
        fidelity=fidelity, steps=o["steps"], target_mode=o.get("target_mode") or "native"
    )
    evaluator, workload = build(workload, device, settings)
    o["dataset"], o["train_batch_size"] = workload.dataset, workload.cost_batch_size
    return evaluator
