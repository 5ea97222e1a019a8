"""MX and NVFP4 emulation, checked bit for bit against torchao's reference implementation
(``torchao.prototype.mx_formats``, its pure-torch emulated path) and against hand-made oracles.
"""

from __future__ import annotations

import types

import pytest
import torch

from autoprec.kernels import (
    MX_ELEMENTS,
    MX_SCALING_MODES,
    mx_linear,
    mx_quantize,
    mx_round,
    nvfp4_quantize,
    nvfp4_round,
    nvfp4_tensor_scale,
)

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def ao() -> types.SimpleNamespace:
    """torchao's MX pieces; the tests that compare with torchao skip without it."""
    pytest.importorskip("torchao.prototype.mx_formats")
    from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig
    from torchao.prototype.moe_training.mxfp8_linear import MXFP8Linear, mx_mm
    from torchao.prototype.mx_formats import config, constants
    from torchao.prototype.mx_formats.kernels import f4_unpacked_to_f32, unpack_uint4
    from torchao.prototype.mx_formats.mx_tensor import MXTensor, get_fp_scale
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale
    from torchao.quantization import quantize_
    from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

    return types.SimpleNamespace(
        MXTensor=MXTensor,
        NVFP4Tensor=NVFP4Tensor,
        get_fp_scale=get_fp_scale,
        per_tensor_amax_to_scale=per_tensor_amax_to_scale,
        f4_to_f32=lambda packed: f4_unpacked_to_f32(unpack_uint4(packed)),
        mode=lambda name: config.ScaleCalculationMode(name),
        emulated=KernelPreference.EMULATED,
        dim0=config.MXFP8Dim0CastKernelChoice.TORCH,
        dim1=config.MXFP8Dim1CastKernelChoice.TORCH,
        elem={
            "fp8_e4m3": torch.float8_e4m3fn,
            "fp8_e5m2": torch.float8_e5m2,
            "fp6_e2m3": constants.DTYPE_FP6_E2M3,
            "fp6_e3m2": constants.DTYPE_FP6_E3M2,
            "fp4_e2m1": torch.float4_e2m1fn_x2,
        },
        MXFP8TrainingOpConfig=MXFP8TrainingOpConfig,
        MXFP8Linear=MXFP8Linear,
        mx_mm=mx_mm,
        quantize_=quantize_,
    )


def assert_same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal bit patterns, except that any NaN matches any NaN (payloads are not specified)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    as_int = torch.int16 if got.dtype == torch.bfloat16 else torch.int32
    same = (got.view(as_int) == want.view(as_int)) | (got.isnan() & want.isnan())
    assert bool(same.all()), f"{int((~same).sum())} of {got.numel()} values differ"


def magnitudes(dtype: torch.dtype, width: int = 64, seed: int = 0) -> torch.Tensor:
    """Rows of different magnitudes: normal, tiny (fp32 subnormal range), huge, mixed blocks,
    zeros, grid midpoints (rounding ties), and NaN/inf/-0/near-max specials."""
    g = torch.Generator().manual_seed(seed)

    def randn(scale: float = 1.0) -> torch.Tensor:
        return torch.randn(4, width, generator=g) * scale

    def exp2(lo: int, hi: int) -> torch.Tensor:
        return torch.exp2(torch.randint(lo, hi, (4, width), generator=g).float())

    ties = (torch.randint(-64, 64, (4, width), generator=g) + 0.5) * exp2(-8, 4)
    special = randn()
    special[0, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0])
    special[1, 5] = float("inf")
    special[2, 7] = 3e38
    special[3, :] = 0.0
    special[3, 40] = -float("nan")
    rows = [
        randn(),
        randn(2.0**-125),
        randn(2.0**-140),
        randn(2.0**120),
        randn() * exp2(-140, 120),
        torch.zeros(4, width),
        ties,
        special,
    ]
    return torch.cat(rows).to(dtype)


# --- MX: quantise-dequantise ------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scaling", MX_SCALING_MODES)
@pytest.mark.parametrize("elem", MX_ELEMENTS)
def test_mx_round_matches_torchao(ao, elem, scaling, dtype):
    x = magnitudes(dtype)
    want = ao.MXTensor.to_mx(x, ao.elem[elem], 32, ao.mode(scaling), ao.emulated)
    assert_same_bits(mx_round(x, elem, 32, scaling), want.dequantize(dtype))


@pytest.mark.parametrize(
    ("shape", "block_size", "dim"), [((3, 8, 64), 16, -1), ((2, 64, 24), 64, 1), ((32, 6), 32, 0)]
)
def test_mx_round_blocks_along_any_dim(ao, shape, block_size, dim):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1)) * 10
    moved = x.movedim(dim, -1).contiguous()
    for elem, scaling in [("fp8_e5m2", "rceil"), ("fp4_e2m1", "floor")]:
        want = ao.MXTensor.to_mx(moved, ao.elem[elem], block_size, ao.mode(scaling), ao.emulated)
        got = mx_round(x, elem, block_size, scaling, dim=dim)
        assert_same_bits(got, want.dequantize(torch.float32).movedim(-1, dim).contiguous())


@pytest.mark.parametrize("elem", ["fp8_e4m3", "fp4_e2m1"])
def test_mx_quantize_gives_torchao_elements_and_scales(ao, elem):
    x = magnitudes(torch.float32, seed=2)
    q = mx_quantize(x, elem, 32, "rceil")
    t = ao.MXTensor.to_mx(x, ao.elem[elem], 32, ao.mode("rceil"), ao.emulated)
    elements = t.qdata.float() if elem.startswith("fp8") else ao.f4_to_f32(t.qdata)
    finite_scale = q.scales.repeat_interleave(32, -1).isfinite()
    assert_same_bits(q.elements[finite_scale], elements[finite_scale])
    assert_same_bits(q.scales, ao.get_fp_scale(t.scale))
    assert q.scales.shape == (x.shape[0], x.shape[1] // 32)


def test_fp4_elements_round_to_nearest_even():
    # block max 6.5: floor and even give the scale 1, so the block shows e2m1's own grid
    x = torch.tensor([[6.0, 5.0, 3.5, 2.5, 0.25, 0.75, 1.25, 1.75, -0.2, -6.5, 4.9, 0.0]])
    want = torch.tensor([[6.0, 4.0, 4.0, 2.0, 0.0, 1.0, 1.0, 2.0, -0.0, -6.0, 4.0, 0.0]])
    for scaling in ("floor", "even"):
        assert_same_bits(mx_round(x, "fp4_e2m1", block_size=12, scaling=scaling), want)
    # rceil: 6.5 / 6 > 1 needs the scale 2, and the grid doubles
    want_rceil = torch.tensor([[6.0, 4.0, 4.0, 2.0, 0.0, 1.0, 1.0, 2.0, -0.0, -6.0, 4.0, 0.0]])
    assert_same_bits(mx_round(x, "fp4_e2m1", block_size=12, scaling="rceil"), want_rceil)


def test_tiny_blocks_as_torchao():
    """Blocks whose scale would fall below E8M0's 2**-127, as torchao treats them (kept for
    bit-exactness): floor and ceil divide by at least 2**-126 but store the scale 2**-127, so
    the block comes back halved; rceil then multiplies by 1 instead, flushing it to zero."""
    x = torch.full((1, 32), 2.0**-121)
    for scaling in ("floor", "ceil"):
        assert torch.all(mx_round(x, "fp8_e4m3", scaling=scaling) == 2.0**-122)
    assert torch.all(mx_round(x, "fp8_e4m3", scaling="rceil") == 0)
    assert torch.all(mx_round(x * 2.0**4, "fp8_e4m3", scaling="rceil") == x * 2.0**4)


def test_nan_poisons_only_its_block():
    x = torch.ones(2, 64)
    x[0, 3] = float("nan")
    for scaling in MX_SCALING_MODES:
        y = mx_round(x, "fp8_e4m3", scaling=scaling)
        assert y[0, :32].isnan().all() and torch.equal(y[0, 32:], x[0, 32:])
        assert torch.equal(y[1], x[1])


# --- NVFP4 -----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("per_tensor", [None, "amax", "fixed"])
def test_nvfp4_round_matches_torchao(ao, per_tensor, dtype):
    for seed in range(2):
        x = magnitudes(dtype, seed=seed)
        for rows in (x, x.reshape(2, -1, 64)[:, :8]):  # 2-D and 3-D
            pts = None
            if per_tensor == "amax":
                pts = ao.per_tensor_amax_to_scale(torch.max(torch.abs(rows)))
                assert_same_bits(nvfp4_tensor_scale(rows), pts)
            elif per_tensor == "fixed":
                pts = torch.tensor(0.37)
            want = ao.NVFP4Tensor.to_nvfp4(rows.contiguous(), per_tensor_scale=pts)
            assert_same_bits(nvfp4_round(rows, pts), want.dequantize(dtype))
            q = nvfp4_quantize(rows, pts)
            assert_same_bits(q.scales, want.scale.float())


def test_nvfp4_along_dim0_equals_transposed(ao):
    x = torch.randn(48, 5, generator=torch.Generator().manual_seed(3))
    want = ao.NVFP4Tensor.to_nvfp4(x.t().contiguous()).dequantize(torch.float32).t()
    assert_same_bits(nvfp4_round(x, dim=0), want.contiguous())


# --- MX training linear ----------------------------------------------------------------------


def _run(fn, x, w, grad_out):
    x = x.detach().clone().requires_grad_(True)
    w = w.detach().clone().requires_grad_(True)
    out = fn(x, w)
    out.backward(grad_out)
    return out, x.grad, w.grad


@pytest.mark.parametrize("wgrad_with_hp", [False, True])
@pytest.mark.parametrize("scaling", ["floor", "rceil"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_mx_linear_matches_torchao_mxfp8_training(ao, dtype, scaling, wgrad_with_hp):
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(2, 32, 64, generator=g) * 3).to(dtype)
    w = (torch.randn(96, 64, generator=g) * 0.05).to(dtype)
    grad_out = (torch.randn(2, 32, 96, generator=g) * 1e-3).to(dtype)
    config = ao.MXFP8TrainingOpConfig(
        kernel_preference=ao.emulated,
        scale_calculation_mode=ao.mode(scaling),
        wgrad_with_hp=wgrad_with_hp,
    )

    lin = torch.nn.Linear(64, 96, bias=False, dtype=dtype)
    with torch.no_grad():
        lin.weight.copy_(w)
    ao.quantize_(lin, config)
    xr = x.clone().requires_grad_(True)
    out = lin(xr)
    out.backward(grad_out)
    got = _run(
        lambda a, b: mx_linear(a, b, scaling=scaling, wgrad_with_hp=wgrad_with_hp), x, w, grad_out
    )
    for mine, theirs in zip(got, (out, xr.grad, lin.weight.grad), strict=True):
        assert_same_bits(mine, theirs)


@pytest.mark.parametrize(
    ("elem", "grad_elem"),
    [("fp8_e4m3", "fp8_e5m2"), ("fp4_e2m1", "fp4_e2m1"), ("fp6_e2m3", "fp6_e3m2")],
)
def test_mx_linear_matches_torchao_mx_mm_for_other_elements(ao, elem, grad_elem):
    g = torch.Generator().manual_seed(5)
    x, w, grad_out = torch.randn(64, 32, generator=g), torch.randn(32, 32), torch.randn(64, 32)
    e, ge = ao.elem[elem], ao.elem[grad_elem]

    def theirs(a, b):
        args = (e, e, ge, 32, ao.emulated, ao.dim0, ao.dim1, ao.mode("even"), False)
        return ao.mx_mm.apply(a, b, *args)

    want = _run(theirs, x, w, grad_out)
    got = _run(
        lambda a, b: mx_linear(a, b, elem=elem, grad_elem=grad_elem, scaling="even"), x, w, grad_out
    )
    for mine, ref in zip(got, want, strict=True):
        assert_same_bits(mine, ref)


def test_mx_linear_bias_as_torchao_mxfp8_linear(ao):
    layer = ao.MXFP8Linear(64, 32, bias=True, kernel_preference=ao.emulated)
    x = torch.randn(32, 64, requires_grad=True)
    grad_out = torch.randn(32, 32)
    layer(x).backward(grad_out)
    xm = x.detach().clone().requires_grad_(True)
    bias = layer.bias.detach().clone().requires_grad_(True)
    weight = layer.weight.detach().clone().requires_grad_(True)
    mx_linear(xm, weight, bias).backward(grad_out)
    assert_same_bits(xm.grad, x.grad)
    assert_same_bits(weight.grad, layer.weight.grad)
    assert_same_bits(bias.grad, layer.bias.grad)


def test_mx_linear_blocks_each_gemm_along_its_reduction_dim():
    """Oracle without torchao: small integers keep every product and sum exact, so the GEMMs
    equal matmuls of operands quantised along K (output), N (grad_x) and M (grad_w)."""
    g = torch.Generator().manual_seed(6)
    x = torch.randint(-9, 10, (64, 32), generator=g).float() * 64
    w = torch.randint(-9, 10, (32, 32), generator=g).float() / 8
    grad_out = torch.randint(-9, 10, (64, 32), generator=g).float()
    q = lambda t, dim: mx_round(t, "fp4_e2m1", 32, "floor", dim=dim)  # noqa: E731
    out, grad_x, grad_w = _run(
        lambda a, b: mx_linear(a, b, elem="fp4_e2m1", scaling="floor"), x, w, grad_out
    )
    assert torch.equal(out, q(x, 1) @ q(w, 1).t())
    assert torch.equal(grad_x, q(grad_out, 1) @ q(w, 0))
    assert torch.equal(grad_w, q(grad_out, 0).t() @ q(x, 0))
    assert not torch.equal(out, x @ w.t())  # fp4 really rounded


# --- errors ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: mx_round(torch.ones(4, 48)), "not a multiple of the block size 32"),
        (lambda: mx_round(torch.ones(4, 32), "fp8_e3m4"), "unknown MX element format"),
        (lambda: mx_round(torch.ones(4, 32), scaling="round"), "unknown MX scaling"),
        (lambda: mx_round(torch.ones(4, 32, dtype=torch.float16)), "float32 or bfloat16"),
        (lambda: mx_round(torch.ones(4, 32), block_size=0), "positive int"),
        (lambda: mx_round(torch.ones(4, 32), dim=2), "out of range"),
        (lambda: mx_round([1.0] * 32), "torch.Tensor"),
        (lambda: nvfp4_round(torch.ones(4, 24)), "multiple of the block size 16"),
        (lambda: nvfp4_round(torch.ones(4, 16), torch.ones(2)), "one value"),
        (lambda: mx_linear(torch.ones(32, 32), torch.ones(32, 64)), "weight (N, K)"),
        (
            lambda: mx_linear(torch.ones(32, 32), torch.ones(32, 32, dtype=torch.bfloat16)),
            "both float32 or both bfloat16",
        ),
        (
            lambda: mx_linear(torch.ones(8, 32), torch.ones(32, 32, requires_grad=True)),
            "M (rows of x) = 8",
        ),
        (lambda: mx_linear(torch.ones(32, 32), torch.ones(32, 32), block_size=-1), "positive"),
    ],
)
def test_clear_errors(call, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        call()


def test_rows_need_no_blocking_without_weight_gradient():
    w = torch.ones(32, 32, requires_grad=True)
    assert mx_linear(torch.ones(8, 32), w, wgrad_with_hp=True).shape == (8, 32)
    with torch.no_grad():
        assert mx_linear(torch.ones(8, 32), w).shape == (8, 32)
