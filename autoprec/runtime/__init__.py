"""The mixed-precision runtime: apply a per-layer precision policy to any ``nn.Module``.

- :mod:`.apply`: ``apply_policy`` (emulate and native modes), the handle, the overflow guard.
- :mod:`.layer`: one managed layer's hooks, precision and promotions.
- :mod:`.native`: native mode's program (autocast region, per-layer rules, TF32, torchao fp8).
- :mod:`.compiled`: ``compile_policy``, native's program without hooks, under ``torch.compile``.
- :mod:`.functional`: weights used functionally (``F.linear(x, self.qkv.weight)``).
- :mod:`.record`: ``OpRecorder``, a dispatch mode that records the casts and matmuls that ran.
- :mod:`.casting`: per-layer casting state in emulate mode.
- :mod:`.loss_scaler`: ``LossScaler``, dynamic loss scaling with GradScaler's interface.
- :mod:`.layer_scaling`: ``apply_layer_scaling``, a delayed scale per fp16 layer's gradient.
"""

from autoprec.runtime.apply import (
    MODES,
    GuardConfig,
    LayerStats,
    PolicyHandle,
    RuntimeStateError,
    apply_policy,
)
from autoprec.runtime.compiled import CompiledPolicy, NotCompilableError, compile_policy
from autoprec.runtime.layer_scaling import LayerScaling, apply_layer_scaling
from autoprec.runtime.loss_scaler import LOSS_SCALER_KINDS, LossScaler, ScaleRecord

__all__ = [
    "LOSS_SCALER_KINDS",
    "MODES",
    "CompiledPolicy",
    "GuardConfig",
    "LayerScaling",
    "LayerStats",
    "LossScaler",
    "NotCompilableError",
    "PolicyHandle",
    "RuntimeStateError",
    "ScaleRecord",
    "apply_layer_scaling",
    "apply_policy",
    "compile_policy",
]
