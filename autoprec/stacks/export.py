"""``export_policy``: the text ``autoprec export --to STACK`` writes for a policy and a model.

| stack | what is written |
|---|---|
| ``torchao`` | Python: the layers per recipe, ``convert_model(model)``, ``autocast(device)`` |
| ``torchtitan`` | TOML: ``[model]``, ``[quantize.linear.float8]`` (or ``.mx``), ``[training]`` |
| ``accelerate`` | Python: ``accelerator_kwargs()`` for ``Accelerator(**...)`` |
| ``lightning`` | Python: ``PRECISION`` and a ``PolicyCallback`` |
| ``megatron`` | YAML: Megatron-LM's ``--te-precision-config-file`` |

Every exporter reads the policy against the model first (a name the model does not have is a
one-line error) and refuses, in one line, what its stack cannot run or express.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from autoprec.stacks.plan import STACKS

if TYPE_CHECKING:  # pragma: no cover
    from autoprec.policy.precision_policy import PolicyLike

__all__ = ["export_policy"]


def export_policy(model: nn.Module, policy: PolicyLike, stack: str, source: str) -> str:
    """The code or config a user pastes to train ``model`` under ``policy`` in ``stack``.

    Args:
        model: the model the policy is for (its module names; the meta device will do).
        policy: a policy (see :meth:`~autoprec.PrecisionPolicy.coerce`).
        stack: one of :data:`~autoprec.stacks.plan.STACKS`.
        source: the policy's name, for the header of the text.

    Raises:
        ValueError: an unknown stack; what the stack's exporter refuses (a name the model does
            not have, a format or a mix of recipes the stack cannot run), in one line.
    """
    if stack == "torchao":
        from autoprec.stacks.torchao import torchao_export

        return torchao_export(model, policy).snippet(source)
    if stack == "torchtitan":
        from autoprec.stacks.torchtitan import torchtitan_export

        return torchtitan_export(model, policy).toml(source)
    if stack == "accelerate":
        from autoprec.stacks.accelerate import accelerate_export

        return accelerate_export(model, policy).snippet(source)
    if stack == "lightning":
        from autoprec.stacks.lightning import lightning_snippet
        from autoprec.stacks.torchao import torchao_export

        return lightning_snippet(torchao_export(model, policy), source)
    if stack == "megatron":
        from autoprec.stacks.megatron import megatron_export

        return megatron_export(model, policy).yaml(source)
    raise ValueError(f"unknown stack {stack!r}; expected one of {', '.join(STACKS)}")
