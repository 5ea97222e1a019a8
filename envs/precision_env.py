"""``PrecisionEnv``: choose one training precision per layer, one layer per step (as in HAQ).

The environment takes what it reads (an evaluate callable, the layer and sensitivity tables,
the device, the reward); building those from a model name is
:func:`autoprec.envs.factory.make_env`, which ``import autoprec.envs`` registers as
``autoprec/PrecisionSearch-v0``.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from autoprec.envs.features import STATIC_FEATURES, sensitivity_features, static_features
from autoprec.evaluate.reward import RewardConfig
from autoprec.hardware.cost import CostModel, layer_memory
from autoprec.hardware.memory import activation_ratio
from autoprec.hardware.program import region_of
from autoprec.precision import PRECISION_NAMES, Precision, parse_precision

if TYPE_CHECKING:  # pragma: no cover
    from autoprec.evaluate import Metrics
    from autoprec.graph.table import LayerRow, LayerTable
    from autoprec.hardware import DeviceSpec
    from autoprec.sensitivities.grade import SensitivityTable

#: The action set by default, in action order.
DEFAULT_PRECISIONS: tuple[str, ...] = PRECISION_NAMES


def action_set(precisions: Sequence[str]) -> tuple[Precision, ...]:
    """``precisions`` parsed, in action order.

    Raises:
        ValueError: an unknown precision, or an empty or duplicated list.
    """
    parsed = tuple(parse_precision(p) for p in precisions)
    if not parsed or len(set(parsed)) != len(parsed):
        raise ValueError(
            f"precisions must be a non-empty list without repeats, got {list(precisions)!r}"
        )
    return parsed


class PrecisionEnv(gym.Env):
    """Per-layer precision search for training one model on one target accelerator.

    ## Description

    An episode walks the model's tunable layers (convolutions, linears, attention blocks) in
    execution order, as :func:`autoprec.graph.analyze` lists them; at each step the agent picks
    the training precision of the current layer. After the last layer the whole policy
    ``{layer: precision}`` is scored by the ``evaluate`` callable (an
    :class:`autoprec.evaluate.Evaluator`'s: fine-tuned from a cached fp32 warm start and
    compared with the uniform fp32 policy for quality and, through the cost model or a
    measurement, for step time and memory).

    ## Action Space

    ``Discrete(len(precisions))``: action ``i`` is ``precisions[i]`` (by default
    ``0: fp32, 1: tf32, 2: bf16, 3: fp16, 4: fp8``). :meth:`action_masks` says which precisions
    the target can run for the current layer (the sb3-contrib ``MaskablePPO`` convention), from
    ``choices`` (by name: the runnability table, :mod:`autoprec.hardware.runnability`): on an
    NVIDIA target a convolution cannot be fp8, nor a Linear whose shape torchao rejects. An
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
    |                  | only this layer lowered, from the sensitivity table           |
    |                  | (by name: ``Evaluator.surrogate().table``), log-scaled by the |
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

    0 on every step but the last. On the last step, ``reward(m)`` of the evaluated
    :class:`~autoprec.evaluate.Metrics` ``m`` (:class:`~autoprec.evaluate.reward.RewardConfig`,
    where the formula and its defaults are written): the weighted log speedup and log memory
    saving less the weighted ``loss_delta``, a penalty once ``loss_delta`` exceeds the
    tolerance, and a fixed penalty for a diverged or infeasible policy. ``loss_delta`` is the
    relative change of the training-split loss against fp32, the evaluator's finer quality
    signal (it moves before the accuracy does). Infeasibility cannot come from the agent's
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
    speedup over fp32 (``CostModel.step`` at the layer table's batch size): while it is
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

    builds the model, data and evaluator by name (:func:`autoprec.envs.factory.make_env`);
    the constructor takes them built.

    Args:
        evaluate: scores a whole policy ``{layer: precision string}`` (e.g. an evaluator's
            ``evaluate``, or ``ppo``'s at the surrogate fidelity).
        table: the layer table the costs are read from (``Evaluator.cost_table()``); its
            layers are the episode's steps.
        sensitivity: the sensitivity table of the observations
            (``Evaluator.surrogate().table``).
        device: the target, for its costs and its preferred low precision.
        reward: scores the evaluated metrics; None: the default weights and tolerance.
        precisions: the action set, in action order.
        choices: ``{layer: precisions it may take}`` (the action masks); None: all of
            ``precisions`` for every layer.
        target_speedup: turns on budget mode (see above); None turns it off.
        render_mode: None or ``"ansi"`` (a text table of the decisions so far).

    Raises:
        ValueError: an unknown precision, an empty or duplicated action set, a layer none of
            whose ``choices`` is in the action set, a bad ``render_mode`` or ``target_speedup``,
            or a table without tunable layers (:class:`~autoprec.layers.NoTunableLayerError`).
    """

    metadata = {"render_modes": ["ansi"]}

    def __init__(
        self,
        evaluate: Callable[[dict[str, str]], Metrics],
        table: LayerTable,
        sensitivity: SensitivityTable,
        device: DeviceSpec,
        reward: RewardConfig | None = None,
        precisions: Sequence[str] = DEFAULT_PRECISIONS,
        choices: Mapping[str, Collection[str]] | None = None,
        *,
        target_speedup: float | None = None,
        render_mode: str | None = None,
    ) -> None:
        if render_mode is not None and render_mode not in self.metadata["render_modes"]:
            raise ValueError(
                f"unknown render_mode {render_mode!r}; expected None or one of "
                f"{', '.join(self.metadata['render_modes'])}"
            )
        if target_speedup is not None and not target_speedup > 0:
            raise ValueError(f"target_speedup must be > 0 or None, got {target_speedup!r}")
        self.render_mode = render_mode
        self.target_speedup = target_speedup
        self.reward = RewardConfig() if reward is None else reward
        self.precisions = action_set(precisions)
        self.evaluate = evaluate
        self.table = table
        self.sensitivity = sensitivity
        self.device = device
        self.layers = tuple(table.names)
        if not self.layers:
            from autoprec.layers import NoTunableLayerError

            raise NoTunableLayerError.of(table.model)

        # Static features, costs and masks: computed once.
        self._static = static_features(table.rows)
        self._sensitivity = sensitivity_features(sensitivity, self.layers, self.precisions)
        allowed = {
            name: self.precisions if choices is None else choices.get(name, ())
            for name in self.layers
        }
        self._masks = np.array(
            [[p in allowed[name] for p in self.precisions] for name in self.layers], dtype=bool
        )
        for name, mask in zip(self.layers, self._masks, strict=True):
            if not mask.any():
                raise ValueError(
                    f"layer {name!r} may take none of the precisions "
                    f"{', '.join(p.value for p in self.precisions)} (its choices: "
                    f"{', '.join(map(str, allowed[name])) or 'none'}); widen choices or precisions"
                )
        self._cost = cost = CostModel(device)
        self._layer_time = {
            (row.name, p): _seconds(cost.layer_cost(row, p))
            for row, mask in zip(table.rows, self._masks, strict=True)
            for p, ok in zip(self.precisions, mask, strict=True)
            if ok
        }
        self._fp32_cost = {r.name: _seconds(cost.layer_cost(r, Precision.FP32)) for r in table}
        self._fp32_time = sum(self._fp32_cost.values())
        self._fp32_memory = sum(_layer_memory(r, Precision.FP32) for r in table)
        if target_speedup is not None:
            low = parse_precision(device.preferred.low)
            if not device.supports(low):
                raise ValueError(f"{device.name} cannot run its preferred low precision {low}")
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
        lines = [f"{self.table.model} on {self.device.name}"]
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
        region = region_of(self._chosen)  # the autocast region of the layers chosen so far
        memory_so_far = sum(
            _layer_memory(self.table[n], p, region) for n, p in self._chosen.items()
        )
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
        metrics = self.evaluate({n: p.value for n, p in policy.items()})
        info["metrics"] = metrics.to_dict()
        info["policy"] = {n: p.value for n, p in policy.items()}
        info["remapped_layers"] = dict(self._remapped)
        return self.reward(metrics)


def _seconds(cost: Any) -> float:
    return cost.forward_s + cost.backward_s


def _layer_memory(row: LayerRow, precision: Precision, region: str | None = None) -> float:
    """Bytes one layer holds in a step inside an autocast region of format ``region``: fp32
    weights and gradients plus what its precision changes (an 8-bit layer saves its input at
    the region's width: :func:`autoprec.hardware.memory.activation_ratio`), as
    ``CostModel.step`` counts them."""
    ratio = activation_ratio(precision, region)
    low_copy, activations = layer_memory(row, precision, activations=ratio)
    return 8 * row.params + low_copy + activations
