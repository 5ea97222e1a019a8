"""What a search trains and what it prices: the model, its data, the production shape, the target.

One :class:`Workload` (model, dataset, shapes, classes, costing batch) and one
:func:`build_evaluator` that builds the model, its data and the evaluator from it, for the
search (:mod:`autoprec.pipeline`), ``autoprec migrate``, the environment factory
(:func:`autoprec.envs.make_env`) and the experiments.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from autoprec.evaluate.config import EvaluatorConfig

if TYPE_CHECKING:  # pragma: no cover
    from pathlib import Path

    from autoprec.data import DataBundle
    from autoprec.evaluate.evaluator import Evaluator
    from autoprec.hardware import DeviceSpec
    from autoprec.models import ModelSpec

#: The production batch the cost model prices when none is named (a common per-GPU batch of
#: the image models it was first built for).
DEFAULT_TRAIN_BATCH = 256
#: The target of a machine without a GPU.
FALLBACK_TARGET = "h100-sxm"
SMALL_IMAGE = 32  # fine-tuning image size for torchvision models on a CPU


@dataclass(frozen=True)
class Workload:
    """The model a search fine-tunes, on what data, and the production shape it prices.

    Args:
        model: a model name or ``module:factory``.
        dataset: the fine-tuning data (None: the default for the model's task).
        data_dir: the folder of cifar / imagefolder data.
        num_classes: the model's classes (None: the model's default).
        image_size: the fine-tuning image size (None: the model's own; but see
            ``small_image``).
        small_image: without ``image_size``, fine-tune a model made for 224x224 inputs
            (torchvision's) and a user's factory that needs a size at :data:`SMALL_IMAGE`.
        train_shape: a named production shape for the costs (``llama3-8b``).
        train_image_size: the production image size for the costs (None: the model's own).
        cost_batch_size: the production batch (None: the evaluator's default, the fine-tuning
            batch; :meth:`resolved` chooses the search's).
        seed: the data's seed.
        init_weights: a weights file the model starts from instead of fresh weights: a
            checkpoint of ``autoprec train`` or a state dict (continued training; the
            evaluator's warm start, keyed by the initial weights, continues from it).
        max_samples: the examples the data keeps, train and validation together (its
            ``max_samples``; None: the dataset's own size).
    """

    model: str
    dataset: str | None = None
    data_dir: str | None = None
    num_classes: int | None = 10
    image_size: int | None = None
    small_image: bool = True
    train_shape: str | None = None
    train_image_size: int | None = None
    cost_batch_size: int | None = None
    seed: int = 0
    init_weights: str | None = None
    max_samples: int | None = None

    def resolved(self) -> Workload:
        """This workload with the search's costing batch: ``cost_batch_size``, else the named
        shape's per-GPU batch, else :data:`DEFAULT_TRAIN_BATCH`."""
        if self.cost_batch_size is not None:
            return self
        from autoprec.models.llama import PRODUCTION_BATCH

        batch = PRODUCTION_BATCH if self.train_shape else DEFAULT_TRAIN_BATCH
        return replace(self, cost_batch_size=batch)


def fallback_note(doing: str) -> str:
    """The line that says a CPU-only run targets :data:`FALLBACK_TARGET` (``doing``:
    ``"optimising"``, ``"migrating"``)."""
    return (
        f"no GPU here: {doing} for {FALLBACK_TARGET} (choose with --target); precisions are "
        "emulated and costs predicted by the cost model"
    )


def resolve_target(name: str | None) -> tuple[DeviceSpec, bool]:
    """``(device, fell_back)``: ``name``, else the local GPU, else :data:`FALLBACK_TARGET`."""
    from autoprec.hardware import detect, get_device

    if name is not None:
        return get_device(name), False
    local = detect()
    if local.name != "cpu":
        return local, False
    return get_device(FALLBACK_TARGET), True


def production_spec(
    spec: ModelSpec,
    name: str,
    num_classes: int | None,
    train_shape: str | None = None,
    train_image_size: int | None = None,
) -> ModelSpec:
    """The model ``name`` as production trains it, for the cost model: at the named shape
    ``train_shape`` (built on the meta device: only its shapes are analysed, and its weights
    could take many GB), else, for an image model, at ``train_image_size``; else ``spec``.

    Raises:
        autoprec.models.ModelError: the model has no shape ``train_shape`` (the message lists
            the valid names).
    """
    from autoprec.models import load_model

    classes = {} if num_classes is None else {"num_classes": num_classes}
    if train_shape is not None:
        import torch

        with torch.device("meta"):
            return load_model(name, shape=train_shape, **classes)
    if train_image_size is not None and len(spec.input_shape) == 3:
        return load_model(name, image_size=train_image_size, **classes)
    return spec


def production_parameters(workload: Workload, cost_spec: ModelSpec) -> int:
    """Parameters of the model production trains: at a named shape of a zoo Llama, the named
    model at its own depth (``llama3-8b``: Meta's 8.03B; the cost spec keeps the zoo model's
    depth, and for ``llama-moe`` every expert counts); else the cost spec's."""
    from autoprec.models.llama import Llama, config_parameters

    module = cost_spec.module
    if workload.train_shape is not None and isinstance(module, Llama):
        from autoprec.models import llama, moe

        family = moe if isinstance(module, moe.LlamaMoE) else llama
        depth = family.PRODUCTION_SHAPES[workload.train_shape].n_layers
        return config_parameters(replace(module.config, n_layers=depth), type(module))
    return sum(p.numel() for p in module.parameters())


class InitWeightsError(ValueError):
    """``init_weights`` cannot be read or does not fit the model."""


def _initial(spec: ModelSpec, workload: Workload) -> ModelSpec:
    """``spec`` with ``workload.init_weights`` loaded (as it is without one)."""
    if workload.init_weights is not None:
        from autoprec.training.checkpoint import load_model_weights, read_model_weights

        path = workload.init_weights
        weights = read_model_weights(path, InitWeightsError)
        load_model_weights(spec.module, weights, path, InitWeightsError)
    return spec


def _classes(workload: Workload) -> dict[str, int]:
    return {} if workload.num_classes is None else {"num_classes": workload.num_classes}


def _own_spec(workload: Workload, seed: int | None) -> tuple[ModelSpec, int | None]:
    """The model at its own size (a factory that needs a size: at the fine-tuning size) and
    the fine-tuning image size (None: that same size); the initial weights of ``seed``."""
    from autoprec.models import InputShapeError, load_model

    name, image_size, classes = workload.model, workload.image_size, _classes(workload)
    try:
        spec = load_model(name, seed=seed, **classes)
    except InputShapeError:
        if not workload.small_image and image_size is None:
            raise
        # a user's factory that builds at the size it is given: image_size, else the small
        # size analyze offers it; that is its own size (the costs' too, but for
        # train_image_size or train_shape)
        image_size = image_size or SMALL_IMAGE
        spec = load_model(name, image_size=image_size, seed=seed, **classes)
    small = workload.small_image and len(spec.input_shape) == 3 and spec.input_shape[-1] == 224
    if image_size is None and small:
        image_size = SMALL_IMAGE
    return spec, image_size


def training_spec(workload: Workload, *, seed: int | None = 0) -> ModelSpec:
    """The model ``workload`` fine-tunes or trains: at ``image_size`` when given, else at its
    own size (see ``small_image``), its initial weights drawn with ``seed``
    (:func:`autoprec.models.load_model`)."""
    from autoprec.models import load_model

    if workload.image_size is not None:  # the size _own_spec would end at, loaded directly
        return _initial(
            load_model(
                workload.model, image_size=workload.image_size, seed=seed, **_classes(workload)
            ),
            workload,
        )
    spec, image_size = _own_spec(workload, seed)
    if image_size is None:
        return _initial(spec, workload)
    spec = load_model(workload.model, image_size=image_size, seed=seed, **_classes(workload))
    return _initial(spec, workload)


def workload_data(spec: ModelSpec, workload: Workload) -> DataBundle:
    """``workload``'s data for ``spec`` (:func:`autoprec.data.load_dataset_for`): its
    dataset (None: the default for the model's task) from ``data_dir``, seeded by ``seed``,
    with at most ``max_samples`` examples."""
    from autoprec.data import load_dataset_for

    options: dict[str, Any] = {"root": workload.data_dir} if workload.data_dir else {}
    if workload.max_samples is not None:
        options["max_samples"] = workload.max_samples
    return load_dataset_for(spec, workload.dataset, seed=workload.seed, **options)


def build_evaluator(
    workload: Workload,
    device: DeviceSpec | str,
    config: EvaluatorConfig | None = None,
    *,
    cache_dir: str | Path | None = None,
) -> tuple[Evaluator, Workload]:
    """Model, data and evaluator of ``workload``, and the workload with the dataset's name
    filled in (for what is printed and logged).

    Fine-tuning at ``image_size`` (see ``small_image``), costs at ``cost_batch_size`` and
    ``train_shape`` or ``train_image_size`` (:func:`production_spec`). ``config``: the
    evaluator's settings (None: the defaults); its seed is the workload's, and its
    ``cost_batch_size``, when None, the workload's. ``cache_dir``: the evaluator's.
    """
    from autoprec.evaluate.evaluator import Evaluator
    from autoprec.models import load_model

    spec, image_size = _own_spec(workload, 0)
    cost_spec = production_spec(
        spec, workload.model, workload.num_classes, workload.train_shape, workload.train_image_size
    )
    if image_size is not None:
        spec = load_model(workload.model, image_size=image_size, **_classes(workload))
    spec = _initial(spec, workload)
    data = workload_data(spec, workload)
    workload = replace(workload, dataset=workload.dataset or data.name)
    config = replace(EvaluatorConfig() if config is None else config, seed=workload.seed)
    if config.cost_batch_size is None and workload.cost_batch_size is not None:
        config = replace(config, cost_batch_size=workload.cost_batch_size)
    evaluator = Evaluator(
        spec, data, target=device, config=config, cache_dir=cache_dir, cost_spec=cost_spec
    )
    return evaluator, workload
