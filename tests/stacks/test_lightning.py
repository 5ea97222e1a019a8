"""Lightning: the policy callback (and the exported snippet's) through Lightning's own Trainer.

Lightning's ``bf16-mixed`` runs on this CPU (CPU autocast), so the tests train through it: the
converted module must pass the check and train as ``apply_torchao`` does for the same policy.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from autoprec.policy import PrecisionPolicy
from autoprec.stacks import StackError, apply_torchao
from autoprec.stacks.lightning import lightning_snippet, policy_callback
from autoprec.stacks.torchao import torchao_export

pl = pytest.importorskip("lightning.pytorch")


class _Module(pl.LightningModule):
    """The tiny llama as ``self.model``; its loss as the stack tests compute it."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model
        self.losses: list[float] = []

    def training_step(self, batch, _):
        x, y = batch[:, :-1], batch[:, 1:]
        logits = self.model(x)
        with torch.autocast("cpu", enabled=False):
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(tiny, callback, precision: str) -> _Module:
    module = _Module(tiny.copy())
    trainer = pl.Trainer(
        accelerator="cpu",
        precision=precision,
        max_steps=len(tiny.batches),
        callbacks=[callback],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    loader = torch.utils.data.DataLoader(list(tiny.batches), batch_size=None)
    trainer.fit(module, loader)
    return module


def _policy(names):
    return PrecisionPolicy(default="bf16", layers={n: "fp8" for n in names if "feed_forward" in n})


def _reference(tiny, policy) -> list[float]:
    model = tiny.copy()
    export = apply_torchao(model, policy)
    return tiny.train(model, lambda: export.autocast("cpu"))


def test_the_callback_converts_checks_and_trains_as_torchao(tiny):
    policy = _policy(tiny.names())
    callback = policy_callback(policy, module="model")
    module = _fit(tiny, callback, "bf16-mixed")
    running = callback.export.check(module.model)
    assert running["layers.1.feed_forward.w2"].recipe == "tensorwise"
    assert running["output"].precision == "bf16"
    assert module.losses == _reference(tiny, policy)


def test_the_snippets_callback_trains_the_same(tiny):
    policy = _policy(tiny.names())
    namespace: dict = {}
    code = lightning_snippet(torchao_export(tiny.copy(), policy), "best_policy.yaml")
    exec(compile(code, "<snippet>", "exec"), namespace)
    module = _fit(tiny, namespace["PolicyCallback"]("model"), namespace["PRECISION"])
    torchao_export(tiny.copy(), policy).check(module.model)
    assert module.losses == _reference(tiny, policy)


def test_a_trainer_of_another_precision_is_refused_before_training(tiny):
    with pytest.raises(StackError, match="pass precision='bf16-mixed'"):
        _fit(tiny, policy_callback(_policy(tiny.names()), module="model"), "32-true")


def test_a_bf16_policy_trains_the_native_runtimes_losses(tiny):
    import contextlib

    from autoprec.runtime import apply_policy

    policy = PrecisionPolicy(default="bf16")
    module = _fit(tiny, policy_callback(policy, module="model"), "bf16-mixed")
    native = tiny.copy()
    with apply_policy(native, policy, mode="native"):
        expected = tiny.train(native, contextlib.nullcontext)
    assert module.losses == pytest.approx(expected, rel=1e-6, abs=0)
