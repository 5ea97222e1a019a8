"""What a policy costs on the target when it is not measured: the cost model on the layer table.

One :class:`CostEstimator` per evaluator: the layer table of the production model and shape
(analysed once), the cost model of the target (with its calibration), and the two costs every
evaluation is compared with, fp32's and the blanket AMP policy's, computed once. A layer the
target cannot run (:func:`autoprec.hardware.runnability.verdict_for_row`) is priced as fp32.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from torch import nn

from autoprec.hardware import CostModel, DeviceSpec
from autoprec.hardware import runnability as runnability_table
from autoprec.hardware.defaults import amp_policy
from autoprec.layers import model_fingerprint
from autoprec.policy import PrecisionPolicy
from autoprec.precision import Precision

if TYPE_CHECKING:  # pragma: no cover
    from autoprec.graph.table import LayerTable
    from autoprec.models import ModelSpec


@functools.cache
def runnability_identity() -> dict[str, Any]:
    """What decides the runnability table's verdicts, for cache keys: a digest of the table's
    code (its rules and constants) and whether torchao is installed."""
    source = inspect.getsource(runnability_table).encode()
    return {
        "float8": runnability_table.float8_available(),
        "rules": hashlib.sha256(source).hexdigest()[:32],
    }


def cost_fields(
    step_time: float, memory: int, fp32: tuple[float, int], amp: tuple[float, int]
) -> dict[str, Any]:
    """Step time and memory, and their ratios to the fp32 and blanket-AMP policies'."""
    return {
        "speedup": fp32[0] / step_time,
        "memory_ratio": memory / max(fp32[1], 1),
        "speedup_vs_amp": amp[0] / step_time,
        "memory_ratio_vs_amp": memory / max(amp[1], 1),
        "step_time_s": step_time,
        "memory_bytes": memory,
    }


class CostEstimator:
    """Step time and memory of policies from the cost model.

    Args:
        device: the target.
        cost_spec: the model as it will be trained in production (``module``,
            ``input_shape``), with the layer names of the fine-tuned model.
        batch_size: the production batch size.
        target_mode: ``"native"`` or ``"emulate"`` (see :mod:`autoprec.hardware.runnability`).
        module: the fine-tuned model, whose layers policies are resolved against.
        execution: the program production runs, ``"eager"`` or ``"compiled"``
            (:meth:`CostModel.step`'s ``execution``); None: the cost model's default.

    Attributes:
        module: the fine-tuned model (``module`` above).
        model: the target's :class:`~autoprec.hardware.CostModel` (its calibration included).
    """

    def __init__(
        self,
        device: DeviceSpec,
        cost_spec: ModelSpec,
        batch_size: int,
        target_mode: str,
        module: nn.Module,
        execution: str | None = None,
    ) -> None:
        self.device = device
        self.cost_spec = cost_spec
        self.batch_size = batch_size
        self.target_mode = target_mode
        self.execution = execution
        self.model = CostModel(device)
        self.module = module
        self._table: LayerTable | None = None

    def identity(self) -> dict[str, Any]:
        """What decides the estimates besides the policy, for cache keys."""
        out = {
            "cost": [
                model_fingerprint(self.cost_spec.module),
                list(getattr(self.cost_spec, "input_shape", None) or []),
                self.batch_size,
            ],
            "device": self.device.name,
            "efficiency": self.model.efficiency.to_dict(),
            "runnability": runnability_identity(),
        }
        if self.execution is not None:  # named: part of the key (unnamed keys stay as they were)
            out["execution"] = self.execution
        return out

    def cost_table(self) -> LayerTable:
        """The layer table of ``cost_spec`` at ``batch_size`` (analysed once, cached on disk)."""
        if self._table is None:
            from autoprec.graph import analyze

            self._table = analyze(self.cost_spec, self.batch_size, cache=True)
        return self._table

    def unrunnable(self, precisions: Mapping[str, Precision]) -> dict[str, str]:
        """``{layer: reason}`` for the layers of ``precisions`` the target cannot run in its
        ``target_mode`` (the runnability table; for a layer the table lacks, whether the
        device has the format at all)."""
        shapes = runnability_table.shapes_of(self.cost_table())
        bad = runnability_table.unrunnable(precisions, self.device, shapes, self.target_mode)
        return {name: verdict.reason for name, verdict in bad.items()}

    def estimate(self, precisions: Mapping[str, Precision]) -> tuple[float, int]:
        """Step time (s) and memory (bytes) of ``{layer: precision}``, unrunnable layers fp32."""
        return self.price(self.runnable(precisions))

    def runnable(self, precisions: Mapping[str, Precision]) -> dict[str, Precision]:
        """``precisions`` with the layers the target cannot run (:meth:`unrunnable`) at fp32:
        the program that is priced."""
        bad = self.unrunnable(precisions)
        return {n: (Precision.FP32 if n in bad else p) for n, p in precisions.items()}

    def price(self, runnable: Mapping[str, Precision]) -> tuple[float, int]:
        """Step time (s) and memory (bytes) of a map :meth:`runnable` returned."""
        est = self.model.step(
            self.cost_table(), runnable, batch_size=self.batch_size, execution=self.execution
        )
        return est.step_time_s, int(est.memory_bytes)

    @functools.cached_property
    def fp32(self) -> tuple[float, int]:
        """The estimate of the uniform fp32 policy."""
        return self.estimate(PrecisionPolicy.uniform(Precision.FP32).resolve(self.module))

    @functools.cached_property
    def amp(self) -> tuple[float, int]:
        """The estimate of the target's blanket AMP policy."""
        return self.estimate(amp_policy(self.device).resolve(self.module))
