"""The cost model's block-scaled formats: nvfp4 on Blackwell's FP4 tensor cores, fp8_block at
the fp8 rate, with each backend's quantisation kernels priced as memory passes; and the
published NVFP4 and fp8 block-scaling rows of experiments/published_speedups.yaml."""

from __future__ import annotations

import importlib.util
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
import yaml
from torch import nn

from autoprec.graph import analyze
from autoprec.hardware import CostModel, get_device
from autoprec.hardware.cost import CostModelError
from autoprec.hardware.factors import BLOCK_FP8_GEMM_EFFICIENCY
from autoprec.hardware.memory import cast_traffic
from autoprec.hardware.program_types import Cast
from autoprec.models import ModelSpec, Task
from autoprec.precision import parse_precision

EXPERIMENTS = Path(__file__).resolve().parents[2] / "experiments"
FEATURES, TOKENS = 8192, 8192


class _TwoLinears(nn.Module):
    def __init__(self, features: int) -> None:
        super().__init__()
        self.a = nn.Linear(features, features, bias=False)
        self.b = nn.Linear(features, features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


@pytest.fixture(scope="module")
def big():
    """Two 8192 x 8192 Linears on 8192 rows, analysed on the meta device: compute-bound GEMMs."""
    with torch.device("meta"):
        module = _TwoLinears(FEATURES)
    spec = ModelSpec("two-linears", module, (FEATURES,), Task.IMAGE_CLASSIFICATION, FEATURES)
    return analyze(spec, TOKENS)


def test_blackwell_runs_nvfp4_and_hopper_does_not():
    b200, h100 = get_device("b200"), get_device("h100-sxm")
    assert b200.supports("nvfp4") and "nvfp4" in b200.peak_tflops
    assert b200.peak_tflops["nvfp4"] == 2 * b200.peak_tflops["fp8"]  # the datasheet's FP4 row
    assert "FP4 Tensor Core" in b200.sources["peak_tflops.nvfp4"]
    assert not h100.supports("nvfp4")
    gb200 = get_device("NVIDIA GB200")  # the NVL72 table's per-GPU column
    assert gb200.peak_tflops["nvfp4"] == 10000 and gb200.supports("mxfp8")
    assert b200.supports("fp8_block") and h100.supports("fp8_block")  # an fp8 GEMM


def test_on_b200_a_large_gemm_is_fastest_in_nvfp4_then_mxfp8_then_bf16(big):
    """Layer ``a`` at each format, ``b`` bf16 (so a bf16 region, as these formats train):
    its GEMMs and the whole step, casts included."""
    cm = CostModel("b200")
    formats = ("bf16", "mxfp8", "nvfp4")
    layer = {p: cm.layer_cost(big.rows[0], p) for p in formats}
    seconds = {p: c.forward_s + c.backward_s for p, c in layer.items()}
    assert seconds["nvfp4"] < seconds["mxfp8"] < seconds["bf16"]
    step = {p: cm.step(big, {"a": p, "b": "bf16"}).step_time_s for p in formats}
    assert step["nvfp4"] < step["mxfp8"] < step["bf16"]
    gemm = {p: cm.layer_cost(big.rows[1], p).forward_s for p in ("bf16", "fp8", "nvfp4")}
    # Blackwell's dense FP4 rate is twice its FP8 rate; the default efficiency takes some back
    assert gemm["fp8"] / gemm["nvfp4"] == pytest.approx(9000 * 0.43 / (4500 * 0.5), rel=0.05)


def test_nvfp4_program_has_the_amax_cast_and_hadamard_passes_of_each_tensor(big):
    prog = CostModel("b200").program(big, "nvfp4")
    pairs = prog.cast_pairs()
    per_layer = {
        ("bf16", "amax"): 3,  # input, weight (forward) and output gradient (backward)
        ("bf16", "nvfp4"): 1,  # the input rowwise, for the forward GEMM
        ("bf16", "nvfp4_rht"): 1,  # the input columnwise after the Hadamard transform
        ("bf16", "nvfp4_16x16"): 2,  # the weight and its transpose, 16x16 blocks
        ("bf16", "nvfp4_sr"): 1,  # the output gradient rowwise, stochastically rounded
        ("bf16", "nvfp4_rht_sr"): 1,  # ... and transformed, for the weight gradient
    }
    assert {k: pairs[k] for k in per_layer} == {k: 2 * n for k, n in per_layer.items()}
    assert prog.matmul_kinds() == Counter({("_scaled_mm", "nvfp4"): 6})
    transformed = [c for c in prog.casts if c.target.startswith("nvfp4_rht")]
    assert {c.phase for c in transformed} == {"forward", "backward"}
    assert all(not c.weight for c in transformed)  # both weight-gradient operands: activations


def test_nvfp4_quantisation_kernels_are_priced_as_memory_passes():
    """amax: one read; the two layouts of one tensor: one read, both writes, one kernel."""
    n = 1000
    casts = [
        Cast("forward", "a", "bf16", "amax", n, False),
        Cast("forward", "a", "bf16", "nvfp4", n, False),
        Cast("forward", "a", "bf16", "nvfp4_rht", n, False),
    ]
    assert list(cast_traffic(casts, 2.0)) == [
        (2 * n * 2, 1),
        (2 * n * (2 + 2 * (0.5 + 1 / 16)), 1),
    ]
    other = [casts[1], Cast("forward", "b", "bf16", "nvfp4_rht", n, False)]  # two tensors
    assert [k for _, k in cast_traffic(other, 1.0)] == [1, 1]


def test_nvfp4_is_refused_on_h100(big):
    cm = CostModel("h100-sxm")
    with pytest.raises(CostModelError, match="cannot run nvfp4"):
        cm.step(big, "nvfp4")
    with pytest.raises(CostModelError, match="cannot run nvfp4"):
        cm.rate("nvfp4")


@pytest.mark.parametrize("device", ["h100-sxm", "b200"])
def test_fp8_block_runs_at_the_fp8_rate_with_its_tile_casts(big, device):
    cm = CostModel(device)
    row = big.rows[1]
    block, fp8 = cm.layer_cost(row, "fp8_block"), cm.layer_cost(row, "fp8")
    overhead = cm.efficiency.kernel_overhead_s
    assert block.bound == "compute" and cm.rate("fp8_block") == cm.rate("fp8")
    assert (block.forward_s - overhead) * BLOCK_FP8_GEMM_EFFICIENCY == pytest.approx(
        fp8.forward_s - overhead
    )
    prog = cm.program(big, "fp8_block")
    pairs = prog.cast_pairs()
    # per Linear: input and output gradient in 1x128 tiles for each of their two GEMMs, the
    # weight in 128x128 blocks for each of its two
    assert pairs[("bf16", "e4m3_1x128")] == 2 * 4 and pairs[("bf16", "e4m3_128x128")] == 2 * 2
    assert prog.matmul_kinds() == Counter({("_scaled_mm", "fp8"): 6})
    tiles = [c for c in prog.casts if c.target == "e4m3_1x128"]
    assert list(cast_traffic(tiles[:1], 1.0)) == [(tiles[0].numel * (2 + 1 + 4 / 128), 1)]
    assert cm.step(big, "fp8_block").cast_s > cm.step(big, "bf16").cast_s


def test_nvfp4_saves_its_input_quantised(big):
    """torchao's nvfp4_mm_triton keeps the FP4 codes of its input for the weight gradient,
    where mxfp8 keeps the bf16 input."""
    cm = CostModel("b200")
    memory = {p: cm.step(big, p).memory for p in ("mxfp8", "nvfp4")}
    assert memory["nvfp4"]["activations"] < memory["mxfp8"]["activations"]


def _load(name: str):
    sys.path.insert(0, str(EXPERIMENTS))
    try:
        spec = importlib.util.spec_from_file_location(f"b2_{name}", EXPERIMENTS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(EXPERIMENTS))


def _new_rows() -> list[dict]:
    rows = yaml.safe_load((EXPERIMENTS / "published_speedups.yaml").read_text())
    return [r for r in rows if r["compare"]["precision"] in ("nvfp4", "fp8_block")]


def test_the_published_nvfp4_and_fp8_block_rows_load_and_are_priced():
    rows = _new_rows()
    kinds = Counter((r["kind"], r["compare"]["precision"]) for r in rows)
    assert kinds == {("gemm", "nvfp4"): 2, ("gemm", "fp8_block"): 2, ("transformer", "nvfp4"): 3}
    vcm = _load("validate_cost_model")
    for r in rows:
        assert r["url"].startswith("https://") and r["note"]
        parse_precision(r["compare"]["precision"])
        if r["kind"] != "gemm":
            continue
        result = vcm.evaluate(r, CostModel, vcm.Args())
        assert result["pred"]["ratio"] > 1.4 and abs(result["error"]) < 0.5, r["note"]
    tails = [r for r in rows if r["kind"] == "transformer"]
    assert [r["compare"]["bf16_from_block"] for r in tails] == [27, 30, 28]
    assert tails[0]["compare"]["throughput"] / tails[0]["baseline"]["throughput"] == (
        pytest.approx(1.37, abs=0.005)  # torchtitan's Llama 3 8B: 30,040 against 21,919
    )


def test_the_bf16_tail_policy_keeps_the_last_blocks_and_the_head_in_bf16():
    """The torchtitan row's policy, priced on a 32-block Llama of tiny width: blocks 0-26
    nvfp4, 27-31 and the output head bf16; and it prices faster than all-bf16 on b200."""
    from autoprec.models.llama import Llama, LlamaConfig

    rows_mod = _load("transformer_rows")
    config = LlamaConfig(256, 32, 4, 2, 512, 512, 128)
    with torch.device("meta"):
        module = Llama(config)
    spec = ModelSpec.for_tokens("t", module, 128, Task.TOKEN_CLASSIFICATION, 512, 512, "builtin")
    table = analyze(spec, 8)
    side = next(r for r in _new_rows() if r["kind"] == "transformer")["compare"]
    base, cmp = rows_mod.policies(table, side)
    low = {n for n, p in cmp.items() if p == "nvfp4"}
    assert set(base.values()) == {"bf16"}
    assert len(low) == 27 * 7 and cmp["output"] == "bf16"
    assert all(cmp[f"layers.{i}.feed_forward.w2"] == "bf16" for i in range(27, 32))
    assert all(cmp[f"layers.{i}.attention.wq"] == "nvfp4" for i in range(27))
