"""The policy where production training happens: one library call per training stack.

- :mod:`.plan`: the policy read against a model (``plan_for``, ``StackPlan``, ``StackError``).
- :mod:`.check`: ``check_stack``, the walk that compares what will run with the policy.
- :mod:`.torchao`: ``convert_to_float8_training`` per recipe plus an autocast
  (``torchao_export``, ``apply_torchao``).
- :mod:`.torchtitan`: the TOML section of torchtitan's float8 or mx converter.
- :mod:`.accelerate`: ``Accelerator`` kwargs (``AORecipeKwargs``).
- :mod:`.lightning`: a Lightning callback that converts and checks.
- :mod:`.megatron`: Megatron-LM's ``--te-precision-config-file``.
- :mod:`.export`: ``export_policy``, the text ``autoprec export`` writes per stack.

Heavy imports (torchao, accelerate, lightning) happen inside the functions that need them.
"""

from __future__ import annotations

from autoprec.stacks.check import Running, StackMismatchError, check_stack, what_runs
from autoprec.stacks.plan import STACKS, StackError, StackPlan, plan_for
from autoprec.stacks.torchao import TorchaoExport, apply_torchao, torchao_export

__all__ = [
    "STACKS",
    "Running",
    "StackError",
    "StackMismatchError",
    "StackPlan",
    "TorchaoExport",
    "apply_torchao",
    "check_stack",
    "plan_for",
    "torchao_export",
    "what_runs",
]
