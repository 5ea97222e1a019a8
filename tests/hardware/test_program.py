"""The cost model prices the program the runtime runs: its kernel inventory (casts with their
dtypes, matrix operations with theirs) equals a dispatch-mode recording of one native step."""

from __future__ import annotations

import copy
from collections import Counter

import numpy as np
import pytest
import torch
from torch import nn

from autoprec.graph import analyze
from autoprec.hardware import CostModel, get_device
from autoprec.hardware.program import program
from autoprec.hardware.runnability import runnable_precisions
from autoprec.models import load_model
from autoprec.precision import PRECISION_NAMES
from autoprec.runtime import apply_policy
from autoprec.runtime.record import OpRecorder

NAMES = {
    torch.float32: "fp32",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float8_e4m3fn: "fp8_e4m3",
    torch.float8_e5m2: "fp8_e5m2",
    torch.float64: "fp64",  # torchao computes fp8 scales through fp64
}
ATTENTION = "scaled_dot_product_attention"


def _matmul_name(name: str) -> str:
    """Fused attention kernels under one name (flash on this CPU, others on a GPU)."""
    if "scaled_dot_product" in name:
        return ATTENTION + ("_backward" if name.endswith("backward") else "")
    return name


def _recorded(spec, precisions, batch) -> tuple[Counter, Counter]:
    model = copy.deepcopy(spec.module).train()
    x, y = batch
    handle = apply_policy(model, precisions, mode="native")
    try:
        with OpRecorder() as rec:
            spec.loss(model(x), y).backward()
    finally:
        handle.remove()
    casts = Counter(
        (NAMES[a], NAMES[b]) for (a, b), n in rec.cast_pairs().items() for _ in range(n)
    )
    matmuls = Counter()
    for op in rec.ops:
        name = _matmul_name(op.name)
        if op.is_matmul or name.startswith(ATTENTION):
            dtype = "fp8" if op.name == "_scaled_mm" else NAMES[op.dtypes[0]]
            matmuls[(name, dtype)] += 1
    return casts, matmuls


def _random_policies(table, n: int, seed: int) -> list[dict[str, str]]:
    choices = runnable_precisions(table, get_device("h100-sxm"), PRECISION_NAMES)
    rng = np.random.default_rng(seed)
    out = [{name: "bf16" for name in choices}]  # blanket AMP first
    while len(out) < n:
        out.append(
            {name: str(allowed[rng.integers(len(allowed))]) for name, allowed in choices.items()}
        )
    return out


@pytest.mark.parametrize(("model", "image_size"), [("resnet18", 32), ("tinytransformer", None)])
def test_inventory_equals_the_recorded_native_step(model, image_size):
    torch.manual_seed(0)
    spec = load_model(model, num_classes=10, image_size=image_size)
    batch = spec.example_batch(4)
    table = analyze(spec, batch)
    assert table.flow is not None
    for policy in _random_policies(table, 20, seed=1):
        prog = program(table.flow, policy, device_type="cpu")
        casts, matmuls = _recorded(spec, policy, batch)
        assert prog.cast_pairs() == casts, policy
        assert prog.matmul_kinds() == matmuls, policy


def test_blanket_bf16_is_autocast_and_the_cost_model_prices_those_casts():
    spec = load_model("resnet18", num_classes=10, image_size=32)
    batch = spec.example_batch(4)
    table = analyze(spec, batch)
    prog = program(table.flow, dict.fromkeys(table.names, "bf16"), device_type="cpu")
    model = copy.deepcopy(spec.module).train()
    with OpRecorder() as rec:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = spec.loss(model(batch[0]), batch[1])
        loss.backward()
    assert len(prog.casts) == len(rec.casts()) == 47
    cost = CostModel("h100-sxm")
    # more casts cost more: a policy that flips dtype at every layer pays for each boundary
    flips = {name: ("bf16" if i % 2 else "fp32") for i, name in enumerate(table.names)}
    assert len(cost.program(table, flips).casts) > len(cost.program(table, "bf16").casts)
    assert cost.step(table, flips).cast_s > cost.step(table, "bf16").cast_s


def test_a_residual_merge_of_two_dtypes_casts_the_gradient_back():
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(16, 16)
            self.b = nn.Linear(16, 16)

        def forward(self, x):
            return self.a(x) + self.b(x)

    from autoprec.graph.flow import record_flow

    meta = Block().to("meta")
    flow = record_flow(meta, torch.randn(2, 16, device="meta"), {"a": meta.a, "b": meta.b})
    prog = program(flow, {"a": "bf16", "b": "fp32"}, device_type="cpu")
    backward = [c for c in prog.casts if c.phase == "backward" and not c.layer]
    assert [(c.source, c.target) for c in backward] == [("fp32", "bf16")]  # a's branch


@pytest.mark.parametrize("around", ["fp32", "bf16"])
def test_an_mxfp8_layer_casts_each_operand_of_each_gemm_with_its_block_scales(monkeypatch, around):
    """torchao's MXFP8Linear (its emulated kernel on this CPU): six e4m3 casts with their E8M0
    scales (uint8 in the recording), as the program has them; in a bf16 region the layer reads
    bf16 and to_mx upcasts each operand and its block amaxes to fp32 first. What the layer adds
    to the step (against the same policy with that layer ``around``) is compared: the emulated
    kernel then dequantises (E8M0 back to fp32) and multiplies where a Blackwell GPU runs three
    MX ``_scaled_mm``, so those are left out."""
    pytest.importorskip("torchao.prototype.moe_training")
    monkeypatch.setitem(NAMES, torch.uint8, "e8m0")
    torch.manual_seed(0)
    spec = load_model("tinytransformer", num_classes=10)
    batch = spec.example_batch(4)
    table = analyze(spec, batch)
    policy = {row.name: around for row in table.rows}
    before = _recorded(spec, policy, batch)[0], program(table.flow, policy, "cpu").cast_pairs()
    policy["layers.1.linear1"] = "mxfp8"
    casts, _ = _recorded(spec, policy, batch)
    prog = program(table.flow, policy, device_type="cpu")
    recorded = {pair: n for pair, n in (casts - before[0]).items() if pair[0] != "e8m0"}
    added = Counter(prog.cast_pairs()) - Counter(before[1])
    mx = {("fp32", "fp8_e4m3"): 6, ("fp32", "e8m0"): 6}
    assert added == recorded == ({**mx, ("bf16", "fp32"): 12} if around == "bf16" else mx)
    assert prog.matmul_kinds()[("_scaled_mm", "mxfp8")] == 3
