"""``make_env``: a :class:`~autoprec.envs.PrecisionEnv` of a workload, and
:func:`make_env_by_name`, its keyword form, registered as ``autoprec/PrecisionSearch-v0`` (what
``gymnasium.make`` and the worker processes of :func:`autoprec.envs.vec.make_vec` call).

The environment takes its evaluator's pieces; :func:`make_env` builds the model, its data and
the evaluator from a :class:`~autoprec.evaluate.workload.Workload` and an
:class:`~autoprec.evaluate.EvaluatorConfig` first (:func:`autoprec.evaluate.workload.
build_evaluator`). :func:`make_env_by_name` is the one place that maps plain, picklable keyword
arguments onto those configs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from autoprec.defaults import DEFAULT_DATASET
from autoprec.envs.precision_env import DEFAULT_PRECISIONS, PrecisionEnv, action_set
from autoprec.evaluate.config import EvaluatorConfig
from autoprec.evaluate.reward import DEFAULT_TOLERANCE, RewardConfig
from autoprec.evaluate.workload import Workload, build_evaluator

if TYPE_CHECKING:  # pragma: no cover
    from pathlib import Path

    from autoprec.evaluate import Evaluator

DEFAULT_TARGET = "h100-sxm"


def make_env(
    workload: Workload | None = None,
    config: EvaluatorConfig | None = None,
    reward: RewardConfig | None = None,
    *,
    target: str = DEFAULT_TARGET,
    precisions: Sequence[str] = DEFAULT_PRECISIONS,
    evaluator: Evaluator | None = None,
    render_mode: str | None = None,
    target_speedup: float | None = None,
    cache_dir: str | Path | None = None,
) -> PrecisionEnv:
    """The environment of ``workload``'s model fine-tuned on its data, costed on ``target``.

    Example:
        >>> from autoprec.evaluate import EvaluatorConfig
        >>> from autoprec.evaluate.workload import Workload, build_evaluator
        >>> env = make_env(Workload("tinycnn"), EvaluatorConfig(steps=5))  # doctest: +SKIP

    Args:
        workload: the model, its data (and the data's and evaluator's ``seed``), the
            fine-tuning image size and the costing shape; None: :func:`named_workload` of
            ``"tinycnn"`` on the default dataset.
        config: the evaluator's settings (fidelity, steps, warm start, recipe); None: the
            defaults. Its seed is the workload's.
        reward: how metrics are scored (weights, accuracy tolerance); None: the defaults.
        target: a device name from the database (the precisions and costs of the search).
        precisions: the action set, in action order.
        evaluator: an existing :class:`~autoprec.evaluate.Evaluator` to use; then
            ``workload``, ``config`` and ``target`` are ignored.
        render_mode: None or ``"ansi"``.
        target_speedup: turns on the environment's budget mode; None turns it off.
        cache_dir: the evaluator's (warm starts, evaluations); None: the default.

    Raises:
        ValueError: an unknown precision, an empty or duplicated action set, or a layer for
            which no listed precision runs on the target.
    """
    from autoprec.hardware.runnability import runnable_precisions

    reward = RewardConfig() if reward is None else reward
    actions = action_set(precisions)
    if evaluator is None:
        workload = named_workload("tinycnn") if workload is None else workload
        evaluator = build_evaluator(workload, target, config, cache_dir=cache_dir)[0]
    device = evaluator.device
    table = evaluator.cost_table()
    if not table.rows:  # refused before the surrogate's warm start and sensitivities
        from autoprec.layers import NoTunableLayerError

        raise NoTunableLayerError.of(table.model)
    supported = [p for p in actions if device.supports(p)]
    if not supported:
        raise ValueError(
            f"none of the precisions {', '.join(p.value for p in actions)} runs on "
            f"{device.name} (it supports {', '.join(device.supported_precisions)}); "
            "add one of those to precisions"
        )
    evaluator.grade(p.value for p in supported)  # as a Problem of these precisions does
    sensitivity = evaluator.surrogate().table
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


def named_workload(
    model: str, dataset: str = DEFAULT_DATASET, image_size: int | None = None, seed: int = 0
) -> Workload:
    """The workload of ``model`` on ``dataset`` as the environment builds it by name: the
    model sized to the dataset's classes (the model's default for a dataset of any),
    fine-tuned at ``image_size`` (None: its own), costed at its own shape."""
    from autoprec.data import list_datasets

    classes = {d["name"]: d["num_classes"] for d in list_datasets()}.get(dataset.strip().lower())
    return Workload(
        model, dataset, num_classes=classes, image_size=image_size, small_image=False, seed=seed
    )


def make_env_by_name(
    model: str = "tinycnn",
    dataset: str = DEFAULT_DATASET,
    target: str = DEFAULT_TARGET,
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
    """:func:`make_env` by plain keywords, the registered ``autoprec/PrecisionSearch-v0``:
    ``model``, ``dataset``, ``image_size`` and ``seed`` make the workload
    (:func:`named_workload`), ``fidelity``, ``steps``, ``warm_start_steps`` and
    ``evaluator_kwargs`` (:class:`~autoprec.evaluate.EvaluatorConfig`'s fields such as
    ``batch_size`` and ``lr``, and ``cache_dir``) the evaluator's config, ``reward_weights``
    and ``accuracy_tolerance`` the reward; the rest is :func:`make_env`'s.

    Example:
        >>> import gymnasium, autoprec.envs
        >>> env = gymnasium.make("autoprec/PrecisionSearch-v0", model="tinycnn")  # doctest: +SKIP

    Raises:
        ValueError: as :func:`make_env`, and an unknown reward weight or a negative tolerance.
    """
    reward = RewardConfig(reward_weights, accuracy_tolerance)
    workload = config = cache_dir = None
    if evaluator is None:
        settings = dict(evaluator_kwargs or {})
        cache_dir = settings.pop("cache_dir", None)
        if warm_start_steps is not None:
            settings["warm_start_steps"] = warm_start_steps
        workload = named_workload(model, dataset, image_size, seed)
        config = EvaluatorConfig(fidelity=fidelity, steps=steps, **settings)
    return make_env(
        workload,
        config,
        reward,
        target=target,
        precisions=precisions,
        evaluator=evaluator,
        render_mode=render_mode,
        target_speedup=target_speedup,
        cache_dir=cache_dir,
    )
