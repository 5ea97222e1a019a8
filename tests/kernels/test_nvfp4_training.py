"""NVFP4 as Transformer Engine trains in it (kernels/nvfp4.py, kernels/nvfp4_linear.py).

Oracle: TE's own reference quantiser cannot run here (it needs TE's CUDA extension), so
:func:`te_reference` below writes its algorithm in float64 with TE's float32 roundings made
explicit, from ``transformer_engine/pytorch/custom_recipes/reference_nvfp4.py``
(``NVFP4QuantizerRef._quantize_blockwise_reference``, ``cast_to_fp4x2``; TE tests its CUDA
kernels bit for bit against it) and ``transformer_engine/common/recipe/nvfp4.cu`` (the GEMM's
``amax_a * amax_b / (6 * 6 * 448 * 448)``). The E2M1 rounding is TE's threshold table, the
E4M3 cast torch's, so neither shares code with the kernel. The Hadamard matrices are checked
against torchao's (``torchao/prototype/moe_training/nvfp4_training/hadamard_utils.py``, which
imports on the CPU).
"""

from __future__ import annotations

import pytest
import torch

from autoprec.kernels import (
    TE_RHT_SIGNS,
    NVFP4Options,
    hadamard_matrix,
    nvfp4_linear,
    nvfp4_te_quantize,
    nvfp4_te_round,
    quantize,
    rht,
    rht_matrix,
)

F32_MAX = torch.finfo(torch.float32).max
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
# TE's cast_to_fp4x2: magnitude thresholds and whether the threshold itself rounds down
# (ties to the even code: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4)
THRESHOLDS = [(0.25, True), (0.75, False), (1.25, True), (1.75, False), (2.5, True),
              (3.5, False), (5.0, True)]  # fmt: skip


def f32(t: torch.Tensor) -> torch.Tensor:
    """Round float64 to float32 and back: one float32 operation of float32 operands, since
    float64 holds their exact product and rounds quotients innocuously (53 >= 2 * 24 + 2)."""
    return t.float().double()


def te_e2m1(v: torch.Tensor) -> torch.Tensor:
    """TE's ``cast_to_fp4x2`` on values within ±6, as float64 values."""
    a = v.abs()
    code = torch.zeros_like(a, dtype=torch.long)
    for i, (t, down) in enumerate(THRESHOLDS):
        code = torch.where((a > t) if down else (a >= t), i + 1, code)
    return torch.copysign(E2M1[code], v)


def te_reference(x: torch.Tensor, two_d: bool) -> dict[str, torch.Tensor]:
    """TE's reference NVFP4 quantisation of a 2-D tensor (blocks along the last dim)."""
    x64 = x.double()
    rows, cols = x.shape
    amax = x64.abs().max()
    quotient = torch.div(torch.tensor(2688.0, dtype=torch.float64), amax)
    encode = f32(torch.clamp_max(quotient, F32_MAX)) if amax > 0 else torch.tensor(1.0)
    encode = encode.double()
    decode = f32(1.0 / encode)
    multiplier = f32(encode * f32(torch.tensor(1.0 / 6.0)))
    blocks = x64.reshape(rows, cols // 16, 16)
    vec_max = blocks.abs().amax(-1)
    if two_d:
        vec_max = vec_max.reshape(rows // 16, 16, -1).amax(1).repeat_interleave(16, 0)
    decode_scale = torch.clamp(f32(vec_max * multiplier), max=448.0)
    decode_scale = decode_scale.float().to(torch.float8_e4m3fn).double()
    encode_scale = torch.clamp_max(f32(1.0 / f32(decode_scale * decode)), F32_MAX)
    scaled = torch.clamp(f32(blocks * encode_scale.unsqueeze(-1)), -6.0, 6.0)
    return {
        "elements": te_e2m1(scaled).reshape(rows, cols).float(),
        "scales": decode_scale.float(),
        "amax": amax.float(),
        "scaled": scaled.reshape(rows, cols),
    }


def ref_mm(a: dict, b: dict, dtype: torch.dtype) -> torch.Tensor:
    """TE's GEMM of two reference-quantised operands: block-scaled elements multiplied in
    float32, then ``amax_a * amax_b * fp32(1 / (6 * 6 * 448 * 448))``."""

    def scaled(q: dict) -> torch.Tensor:
        return q["elements"] * q["scales"].repeat_interleave(16, -1)

    alpha = a["amax"] * b["amax"] * torch.tensor(1.0 / (36 * 448 * 448), dtype=torch.float32)
    return (torch.mm(scaled(a), scaled(b).t()) * alpha).to(dtype)


def samples(dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    """(32, 64) tensors: normal, mixed magnitudes (tiny blocks get E4M3-subnormal or zero
    scales), fp32-subnormal, huge, zeros, constant, and one huge value among small ones."""
    g = torch.Generator().manual_seed(seed)
    shape = (32, 64)

    def randn(scale: float = 1.0) -> torch.Tensor:
        return torch.randn(shape, generator=g) * scale

    spread = torch.exp2(torch.randint(-30, 10, shape, generator=g).float())
    one_huge = randn()
    one_huge[3, 5] = 1e4
    out = [randn(), randn() * spread, randn(2.0**-130), randn(2.0**100), torch.zeros(shape)]
    out += [torch.full(shape, -0.3), one_huge]
    # many small tensors of random amax: the global scale 2688 / amax must round once
    amaxes = torch.exp2(torch.rand(64, generator=g) * 40 - 20)
    out += [torch.randn(16, 32, generator=g) * a for a in amaxes]
    return [t.to(dtype) for t in out]


def assert_equal(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal values (a signed zero matches either zero: TE's encoder writes +0 for -0.0)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    same = got == want
    assert bool(same.all()), f"{int((~same).sum())} of {got.numel()} values differ"


# --- quantisation against TE's reference --------------------------------------------------


@pytest.mark.parametrize("two_d", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_matches_te_reference(two_d, dtype):
    for x in samples(dtype):
        q = nvfp4_te_quantize(x, two_d=two_d)
        want = te_reference(x, two_d)
        assert_equal(q.elements, want["elements"])
        assert_equal(q.scales, want["scales"])
        assert_equal(q.amax, want["amax"])


def test_edge_values():
    zeros, const, one_huge = samples(torch.float32)[4:7]
    assert torch.equal(nvfp4_te_round(zeros, two_d=True), zeros)
    # a constant tensor fills e2m1's top (6) and e4m3's top (448): it comes back within a
    # float32 rounding of the global decode scale
    got = nvfp4_te_round(const, two_d=True)
    assert torch.allclose(got, const, rtol=2**-22, atol=0)
    # the huge value keeps its tile's scale at e4m3's top: the tile's small values flush to 0,
    # the other tiles keep theirs
    q = nvfp4_te_quantize(one_huge, two_d=True)
    got = q.dequantize()
    assert torch.allclose(got[3, 5], one_huge[3, 5], rtol=2**-22)
    assert q.scales[3, 0] == 448
    assert got[:16, :16].ne(0).nonzero().tolist() == [[3, 5]]
    assert got[16:, 16:].ne(0).any()


def test_two_d_weight_and_its_transpose_quantise_alike():
    w = torch.randn(48, 80, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    a = nvfp4_te_round(w, two_d=True)
    b = nvfp4_te_round(w.t().contiguous(), two_d=True)
    assert torch.equal(a.t(), b)
    # 1x16 blocks do not: that is what the 16x16 tiles are for
    assert not torch.equal(nvfp4_te_round(w).t(), nvfp4_te_round(w.t().contiguous()))


@pytest.mark.parametrize(
    ("shape", "two_d", "message"),
    [((32, 24), False, "last size a multiple of 16"), ((24, 32), True, "both sizes")],
)
def test_refuses_shapes_that_are_not_blocked(shape, two_d, message):
    with pytest.raises(ValueError, match=message):
        nvfp4_te_quantize(torch.ones(shape), two_d=two_d)
    with pytest.raises(ValueError, match="2-D floating-point"):
        nvfp4_te_quantize(torch.ones(2, 16, 16))


# --- stochastic rounding ------------------------------------------------------------------


def test_stochastic_keeps_scales_and_lands_on_a_neighbour():
    x = samples(torch.bfloat16, seed=2)[1]
    want = te_reference(x, two_d=False)
    g = torch.Generator().manual_seed(0)
    q = nvfp4_te_quantize(x, stochastic=True, generator=g)
    assert_equal(q.scales, want["scales"])
    v = want["scaled"]
    index = torch.searchsorted(E2M1, v.abs().contiguous(), right=True).clamp(max=7)
    below, above = E2M1[index - 1], E2M1[index]
    below = torch.where(v.abs() >= 6, 6.0, below)
    got = q.elements.double().abs()
    assert torch.all((got == below) | (got == above))


def test_stochastic_equals_nearest_on_representable_values():
    # values on the e2m1 grid times a power of two, block amax 6 * 2**j: every scaling is
    # exact, so the scaled values are on the grid and rounding must not move them
    g = torch.Generator().manual_seed(3)
    grid = E2M1.float()[torch.randint(0, 8, (16, 64), generator=g)]
    grid = grid * torch.where(torch.rand(16, 64, generator=g) < 0.5, -1.0, 1.0)
    grid[:, ::16] = 6.0
    x = grid * 2.0 ** torch.randint(-4, 4, (16, 4), generator=g).repeat_interleave(16, 1)
    nearest = nvfp4_te_quantize(x)
    assert torch.equal(nearest.dequantize(), nvfp4_te_round(x))
    for seed in range(3):
        sr = nvfp4_te_quantize(x, stochastic=True, generator=torch.Generator().manual_seed(seed))
        assert torch.equal(sr.elements, nearest.elements)
        assert torch.equal(sr.elements, te_reference(x, two_d=False)["elements"])


def test_stochastic_is_unbiased():
    """Over N draws each element's mean stays within 6 standard errors (from the Bernoulli
    variance p(1-p) times the grid spacing squared) of the scaled value, plus the 2**-24
    resolution of the random bits; seeded, so deterministic."""
    repeats = 2048
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(4))
    v = te_reference(x, two_d=False)["scaled"]
    g = torch.Generator().manual_seed(5)
    draws = torch.stack(
        [nvfp4_te_quantize(x, stochastic=True, generator=g).elements for _ in range(repeats)]
    ).double()
    mean = draws.mean(0)
    index = torch.searchsorted(E2M1, v.abs().contiguous(), right=True).clamp(max=7)
    spacing = torch.where(v.abs() >= 6, 0.0, E2M1[index] - E2M1[index - 1])
    p = torch.where(spacing > 0, (v.abs() - E2M1[index - 1]) / spacing.clamp_min(1e-30), 0.0)
    stderr = spacing * torch.sqrt(p * (1 - p) / repeats)
    assert torch.all((mean - v).abs() <= 6 * stderr + spacing * 2.0**-23)
    # and it really is stochastic: the nearest rounding is biased on the same values
    nearest = te_reference(x, two_d=False)["elements"].double()
    assert (nearest - v).abs().mean() > 10 * (mean - v).abs().mean()


def test_stochastic_repeats_with_the_same_seed():
    x = torch.randn(32, 64)
    a = nvfp4_te_quantize(x, stochastic=True, generator=torch.Generator().manual_seed(7))
    b = nvfp4_te_quantize(x, stochastic=True, generator=torch.Generator().manual_seed(7))
    c = nvfp4_te_quantize(x, stochastic=True, generator=torch.Generator().manual_seed(8))
    assert torch.equal(a.elements, b.elements) and not torch.equal(a.elements, c.elements)
    assert torch.equal(a.elements.view(torch.int32), b.elements.view(torch.int32))


# --- random Hadamard transform ------------------------------------------------------------


@pytest.fixture(scope="module")
def hadamard_utils():
    return pytest.importorskip("torchao.prototype.moe_training.nvfp4_training.hadamard_utils")


def test_hadamard_matrices_match_torchao(hadamard_utils):
    h = hadamard_matrix(16)
    assert torch.equal(h @ h.t(), 16 * torch.eye(16))
    assert torch.equal(h / 4, hadamard_utils.get_hadamard_matrix(16, "cpu", torch.float32))
    g = torch.Generator().manual_seed(0)
    random_signs = tuple(int(s) for s in torch.randint(0, 2, (16,), generator=g) * 2 - 1)
    for signs in (TE_RHT_SIGNS, random_signs, (1,) * 16):
        want = hadamard_utils.get_rht_matrix(signs, "cpu", torch.float32, 16)
        assert torch.equal(rht_matrix(signs), want)
    assert torch.equal(rht_matrix(), rht_matrix(TE_RHT_SIGNS))


def test_rht_is_orthogonal():
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(1)) * 10
    y = rht(x)
    assert not torch.allclose(y, x)
    assert torch.allclose(rht(y, inverse=True), x, rtol=0, atol=1e-5)
    assert torch.allclose(y.norm(dim=1), x.norm(dim=1), rtol=1e-6)
    # along dim 0 = along the last dim of the transpose; the product is preserved
    assert torch.equal(rht(x.t(), dim=0), rht(x).t())
    z = torch.randn(5, 64)
    assert torch.allclose(rht(x) @ rht(z).t(), x @ z.t(), rtol=1e-5, atol=1e-4)
    assert rht(x.to(torch.bfloat16)).dtype == torch.bfloat16


def test_rht_errors():
    with pytest.raises(ValueError, match="multiple of 16"):
        rht(torch.ones(4, 24))
    with pytest.raises(ValueError, match="16 values, each 1 or -1"):
        rht(torch.ones(4, 16), signs=(1, 0) * 8)
    with pytest.raises(ValueError, match="out of range"):
        rht(torch.ones(4, 16), dim=2)


# --- the training linear ------------------------------------------------------------------


def operands(m=64, k=48, n=32, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * 2).to(dtype)
    w = (torch.randn(n, k, generator=g) * 0.1).to(dtype)
    dy = (torch.randn(m, n, generator=g) * 1e-3).to(dtype)
    return x, w, dy


def run(x, w, dy, **kwargs):
    xr, wr = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    out = nvfp4_linear(xr, wr, **kwargs)
    out.backward(dy)
    return out, xr.grad, wr.grad


@pytest.mark.parametrize("two_d", [True, False])
@pytest.mark.parametrize("use_rht", [True, False])
def test_linear_equals_te_reference_without_stochastic_rounding(two_d, use_rht):
    x, w, dy = operands()
    opts = NVFP4Options(two_d_weight=two_d, stochastic_rounding=False, rht=use_rht)
    out, gx, gw = run(x, w, dy, options=opts)
    assert_equal(out, ref_mm(te_reference(x, False), te_reference(w, two_d), x.dtype))
    wt = te_reference(w.t().contiguous(), two_d)
    assert_equal(gx, ref_mm(te_reference(dy, False), wt, x.dtype))
    dyt, xt = dy.t().contiguous(), x.t().contiguous()
    if use_rht:  # rht is checked above against torchao's matrix and for orthogonality
        dyt, xt = rht(dyt), rht(xt)
    assert_equal(gw, ref_mm(te_reference(dyt, False), te_reference(xt, False), x.dtype))


def test_linear_backward_draws_as_its_operands_with_a_fixed_generator():
    """With stochastic rounding: the input gradient's dY draws first, then the weight
    gradient's; each equals quantising that operand with the generator at that point."""
    x, w, dy = operands(seed=1)
    _, gx, gw = run(x, w, dy, generator=torch.Generator().manual_seed(11))
    g = torch.Generator().manual_seed(11)
    q = lambda t, **kw: vars(nvfp4_te_quantize(t, **kw))  # noqa: E731
    dyq = q(dy, stochastic=True, generator=g)
    dytq = q(rht(dy.t().contiguous()), stochastic=True, generator=g)
    wt = te_reference(w.t().contiguous(), True)
    assert_equal(gx, ref_mm(dyq, wt, x.dtype))
    assert_equal(gw, ref_mm(dytq, te_reference(rht(x.t().contiguous()), False), x.dtype))


def test_seeded_run_repeats():
    x, w, dy = operands(seed=2)
    a = run(x, w, dy, generator=torch.Generator().manual_seed(3))
    b = run(x, w, dy, generator=torch.Generator().manual_seed(3))
    c = run(x, w, dy, generator=torch.Generator().manual_seed(4))
    assert all(torch.equal(s, t) for s, t in zip(a, b, strict=True))
    assert torch.equal(a[0], c[0]) and not torch.equal(a[1], c[1])
    off = NVFP4Options(stochastic_rounding=False)
    d = run(x, w, dy, options=off, generator=torch.Generator().manual_seed(3))
    e = run(x, w, dy, options=off, generator=torch.Generator().manual_seed(4))
    assert all(torch.equal(s, t) for s, t in zip(d, e, strict=True))


def test_gradients_close_to_fp32():
    """Within NVFP4's error: E2M1 keeps a relative error of at most 1/3 per element (1/6 of
    the scaled range above 1), so a product of two quantised operands keeps a relative
    Frobenius error well under 0.35; far above bf16's."""
    x, w, dy = operands(m=128, k=64, n=64, dtype=torch.float32, seed=4)
    dy = dy * 1e3
    got = run(x, w, dy, generator=torch.Generator().manual_seed(0))
    exact = (x @ w.t(), dy @ w, dy.t() @ x)
    for mine, ref in zip(got, exact, strict=True):
        err = float((mine - ref).detach().norm() / ref.norm())
        assert 0.01 < err < 0.35


def test_options_switch_each_part_off():
    x, w, dy = operands(seed=5)
    g = lambda: torch.Generator().manual_seed(0)  # noqa: E731
    full = run(x, w, dy, generator=g())
    hp_w = run(x, w, dy, options=NVFP4Options(hp_gemms={"grad_weight"}), generator=g())
    assert torch.equal(hp_w[0], full[0]) and torch.equal(hp_w[1], full[1])
    assert torch.equal(hp_w[2], torch.mm(dy.t(), x))
    every = NVFP4Options(hp_gemms={"output", "grad_input", "grad_weight"})
    hp_all = run(x, w, dy, options=every)
    for mine, ref in zip(hp_all, (x @ w.t(), dy @ w, dy.t() @ x), strict=True):
        assert torch.equal(mine, ref)
    no_rht = run(x, w, dy, options=NVFP4Options(rht=False), generator=g())
    assert torch.equal(no_rht[1], full[1]) and not torch.equal(no_rht[2], full[2])
    one_d = run(x, w, dy, options=NVFP4Options(two_d_weight=False), generator=g())
    assert not torch.equal(one_d[0], full[0])
    assert_equal(one_d[0], ref_mm(te_reference(x, False), te_reference(w, False), x.dtype))


def test_linear_shapes_bias_and_dtypes():
    x, w, dy = operands(m=64, k=32, n=16, dtype=torch.float32, seed=6)
    bias = torch.randn(16, requires_grad=True)
    x3 = x.reshape(4, 16, 32).requires_grad_(True)
    out = nvfp4_linear(x3, w, bias, generator=torch.Generator().manual_seed(0))
    assert out.shape == (4, 16, 16) and out.dtype == torch.float32
    out.backward(dy.reshape(4, 16, 16))
    assert torch.equal(bias.grad, dy.sum(0))
    assert x3.grad.shape == x3.shape
    flat = nvfp4_linear(x, w, options=NVFP4Options(stochastic_rounding=False))
    assert torch.equal(out.detach().reshape(64, 16), flat.detach() + bias.detach())
    # no weight gradient: M need not be a multiple of 16
    with torch.no_grad():
        assert nvfp4_linear(x[:8], w).shape == (8, 16)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: nvfp4_linear(torch.ones(16, 24), torch.ones(16, 24)), "K \\(in_features\\) = 24"),
        (lambda: nvfp4_linear(torch.ones(16, 32), torch.ones(8, 32)), "N \\(out_features\\) = 8"),
        (lambda: nvfp4_linear(torch.ones(16, 32), torch.ones(16, 16)), "weight \\(N, K\\)"),
        (lambda: nvfp4_linear(torch.ones(16, 32), torch.ones(16, 32, dtype=torch.bfloat16)),
         "one float dtype"),
        (lambda: NVFP4Options(hp_gemms={"forward"}), "unknown GEMM 'forward'"),
        (lambda: NVFP4Options(hp_gemms="output"), "set of GEMM names"),
        (lambda: NVFP4Options(rht_signs=(1,) * 15), "16 values"),
        (lambda: nvfp4_linear(torch.ones(16, 32), torch.ones(16, 32), options={}), "NVFP4Options"),
    ],
)  # fmt: skip
def test_clear_errors(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_autocast_does_not_change_the_gemms():
    x, w, dy = operands(dtype=torch.float32, seed=7)
    for opts in (NVFP4Options(), NVFP4Options(hp_gemms={"output"})):
        plain = nvfp4_linear(x, w, options=opts)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            inside = nvfp4_linear(x, w, options=opts)
        assert inside.dtype == torch.float32 and torch.equal(inside, plain)


def test_hp_gemms_lift_the_shape_rules():
    w = torch.ones(8, 32, requires_grad=True)
    opts = NVFP4Options(two_d_weight=False, hp_gemms={"grad_input", "grad_weight"})
    assert nvfp4_linear(torch.ones(8, 32), w, options=opts).shape == (8, 8)


def test_quantize_is_the_one_e2m1_rounding():
    """The elements round through kernels.quantize's fp4_e2m1 (the one home of E2M1 rounding),
    which agrees with TE's threshold table on every midpoint and grid value."""
    v = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.3, 5.9, 6.0, -0.25, -2.6])
    assert torch.equal(quantize(v, "fp4_e2m1", saturate=True), te_e2m1(v.double()).float())


def test_a_token_count_off_the_blocks_is_padded_with_zero_rows():
    """M not a multiple of 16 (a last partial batch): the layer equals the same layer on the
    input padded with zero rows, cut back, in the output and both gradients (TE's reference
    quantizer pads so; its kernels refuse), stochastic rounding included."""
    torch.manual_seed(3)
    x = torch.randn(8, 32, requires_grad=True)
    w = torch.randn(16, 32, requires_grad=True)
    out = nvfp4_linear(x, w, generator=torch.Generator().manual_seed(1))
    dy = torch.randn_like(out)
    gx, gw = torch.autograd.grad(out, (x, w), dy)
    xp = torch.nn.functional.pad(x.detach(), (0, 0, 0, 8)).requires_grad_()
    wp = w.detach().clone().requires_grad_()
    padded = nvfp4_linear(xp, wp, generator=torch.Generator().manual_seed(1))
    gxp, gwp = torch.autograd.grad(padded, (xp, wp), torch.nn.functional.pad(dy, (0, 0, 0, 8)))
    assert torch.equal(out, padded[:8]) and torch.equal(gx, gxp[:8]) and torch.equal(gw, gwp)
