"""``make_env``: a :class:`~autoprec.envs.PrecisionEnv` by model name, registered as
``autoprec/PrecisionSearch-v0`` (what ``gymnasium.make`` and the worker processes of
:func:`autoprec.envs.vec.make_vec` call).

The environment takes its evaluator's pieces; this module builds the model, its data and the
evaluator from names first, so that every keyword argument is a plain, picklable value.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from autoprec.defaults import DEFAULT_DATASET
from autoprec.envs.precision_env import DEFAULT_PRECISIONS, PrecisionEnv, action_set
from autoprec.evaluate.reward import DEFAULT_TOLERANCE, RewardConfig

if TYPE_CHECKING:  # pragma: no cover
    from autoprec.evaluate import Evaluator


def make_env(
    model: str = "tinycnn",
    dataset: str = DEFAULT_DATASET,
    target: str = "h100-sxm",
    fidelity: str = "short",
    precisions: Sequence[str] = DEFAULT_PRECISIONS,
    reward_weights: Mapping[str, float] | None = None,
    accuracy_tolerance: float = DEFAULT_TOLERANCE,
    evaluator: Evaluator | None = None,
    seed: int = 0,
    steps: int | None = None,
    image_size: int | None = None,
    render_mode: str | None = None,
    *,
    warm_start_steps: int | None = None,
    target_speedup: float | None = None,
    evaluator_kwargs: Mapping[str, Any] | None = None,
) -> PrecisionEnv:
    """The environment of ``model`` fine-tuned on ``dataset``, costed on ``target``.

    Example:
        >>> import gymnasium, autoprec.envs
        >>> env = gymnasium.make("autoprec/PrecisionSearch-v0", model="tinycnn")  # doctest: +SKIP

    Args:
        model: a model name for :func:`autoprec.models.load_model`, with the dataset's number
            of classes (the model's default for a dataset of any).
        dataset: a dataset name for :func:`autoprec.data.load_dataset_for`.
        target: a device name from the database (the precisions and costs of the search).
        fidelity: the evaluator's fidelity (``"short"`` or ``"full"``).
        precisions: the action set, in action order.
        reward_weights: ``{"speedup", "memory", "accuracy"}`` weights; missing keys keep the
            defaults.
        accuracy_tolerance: the ``loss_delta`` above which the tolerance penalty applies.
        evaluator: an existing :class:`~autoprec.evaluate.Evaluator` to use; then ``model``,
            ``dataset``, ``target``, ``fidelity``, ``seed``, ``steps``, ``warm_start_steps``,
            ``image_size`` and ``evaluator_kwargs`` are ignored.
        seed: the evaluator's seed (warm start, data order); the environment's own randomness
            is seeded by ``reset(seed=...)``.
        steps: fine-tuning steps at ``"short"`` fidelity (None: the evaluator's default).
        image_size: passed to ``load_model``.
        render_mode: None or ``"ansi"``.
        warm_start_steps: fp32 warm-start steps (None: the evaluator's default).
        target_speedup: turns on the environment's budget mode; None turns it off.
        evaluator_kwargs: further keyword arguments for ``Evaluator`` (``batch_size``,
            ``lr``, ``cache_dir``).

    Raises:
        ValueError: an unknown precision, an empty or duplicated action set, an unknown reward
            weight, a negative tolerance, or a layer for which no listed precision runs on the
            target.
    """
    from autoprec.hardware.runnability import runnable_precisions

    reward = RewardConfig(reward_weights, accuracy_tolerance)
    actions = action_set(precisions)
    if evaluator is None:
        kwargs = dict(evaluator_kwargs or {})
        if warm_start_steps is not None:
            kwargs["warm_start_steps"] = warm_start_steps
        evaluator = _build_evaluator(
            model, dataset, target, fidelity, seed, steps, image_size, kwargs
        )
    device = evaluator.device
    table = evaluator.cost_table()
    if not table.rows:  # refused before the surrogate's warm start and sensitivities
        from autoprec.layers import NoTunableLayerError

        raise NoTunableLayerError.of(table.model)
    sensitivity = evaluator.surrogate().table
    supported = [p for p in actions if device.supports(p)]
    if not supported:
        raise ValueError(
            f"none of the precisions {', '.join(p.value for p in actions)} runs on "
            f"{device.name} (it supports {', '.join(device.supported_precisions)}); "
            "add one of those to precisions"
        )
    # one table for every agent's masks (agents.base.layer_choices reads the same)
    choices = runnable_precisions(table, device, supported, evaluator.target_mode)
    return PrecisionEnv(
        evaluator.evaluate,
        table,
        sensitivity,
        device,
        reward,
        actions,
        choices,
        target_speedup=target_speedup,
        render_mode=render_mode,
    )


def _build_evaluator(
    model: str,
    dataset: str,
    target: str,
    fidelity: str,
    seed: int,
    steps: int | None,
    image_size: int | None,
    evaluator_kwargs: dict[str, Any],
) -> Evaluator:
    """The evaluator of ``model`` on ``dataset``, the model sized to the dataset's classes and
    fine-tuned at ``image_size`` (None: its own), costed at its own shape
    (:func:`autoprec.evaluate.workload.build_evaluator`)."""
    from autoprec.data import list_datasets
    from autoprec.evaluate.workload import Workload, build_evaluator

    classes = {d["name"]: d["num_classes"] for d in list_datasets()}.get(dataset.strip().lower())
    workload = Workload(
        model, dataset, num_classes=classes, image_size=image_size, small_image=False, seed=seed
    )
    settings = {"fidelity": fidelity, "steps": steps, **evaluator_kwargs}
    return build_evaluator(workload, target, **settings)[0]
