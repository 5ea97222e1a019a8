"""autoprec.models.moe: the zoo's ``llama-moe``, its fused experts as one tunable layer per block,
and their FLOPs in the analysis."""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn import functional as F

from autoprec.data import load_dataset_for
from autoprec.graph import analyze
from autoprec.layers import geometry, is_fused_experts, tunable_layers
from autoprec.models import ModelError, list_models, load_model, model_shapes
from autoprec.models.moe import (
    PRODUCTION_SHAPES,
    GroupedExperts,
    LlamaMoE,
    MoEConfig,
    expert_gemm,
)
from autoprec.models.spec import ModelSpec, Task
from autoprec.policy import PrecisionPolicy
from autoprec.training.run import train

TINY = MoEConfig(
    dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, seq_len=16, n_experts=4,
    top_k=2, expert_hidden=48, n_shared_experts=1,
)  # fmt: skip


def test_names_follow_torchtitans_moe_and_experts_are_one_layer_per_block():
    spec = load_model("llama-moe")
    names = [name for name, _ in tunable_layers(spec.module)]
    per_block = ["attention.wq", "attention.wk", "attention.wv", "attention.wo"]
    per_block += ["moe.router.gate", "moe.experts"]
    per_block += ["moe.shared_experts.w1", "moe.shared_experts.w2", "moe.shared_experts.w3"]
    assert names == [f"layers.{i}.{n}" for i in range(4) for n in per_block] + ["output"]
    experts = spec.module.get_submodule("layers.0.moe.experts")
    assert isinstance(experts, GroupedExperts) and is_fused_experts(experts)
    assert [(n, tuple(p.shape)) for n, p in experts.named_parameters()] == [
        ("w1", (4, 256, 128)), ("w2", (4, 128, 256)), ("w3", (4, 256, 128)),
    ]  # fmt: skip
    assert geometry(experts) == (128, 256, (), ())
    # not one of its three weights is a layer of its own
    assert not any(name.startswith("layers.0.moe.experts.") for name in names)
    assert {"name": "llama-moe", "family": "builtin"}.items() <= next(
        row for row in list_models() if row["name"] == "llama-moe"
    ).items()


def test_a_moe_block_is_its_per_token_definition():
    # each token: the renormalised softmax scores of its top-k experts times their SwiGLU
    # outputs, plus the shared expert's
    torch.manual_seed(0)
    model = LlamaMoE(TINY)
    moe = model.layers["0"].moe
    x = torch.randn(2, 5, TINY.dim)
    out = moe(x)
    flat = x.reshape(-1, TINY.dim)
    probs = F.softmax(moe.router.gate(flat), dim=-1)
    ref = moe.shared_experts(flat)
    w = moe.experts
    for t in range(flat.shape[0]):
        top, chosen = probs[t].topk(TINY.top_k)
        for score, e in zip(top / top.sum(), chosen.tolist(), strict=True):
            h = F.silu(flat[t] @ w.w1[e].T) * (flat[t] @ w.w3[e].T)
            ref[t] = ref[t] + score * (h @ w.w2[e].T)
    torch.testing.assert_close(out.reshape(-1, TINY.dim), ref, rtol=1e-5, atol=1e-5)


def test_expert_gemm_is_each_experts_matmul_and_casts_under_autocast():
    torch.manual_seed(0)
    x, w = torch.randn(10, 16), torch.randn(3, 8, 16)
    counts = torch.tensor([4, 0, 6])
    ref = torch.cat([x[:4] @ w[0].T, x[4:] @ w[2].T])
    assert torch.equal(expert_gemm(x, w, counts), ref)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert expert_gemm(x, w, counts).dtype == torch.bfloat16


def test_bad_configs_are_one_line_model_errors():
    with pytest.raises(ModelError, match="top_k 5 is more than the 4 experts"):
        MoEConfig(top_k=5)
    with pytest.raises(ModelError, match="n_shared_experts must be an int >= 0"):
        MoEConfig(n_shared_experts=-1)
    with pytest.raises(ModelError, match="llama-moe reads token ids"):
        load_model("llama-moe", image_size=8)


def test_it_trains_two_steps_on_teacher_text():
    spec = load_model("llama-moe", seq_len=32)
    data = load_dataset_for(spec, "teacher-text", seed=0, max_samples=64)
    before = spec.module.layers["0"].moe.experts.w2.detach().clone()
    result = train(spec, data, PrecisionPolicy(default="fp32"), steps=2, batch_size=8, lr=0.05)
    assert len(result.train_loss) == 2 and all(math.isfinite(v) for v in result.train_loss)
    assert abs(result.train_loss[0] - math.log(512)) < 0.5  # random weights: near uniform
    assert not torch.equal(spec.module.layers["0"].moe.experts.w2, before)  # experts learn


def test_analysis_counts_the_grouped_gemms_at_the_routed_tokens():
    spec = ModelSpec.for_tokens(
        "tiny-moe", LlamaMoE(TINY), TINY.seq_len, Task.TOKEN_CLASSIFICATION, TINY.vocab_size,
        TINY.vocab_size, family="builtin",
    )  # fmt: skip
    table = analyze(spec, 3)
    assert table.meta_failure == ""  # shapes only: the grouped GEMMs run on the meta device
    row = table["layers.1.moe.experts"]
    # every token goes to top_k experts: tokens * top_k / E rows per expert on average, E
    # experts, three GEMMs of dim x hidden each; backward: two GEMMs per forward GEMM
    tokens = 3 * TINY.seq_len
    per_expert = tokens * TINY.top_k / TINY.n_experts
    hand = TINY.n_experts * 3 * 2 * per_expert * TINY.dim * TINY.expert_hidden
    assert row.forward_flops == hand == 2 * 3 * 96 * 32 * 48
    assert row.backward_flops == 2 * hand
    assert row.type == "GroupedExperts" and (row.fan_in, row.fan_out) == (32, 48)
    assert row.params == 3 * 4 * 32 * 48 and row.calls == 3  # its three grouped GEMMs
    assert table["layers.1.moe.router.gate"].forward_flops == 2 * tokens * 32 * 4
    assert not any("GroupedExperts" in reason for reason, _ in table.uncovered)


def test_the_mixtral_shape_is_costed_on_the_meta_device():
    with torch.device("meta"):
        spec = load_model("llama-moe", shape="mixtral-8x7b")
    assert model_shapes("llama-moe") == {
        "mixtral-8x7b": PRODUCTION_SHAPES["mixtral-8x7b"].describe()
    }
    names = [name for name, _ in tunable_layers(spec.module)]
    assert len(names) == 4 * 6 + 1 and "layers.3.moe.experts" in names  # no shared expert
    table = analyze(spec, 1)
    assert table.meta_failure == ""
    # 8192 tokens, 2 experts each, three GEMMs of 4096 x 14336
    assert table["layers.0.moe.experts"].forward_flops == 2 * 8192 * 2 * 3 * 4096 * 14336
    with pytest.raises(ModelError, match="unknown shape 'llama3-8b' for llama-moe"):
        load_model("llama-moe", shape="llama3-8b")
