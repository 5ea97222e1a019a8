"""accelerate: the exported ``Accelerator`` kwargs, through accelerate's own ``prepare``.

accelerate's torchao fp8 path runs on this CPU (it converts with torchao and autocasts bf16),
so the tests train through it: the prepared model must pass the check and train as
``apply_torchao`` does for the same policy (whose fp32-region programs equal the native
runtime's, tests/stacks/test_torchao.py).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from autoprec.policy import PrecisionPolicy
from autoprec.stacks import StackError, StackMismatchError, apply_torchao
from autoprec.stacks.accelerate import accelerate_export
from autoprec.stacks.plan import NearestPolicyError

accelerate = pytest.importorskip("accelerate")


@pytest.fixture(autouse=True)
def _fresh_state():
    """accelerate keeps one process-wide state; each test builds its own Accelerator."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
    yield
    AcceleratorState._reset_state(True)


def _policy(names: list[str]) -> PrecisionPolicy:
    return PrecisionPolicy(
        default="bf16", layers={n: "fp8_rowwise" for n in names if "feed_forward" in n}
    )


def _prepared(tiny, kwargs):
    model = tiny.copy()
    accelerator = accelerate.Accelerator(cpu=True, **kwargs)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    prepared, _ = accelerator.prepare(model, optimizer)
    return accelerator, prepared


def test_accelerate_trains_the_policy_as_torchao_does(tiny):
    policy = _policy(tiny.names())
    export = accelerate_export(tiny.copy(), policy)
    assert export.mixed_precision == "fp8" and export.group.recipe == "rowwise"
    accelerator, model = _prepared(tiny, export.kwargs())
    running = export.check(accelerator.unwrap_model(model))
    assert running["layers.0.feed_forward.w1"].recipe == "rowwise"
    assert running["layers.0.attention.wq"].precision == "bf16"
    losses = tiny.train(model, contextlib.nullcontext)  # accelerate autocasts itself
    reference = tiny.copy()
    torchao = apply_torchao(reference, policy)
    assert losses == tiny.train(reference, lambda: torchao.autocast("cpu"))


def test_the_snippet_builds_the_same_accelerator(tiny):
    policy = _policy(tiny.names())
    namespace: dict = {}
    code = accelerate_export(tiny.copy(), policy).snippet("best_policy.yaml")
    exec(compile(code, "<snippet>", "exec"), namespace)
    accelerator, model = _prepared(tiny, namespace["accelerator_kwargs"]())
    accelerate_export(tiny.copy(), policy).check(accelerator.unwrap_model(model))
    losses = tiny.train(model, contextlib.nullcontext)
    reference = tiny.copy()
    torchao = apply_torchao(reference, policy)
    assert losses == tiny.train(reference, lambda: torchao.autocast("cpu"))


def test_accelerates_default_filter_fails_the_check(tiny):
    # accelerate's own default (no filter): every Linear but the first and last, with its
    # default config; the policy keeps only the head wide, so the check names the first layer
    policy = PrecisionPolicy(default="fp8", layers={"output": "bf16"})
    accelerator, model = _prepared(tiny, {"mixed_precision": "fp8"})
    with pytest.raises(StackMismatchError) as err:
        accelerate_export(tiny.copy(), policy).check(accelerator.unwrap_model(model))
    message = str(err.value)
    assert "\n" not in message
    assert "layers.0.attention.wq: Linear (bf16) where the policy says fp8" in message


def test_what_accelerate_cannot_run_is_refused(tiny):
    names = tiny.names()
    mixed = PrecisionPolicy(default="bf16", layers={names[0]: "fp8", names[1]: "fp8_rowwise"})
    with pytest.raises(NearestPolicyError, match="accelerate converts with one recipe"):
        accelerate_export(tiny.copy(), mixed)
    with pytest.raises(StackError, match="puts them at bf16"):
        accelerate_export(tiny.copy(), PrecisionPolicy(default="fp32", layers={names[0]: "fp8"}))
    plain = accelerate_export(tiny.copy(), PrecisionPolicy(default="bf16"))
    assert plain.kwargs() == {"mixed_precision": "bf16"}


def test_a_bf16_policy_trains_the_native_runtimes_losses(tiny):
    # without fp8 layers accelerate's program is the native runtime's: one bf16 region whose
    # outputs come back as fp32
    from autoprec.runtime import apply_policy

    policy = PrecisionPolicy(default="bf16")
    export = accelerate_export(tiny.copy(), policy)
    accelerator, model = _prepared(tiny, export.kwargs())
    export.check(accelerator.unwrap_model(model))
    native = tiny.copy()
    with apply_policy(native, policy, mode="native"):
        expected = tiny.train(native, contextlib.nullcontext)
    assert tiny.train(model, contextlib.nullcontext) == pytest.approx(expected, rel=1e-6, abs=0)
