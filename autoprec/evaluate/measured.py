"""What a policy costs when the target is this machine's device: measured, not modelled.

:class:`MeasuredCosts` stands where :class:`~autoprec.evaluate.costing.CostEstimator` stands
(the same ``estimate``, ``fp32``, ``amp``, ``unrunnable``, ``cost_table`` and ``identity``) when
the evaluator's target is the local device. A search evaluates hundreds of policies, so it
ranks them by the per-layer table (:class:`~autoprec.timing.LayerTimings`: each unique layer
alone with its casts, measured once per device and software version):

    step(policy) = step(fp32, measured whole)
                 + sum over layers of [alone(layer, its precision) - alone(layer, fp32)]
                 - the casts a layer does not pay because its neighbours share its dtype

(a layer's input cast is saved when every layer feeding it hands on the same 16-bit dtype, its
output cast when every layer it feeds takes it), and :meth:`MeasuredCosts.steps` times the
finalists (the search's best few, the target's AMP, every hand rule) as whole steps side by side
before the export (:func:`~autoprec.timing.time_steps`). Memory is the cost
model's, scaled by the measured fp32 peak where the device reports one (CUDA).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from autoprec.cache import digest
from autoprec.hardware.defaults import amp_policy
from autoprec.layers import model_fingerprint
from autoprec.policy import PrecisionPolicy
from autoprec.precision import Precision
from autoprec.timing import LayerTimings, StepTiming, TimingStore, time_steps
from autoprec.timing.layers import io_dtype
from autoprec.timing.step import check_execution, memory_format_for

if TYPE_CHECKING:  # pragma: no cover
    from autoprec._periodic import Progress
    from autoprec.evaluate.costing import CostEstimator

__all__ = ["MeasuredCosts", "local_torch_device"]

#: The least an estimate may be, as a fraction of fp32's measured step: on a model of tiny
#: layers the table's noise can sum to less than nothing (the finalists' whole steps decide).
ESTIMATE_FLOOR = 0.01


def local_torch_device() -> torch.device:
    """This machine's accelerator (``cuda``), else the CPU: where measured costs are taken."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class MeasuredCosts:
    """Step times measured on the local device, ranked by the per-layer table.

    Args:
        model: the cost model's estimator of the same production model (memory, runnability,
            the layer table's data flow).
        execution: ``"compiled"`` or ``"eager"``: the program production runs.
        optimizer: the recipe's optimizer (whole steps include its step).
        torch_device: where to measure; None: :func:`local_torch_device`.
        store: where timings are kept; None: the default store of the device.
    """

    def __init__(
        self,
        model: CostEstimator,
        execution: str = "compiled",
        optimizer: str = "sgd",
        torch_device: torch.device | str | None = None,
        store: TimingStore | None = None,
    ) -> None:
        self.model = model
        self.device = model.device
        self.execution = check_execution(execution)
        self.optimizer = optimizer
        self.torch_device = torch.device(torch_device or local_torch_device())
        self.memory_format = memory_format_for(model.cost_spec)
        self.store = (
            store if store is not None else TimingStore(self.device.name, self.torch_device)
        )
        self._layers: LayerTimings | None = None
        self._module = model.module
        self.untimed: set[str] = set()  # layers whose precisions could not be timed alone

    # --- what CostEstimator offers -----------------------------------------------------------
    def identity(self) -> dict[str, Any]:
        """What decides the costs besides the policy: the model's pricing inputs, the
        software and device that measure, the program and the layout."""
        return {
            **self.model.identity(),
            "measured": {
                "software": self.store.software,
                "execution": self.execution,
                "memory_format": self.memory_format,
                "optimizer": self.optimizer,
            },
        }

    def cost_table(self) -> Any:
        """The cost model's layer table (its data flow names each layer's neighbours)."""
        return self.model.cost_table()

    def unrunnable(self, precisions: Mapping[str, Precision]) -> dict[str, str]:
        """As :meth:`CostEstimator.unrunnable`."""
        return self.model.unrunnable(precisions)

    @property
    def layers(self) -> LayerTimings:
        """The per-layer table (its layer shapes read on first use)."""
        if self._layers is None:
            spec = self.model.cost_spec
            self._layers = LayerTimings(
                spec, self.model.batch_size, self.device.name, self.torch_device,
                self.execution, self.memory_format, self.store,
            )  # fmt: skip
        return self._layers

    def measure(
        self, choices: Mapping[str, Iterable[str | Precision]], progress: Progress | None = None
    ) -> int:
        """Time the layers of ``{layer: precisions}`` not in the store yet, and fp32's whole
        step; returns how many layer timings were taken."""
        taken = self.layers.measure(choices, progress)
        self.fp32_step  # noqa: B018 - measured now, not in the middle of the search
        return taken

    def _options(self) -> dict[str, Any]:
        return {
            "batch_size": self.model.batch_size,
            "device": self.torch_device,
            "execution": self.execution,
            "memory_format": self.memory_format,
            "optimizer": self.optimizer,
        }

    def steps(self, policies: Iterable[Any]) -> list[StepTiming]:
        """The policies' whole training steps, timed side by side now
        (:func:`~autoprec.timing.time_steps`; not kept: finalists compare within one run)."""
        policies = [PrecisionPolicy.coerce(p) for p in policies]
        return time_steps(self.model.cost_spec, policies, **self._options())

    def program_digest(self, policy: PrecisionPolicy) -> str:
        """What decides the program ``policy`` runs: each layer's precision and the loss
        scaling (two policies that say the same, e.g. ``default: bf16`` and every layer bf16,
        are one program, timed once)."""
        precisions = {n: p.value for n, p in policy.resolve(self._module).items()}
        scaling = policy.loss_scaling
        return digest([precisions, None if scaling is None else dataclasses.asdict(scaling)])

    @functools.cached_property
    def fp32_step(self) -> StepTiming:
        """The uniform fp32 policy's whole step, the base of every estimate: measured once
        per model, shape, program and software (kept in the store, so that the estimates,
        and the evaluations cached with them, stay one set).

        Raises:
            ValueError: fp32 itself cannot run here (the message says why).
        """
        fp32 = PrecisionPolicy.uniform(Precision.FP32)
        spec = self.model.cost_spec
        key = "fp32-step:" + digest(
            [
                model_fingerprint(spec.module),
                list(spec.input_shape),
                self.program_digest(fp32),
                {k: str(v) for k, v in self._options().items() if k != "device"},
            ]
        )
        stored = self.store.get(key)
        if stored is not None:
            return StepTiming.from_dict(stored)
        timing = time_steps(spec, [fp32], **self._options())[0]
        if not timing.ok:
            raise ValueError(f"cannot time fp32 training on {self.torch_device}: {timing.error}")
        self.store.put(key, timing.to_dict())
        return timing

    def estimate(self, precisions: Mapping[str, Precision]) -> tuple[float, int]:
        """Step time from the per-layer table and memory (see the module docstring);
        unrunnable layers fp32."""
        runnable = self.model.runnable(precisions)
        table = self.layers
        table.measure({n: [p] for n, p in runnable.items()})  # one the search did not announce
        seconds = self.fp32_step.step_s
        for name, p in runnable.items():
            if p == Precision.FP32 or name not in table.site_of:
                continue
            delta = table.alone(name, p) - table.alone(name, Precision.FP32)
            if not math.isfinite(delta):
                self._note_untimed(name)
                continue
            seconds += delta - self._saved_casts(name, p, runnable)
        floor = ESTIMATE_FLOOR * self.fp32_step.step_s
        return max(seconds, floor), self._memory(runnable)

    def _saved_casts(self, name: str, p: Precision, runnable: Mapping[str, Precision]) -> float:
        dtype = io_dtype(p)
        if dtype is None:
            return 0.0
        flow = self.flow
        sources, users = flow["sources"].get(name, ()), flow["users"].get(name, ())

        def same(others: tuple[str, ...]) -> bool:
            return bool(others) and all(
                o and io_dtype(runnable.get(o, Precision.FP32)) == dtype for o in others
            )

        saved = 0.0
        if same(sources):
            saved += self.layers.cast_in(name, p)
        if same(users):
            saved += self.layers.cast_out(name, p)
        return saved if math.isfinite(saved) else 0.0

    @functools.cached_property
    def flow(self) -> dict[str, dict[str, tuple[str, ...]]]:
        """Each layer's sources (the layers feeding it; "" for a model input) and users."""
        rows = self.cost_table().rows
        sources = {row.name: tuple(row.sources) for row in rows}
        users: dict[str, list[str]] = {}
        for row in rows:
            for s in row.sources:
                if s:
                    users.setdefault(s, []).append(row.name)
        return {"sources": sources, "users": {k: tuple(v) for k, v in users.items()}}

    def _memory(self, runnable: Mapping[str, Precision]) -> int:
        memory = self.model.price(runnable)[1]
        measured = self.fp32_step.memory_bytes
        if measured:
            memory = int(memory * measured / max(self.model.fp32[1], 1))
        return memory

    def _note_untimed(self, name: str) -> None:
        if name not in self.untimed:
            self.untimed.add(name)
            warnings.warn(
                f"layer {name!r} could not be timed alone on {self.torch_device}; its "
                "precision is priced by the finalists' whole steps only",
                stacklevel=3,
            )

    @functools.cached_property
    def fp32(self) -> tuple[float, int]:
        """The uniform fp32 policy's step time (measured whole) and memory."""
        return self.estimate(PrecisionPolicy.uniform(Precision.FP32).resolve(self._module))

    @functools.cached_property
    def amp(self) -> tuple[float, int]:
        """The target's blanket AMP policy's estimate from the per-layer table."""
        return self.estimate(amp_policy(self.device).resolve(self._module))
