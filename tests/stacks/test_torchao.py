"""torchao: the exported per-recipe conversions train the program autoprec's native runtime runs.

The oracle is the native runtime (``apply_policy(mode="native")``, which converts with torchao
too but through its own code, :class:`autoprec.runtime.native.Float8Swap`): module types and
recipes per layer, and the first steps' losses of the tiny llama on this CPU.
"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

from autoprec.hardware.runnability import NotRunnableError
from autoprec.policy import PolicyMismatchError, PrecisionPolicy
from autoprec.runtime import apply_policy
from autoprec.stacks import StackError, StackMismatchError, apply_torchao, check_stack, what_runs
from autoprec.stacks.torchao import torchao_export


def _mixed(names: list[str], default: str = "fp32") -> PrecisionPolicy:
    """fp8 tensorwise in the feed-forwards, rowwise on the queries, the rest at ``default``."""
    return PrecisionPolicy(
        default=default,
        layers={
            **{n: "fp8" for n in names if "feed_forward" in n},
            **{n: "fp8_rowwise" for n in names if n.endswith(".wq")},
        },
    )


def _native(tiny, policy):
    """The native runtime's losses and what each layer ran as (read while it is applied)."""
    model = tiny.copy()
    with apply_policy(model, policy, mode="native") as handle:
        dtype = {"bf16": torch.bfloat16}.get(handle.region_format)
        running = what_runs(model, tiny.names(), dtype)
        losses = tiny.train(model, contextlib.nullcontext)
    return losses, running


def test_mixed_recipes_convert_group_by_group_and_train_as_the_native_runtime(tiny):
    policy = _mixed(tiny.names())
    model = tiny.copy()
    export = apply_torchao(model, policy)
    assert [g.recipe for g in export.groups] == ["rowwise", "tensorwise"]
    assert export.autocast_dtype is None
    running = check_stack(model, policy, export.autocast_dtype)
    native_losses, native_running = _native(tiny, policy)
    assert running == native_running  # module type, recipe, precision, layer by layer
    assert running["layers.0.attention.wq"].recipe == "rowwise"
    assert running["layers.1.feed_forward.w2"].recipe == "tensorwise"
    assert running["output"].module == "Linear" and running["output"].precision == "fp32"
    losses = tiny.train(model, lambda: export.autocast("cpu"))
    assert losses == pytest.approx(native_losses, rel=1e-6, abs=0)  # fp32 rounding


def test_a_bf16_region_runs_the_native_runtimes_modules_and_recipes(tiny):
    # on a CPU torchao's Float8Linear ignores CPU autocast (it reads CUDA's): it takes its input
    # unrounded where the native runtime (and CUDA's torchao) hands it bf16, so the losses agree
    # to the bf16 rounding of the fp8 layers' inputs (measured: 2e-4 relative), not bit for bit
    policy = _mixed(tiny.names(), default="bf16")
    model = tiny.copy()
    export = apply_torchao(model, policy)
    assert export.autocast_dtype is torch.bfloat16
    native_losses, native_running = _native(tiny, policy)
    assert check_stack(model, policy, torch.bfloat16) == native_running
    losses = tiny.train(model, lambda: export.autocast("cpu"))
    assert losses == pytest.approx(native_losses, rel=1e-3, abs=0)


def test_the_check_names_a_module_left_in_another_format(tiny):
    # torchtitan PR #4008's bug: the filter excluded `lm_head`, the head is `output`, so the
    # head ran in fp8 although the policy keeps it in bf16
    from torchao.float8 import convert_to_float8_training

    policy = PrecisionPolicy(default="fp8", layers={"output": "bf16"})
    model = tiny.copy()
    convert_to_float8_training(model, module_filter_fn=lambda m, fqn: fqn != "lm_head")
    with pytest.raises(StackMismatchError) as err:
        check_stack(model, policy, torch.bfloat16)
    message = str(err.value)
    assert "\n" not in message and message.count(": Float8Linear") == 1
    assert "output: Float8Linear tensorwise (fp8) where the policy says bf16" in message
    # accelerate PR #4147's bug: a filter that matches nothing converts nothing
    with pytest.raises(StackMismatchError, match=r"re:.*\.linear_fc1 match no layer"):
        check_stack(tiny.copy(), {"re:.*\\.linear_fc1": "fp8"}, None)
    # and an unconverted model is not what an fp8 policy says
    with pytest.raises(StackMismatchError, match="14 module"):
        check_stack(tiny.copy(), policy, torch.bfloat16)


def test_what_the_program_cannot_run_is_refused_in_one_line(tiny):
    names = tiny.names()
    with pytest.raises(PolicyMismatchError, match="layers.0.attention.q_proj"):
        torchao_export(tiny.copy(), PrecisionPolicy(layers={"layers.0.attention.q_proj": "fp8"}))
    bf16_and_fp32 = PrecisionPolicy(default="bf16", layers={"output": "fp32"})
    with pytest.raises(StackError, match=r"1 layer\(s\) need another: output \(fp32\)"):
        torchao_export(tiny.copy(), bf16_and_fp32)
    with pytest.raises(StackError, match="block-scaled \\(nvfp4\\): layers.0.attention.wq"):
        torchao_export(tiny.copy(), PrecisionPolicy(default="bf16", layers={names[0]: "nvfp4"}))
    model = tiny.copy()
    model.layers["0"].attention.wq = torch.nn.Linear(64, 40, bias=False)  # 40 % 16 != 0
    with pytest.raises(NotRunnableError, match="layers.0.attention.wq"):
        apply_torchao(model, PrecisionPolicy(default="fp8"))


def test_mxfp8_layers_train_as_the_native_runtimes_mxfp8linear(tiny):
    # torchao's MXFP8 training (quantize_ with MXFP8TrainingOpConfig, a weight wrapper) against
    # the native runtime's MXFP8Linear: the same numerics, another module
    names = tiny.names()
    policy = PrecisionPolicy(
        default="fp32",
        layers={**{n: "mxfp8" for n in names if "feed_forward" in n}, names[0]: "fp8_rowwise"},
    )
    model = tiny.copy()
    export = apply_torchao(model, policy)
    running = export.check(model)
    native_losses, native_running = _native(tiny, policy)
    assert {n: r.precision for n, r in running.items()} == {
        n: r.precision for n, r in native_running.items()
    }
    w1 = running["layers.0.feed_forward.w1"]
    assert (w1.module, w1.recipe) == ("Linear", "MXFP8TrainingOpConfig")
    assert native_running["layers.0.feed_forward.w1"].module == "MXFP8Linear"
    losses = tiny.train(model, lambda: export.autocast("cpu"))
    assert losses == pytest.approx(native_losses, rel=1e-6, abs=0)
    # the snippet converts the same
    namespace: dict = {}
    exec(compile(export.snippet("best_policy.yaml"), "<snippet>", "exec"), namespace)
    converted = namespace["convert_model"](tiny.copy())
    assert export.check(converted) == running
    # in a bf16 region torchao's MXFP8 GEMM would get a bf16 input and the fp32 weight
    with pytest.raises(StackError, match="export with --to torchtitan"):
        torchao_export(tiny.copy(), policy.replace(default="bf16"))


def test_the_snippet_runs_and_converts_as_apply_torchao(tiny):
    policy = _mixed(tiny.names(), default="bf16")
    code = torchao_export(tiny.copy(), policy).snippet("best_policy.yaml")
    namespace: dict = {}
    exec(compile(code, "<snippet>", "exec"), namespace)
    model = namespace["convert_model"](tiny.copy())
    reference = tiny.copy()
    export = apply_torchao(reference, policy)
    assert check_stack(model, policy, namespace["AUTOCAST_DTYPE"]) == check_stack(
        reference, policy, export.autocast_dtype
    )
    losses = tiny.train(model, lambda: namespace["autocast"]("cpu"))
    assert losses == tiny.train(reference, lambda: export.autocast("cpu"))


def test_the_exported_program_trains_autoprec_trains_losses():
    # autoprec.training.run.train is what `autoprec train` runs: once with the policy (the
    # native runtime), once on the model apply_torchao converted, under an fp32 policy (on a
    # CPU native mode's fp32 rule changes no bits), same weights, batches and optimizer
    from torch.utils.data import Subset

    from autoprec.data import load_dataset_for
    from autoprec.models import ModelSpec, Task
    from autoprec.models.llama import Llama
    from autoprec.training.run import train

    from .conftest import TINY

    def spec() -> ModelSpec:
        torch.manual_seed(0)
        return ModelSpec.for_tokens(
            "tiny-llama", Llama(TINY), TINY.seq_len, Task.TOKEN_CLASSIFICATION,
            TINY.vocab_size, TINY.vocab_size, "user",
        )  # fmt: skip

    native, exported = spec(), spec()
    names = [n for n, _ in native.module.named_modules() if ".feed_forward." in n]
    policy = PrecisionPolicy(default="fp32", layers=dict.fromkeys(names, "fp8"))
    data = load_dataset_for(native, "teacher-text", seed=0)
    data = dataclasses.replace(data, val=Subset(data.val, range(8)))  # a short validation
    expected = train(native, data, policy, steps=3, batch_size=4, mode="native").train_loss
    apply_torchao(exported.module, policy)
    fp32 = PrecisionPolicy(default="fp32")
    losses = train(exported, data, fp32, steps=3, batch_size=4, mode="native").train_loss
    assert len(losses) == 3 and losses == pytest.approx(expected, rel=1e-6, abs=0)
