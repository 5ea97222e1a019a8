"""The cost model's execution modes: eager and compiled as separate programs (issue 37)."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from autoprec.cli import main
from autoprec.graph import analyze
from autoprec.hardware import CostModel, Efficiency
from autoprec.hardware.cost import CostModelError
from autoprec.hardware.memory import EAGER_FP8_CAST_KERNELS, cast_traffic
from autoprec.hardware.program_types import Cast
from autoprec.models import load_model
from autoprec.policy import PrecisionPolicy
from autoprec.policy.fields import PolicyError, TargetInfo
from autoprec.policy.io import save_policy

H200 = "h200"


@pytest.fixture(scope="module")
def llama8b():
    """The zoo's llama at Llama 3 8B's widths (4 blocks, one 8192-token sequence): the shape
    measured on the H200 (experiments/results/gpu_validate-h200*.json)."""
    with torch.device("meta"):
        spec = load_model("llama", shape="llama3-8b")
    return analyze(spec, 1, cache=True)


def fp8_except_output(table) -> dict[str, str]:
    return {row.name: "bf16" if row.name == "output" else "fp8" for row in table.rows}


class _Kernels(TorchDispatchMode):
    """Every aten operation run: bytes read (its tensor arguments) and written (its results)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = [t for t in tree_leaves((args, kwargs or {}, out)) if isinstance(t, torch.Tensor)]
        self.ops.append((str(func), sum(t.numel() * t.element_size() for t in tensors)))
        return out


@pytest.mark.parametrize("dtype, source", [(torch.bfloat16, "bf16"), (torch.float32, "fp32")])
def test_eager_fp8_cast_is_priced_as_torchao_runs_it(dtype, source):
    """The oracle: torchao's own eager tensorwise cast (tensor_to_scale, then
    hp_tensor_and_scale_to_float8) recorded op by op. Eager: every op a kernel, ~33 bytes per
    element; compiled: the amax read, one read and the fp8 write, two kernels."""
    pytest.importorskip("torchao")
    from torchao.float8.float8_training_tensor import hp_tensor_and_scale_to_float8
    from torchao.float8.float8_utils import tensor_to_scale

    x = torch.randn(64, 256, dtype=dtype)
    with _Kernels() as ran:
        scale = tensor_to_scale(x, torch.float8_e4m3fn)
        hp_tensor_and_scale_to_float8(x, scale, torch.float8_e4m3fn)
    n = x.numel()
    chain = [
        Cast("forward", "fc", source, "fp64", 1, False),
        Cast("forward", "fc", "fp64", "fp32", 1, False),
        *([Cast("forward", "fc", source, "fp32", n, False)] if source != "fp32" else []),
        Cast("forward", "fc", "fp32", "fp8_e4m3", n, False),
    ]
    ((eager_bytes, eager_kernels),) = cast_traffic(chain, 1.0, "eager")
    assert eager_kernels == len(ran.ops)
    assert eager_kernels == EAGER_FP8_CAST_KERNELS - (source == "fp32")
    recorded = sum(b for _, b in ran.ops)
    assert eager_bytes == pytest.approx(recorded, rel=1e-3)  # the scalars' bytes aside
    ((compiled_bytes, compiled_kernels),) = cast_traffic(chain, 1.0, "compiled")
    assert compiled_kernels == 2
    assert compiled_bytes == n * (2 * x.element_size() + 1)
    assert list(cast_traffic(chain, 1.0, None)) == [(compiled_bytes, 2)]  # the default


def test_eager_fp8_loses_to_bf16_where_compiled_fp8_wins(llama8b):
    """The H200's measured direction: fp8 (all Linears but the head) is slower than bf16
    eager and faster compiled; eager fp8 is slower than compiled fp8 relative to bf16."""
    model, fp8 = CostModel(H200), fp8_except_output(llama8b)

    def step(policy, execution):
        return model.step(llama8b, policy, execution=execution).step_time_s

    eager = step(fp8, "eager") / step("bf16", "eager")
    compiled = step(fp8, "compiled") / step("bf16", "compiled")
    assert eager > 1 > compiled
    assert step(fp8, "compiled") < step(fp8, "eager")


def test_the_default_program_is_unchanged_and_between_the_modes(llama8b):
    """No execution mode: the model's old program (eager, torchao's fp8 casts as compiled).
    Compiled keeps ``fused_elementwise`` of the element-wise time and drops activation casts."""
    model, fp8 = CostModel(H200), fp8_except_output(llama8b)
    runs = {mode: model.step(llama8b, fp8, execution=mode) for mode in (None, "eager", "compiled")}
    assert runs[None].other_s == runs["eager"].other_s
    fused = model.efficiency.fused_elementwise
    assert runs["compiled"].other_s == pytest.approx(fused * runs["eager"].other_s)
    assert runs["compiled"].cast_s < runs[None].cast_s < runs["eager"].cast_s
    for part in ("forward_s", "backward_s", "optimizer_s", "layout_s"):
        assert getattr(runs["compiled"], part) == getattr(runs["eager"], part)
    amp = {mode: model.step(llama8b, "bf16", execution=mode) for mode in (None, "eager")}
    assert amp[None].step_time_s == amp["eager"].step_time_s  # no fp8 cast to price otherwise


def test_unknown_execution_mode_is_one_line(llama8b):
    with pytest.raises(CostModelError, match="unknown execution mode 'jit'; expected one of eager"):
        CostModel(H200).step(llama8b, "bf16", execution="jit")


def test_convolution_efficiency_applies_to_convolutions_only():
    table = analyze(load_model("tinycnn"), 8)
    slow = Efficiency(conv_compute={"bf16": 0.05})
    steps = [
        m.step(table, "bf16", batch_size=4096, memory_format="channels_last").layers
        for m in (CostModel(H200), CostModel(H200, slow))
    ]
    slower = set()
    for a, b in zip(*steps, strict=True):
        if not table[a.name].type.startswith("Conv"):
            assert b == a
        elif b.forward_s > a.forward_s:
            slower.add(a.name)
    assert slower == {"conv2"}  # conv1 (3 input channels) stays memory-bound


def test_new_efficiency_fields_leave_old_cache_keys_alone():
    """The canonical form (the evaluator's cache key) of the default factors is as before."""
    assert set(Efficiency().to_dict()) == {"compute", "bandwidth", "kernel_overhead_s"}
    tuned = Efficiency(conv_compute={"fp32": 0.3}, fused_elementwise=0.4)
    assert Efficiency.from_dict(json.loads(json.dumps(tuned.to_dict()))) == tuned
    assert hash(tuned) != hash(Efficiency())
    with pytest.raises(CostModelError, match="fused_elementwise must be a fraction"):
        Efficiency(fused_elementwise=0)


def test_target_execution_round_trips_and_old_files_load(tmp_path):
    target = TargetInfo(device=H200, mode="native", execution="compiled")
    policy = PrecisionPolicy.uniform("bf16", target=target)
    assert PrecisionPolicy.from_dict(policy.to_dict()).target == target
    old = PrecisionPolicy.from_dict({"autoprec_policy": 1, "default": "bf16", "target": {}})
    assert old.target.execution is None and "execution" not in old.to_dict()["target"]
    with pytest.raises(PolicyError, match="target.execution must be one of eager, compiled"):
        TargetInfo(execution="jit")


def test_estimate_takes_the_execution_mode_and_the_policy_files(tmp_path, capsys):
    args = ["hardware", "estimate", "--model", "mlp", "--device", H200, "--batch-size", "64"]
    times = {}
    for mode in ("eager", "compiled"):
        assert main([*args, "--precision", "bf16", "--execution", mode, "--json"]) == 0
        times[mode] = json.loads(capsys.readouterr().out)["step_time_s"]
    assert times["compiled"] < times["eager"]
    path = tmp_path / "p.yaml"
    target = TargetInfo(device=H200, mode="native", execution="compiled")
    save_policy(PrecisionPolicy.uniform("bf16", target=target), path)
    assert main([*args, "--policy", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step_time_s"] == times["compiled"]
