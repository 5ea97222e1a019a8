"""fp8 block scaling (kernels/block_fp8.py) bit for bit against torchao's torch references
(``torchao/prototype/blockwise_fp8_training/kernels.py``: ``torch_blockwise_scale_act_quant_lhs``,
``..._rhs``, ``torch_blockwise_scale_weight_quant``), which import here (triton is installed;
the tests skip where they do not), and the linear against ``fp8_blockwise_mm``'s GEMMs
(``linear.py``) rebuilt from those quantisers."""

from __future__ import annotations

import types

import pytest
import torch

from autoprec.kernels import (
    block_fp8_linear,
    fp8_block_quantize_lhs,
    fp8_block_quantize_rhs,
    fp8_block_quantize_weight,
)

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def ao() -> types.SimpleNamespace:
    kernels = pytest.importorskip("torchao.prototype.blockwise_fp8_training.kernels")
    return types.SimpleNamespace(
        lhs=kernels.torch_blockwise_scale_act_quant_lhs,
        rhs=kernels.torch_blockwise_scale_act_quant_rhs,
        weight=kernels.torch_blockwise_scale_weight_quant,
    )


def tensors(dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    """(256, 256) tensors whose 128-tiles are normal, huge, tiny (below the 1e-12 amax floor),
    fp32-subnormal, zero, spread over many binades, or one huge value among small ones."""
    g = torch.Generator().manual_seed(seed)

    def randn(scale: float = 1.0) -> torch.Tensor:
        return torch.randn(256, 256, generator=g) * scale

    spread = randn() * torch.exp2(torch.randint(-60, 60, (256, 256), generator=g).float())
    mixed = randn()
    mixed[:128, :128] = 0.0
    mixed[128:, 128:] *= 1e-14
    mixed[5, 200] = 3e4
    big = 1e30 if dtype == torch.float32 else 1e25
    out = [randn(), randn(big), randn(1e-20), randn(2.0**-135), torch.zeros(256, 256)]
    out += [spread, mixed]
    return [t.to(dtype) for t in out]


def same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    bits = torch.int16 if got.dtype == torch.bfloat16 else torch.int32
    same = (got.view(bits) == want.view(bits)) | (got.isnan() & want.isnan())
    assert bool(same.all()), f"{int((~same).sum())} of {got.numel()} values differ"


@pytest.mark.parametrize("dtype", DTYPES)
def test_lhs_matches_torchao(ao, dtype):
    for x in tensors(dtype):
        values, scales = ao.lhs(x.contiguous())
        q = fp8_block_quantize_lhs(x)
        same_bits(q.elements, values.float())
        same_bits(q.scales, scales.contiguous())
        assert q.dim == 1 and q.block_size == 128


@pytest.mark.parametrize("dtype", DTYPES)
def test_rhs_matches_torchao(ao, dtype):
    for x in tensors(dtype, seed=1):
        values, scales = ao.rhs(x.contiguous())
        q = fp8_block_quantize_rhs(x)
        same_bits(q.elements, values.float().contiguous())
        same_bits(q.scales, scales)
        assert q.dim == 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_weight_matches_torchao(ao, dtype):
    for x in tensors(dtype, seed=2):
        values, scales = ao.weight(x.contiguous())
        q = fp8_block_quantize_weight(x)
        same_bits(q.elements, values.float())
        same_bits(q.scales, scales.repeat_interleave(128, 0))


def test_dequantised_tiles():
    """Oracle without torchao: a tile whose amax is 448 * 2**k has the scale 2**k, so values
    on e4m3's grid times 2**k come back exactly; the rhs tiles are the lhs ones transposed."""
    g = torch.Generator().manual_seed(3)
    grid = torch.randint(-448, 449, (128, 256), generator=g).float()
    grid = grid.to(torch.float8_e4m3fn).float()
    grid[:, ::128] = 448.0
    x = grid * torch.tensor([2.0**-3, 2.0**5]).repeat_interleave(128)
    assert torch.equal(fp8_block_quantize_lhs(x).dequantize(), x)
    assert torch.equal(fp8_block_quantize_rhs(x.t().contiguous()).dequantize(), x.t())
    y = x * (1 + 0.01 * torch.rand(x.shape, generator=g))
    assert not torch.equal(fp8_block_quantize_lhs(y).dequantize(), y)


# --- the linear ------------------------------------------------------------------------------


def run(x, w, dy, bias=None):
    xr, wr = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    out = block_fp8_linear(xr, wr, bias)
    out.backward(dy)
    return out, xr.grad, wr.grad


def deq(values: torch.Tensor, scales: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """torchao's fp8 values times their reciprocal scales expanded over their tiles."""
    expanded = scales.repeat_interleave(rows, 0).repeat_interleave(cols, 1)
    return values.float() * expanded


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_matches_fp8_blockwise_mm_gemms(ao, dtype):
    """torchao's fp8_blockwise_mm: forward x (1x128) @ W (128x128)^T; input gradient
    dY (1x128) @ W (128x128); weight gradient dY^T (1x128 along M) @ x (128x1 along M)."""
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(256, 128, generator=g) * 3).to(dtype)
    w = (torch.randn(384, 128, generator=g) * 0.05).to(dtype)
    dy = (torch.randn(256, 384, generator=g) * 1e-4).to(dtype)
    out, gx, gw = run(x, w, dy)

    xv, xs = ao.lhs(x)
    wv, ws = ao.weight(w)
    w_deq = deq(wv, ws, 128, 128)
    same_bits(out, torch.mm(deq(xv, xs, 1, 128), w_deq.t()).to(dtype))
    gv, gs = ao.lhs(dy)
    same_bits(gx, torch.mm(deq(gv, gs, 1, 128), w_deq).to(dtype))
    gtv, gts = ao.lhs(dy.t().contiguous())
    xrv, xrs = ao.rhs(x)
    same_bits(gw, torch.mm(deq(gtv, gts, 1, 128), deq(xrv, xrs, 128, 1)).to(dtype))


def test_linear_close_to_fp32_bias_and_shapes():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 64, 128, generator=g)
    w = torch.randn(128, 128, generator=g) * 0.1
    dy = torch.randn(2, 64, 128, generator=g)
    bias = torch.randn(128, requires_grad=True)
    out, gx, gw = run(x, w, dy, bias)
    assert out.shape == (2, 64, 128) and gx.shape == x.shape and gw.shape == w.shape
    assert torch.equal(bias.grad, dy.sum((0, 1)))
    exact = (x @ w.t() + bias, dy @ w, dy.reshape(-1, 128).t() @ x.reshape(-1, 128))
    for mine, ref in zip((out, gx, gw), exact, strict=True):
        err = float((mine - ref).detach().norm() / ref.detach().norm())
        assert 1e-3 < err < 0.05  # e4m3 keeps 3 mantissa bits: ~2% per operand
    with torch.no_grad():  # no weight gradient: any number of rows
        assert block_fp8_linear(x[0, :8], w).shape == (8, 128)
        with torch.autocast("cpu", dtype=torch.bfloat16):  # the GEMM stays in float32
            assert torch.equal(block_fp8_linear(x, w, bias), out)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: block_fp8_linear(torch.ones(128, 128), torch.ones(128, 256)), "weight \\(N, K\\)"),
        (lambda: block_fp8_linear(torch.ones(128, 128), torch.ones(128, 128, dtype=torch.half)),
         "one float dtype"),
        (lambda: fp8_block_quantize_lhs(torch.ones(4, 100)), "not tiled by 128"),
        (lambda: fp8_block_quantize_rhs(torch.ones(100, 128)), "not tiled by 128"),
        (lambda: fp8_block_quantize_weight(torch.ones(128, 128, 1)), "2-D floating-point"),
    ],
)  # fmt: skip
def test_clear_errors(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_shapes_off_the_tiles_are_zero_padded_partial_tiles():
    """K, N and M not multiples of 128 (a llama's 64-wide key projection, 100 tokens): the
    layer equals the same layer zero-padded to whole tiles, cut back -- each partial tile
    scaled from its own values -- in the output and both gradients."""
    torch.manual_seed(0)
    x = torch.randn(100, 96, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(64, 96, dtype=torch.bfloat16, requires_grad=True)
    out = block_fp8_linear(x, w)
    g = torch.randn_like(out)
    gx, gw = torch.autograd.grad(out, (x, w), g)
    xp = torch.nn.functional.pad(x.detach(), (0, 32, 0, 28)).requires_grad_()
    wp = torch.nn.functional.pad(w.detach(), (0, 32, 0, 64)).requires_grad_()
    padded = block_fp8_linear(xp, wp)
    gxp, gwp = torch.autograd.grad(padded, (xp, wp), torch.nn.functional.pad(g, (0, 64, 0, 28)))
    assert out.shape == (100, 64) and torch.equal(out, padded[:100, :64])
    assert torch.equal(gx, gxp[:100, :96]) and torch.equal(gw, gwp[:64, :96])
    assert not torch.equal(out, (x @ w.t()).detach())  # it did quantise
