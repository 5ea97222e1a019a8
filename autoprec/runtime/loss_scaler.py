"""Dynamic loss scaling with the ``torch.amp.GradScaler`` interface, on any device.

:class:`LossScaler` is a thin subclass of :class:`torch.amp.GradScaler`: scaling, unscaling, the
inf/NaN check and the scale update are torch's own kernels, so on the same gradients it gives
bit-identical results. What it adds for autoprec:

* the device is optional and taken from the first tensor passed to :meth:`LossScaler.scale`, so
  one scaler works for the emulated CPU path and on a GPU;
* ``kind``: ``"dynamic"`` (GradScaler's behaviour), ``"static"`` (the scale never changes, steps
  with non-finite gradients are still skipped) or ``"none"`` (disabled);
* :meth:`LossScaler.from_config` builds one from a policy's ``loss_scaling`` section;
* a bounded history of (step, scale, skipped) and counters for reporting.

In emulate mode the gradients are fp32 tensors that hold inf/NaN where an emulated fp16 cast
overflowed; torch's check finds them exactly as it finds fp16 overflows on a GPU.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from autoprec._values import FLOAT32_MAX, FLOAT32_TINY
from autoprec.policy import LOSS_SCALING_KINDS

if TYPE_CHECKING:
    from autoprec.policy import PrecisionPolicy

__all__ = ["LOSS_SCALER_KINDS", "SCALE_RANGE", "LossScaler", "ScaleRecord"]

LOSS_SCALER_KINDS = LOSS_SCALING_KINDS  # the kinds a policy's loss_scaling section may name
# The scales a scaler can hold: the scale is a float32 tensor, and unscaling multiplies every
# gradient by its reciprocal, checking the gradients before that multiplication. A scale below
# float32's smallest normal number rounds to 0 (or its reciprocal overflows to inf), so zero
# gradients became 0 * inf = NaN after the check had passed them: the step was taken with NaN
# gradients and the weights turned NaN. Above float32's largest number the scale is inf.
SCALE_RANGE = (FLOAT32_TINY, FLOAT32_MAX)


class ScaleRecord(NamedTuple):
    """One :meth:`LossScaler.update` call: the iteration, the scale it used, whether it skipped."""

    step: int
    scale: float
    skipped: bool


def _check_positive_finite(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


def _check_factor(
    name: str, value: Any, within: Callable[[float], bool], expected: str, hint: str = ""
) -> float:
    """``value`` as a float: a positive, finite number for which ``within(value)`` holds.

    Raises:
        ValueError: ``<name> must be <expected>, got <value><hint>``.
    """
    value = _check_positive_finite(name, value)
    if not within(value):
        raise ValueError(f"{name} must be {expected}, got {value!r}{hint}")
    return value


def _check_scale(value: Any) -> float:
    low, high = SCALE_RANGE
    return _check_factor(
        "init_scale",
        value,
        lambda v: low <= v <= high,
        f"in [{low:.3g}, {high:.3g}] (the scale is a float32: a smaller one rounds to 0, a "
        "larger one to inf)",
        "; 65536 is a common start",
    )


def _check_growth_factor(value: Any) -> float:
    return _check_factor(
        "growth_factor",
        value,
        lambda v: v >= 1.0,
        ">= 1.0 (it multiplies the scale after a run of good steps)",
    )


def _check_backoff_factor(value: Any) -> float:
    return _check_factor(
        "backoff_factor",
        value,
        lambda v: v <= 1.0,
        "in (0, 1] (it multiplies the scale after an overflow)",
    )


def _check_growth_interval(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"growth_interval must be an integer >= 1, got {value!r}")
    return value


def _check_kind(kind: Any) -> str:
    kind = getattr(kind, "value", kind)  # accept a string enum member
    if not isinstance(kind, str) or kind.lower() not in LOSS_SCALER_KINDS:
        raise ValueError(
            f"unknown loss scaling kind {kind!r}; expected one of {', '.join(LOSS_SCALER_KINDS)}"
        )
    return kind.lower()


def _check_device(device: Any) -> torch.device | None:
    if device is None:
        return None
    if not isinstance(device, (str, torch.device)):
        raise ValueError(
            f"device must be a str, a torch.device or None, got {type(device).__name__}"
        )
    try:
        return torch.device(device)
    except RuntimeError as err:
        raise ValueError(f"invalid device {device!r}: {err}") from None


class LossScaler(torch.amp.GradScaler):
    """Loss scaler with ``torch.amp.GradScaler``'s interface, usable on any device.

    Use it exactly like GradScaler::

        scaler = LossScaler(init_scale=2.0**15)
        for x, y in data:
            optimizer.zero_grad()
            scaler.scale(loss_fn(model(x), y)).backward()
            scaler.step(optimizer)  # skipped when a gradient holds inf/NaN
            scaler.update()  # backs off after an overflow, grows after good runs

    Args:
        init_scale: initial scale factor.
        growth_factor: factor (>= 1) applied after ``growth_interval`` good steps in a row.
        backoff_factor: factor in (0, 1] applied after a step with inf/NaN gradients.
        growth_interval: number of consecutive good steps before the scale grows.
        enabled: ``False`` makes the scaler a pass-through (as GradScaler's ``enabled``).
        device: where the scale lives; ``None`` takes the device of the first tensor passed to
            :meth:`scale`. As with GradScaler, ``"cuda"`` without CUDA disables the scaler with
            a warning.
        kind: ``"dynamic"`` (GradScaler's behaviour), ``"static"`` (the scale stays at
            ``init_scale``; steps with non-finite gradients are still skipped) or ``"none"``
            (same as ``enabled=False``).
        max_history: how many :class:`ScaleRecord` entries :attr:`history` keeps (the last ones).

    Raises:
        ValueError: if an argument is out of range or of the wrong type.

    Note:
        :meth:`update` reads the scale and the overflow flags to the host (one sync per
        iteration; GradScaler's :meth:`step` already syncs once per optimizer).
    """

    def __init__(
        self,
        init_scale: float = 2.0**15,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        *,
        device: str | torch.device | None = None,
        kind: str = "dynamic",
        max_history: int = 10_000,
    ) -> None:
        init_scale = _check_scale(init_scale)
        growth_factor = _check_growth_factor(growth_factor)
        backoff_factor = _check_backoff_factor(backoff_factor)
        growth_interval = _check_growth_interval(growth_interval)
        kind = _check_kind(kind)
        scale_device = _check_device(device)
        if not isinstance(enabled, bool):
            raise ValueError(f"enabled must be a bool, got {enabled!r}")
        if isinstance(max_history, bool) or not isinstance(max_history, int) or max_history < 1:
            raise ValueError(f"max_history must be an integer >= 1, got {max_history!r}")

        self._kind = kind
        self._scale_device = scale_device
        # GradScaler only uses the device type to warn about missing CUDA and to check
        # ``update(new_scale=tensor)``; with a lazy device it is fixed on the first scale().
        super().__init__(
            device=scale_device.type if scale_device is not None else "cpu",
            init_scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            enabled=enabled and kind != "none",
        )
        self._initial_scale = init_scale
        self._history: deque[ScaleRecord] = deque(maxlen=max_history)
        self._num_updates = 0
        self._skipped_steps = 0
        self._overflow_steps = 0
        self._min_scale = math.inf

    @classmethod
    def from_policy(
        cls, policy: PrecisionPolicy | None, *, device: str | torch.device | None = None
    ) -> LossScaler:
        """The scaler a policy asks for: :meth:`from_config` of its ``loss_scaling`` section.

        A policy without that section (no fp16 layers, typically) gets a disabled scaler whose
        ``scale``/``step``/``update`` are plain pass-throughs, so one training loop serves
        every policy.
        """
        return cls.from_config(getattr(policy, "loss_scaling", None), device=device)

    @classmethod
    def from_config(cls, cfg: Any, *, device: str | torch.device | None = None) -> LossScaler:
        """Build a scaler from a policy's ``loss_scaling`` section.

        Args:
            cfg: any object with the attributes (or a mapping with the keys) ``kind``,
                ``init_scale``, ``growth_factor``, ``backoff_factor``, ``growth_interval``;
                missing ones take the constructor's defaults. ``None`` gives a disabled scaler.
            device: passed to the constructor.

        Returns:
            The configured scaler.

        Example:
            >>> from types import SimpleNamespace
            >>> LossScaler.from_config(SimpleNamespace(kind="static", init_scale=1024.0)).kind
            'static'
        """
        if cfg is None:
            return cls(enabled=False, device=device, kind="none")
        names = ("kind", "init_scale", "growth_factor", "backoff_factor", "growth_interval")
        if isinstance(cfg, Mapping):
            unknown = sorted(set(cfg) - set(names))
            if unknown:
                raise ValueError(
                    f"unknown loss scaling keys {unknown}; expected some of {', '.join(names)}"
                )
            kwargs = {name: cfg[name] for name in names if cfg.get(name) is not None}
        else:
            kwargs = {
                name: getattr(cfg, name) for name in names if getattr(cfg, name, None) is not None
            }
        return cls(device=device, **kwargs)

    # ----------------------------------------------------------------- properties

    @property
    def kind(self) -> str:
        """``"dynamic"``, ``"static"`` or ``"none"``."""
        return self._kind

    @property
    def device(self) -> torch.device | None:
        """Where the scale lives; ``None`` until the first :meth:`scale` when chosen lazily."""
        if self._scale is not None:
            return self._scale.device
        return self._scale_device

    @property
    def history(self) -> list[ScaleRecord]:
        """The last ``max_history`` updates as ``(step, scale used, skipped)`` records.

        ``step`` counts :meth:`update` calls from 0; ``scale`` is the scale in effect during that
        step (before the update); ``skipped`` is whether any optimizer step was skipped.
        """
        return list(self._history)

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps that :meth:`step` skipped because of inf/NaN gradients."""
        return self._skipped_steps

    @property
    def overflow_steps(self) -> int:
        """Iterations (:meth:`update` calls) in which some gradient held inf/NaN."""
        return self._overflow_steps

    def summary(self) -> dict[str, Any]:
        """Counters for reporting.

        Returns:
            ``kind``, ``enabled``, ``init_scale``, ``final_scale``, ``min_scale`` (over all
            iterations, not only the kept history), ``updates``, ``skipped_steps`` and
            ``overflow_steps``. Scales are 1.0 when the scaler is disabled.
        """
        final = self.get_scale()
        return {
            "kind": self._kind,
            "enabled": self.is_enabled(),
            "init_scale": self._initial_scale if self.is_enabled() else 1.0,
            "final_scale": final,
            "min_scale": min(self._min_scale, final),
            "updates": self._num_updates,
            "skipped_steps": self._skipped_steps,
            "overflow_steps": self._overflow_steps,
        }

    # ----------------------------------------------------------- GradScaler hooks

    def _lazy_init_scale_growth_tracker(self, dev: torch.device) -> None:
        target = self._scale_device if self._scale_device is not None else dev
        self._device = target.type
        super()._lazy_init_scale_growth_tracker(target)

    def _found_inf(self, optimizer: torch.optim.Optimizer | None = None) -> bool:
        if optimizer is not None:
            states = [self._per_optimizer_states.get(id(optimizer), {})]
        else:
            states = list(self._per_optimizer_states.values())
        return any(
            bool(flag.item())
            for state in states
            for flag in state.get("found_inf_per_device", {}).values()
        )

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale (unless :meth:`unscale_` was called) and step unless a gradient is inf/NaN.

        Args:
            optimizer: the optimizer that applies the gradients.
            *args: forwarded to ``optimizer.step``.
            **kwargs: forwarded to ``optimizer.step`` (no ``closure``, as with GradScaler).

        Returns:
            ``optimizer.step``'s return value, or ``None`` when the step was skipped.
        """
        retval = super().step(optimizer, *args, **kwargs)
        if self.is_enabled() and self._found_inf(optimizer):
            self._skipped_steps += 1
        return retval

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Update the scale at the end of an iteration (after :meth:`step` for every optimizer).

        ``"dynamic"``: backs off after an overflow, grows after ``growth_interval`` good steps
        (torch's own kernel). ``"static"``: the scale stays unchanged. ``new_scale`` sets the
        scale explicitly in both kinds.

        Args:
            new_scale: optional new scale (a float or a one-element tensor).

        Raises:
            RuntimeError: if no :meth:`step` or :meth:`unscale_` happened since the last update.
        """
        if not self.is_enabled():
            return
        if isinstance(new_scale, int) and not isinstance(new_scale, bool):
            new_scale = float(new_scale)
        recorded = any(s["found_inf_per_device"] for s in self._per_optimizer_states.values())
        if new_scale is None and not recorded:
            raise RuntimeError(
                "update() was called without step() or unscale_() since the last update(); "
                "call scaler.step(optimizer) for each optimizer first"
            )
        found_inf = self._found_inf()
        scale_used = self.get_scale()
        if self._kind == "static" and new_scale is None:
            new_scale = scale_used  # keeps the scale and the growth tracker as they are
        super().update(new_scale)
        self._floor_scale()

        self._history.append(ScaleRecord(self._num_updates, scale_used, found_inf))
        self._num_updates += 1
        self._overflow_steps += int(found_inf)
        self._min_scale = min(self._min_scale, scale_used)

    def _floor_scale(self) -> None:
        """Keep the scale at or above :data:`SCALE_RANGE`'s low end: backing off (or a given
        ``new_scale``, or an old checkpoint) must never reach 0, where unscaling turns zero
        gradients into NaN ones that no check sees."""
        low = SCALE_RANGE[0]
        if not self._init_scale >= low:  # a lazy scaler's scale-to-be (load_state_dict's)
            self._init_scale = low
        if self._scale is not None and not float(self._scale) >= low:
            self._scale.fill_(low)

    # ------------------------------------------------------------ getters/setters

    def get_growth_tracker(self) -> int:
        """Return the number of consecutive good steps since the last growth or backoff."""
        return self._get_growth_tracker()

    def set_growth_factor(self, new_factor: float) -> None:
        """Set the growth factor (>= 1).

        Args:
            new_factor: the new growth factor.
        """
        super().set_growth_factor(_check_growth_factor(new_factor))

    def set_backoff_factor(self, new_factor: float) -> None:
        """Set the backoff factor (in (0, 1]).

        Args:
            new_factor: the new backoff factor.
        """
        super().set_backoff_factor(_check_backoff_factor(new_factor))

    def set_growth_interval(self, new_interval: int) -> None:
        """Set the growth interval (an integer >= 1).

        Args:
            new_interval: the new growth interval.
        """
        super().set_growth_interval(_check_growth_interval(new_interval))

    # --------------------------------------------------------------- checkpoints

    def state_dict(self) -> dict[str, Any]:
        """GradScaler's state plus ``kind`` and the counters; ``{}`` when disabled.

        The result loads into a ``torch.amp.GradScaler`` too (it ignores the extra keys).
        """
        state = super().state_dict()
        if state:
            state.update(
                kind=self._kind,
                updates=self._num_updates,
                skipped_steps=self._skipped_steps,
                overflow_steps=self._overflow_steps,
            )
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the scale, growth tracker, factors and counters; a no-op when disabled.

        Accepts a ``torch.amp.GradScaler`` state dict as well. ``kind`` is not restored: it comes
        from the constructor (the policy), so a static scaler stays static.

        Args:
            state_dict: a dict returned by :meth:`state_dict`.
        """
        super().load_state_dict(state_dict)
        if not self.is_enabled():
            return
        self._floor_scale()
        self._num_updates = int(state_dict.get("updates", self._num_updates))
        self._skipped_steps = int(state_dict.get("skipped_steps", self._skipped_steps))
        self._overflow_steps = int(state_dict.get("overflow_steps", self._overflow_steps))

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(kind={self._kind!r}, enabled={self.is_enabled()}, "
            f"scale={self.get_scale()}, device={self.device})"
        )
