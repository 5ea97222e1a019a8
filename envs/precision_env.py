"""``PrecisionEnv``: choose one training precision per layer, one layer per step (as in HAQ).

Registered as ``autoprec/PrecisionSearch-v0`` by ``import autoprec.envs``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from autoprec.defaults import DEFAULT_DATASET
from autoprec.precision import Precision, parse_precision

DEFAULT_PRECISIONS = ("fp32", "tf32", "bf16", "fp16", "fp8")
DEFAULT_REWARD_WEIGHTS = {"speedup": 1.0, "memory": 0.5, "accuracy": 10.0}
FAILURE_PENALTY = -5.0  # diverged or infeasible
TOLERANCE_PENALTY = 1.0  # paid once loss_delta exceeds accuracy_tolerance ...
TOLERANCE_SLOPE = 10.0  # ... plus this much per unit of excess
STATIC_FEATURES = (
    "log_forward_flops",
    "log_backward_flops",
    "log_params",
    "log_input_bytes",
    "log_weight_bytes",
    "log_output_bytes",
    "position",
    "is_conv",
    "is_linear",
    "is_attention",
    "is_first",
    "is_last",
)
_BYTES_RATIO = {
    Precision.FP32: 1.0,
    Precision.TF32: 1.0,
    Precision.BF16: 0.5,
    Precision.FP16: 0.5,
    Precision.FP8: 0.25,
}


class PrecisionEnv(gym.Env):
    """Per-layer precision search for training one model on one target accelerator.

    ## Description

    An episode walks the model's tunable layers (convolutions, linears, attention blocks) in
    execution order, as :func:`autoprec.graph.analyze` lists them; at each step the agent picks
    the training precision of the current layer. After the last layer the whole policy
    ``{layer: precision}`` is scored by an :class:`autoprec.evaluate.Evaluator`: fine-tuned
    from a cached fp32 warm start and compared with the uniform fp32 policy (quality) and,
    through the cost model or a measurement, for step time and memory.

    ## Action Space

    ``Discrete(len(precisions))``: action ``i`` is ``precisions[i]`` (by default
    ``0: fp32, 1: tf32, 2: bf16, 3: fp16, 4: fp8``). :meth:`action_masks` says which precisions
    the target can run for the current layer (the sb3-contrib ``MaskablePPO`` convention), from
    the runnability table (:mod:`autoprec.hardware.runnability`): on an NVIDIA target a
    convolution cannot be fp8, nor a Linear whose shape torchao rejects. An
    action the target cannot run is replaced by the nearest *wider* precision it can run
    (``Precision.wider()`` repeatedly, among ``precisions``) and reported in
    ``info["remapped"]``.

    ## Observation Space

    ``Box(0, 1, shape=(12 + 2 * len(precisions) + 2,), float32)``; every entry is clipped into
    ``[0, 1]``. ``log`` features are ``log1p(x) / log1p(max over layers)``.

    | index            | observation                                                   |
    |------------------|---------------------------------------------------------------|
    | 0                | log forward FLOPs of the current layer                        |
    | 1                | log backward FLOPs                                            |
    | 2                | log parameter count                                           |
    | 3                | log input bytes (fp32)                                        |
    | 4                | log weight bytes (fp32)                                       |
    | 5                | log output bytes (fp32)                                       |
    | 6                | position: relative depth in [0, 1]                            |
    | 7, 8, 9          | layer type one-hot: convolution, linear, attention            |
    | 10, 11           | first layer, last layer flags                                 |
    | 12 .. 12+K-1     | sensitivity of the current layer at each of the K precisions: |
    |                  | gradient distance (1 - cosine with the fp32 gradient) with    |
    |                  | only this layer lowered, from the evaluator's sensitivity     |
    |                  | table (``Evaluator.surrogate().table``), log-scaled by the    |
    |                  | largest over all layers and precisions (fp32: 0)              |
    | 12+K .. 12+2K-1  | one-hot of the previous layer's applied precision (all zero   |
    |                  | on the first layer)                                           |
    | 12+2K            | predicted time so far: cost-model forward + backward seconds  |
    |                  | of the decided layers / the all-fp32 total of every layer     |
    | 12+2K+1          | predicted memory so far: the decided layers' weights,         |
    |                  | gradients, low-precision copies and activations / the fp32    |
    |                  | total of every layer                                          |

    After the last step the observation is the last layer's, with the final previous action
    and cost so far.

    ## Rewards

    0 on every step but the last. On the last step, with ``m`` the evaluator's
    :class:`~autoprec.evaluate.Metrics`, ``w`` the reward weights and ``tol`` the accuracy
    tolerance::

        if m.diverged or not m.feasible:
            reward = -5
        else:
            reward = (w["speedup"] * log(m.speedup)
                      - w["memory"] * log(m.memory_ratio)
                      - w["accuracy"] * max(0, m.loss_delta))
            if m.loss_delta > tol:
                reward -= 1 + 10 * (m.loss_delta - tol)

    ``loss_delta`` is the relative change of the training-split loss against fp32, the
    evaluator's finer quality signal (it moves before the accuracy does). The default weights
    are ``speedup=1.0, memory=0.5, accuracy=10.0``. Infeasibility cannot come from the agent's
    actions (they are remapped to what the target runs); it covers, e.g., out of memory on a
    measured run.

    ## Starting State

    The first tunable layer, no precision chosen yet (the observation is deterministic).

    ## Episode End

    The episode terminates after the last tunable layer is decided (one step per layer);
    there is no truncation. ``info`` on that step holds ``metrics`` (``Metrics.to_dict()``),
    ``policy`` (``{layer: precision string}``, as evaluated), ``remapped_layers``
    (``{layer: [requested, applied]}``) and, in budget mode, ``budget_lowered`` and
    ``budget_met``. Every step's ``info`` has ``layer``, ``requested``, ``precision`` (applied)
    and ``remapped`` (bool).

    ## Budget mode

    With ``target_speedup`` set, before evaluation the policy is made to meet that predicted
    speedup over fp32 (``CostModel.step`` at the evaluator's ``cost_batch_size``): while it is
    below the target, the most expensive remaining fp32/tf32 layer (by its fp32 forward +
    backward cost) is lowered to the device's preferred low precision
    (``DeviceSpec.preferred.low``), skipping a layer whose lowering does not raise the predicted
    speedup (on small layers the casts can cost more than the narrower matmul saves). If the
    candidates run out first, the policy is evaluated as it is and ``info["budget_met"]`` is
    False. Nothing is raised above what the agent chose.

    ## Arguments

    ```python
    import autoprec.envs
    gymnasium.make("autoprec/PrecisionSearch-v0", model="tinycnn", target="h100-sxm")
    ```

    Args:
        model: a model name for :func:`autoprec.models.load_model`.
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
        render_mode: None or ``"ansi"`` (a text table of the decisions so far).
        warm_start_steps: fp32 warm-start steps (None: the evaluator's default).
        target_speedup: turns on budget mode (see above); None turns it off.
        evaluator_kwargs: further keyword arguments for ``Evaluator`` (``batch_size``,
            ``lr``, ``cache_dir``).

    Raises:
        ValueError: an unknown precision, an empty or duplicated action set, an unknown reward
            weight, a negative tolerance, or a layer for which no listed precision runs on the
            target.
    """

    metadata = {"render_modes": ["ansi"]}

    def __init__(
        self,
        model: str = "tinycnn",
        dataset: str = DEFAULT_DATASET,
        target: str = "h100-sxm",
        fidelity: str = "short",
        precisions: Sequence[str] = DEFAULT_PRECISIONS,
        reward_weights: Mapping[str, float] | None = None,
        accuracy_tolerance: float = 0.05,
        evaluator: Any = None,
        seed: int = 0,
        steps: int | None = None,
        image_size: int | None = None,
        render_mode: str | None = None,
        *,
        warm_start_steps: int | None = None,
        target_speedup: float | None = None,
        evaluator_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        from autoprec.graph import analyze
        from autoprec.hardware import CostModel

        if render_mode is not None and render_mode not in self.metadata["render_modes"]:
            raise ValueError(
                f"unknown render_mode {render_mode!r}; expected None or one of "
                f"{', '.join(self.metadata['render_modes'])}"
            )
        self.render_mode = render_mode
        self.precisions = tuple(parse_precision(p) for p in precisions)
        if not self.precisions or len(set(self.precisions)) != len(self.precisions):
            raise ValueError(
                f"precisions must be a non-empty list without repeats, got {list(precisions)!r}"
            )
        self.reward_weights = dict(DEFAULT_REWARD_WEIGHTS)
        unknown = set(reward_weights or {}) - set(DEFAULT_REWARD_WEIGHTS)
        if unknown:
            raise ValueError(
                f"unknown reward weight(s) {sorted(unknown)}; expected keys "
                f"{', '.join(DEFAULT_REWARD_WEIGHTS)}"
            )
        self.reward_weights.update({k: float(v) for k, v in (reward_weights or {}).items()})
        if not accuracy_tolerance >= 0:
            raise ValueError(f"accuracy_tolerance must be >= 0, got {accuracy_tolerance!r}")
        self.accuracy_tolerance = float(accuracy_tolerance)
        if target_speedup is not None and not target_speedup > 0:
            raise ValueError(f"target_speedup must be > 0 or None, got {target_speedup!r}")
        self.target_speedup = target_speedup

        if evaluator is None:
            evaluator = self._build_evaluator(
                model,
                dataset,
                target,
                fidelity,
                seed,
                steps,
                image_size,
                warm_start_steps,
                evaluator_kwargs,
            )
        self.evaluator = evaluator
        self.device = evaluator.device
        self.table = analyze(
            getattr(evaluator, "cost_spec", evaluator.spec),
            getattr(evaluator, "cost_batch_size", evaluator.batch_size),
            cache=True,
        )
        self.layers = tuple(self.table.names)
        if not self.layers:
            raise ValueError(f"model {evaluator.spec.name!r} has no tunable layers to search")
        self._cost = CostModel(self.device)

        # Static features, costs and masks: computed once.
        self._static = _static_features(self.table.rows)
        self._sensitivity = _sensitivity_features(
            evaluator.surrogate().table, self.layers, self.precisions
        )
        from autoprec.hardware.runnability import runnable_precisions

        supported = [p for p in self.precisions if self.device.supports(p)]
        if not supported:
            raise ValueError(
                f"none of the precisions {', '.join(p.value for p in self.precisions)} runs on "
                f"{self.device.name} (it supports {', '.join(self.device.supported_precisions)}); "
                "add one of those to precisions"
            )
        # one table for every agent's masks (agents.base.layer_choices reads the same)
        mode = getattr(evaluator, "target_mode", "native")
        allowed = runnable_precisions(self.table, self.device, supported, mode)
        self._masks = np.array(
            [[p in allowed[name] for p in self.precisions] for name in self.layers],
            dtype=bool,
        )
        self._layer_time = {
            (row.name, p): _seconds(self._cost.layer_cost(row, p))
            for row in self.table.rows
            for p in supported
        }
        fp32_time = sum(_seconds(self._cost.layer_cost(r, Precision.FP32)) for r in self.table)
        fp32_memory = sum(_layer_memory(r, Precision.FP32) for r in self.table)
        self._fp32_time, self._fp32_memory = fp32_time, fp32_memory
        self._fp32_cost = {
            r.name: _seconds(self._cost.layer_cost(r, Precision.FP32)) for r in self.table
        }
        if target_speedup is not None:
            low = parse_precision(self.device.preferred.low)
            if not self.device.supports(low):
                raise ValueError(f"{self.device.name} cannot run its preferred low precision {low}")
            self._budget_low = low

        n_features = len(STATIC_FEATURES) + 2 * len(self.precisions) + 2
        self.action_space = spaces.Discrete(len(self.precisions))
        self.observation_space = spaces.Box(
            low=0.0, high=1.0, shape=(n_features,), dtype=np.float32
        )

        self._index = 0
        self._chosen: dict[str, Precision] = {}
        self._remapped: dict[str, list[str]] = {}
        self._previous: int | None = None

    @staticmethod
    def _build_evaluator(
        model: str,
        dataset: str,
        target: str,
        fidelity: str,
        seed: int,
        steps: int | None,
        image_size: int | None,
        warm_start_steps: int | None,
        evaluator_kwargs: Mapping[str, Any] | None,
    ) -> Any:
        from autoprec.data import load_dataset_for
        from autoprec.evaluate import Evaluator
        from autoprec.models import load_model

        spec = load_model(model, num_classes=10, image_size=image_size)
        data = load_dataset_for(spec, dataset, seed=seed)
        kwargs = dict(evaluator_kwargs or {})
        if warm_start_steps is not None:
            kwargs["warm_start_steps"] = warm_start_steps
        return Evaluator(
            spec, data, target=target, fidelity=fidelity, steps=steps, seed=seed, **kwargs
        )

    # --- Gymnasium API ------------------------------------------------------------------------
    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        self._index = 0
        self._chosen = {}
        self._remapped = {}
        self._previous = None
        return self._observation(), {"layer": self.layers[0]}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        if self._index >= len(self.layers):
            raise gym.error.ResetNeeded("the episode has ended; call reset() before step()")
        if not self.action_space.contains(np.int64(action)):
            raise ValueError(
                f"action must be an integer in [0, {len(self.precisions) - 1}] "
                f"({', '.join(p.value for p in self.precisions)}), got {action!r}"
            )
        action = int(action)
        layer = self.layers[self._index]
        requested = self.precisions[action]
        applied = self._remap(requested, self._masks[self._index])
        remapped = applied is not requested
        if remapped:
            self._remapped[layer] = [requested.value, applied.value]
        self._chosen[layer] = applied
        self._previous = self.precisions.index(applied)
        info: dict[str, Any] = {
            "layer": layer,
            "requested": requested.value,
            "precision": applied.value,
            "remapped": remapped,
        }
        terminated = self._index == len(self.layers) - 1
        reward = 0.0
        if terminated:
            reward = self._finish(info)
        self._index = min(self._index + 1, len(self.layers))
        return self._observation(), reward, terminated, False, info

    def action_masks(self) -> np.ndarray:
        """Which actions the target can run for the current layer (True: allowed)."""
        return self._masks[min(self._index, len(self.layers) - 1)].copy()

    def render(self) -> str | None:
        if self.render_mode != "ansi":
            return None
        lines = [f"{self.evaluator.spec.name} on {self.device.name}"]
        for i, name in enumerate(self.layers):
            mark = "->" if i == self._index else "  "
            chosen = self._chosen.get(name)
            lines.append(f"{mark} {name:<24} {chosen.value if chosen else '.'}")
        return "\n".join(lines)

    # --- internals ----------------------------------------------------------------------------
    def _remap(self, requested: Precision, mask: np.ndarray) -> Precision:
        """``requested`` if allowed, else the nearest wider allowed precision."""
        allowed = {p for p, ok in zip(self.precisions, mask, strict=True) if ok}
        p: Precision | None = requested
        while p is not None:
            if p in allowed:
                return p
            p = p.wider()
        return max(allowed, key=lambda q: q.width)  # nothing wider allowed: the widest one

    def _observation(self) -> np.ndarray:
        i = min(self._index, len(self.layers) - 1)
        previous = np.zeros(len(self.precisions), dtype=np.float32)
        if self._previous is not None:
            previous[self._previous] = 1.0
        time_so_far = sum(self._layer_time[(n, p)] for n, p in self._chosen.items())
        memory_so_far = sum(_layer_memory(self.table[n], p) for n, p in self._chosen.items())
        cost = np.array(
            [time_so_far / self._fp32_time, memory_so_far / self._fp32_memory], dtype=np.float32
        )
        obs = np.concatenate([self._static[i], self._sensitivity[i], previous, cost])
        obs = obs.astype(np.float32)
        return np.clip(np.nan_to_num(obs, nan=0.0), 0.0, 1.0)

    def _predicted_speedup(self, policy: Mapping[str, Precision]) -> float:
        batch = self.table.batch_size
        fp32 = self._cost.step(self.table, Precision.FP32, batch_size=batch).step_time_s
        return fp32 / self._cost.step(self.table, dict(policy), batch_size=batch).step_time_s

    def _apply_budget(self, policy: dict[str, Precision], info: dict[str, Any]) -> None:
        lowered: list[str] = []
        candidates = sorted(
            (n for n, p in policy.items() if p in (Precision.FP32, Precision.TF32)),
            key=lambda n: -self._fp32_cost[n],
        )
        speedup = self._predicted_speedup(policy)
        for name in candidates:
            if speedup >= self.target_speedup:
                break
            trial = {**policy, name: self._budget_low}
            trial_speedup = self._predicted_speedup(trial)
            if trial_speedup > speedup:  # keep only lowerings that help (casts cost time too)
                policy[name], speedup = self._budget_low, trial_speedup
                lowered.append(name)
        info["budget_lowered"] = lowered
        info["budget_met"] = speedup >= self.target_speedup

    def _finish(self, info: dict[str, Any]) -> float:
        policy = dict(self._chosen)
        if self.target_speedup is not None:
            self._apply_budget(policy, info)
        metrics = self.evaluator.evaluate({n: p.value for n, p in policy.items()})
        info["metrics"] = metrics.to_dict()
        info["policy"] = {n: p.value for n, p in policy.items()}
        info["remapped_layers"] = dict(self._remapped)
        return self.reward_from_metrics(metrics)

    def reward_from_metrics(self, metrics: Any) -> float:
        """The end-of-episode reward of ``metrics`` (the formula in the class docstring)."""
        return reward(metrics, self.reward_weights, self.accuracy_tolerance)


def reward(
    metrics: Any,
    weights: Mapping[str, float] | None = None,
    accuracy_tolerance: float = 0.05,
) -> float:
    """The reward of evaluated ``metrics`` (:class:`PrecisionEnv`'s formula), always finite.

    Args:
        metrics: an :class:`~autoprec.evaluate.Metrics` (or anything with ``diverged``,
            ``feasible``, ``loss_delta``, ``speedup`` and ``memory_ratio``).
        weights: ``{"speedup", "memory", "accuracy"}``; missing keys keep
            :data:`DEFAULT_REWARD_WEIGHTS`.
        accuracy_tolerance: the ``loss_delta`` above which the tolerance penalty applies.
    """
    if metrics.diverged or not metrics.feasible:
        return FAILURE_PENALTY
    w = {**DEFAULT_REWARD_WEIGHTS, **(weights or {})}
    loss_delta = metrics.loss_delta
    if not math.isfinite(loss_delta):
        return FAILURE_PENALTY
    value = (
        w["speedup"] * math.log(max(metrics.speedup, 1e-9))
        - w["memory"] * math.log(max(metrics.memory_ratio, 1e-9))
        - w["accuracy"] * max(0.0, loss_delta)
    )
    if loss_delta > accuracy_tolerance:
        value -= TOLERANCE_PENALTY + TOLERANCE_SLOPE * (loss_delta - accuracy_tolerance)
    return float(value) if math.isfinite(value) else FAILURE_PENALTY


def _seconds(cost: Any) -> float:
    return cost.forward_s + cost.backward_s


def _layer_memory(row: Any, precision: Precision) -> float:
    """Bytes one layer holds in a step: fp32 weights and gradients, the low-precision weight
    copy (narrow formats only) and its input/output activations (as ``CostModel.step``)."""
    ratio = _BYTES_RATIO[precision]
    low_copy = row.params * 4 * ratio if ratio < 1 else 0.0
    return 8 * row.params + low_copy + row.input_bytes * ratio + row.output_bytes


def _sensitivity_features(
    table: Any, layers: Sequence[str], precisions: Sequence[Precision]
) -> np.ndarray:
    """[layer][action] gradient distance (1 - cosine) at that precision, log-scaled jointly.

    ``log1p(d) / log1p(max d over every layer and precision)``, so that both layers and
    precisions compare; fp32, a precision the table did not grade, a layer it does not list
    and a non-finite entry (the layer diverged alone: worst) are handled as 0, 0, 0 and 1.
    """
    graded = {str(p): j for j, p in enumerate(table.precisions)}
    rows = {name: i for i, name in enumerate(table.layers)}
    distance = table.matrix("grad_distance")
    raw = np.zeros((len(layers), len(precisions)), dtype=np.float64)
    worst = np.zeros_like(raw, dtype=bool)
    for i, layer in enumerate(layers):
        for k, p in enumerate(precisions):
            if p is Precision.FP32 or layer not in rows or p.value not in graded:
                continue
            d = distance[rows[layer]][graded[p.value]]
            if math.isfinite(d):
                raw[i, k] = max(d, 0.0)
            else:
                worst[i, k] = True
    logs = np.log1p(raw)
    top = logs.max()
    scaled = logs / top if top > 0 else np.zeros_like(logs)
    scaled[worst] = 1.0
    return np.clip(scaled, 0.0, 1.0).astype(np.float32)


def _static_features(rows: Sequence[Any]) -> np.ndarray:
    """Per-layer features in [0, 1], in the order of ``STATIC_FEATURES``."""

    def log_scaled(values: list[float]) -> np.ndarray:
        logs = np.log1p(np.maximum(np.asarray(values, dtype=np.float64), 0.0))
        top = logs.max()
        return logs / top if top > 0 else np.zeros_like(logs)

    columns = [
        log_scaled([r.forward_flops for r in rows]),
        log_scaled([r.backward_flops for r in rows]),
        log_scaled([r.params for r in rows]),
        log_scaled([r.input_bytes for r in rows]),
        log_scaled([r.weight_bytes for r in rows]),
        log_scaled([r.output_bytes for r in rows]),
        np.array([r.position for r in rows], dtype=np.float64),
        np.array([float("conv" in r.type.lower()) for r in rows]),
        np.array([float("linear" in r.type.lower()) for r in rows]),
        np.array([float("attention" in r.type.lower()) for r in rows]),
        np.array([float(r.first) for r in rows]),
        np.array([float(r.last) for r in rows]),
    ]
    features = np.stack(columns, axis=1)
    return np.clip(np.nan_to_num(features, nan=0.0), 0.0, 1.0).astype(np.float32)
