"""autoprec.runtime.grouped: fused experts' grouped GEMMs at a precision, in emulation.

Oracles: torchao's ``moe_training`` MXFP8 grouped GEMM (``KernelPreference.EMULATED`` runs on the
CPU); for fp8 rowwise, torchao's fp8 grouped GEMM (``_Float8GroupedMM``) needs CUDA (Triton
kernels), so the reference is built from torchao's own torch quantisers (``tensor_to_scale``,
``torch_to_float8_per_group_colwise``, ``torch_to_3d_rowwise_float8_transpose_rhs``, the ones
its kernels are tested against) cast the way ``_Float8GroupedMM`` casts each GEMM's operands;
for tensorwise fp8, a torchao-exact emulated ``Float8Linear`` per expert; for fp8_block (torchao's
blockwise grouped GEMM is Triton only), ``block_fp8_linear`` per expert on token groups padded as
torchao pads them; for bf16, fp16 and
tf32, each expert's matmul on operands rounded by autoprec's kernels (themselves tested
against torch's casts).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autoprec.hardware.runnability import NotRunnableError
from autoprec.kernels import quantize
from autoprec.layers import geometry, is_fused_experts, tunable_layers
from autoprec.models import load_model
from autoprec.models.moe import GroupedExperts
from autoprec.precision import Precision
from autoprec.runtime.apply import apply_policy
from autoprec.runtime.float8_emulate import EmulatedFloat8Linear, RecipeCasts
from autoprec.runtime.grouped import EmulatedExperts, GroupedCasts, grouped_gemm

COUNTS = [32, 0, 48, 16]  # an expert without tokens among them
E, N, K = 4, 64, 96


def _operands(dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(COUNTS), K, generator=gen) * 3
    x[5, 7] = 300.0  # an outlier: its row's and its column's scales differ from the others'
    w = torch.randn(E, N, K, generator=gen) / 8
    g = torch.randn(sum(COUNTS), N, generator=gen)
    return x.to(dtype), w.to(dtype), g.to(dtype)


def _run(precision, x, w, g, region=None):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = grouped_gemm(x, w, COUNTS, GroupedCasts(Precision(precision), True, region))
    out.backward(g)
    return out.detach(), x.grad, w.grad


def _groups():
    start = 0
    for e, n in enumerate(COUNTS):
        yield e, slice(start, start + n)
        start += n


@pytest.mark.parametrize("precision", ["bf16", "fp16", "tf32"])
def test_16_bit_and_tf32_are_each_experts_matmul_on_rounded_operands(precision):
    x, w, g = _operands()
    out, gx, gw = _run(precision, x, w, g)
    stored = precision if precision != "tf32" else "fp32"  # tf32 writes fp32 results
    r = lambda t: quantize(t, precision)  # noqa: E731
    for e, rows in _groups():
        assert torch.equal(out[rows], quantize(r(x[rows]) @ r(w[e]).t(), stored))
        assert torch.equal(gx[rows], quantize(r(quantize(g[rows], stored)) @ r(w[e]), stored))
        expect_w = quantize(r(quantize(g[rows], stored)).t() @ r(x[rows]), stored)
        assert torch.equal(gw[e], expect_w)
    assert torch.equal(gw[1], torch.zeros(N, K))  # no tokens, no gradient


@pytest.mark.parametrize("precision", ["fp8", "fp8_rowwise", "fp8_rowwise_gw_hp"])
def test_the_fp8_recipes_are_a_float8_linear_per_expert(precision):
    # rowwise: torchao's fp8 grouped GEMM casts as its rowwise Float8Linear would per expert
    x, w, g = _operands()
    out, gx, gw = _run(precision, x, w, g)
    for e, rows in _groups():
        if not COUNTS[e]:
            continue
        linear = nn.Linear(K, N, bias=False)
        linear.weight = nn.Parameter(w[e].clone())
        casts = RecipeCasts(Precision(precision), False)
        ref = EmulatedFloat8Linear.from_linear(linear, casts)
        xe = x[rows].clone().requires_grad_()
        expect = ref(xe)
        expect.backward(g[rows])
        assert torch.equal(out[rows], expect.detach())
        assert torch.equal(gx[rows], xe.grad) and torch.equal(gw[e], linear.weight.grad)


def test_fp8_rowwise_casts_each_gemm_as_torchaos_fp8_grouped_mm():
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_utils import tensor_to_scale, to_fp8_saturated
    from torchao.prototype.moe_training.utils import (
        torch_to_3d_rowwise_float8_transpose_rhs,
        torch_to_float8_per_group_colwise,
    )

    f8 = torch.float8_e4m3fn

    def rowwise(t, dim):  # tensor_to_scale along dim, power-of-two scales, as torchao's kernels
        scale = tensor_to_scale(
            t, f8, scaling_granularity=ScalingGranularity.AXISWISE, axiswise_dim=dim,
            round_scales_to_power_of_2=True,
        )  # fmt: skip
        return to_fp8_saturated(t.float() * scale, f8).float() / scale

    x, w, g = _operands()
    offs = torch.tensor(COUNTS).cumsum(0).to(torch.int32)
    w_t = w.transpose(-2, -1)  # B_t (E, K, N), per-group column-major as torchao wants it
    # output = A @ B_t: A per token, B_t per (expert, output column) over K
    a_q, b_q = rowwise(x, -1), rowwise(w_t, -2)
    # grad_A = dY @ B: dY per token, B per (expert, input column) over N
    g_q = rowwise(g, -1)
    b_data, b_scale = torch_to_3d_rowwise_float8_transpose_rhs(w_t, f8, True)
    bt_q = b_data.float() / b_scale  # (E, N, K)
    # grad_B = dY^T @ A per group: both per column over the group's tokens
    # (torchao's torch reference takes no empty group: the boundaries without the empty one)
    ends = torch.unique_consecutive(offs)
    gc_data, gc_scale = torch_to_float8_per_group_colwise(g, ends, f8, True)
    ac_data, ac_scale = torch_to_float8_per_group_colwise(x, ends, f8, True)
    out, gx, gw = _run("fp8_rowwise", x, w, g)
    bf16 = lambda t: quantize(t, "bf16")  # noqa: E731  # torchao's out_dtype
    used = 0
    for e, rows in _groups():
        assert torch.equal(out[rows], bf16(a_q[rows] @ b_q[e]))
        assert torch.equal(gx[rows], bf16(g_q[rows] @ bt_q[e]))
        if not COUNTS[e]:
            assert torch.equal(gw[e], torch.zeros(N, K))
            continue
        gs = gc_scale[used * N : (used + 1) * N]
        xs = ac_scale[used * K : (used + 1) * K]
        used += 1
        gcol = gc_data[rows].float() / gs
        acol = ac_data[rows].float() / xs
        assert torch.equal(gw[e], bf16(gcol.t() @ acol))  # grad_B_t transposed back


def test_mxfp8_is_torchaos_mxfp8_grouped_mm():
    # in a bf16 region, as torchao's emulated kernels (bf16 only) read and write bf16
    from torchao.prototype.moe_training.mxfp8_grouped_mm import _to_mxfp8_then_scaled_grouped_mm
    from torchao.quantization.quantize_.common import KernelPreference

    dtype = torch.bfloat16
    x, w, g = _operands(dtype)
    out, gx, gw = _run("mxfp8", x, w, g, "bf16")
    xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
    offs = torch.tensor(COUNTS).cumsum(0).to(torch.int32)
    expect = _to_mxfp8_then_scaled_grouped_mm(
        xa, wa.transpose(-2, -1), offs, out_dtype=dtype,
        kernel_preference=KernelPreference.EMULATED,
    )  # fmt: skip
    expect.backward(g)
    assert torch.equal(out, expect.detach())
    assert torch.equal(gx, xa.grad) and torch.equal(gw, wa.grad)


def test_mxfp8_pads_each_experts_tokens_to_its_blocks():
    # 20 tokens: the weight gradient's blocks along the tokens end with 12 zero rows
    x, w, g = _operands()
    counts = [20, 44]
    xs, gs = x[:64], g[:64]
    ws = w[:2].clone().requires_grad_()
    out = grouped_gemm(xs, ws, counts, GroupedCasts(Precision.MXFP8))
    out.backward(gs)
    from autoprec.kernels import mx_linear

    pad = torch.zeros(12, K)
    w0 = w[0].clone().requires_grad_()
    ref = mx_linear(torch.cat([xs[:20], pad]), w0, block_size=32)[:20]
    ref.backward(gs[:20])
    assert torch.equal(out[:20], ref.detach()) and torch.equal(ws.grad[0], w0.grad)


def test_fp8_block_is_torchaos_blockwise_grouped_casts_per_expert():
    # torchao's _Float8BlockwiseGroupedMM quantises with Triton kernels (CUDA only); its casts
    # are Float8BlockwiseLinear's per expert on token groups padded to 128, which is
    # block_fp8_linear (tested against torchao's quantisers) on each padded group
    from autoprec.kernels import block_fp8_linear

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(sum(COUNTS), 128, generator=gen).bfloat16()
    w = (torch.randn(E, 256, 128, generator=gen) / 8).bfloat16()
    g = torch.randn(sum(COUNTS), 256, generator=gen).bfloat16()
    out, gx, gw = _run("fp8_block", x, w, g, "bf16")
    for e, rows in _groups():
        if not COUNTS[e]:
            assert torch.equal(gw[e], torch.zeros(256, 128, dtype=torch.bfloat16))
            continue
        pad = torch.zeros(128 - COUNTS[e], 128, dtype=torch.bfloat16)
        xe = torch.cat([x[rows], pad]).requires_grad_()
        we = w[e].clone().requires_grad_()
        ref = block_fp8_linear(xe, we)[: COUNTS[e]]
        ref.backward(g[rows])
        assert torch.equal(out[rows], ref.detach())
        assert torch.equal(gx[rows], xe.grad[: COUNTS[e]]) and torch.equal(gw[e], we.grad)


def _mixtral_experts():
    transformers = pytest.importorskip("transformers")
    config = transformers.MixtralConfig(
        hidden_size=32, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2
    )
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    torch.manual_seed(0)
    experts = MixtralExperts(config)
    for p in experts.parameters():
        nn.init.normal_(p, std=0.1)
    return experts


def test_a_hugging_face_mixtrals_fused_experts_are_one_layer_run_as_grouped_gemms():
    experts = _mixtral_experts()
    model = nn.Sequential()
    model.add_module("experts", experts)
    assert is_fused_experts(experts) and [n for n, _ in tunable_layers(model)] == ["experts"]
    assert geometry(experts) == (32, 64, (), ())  # the model's width, each expert's hidden
    hidden = torch.randn(10, 32)
    index = torch.stack([torch.randperm(4)[:2] for _ in range(10)])
    weights = torch.rand(10, 2)
    expect = experts(hidden, index, weights)
    # at fp32 the grouped GEMMs are the module's own loop over experts
    same = EmulatedExperts(experts, Precision.FP32, None)(hidden, index, weights)
    torch.testing.assert_close(same, expect, rtol=1e-6, atol=1e-6)
    # at bf16: each GEMM's operands and results rounded, gate_up_proj one GEMM per expert
    emulated = EmulatedExperts(experts, Precision.BF16, None)
    assert dict(emulated.named_parameters()) == dict(experts.named_parameters())
    out = emulated(hidden, index, weights)
    r = lambda t: quantize(t, "bf16")  # noqa: E731
    ref = torch.zeros_like(hidden)
    for t in range(10):
        for k in range(2):
            e = int(index[t, k])
            gate, up = r(r(hidden[t]) @ r(experts.gate_up_proj[e]).t()).chunk(2)
            h = experts.act_fn(gate) * up
            ref[t] += weights[t, k] * r(r(h) @ r(experts.down_proj[e]).t())
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)


def test_apply_policy_runs_the_experts_at_their_precision_and_restores_them():
    spec = load_model("llama-moe", seq_len=16)
    x, y = spec.example_batch(2, generator=torch.Generator().manual_seed(0))
    experts = spec.module.layers["1"].moe.experts
    state = {k: v.clone() for k, v in spec.module.state_dict().items()}
    baseline = spec.module(x)
    with apply_policy(spec.module, {"layers.1.moe.experts": "fp8_rowwise"}, mode="emulate") as h:
        runner = spec.module.layers["1"].moe.experts
        assert isinstance(runner, EmulatedExperts) and runner.w1 is experts.w1
        assert set(spec.module.state_dict()) == set(state)
        out = spec.module(x)
        spec.loss(out, y).backward()
        assert h.stats()["layers.1.moe.experts"].calls == 1
    assert spec.module.layers["1"].moe.experts is experts and isinstance(experts, GroupedExperts)
    assert experts.w2.grad is not None and experts.w2.grad.abs().sum() > 0
    assert not torch.equal(out, baseline)  # the fp8 casts changed the output...
    torch.testing.assert_close(out, baseline, rtol=0.1, atol=0.1)  # ...a little
    assert all(torch.equal(v, state[k]) for k, v in spec.module.state_dict().items())


def test_what_cannot_run_is_refused_in_one_line():
    spec = load_model("llama-moe", seq_len=16)
    with pytest.raises(NotRunnableError) as err:
        apply_policy(spec.module, {"layers.0.moe.experts": "fp8_rowwise"}, mode="native")
    message = str(err.value)
    assert "\n" not in message and "torchao.prototype.moe_training" in message
    assert "this CPU" in message and "mode='emulate'" in message
    with pytest.raises(NotRunnableError, match="does not emulate for grouped GEMMs yet"):
        apply_policy(spec.module, {"layers.0.moe.experts": "nvfp4"}, mode="emulate")
    with pytest.raises(NotRunnableError, match="no backend autoprec drives trains grouped"):
        apply_policy(spec.module, {"layers.0.moe.experts": "nvfp4"}, mode="native")
    assert isinstance(spec.module.layers["0"].moe.experts, GroupedExperts)  # nothing left on
