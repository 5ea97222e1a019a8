"""Lightning: a policy as a callback that converts and checks, and the Trainer's precision.

Lightning's mixed precision is one autocast region (``Trainer(precision="bf16-mixed")``, or
``"16-mixed"``, ``"32-true"``); the fp8 layers are torchao's, converted group by group as
:mod:`.torchao` does, by a callback at ``setup`` (before the optimizer is configured; torchao's
``Float8Linear`` keeps the very ``Parameter`` objects anyway). The callback refuses a Trainer
whose precision is not the policy's region and checks every module after converting, so what
trains is what the policy says.

Example:
    >>> callback = policy_callback("best_policy.yaml", module="model")
    >>> trainer = L.Trainer(precision=lightning_precision(model, "best_policy.yaml"),
    ...                     callbacks=[callback])
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from torch import nn

from autoprec.stacks.plan import StackError
from autoprec.stacks.torchao import TorchaoExport, apply_torchao, torchao_export

if TYPE_CHECKING:  # pragma: no cover
    from autoprec.policy.precision_policy import PolicyLike

__all__ = ["PRECISIONS", "lightning_precision", "lightning_snippet", "policy_callback"]

#: Lightning's ``Trainer(precision=...)`` for each autocast region.
PRECISIONS = {None: "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed"}


def lightning_precision(model: nn.Module, policy: PolicyLike) -> str:
    """The ``Trainer(precision=...)`` of ``policy`` on ``model``.

    Raises:
        ValueError: as :func:`~autoprec.stacks.torchao.torchao_export`.
    """
    return PRECISIONS[torchao_export(model, policy).plan.region]


def policy_callback(policy: PolicyLike, module: str = "") -> Any:
    """A Lightning ``Callback`` that applies ``policy`` at ``setup`` (torchao's conversions,
    then the check) to the LightningModule's submodule ``module`` ("" for the module itself:
    the policy's names are relative to it).

    Raises (at ``setup``):
        StackError: the Trainer's precision is not the policy's region.
        ValueError: as :func:`~autoprec.stacks.torchao.apply_torchao`.
    """
    return _callback_class()(policy, module)


@functools.cache
def _callback_class() -> type:
    import lightning.pytorch as pl

    class PolicyCallback(pl.Callback):  # noqa: D101 - documented by policy_callback
        def __init__(self, policy: PolicyLike, module: str) -> None:
            self.policy = policy
            self.module = module
            self.export: TorchaoExport | None = None

        def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
            if self.export is not None:
                return
            model = pl_module.get_submodule(self.module)
            wanted = lightning_precision(model, self.policy)
            got = str(trainer.precision)
            if got != wanted:
                raise StackError(
                    f"the policy runs under Trainer(precision={wanted!r}), the Trainer has "
                    f"{got!r}; pass precision={wanted!r}"
                )
            self.export = apply_torchao(model, self.policy)

    return PolicyCallback


def lightning_snippet(export: TorchaoExport, source: str) -> str:
    """Python a user pastes: :meth:`TorchaoExport.convert_source`, ``PRECISION`` and a
    ``PolicyCallback`` that converts at ``setup``."""
    return f'''\
# Lightning settings for {source}, written by `autoprec export --to lightning`.
import lightning.pytorch as pl
{export.convert_source()}

PRECISION = "{PRECISIONS[export.plan.region]}"  # Trainer(precision=PRECISION, ...)


class PolicyCallback(pl.Callback):
    """Converts `pl_module.get_submodule(module)` at setup (names as in FP8_LAYERS)."""

    def __init__(self, module=""):
        self.module = module

    def setup(self, trainer, pl_module, stage):
        convert_model(pl_module.get_submodule(self.module))
'''
