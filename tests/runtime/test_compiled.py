"""``compile_policy``: native mode's program without hooks, so that ``torch.compile`` traces it.

On an H200 native mode's hooks failed under ``torch.compile`` and eager fp8 lost to bf16
(docs/benchmarks.md, gpu_validate); these tests hold the hook-free program to native mode's
bits (eager), check that it compiles and trains (``train(mode="compiled")``), and that what it
cannot run is refused in one line.
"""

from __future__ import annotations

import copy

import pytest
import torch

from autoprec import PrecisionPolicy, load_model
from autoprec.data import load_dataset_for
from autoprec.hardware.defaults import amp_policy
from autoprec.layers import tunable_layers
from autoprec.runtime import NotCompilableError, apply_policy, compile_policy
from autoprec.training.run import PolicyMismatchError, train

pytest.importorskip("torchao")


def _llama_policies() -> dict[str, PrecisionPolicy]:
    spec = load_model("llama")
    names = [n for n, _ in tunable_layers(spec.module)]
    ffn = {n: "fp8" for n in names if "feed_forward" in n}
    kv = {n: "fp16" for n in names if n.endswith((".wk", ".wv"))}
    return {
        "all-bf16": amp_policy("h100-sxm", "bf16"),
        "bf16 + fp8 (tensorwise, rowwise)": PrecisionPolicy(
            default="bf16", layers={**ffn, "output": "fp8_rowwise"}
        ),
        # the searched export's form: fp8 Linears in an fp16 region
        "fp16 + fp8": PrecisionPolicy(
            default="fp8", layers=kv | {n: "fp16" for n in names if n.endswith(".wq")}
        ),
    }


@pytest.mark.parametrize("name", list(_llama_policies()))
def test_the_hook_free_program_is_native_modes_bit_for_bit(name):
    policy = _llama_policies()[name]
    spec = load_model("llama")
    x, y = spec.example_batch(2)
    a, b = copy.deepcopy(spec.module), copy.deepcopy(spec.module)
    with apply_policy(a, policy, mode="native"):
        native_loss = spec.loss(a(x), y)
        native_loss.backward()
    handle = compile_policy(b, policy, compile=False)
    loss = spec.loss(b(x), y)
    loss.backward()
    assert loss.dtype == torch.float32 and torch.equal(loss, native_loss)
    for (n, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), n
    if "fp8" in name:
        assert any(type(m).__name__ == "Float8Linear" for m in b.modules())
    # remove() gives the model back: its own modules, forward and outputs
    handle.remove()
    assert "forward" not in b.__dict__ and b._compiled_call_impl is None
    assert [type(m) for m in b.modules()] == [type(m) for m in spec.module.modules()]
    with torch.no_grad():
        assert torch.equal(b(x), copy.deepcopy(spec.module)(x))


def test_a_policy_that_needs_per_layer_rules_is_refused_in_one_line():
    spec = load_model("llama")
    policy = PrecisionPolicy(
        default="bf16", layers={"output": "fp32", "layers.0.attention.wq": "tf32"}
    )
    with pytest.raises(NotCompilableError) as err:
        compile_policy(copy.deepcopy(spec.module), policy)
    message = str(err.value)
    assert "\n" not in message and "2 layer(s)" in message and "output (fp32)" in message
    # train checks it before it starts, with the other policy errors
    data = load_dataset_for(spec, "teacher-text", seed=0)
    with pytest.raises(PolicyMismatchError, match="mode compiled: a compiled program"):
        train(spec, data, policy, steps=1, mode="compiled")


def test_train_in_compiled_mode_follows_native_mode():
    # torch.compile fuses the casts and scalings: not the same bits, the same training
    spec = load_model("tinytransformer")
    names = [n for n, _ in tunable_layers(spec.module)]
    policy = PrecisionPolicy(default="bf16", layers={names[1]: "fp8"})
    data = load_dataset_for(spec, "tokens", seed=0)
    runs = {}
    for mode in ("native", "compiled"):
        run = load_model("tinytransformer")
        runs[mode] = train(run, data, policy, steps=3, batch_size=16, mode=mode, lr=0.01)
        assert "forward" not in run.module.__dict__  # the policy came off again
    assert runs["compiled"].mode == "compiled"
    native, compiled = runs["native"].train_loss, runs["compiled"].train_loss
    assert len(native) == len(compiled) == 3
    assert compiled == pytest.approx(native, rel=1e-2)
    assert runs["compiled"].val_loss == pytest.approx(runs["native"].val_loss, rel=1e-2)
