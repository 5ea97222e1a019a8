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

Importing the package imports no torch: the check and the exporters are imported when first
used; heavy imports (torchao, accelerate, lightning) happen inside the functions that need them.
"""

from __future__ import annotations

from autoprec._lazy import lazy_getattr
from autoprec.stacks.plan import STACKS, NearestPolicyError, StackError, StackPlan, plan_for

__all__ = [
    "STACKS",
    "NearestPolicyError",
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

# torch is imported with the check and the exporters, not with the package (the CLI reads STACKS)
__getattr__ = lazy_getattr(
    globals(),
    {
        "Running": "autoprec.stacks.check",
        "StackMismatchError": "autoprec.stacks.check",
        "check_stack": "autoprec.stacks.check",
        "what_runs": "autoprec.stacks.check",
        "TorchaoExport": "autoprec.stacks.torchao",
        "apply_torchao": "autoprec.stacks.torchao",
        "torchao_export": "autoprec.stacks.torchao",
    },
)
