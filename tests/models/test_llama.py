"""autoprec.models.llama: the Llama-style decoder, its production shapes and their analysis."""

from __future__ import annotations

import math
import time

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from autoprec.cli import main
from autoprec.graph import analyze
from autoprec.layers import tunable_layers
from autoprec.models import ModelError, list_models, load_model, model_shapes
from autoprec.models.llama import (
    PRODUCTION_SHAPES,
    Attention,
    Llama,
    LlamaConfig,
    RMSNorm,
    apply_rotary,
    repeat_kv,
    rotary_tables,
)

SMALL = LlamaConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=48, vocab_size=64)


def _linear_names(module: nn.Module) -> list[str]:
    return [name for name, m in module.named_modules() if isinstance(m, nn.Linear)]


# --- the model --------------------------------------------------------------------------------
def test_forward_backward_shapes_and_loss():
    spec = load_model("llama")
    assert spec.input_shape == (64,) and spec.task == "token-classification"
    assert spec.num_classes == spec.vocab_size == 512 and spec.input_dtype == torch.long
    x, y = spec.example_batch(2, generator=torch.Generator().manual_seed(0))
    assert y.shape == (2, 64)
    out = spec.module(x)
    assert out.shape == (2, 64, 512)
    loss = spec.loss(out, y)
    ref = F.cross_entropy(out.detach().double().reshape(-1, 512), y.reshape(-1))
    assert loss.item() == pytest.approx(ref.item(), rel=1e-6)
    assert abs(loss.item() - math.log(512)) < 0.5  # random weights: near uniform
    loss.backward()
    assert all(
        p.grad is not None and torch.isfinite(p.grad).all() for p in spec.module.parameters()
    )


def test_num_classes_is_the_vocabulary_and_images_do_not_apply():
    assert load_model("llama", num_classes=10).num_classes == 512
    assert load_model("llama", seq_len=32).input_shape == (32,)
    with pytest.raises(ModelError, match="image_size and in_channels do not apply"):
        load_model("llama", image_size=32)


def test_names_follow_torchtitan():
    spec = load_model("llama")
    names = {name for name, _ in spec.module.named_modules()}
    assert {"tok_embeddings", "norm", "output", "layers.3.attention.wk"} <= names
    assert {"layers.0.attention_norm", "layers.0.ffn_norm", "layers.0.feed_forward.w3"} <= names
    per_block = ["attention.wq", "attention.wk", "attention.wv", "attention.wo"]
    per_block += ["feed_forward.w1", "feed_forward.w2", "feed_forward.w3"]
    expected = [f"layers.{i}.{n}" for i in range(4) for n in per_block] + ["output"]
    assert [name for name, _ in tunable_layers(spec.module)] == expected
    assert all(m.bias is None for _, m in tunable_layers(spec.module))


@pytest.mark.parametrize("shape", [None, *PRODUCTION_SHAPES])
def test_every_linear_is_a_multiple_of_16(shape):
    with torch.device("meta"):
        spec = load_model("llama", shape=shape)
    linears = [m for m in spec.module.modules() if isinstance(m, nn.Linear)]
    assert len(linears) == 29
    assert all(m.in_features % 16 == 0 and m.out_features % 16 == 0 for m in linears)


def test_changing_a_future_token_leaves_earlier_logits_alone():
    torch.manual_seed(0)
    model = Llama(SMALL).double()
    ids = torch.randint(0, 64, (2, 16))
    changed = ids.clone()
    changed[:, 9] = (ids[:, 9] + 1) % 64
    with torch.no_grad():
        a, b = model(ids), model(changed)
    assert torch.equal(a[:, :9], b[:, :9])  # bit for bit: nothing reads ahead
    assert (a[:, 9:] - b[:, 9:]).abs().amax(dim=-1).min() > 1e-6  # and the rest does change


def test_attention_matches_a_float64_reference_with_grouped_heads():
    torch.manual_seed(1)
    attn = Attention(SMALL).double()
    x = torch.randn(2, 8, SMALL.dim, dtype=torch.float64)
    cos, sin = rotary_tables(SMALL.head_dim, 8, SMALL.rope_theta, dtype=torch.float64)
    with torch.no_grad():
        got = attn(x, cos, sin)
        h, kv, d = SMALL.n_heads, SMALL.n_kv_heads, SMALL.head_dim
        q = apply_rotary(attn.wq(x).view(2, 8, h, d), cos, sin)
        k = apply_rotary(attn.wk(x).view(2, 8, kv, d), cos, sin)
        v = attn.wv(x).view(2, 8, kv, d)
        heads = []
        for head in range(h):
            g = head // (h // kv)  # query head -> its KV head
            scores = q[:, :, head] @ k[:, :, g].transpose(1, 2) / math.sqrt(d)
            scores = scores.masked_fill(torch.ones(8, 8).triu(1).bool(), -math.inf)
            heads.append(scores.softmax(-1) @ v[:, :, g])
        want = attn.wo(torch.cat(heads, dim=-1))
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_repeat_kv_gives_each_query_head_its_group():
    x = torch.randn(1, 3, 2, 4)
    out = repeat_kv(x, 3)
    assert out.shape == (1, 3, 6, 4)
    for head in range(6):
        assert torch.equal(out[:, :, head], x[:, :, head // 3])


def test_rotary_keeps_norms_and_depends_on_relative_position():
    cos, sin = rotary_tables(8, 16, 10_000.0, dtype=torch.float64)
    q = torch.randn(1, 1, 1, 8, dtype=torch.float64).expand(1, 16, 1, 8)
    k = torch.randn(1, 1, 1, 8, dtype=torch.float64).expand(1, 16, 1, 8)
    rq, rk = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    torch.testing.assert_close(rq.norm(dim=-1), q.norm(dim=-1), rtol=1e-12, atol=0)
    dots = (rq[0, :, 0] @ rk[0, :, 0].T).numpy()  # dots[m, n] depends on m - n only
    assert dots[5, 2] == pytest.approx(dots[12, 9], rel=1e-10)
    assert dots[3, 3] == pytest.approx(float(q[0, 0, 0] @ k[0, 0, 0]), rel=1e-10)
    assert dots[5, 2] != pytest.approx(dots[5, 3], rel=1e-3)


def test_rmsnorm_matches_the_formula_and_is_not_tunable():
    norm = RMSNorm(16, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 2.0, 16))
    x = torch.randn(3, 16, dtype=torch.float64)
    want = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight.double()
    torch.testing.assert_close(norm(x.float()).double(), want, rtol=1e-6, atol=1e-6)
    assert norm(x.bfloat16()).dtype == torch.bfloat16  # computed in fp32, returned as given
    assert list(tunable_layers(norm)) == []


def test_tied_embeddings_share_one_weight():
    model = Llama(LlamaConfig(**{**SMALL.__dict__, "tie_embeddings": True}))
    assert model.output.weight is model.tok_embeddings.weight
    assert Llama(SMALL).output.weight is not Llama(SMALL).tok_embeddings.weight


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"dim": 30}, "even head width"),
        ({"n_kv_heads": 3}, "must divide"),
        ({"seq_len": 0}, "seq_len >= 1"),
    ],
)
def test_config_errors_are_model_errors(change, message):
    with pytest.raises(ModelError, match=message):
        LlamaConfig(**{**SMALL.__dict__, **change})


# --- the layer table --------------------------------------------------------------------------
def test_layer_table_lists_the_linears_as_tunable_layers():
    spec = load_model("llama")
    table = analyze(spec, 2)
    assert sorted(r.name for r in table.rows) == sorted(_linear_names(spec.module))
    order = [r.name.removeprefix("layers.0.") for r in table.rows[:7]]  # execution order
    assert order == [f"attention.w{x}" for x in "qkvo"] + [f"feed_forward.w{x}" for x in "132"]
    assert {r.type for r in table.rows} == {"Linear"} and {r.kind for r in table.rows} == {"linear"}
    wq = table.rows[0]
    assert wq.forward_flops == 2 * 2 * 64 * 256 * 256  # 2 * B * T * K * N
    assert wq.backward_flops == 2 * wq.forward_flops
    # the only matrix work outside them: attention scores and values, 2 * (2*B*H*T*T*D)
    assert [flops for _, flops in table.uncovered] == [4 * 4 * 2 * 8 * 64 * 64 * 32]


# --- production shapes ------------------------------------------------------------------------
def test_production_shapes_match_meta_published_configs():
    b8, b70 = PRODUCTION_SHAPES["llama3-8b"], PRODUCTION_SHAPES["llama3-70b"]
    assert (b8.dim, b8.ffn_hidden, b8.n_heads, b8.n_kv_heads, b8.vocab_size, b8.seq_len) == (
        4096, 14336, 32, 8, 128256, 8192,
    )  # fmt: skip
    assert (b70.dim, b70.ffn_hidden, b70.n_heads, b70.n_kv_heads, b70.n_layers) == (
        8192, 28672, 64, 8, 80,
    )  # fmt: skip
    assert model_shapes("llama") == {n: c.describe() for n, c in PRODUCTION_SHAPES.items()}
    assert model_shapes("tinycnn") == {}
    row = next(r for r in list_models("builtin") if r["name"] == "llama")
    assert set(row["shapes"]) == set(PRODUCTION_SHAPES)


def test_a_production_shape_analyses_on_meta_with_the_same_layer_names():
    small = load_model("llama")
    start = time.perf_counter()
    with torch.device("meta"):
        spec = load_model("llama", shape="llama3-8b")
    assert all(p.is_meta for p in spec.module.parameters())  # nothing allocated
    assert spec.input_shape == (8192,) and spec.vocab_size == 128256
    table = analyze(spec, 4)
    assert time.perf_counter() - start < 10
    assert not table.meta_failure  # it ran on meta, never on the CPU
    assert [r.name for r in table.rows] == [r.name for r in analyze(small, 2).rows]
    rows = {r.name: r for r in table.rows}
    tokens = 4 * 8192
    assert rows["layers.0.attention.wq"].forward_flops == 2 * tokens * 4096 * 4096
    assert rows["layers.2.attention.wk"].forward_flops == 2 * tokens * 4096 * 1024
    assert rows["layers.1.feed_forward.w2"].forward_flops == 2 * tokens * 14336 * 4096
    assert rows["output"].forward_flops == 2 * tokens * 4096 * 128256
    assert rows["output"].weight_bytes == 4 * 4096 * 128256
    assert rows["layers.0.attention.wq"].input_bytes == 4 * tokens * 4096


def test_unknown_shape_and_a_model_without_shapes_are_one_line_errors():
    with pytest.raises(ModelError, match="unknown shape 'llama3-7b' for llama; expected one of"):
        load_model("llama", shape="llama3-7b")
    with pytest.raises(ModelError, match="'tinycnn' has no named shapes; .*llama"):
        load_model("tinycnn", shape="llama3-8b")


def test_cli_refuses_a_bad_train_shape_with_exit_2(capsys):
    assert main(["analyze", "--model", "llama", "--train-shape", "x", "--no-sensitivity"]) == 2
    err = capsys.readouterr().err
    assert "expected one of llama3-8b, llama3-70b, llama3-405b, llama3.2-1b" in err
    assert err.count("\n") == 1
    assert main(["analyze", "--model", "tinycnn", "--train-shape", "llama3-8b"]) == 2
    assert "no named shapes" in capsys.readouterr().err


def test_cli_analyze_prices_the_production_shape(capsys):
    args = ["analyze", "--model", "llama", "--train-shape", "llama3-8b", "--no-sensitivity"]
    assert main([*args, "--target", "h100-sxm", "--batch-size", "1"]) == 0
    out = capsys.readouterr().out
    assert "llama: 29 tunable layers, batch 1, input (8192,)" in " ".join(out.split())
    assert "layers.0.attention.wq" in out


def test_build_evaluator_costs_the_named_shape_and_picks_teacher_text():
    from autoprec.cli._setup import build_evaluator

    o = {
        "model_name": "llama", "num_classes": 10, "image_size": None, "train_image_size": None,
        "train_shape": "llama3-70b", "seed": 0, "data_dir": None, "dataset": None, "steps": 2,
        "train_batch_size": 2,
    }  # fmt: skip
    evaluator = build_evaluator(o, "h100-sxm")
    assert o["dataset"] == "teacher-text" and evaluator.data.name == "teacher-text"
    assert evaluator.spec.input_shape == (64,) and evaluator.cost_spec.input_shape == (8192,)
    assert all(p.is_meta for p in evaluator.cost_spec.module.parameters())
    table = evaluator.cost_table()
    assert sorted(r.name for r in table.rows) == sorted(_linear_names(evaluator.spec.module))
    assert table.rows[0].forward_flops == 2 * 2 * 8192 * 8192 * 8192


def test_llama_small_is_a_deep_narrow_byte_model_with_the_llama_names():
    """``llama-small``: 8 blocks of width 128 over the 256 byte values (python-text), the
    llama's layer names, and the llama's production shapes at its own depth for the costs."""
    spec = load_model("llama-small")
    names = [n for n, _ in tunable_layers(spec.module)]
    assert spec.name == "llama-small" and spec.num_classes == 256
    assert len(names) == 8 * 7 + 1 and names[-1] == "output" and "layers.7.feed_forward.w2" in names
    with torch.device("meta"):
        big = load_model("llama-small", shape="llama3-8b")
    assert [n for n, _ in tunable_layers(big.module)] == names
    assert big.module.output.weight.shape == (128256, 4096)
