"""The fp8 recipes (tensorwise, rowwise, rowwise with a high-precision weight gradient): emulate
mode against torchao's own ``Float8Linear`` with ``Float8LinearConfig.from_recipe_name``, which
runs on this CPU (``torch._scaled_mm``). torchao is the oracle, bit for bit."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from runtime_helpers import step_gradients as _step
from torch import nn

from autoprec.hardware.runnability import runnability
from autoprec.kernels import DynamicScaledCast
from autoprec.precision import FLOAT8_RECIPES, Precision
from autoprec.runtime import apply_policy
from autoprec.runtime.float8_emulate import EmulatedFloat8Linear

float8 = pytest.importorskip("torchao.float8")

RECIPES = [(p.value, r.name) for p, r in FLOAT8_RECIPES.items()]


def _torchao(model: nn.Module, recipe: str) -> nn.Module:
    ref = copy.deepcopy(model)
    float8.convert_to_float8_training(
        ref, config=float8.Float8LinearConfig.from_recipe_name(recipe)
    )
    return ref


@functools.cache
def _scaled_mm_is_an_fp32_gemm() -> bool:
    """Whether this CPU's ``torch._scaled_mm`` is the fp32 GEMM of the dequantized operands
    (torch's fallback) rather than oneDNN's fp8 kernel, which torch takes on CPUs with
    AVX512-FP16 and which sums in its own order (results within a few fp32 ulps)."""
    gen = torch.Generator().manual_seed(0)
    a = (torch.randn(64, 64, generator=gen) * 16).to(torch.float8_e4m3fn)
    b = (torch.randn(32, 64, generator=gen) * 16).to(torch.float8_e4m3fn)
    one = torch.tensor(0.3)
    got = torch._scaled_mm(a, b.t(), one, one, out_dtype=torch.float32)
    return torch.equal(got, (a.float() * one) @ (b.float() * one).t())


def _assert_same_gemm(a: torch.Tensor, b: torch.Tensor, bound: torch.Tensor, name: str) -> None:
    """``a`` equals ``b``, bit for bit where this CPU's ``_scaled_mm`` is an fp32 GEMM; else
    within the fp32 summation bound ``bound`` (K * 2**-23 * |x| @ |w|.T, far below one fp8
    step: a wrong cast or scale still fails)."""
    if _scaled_mm_is_an_fp32_gemm():
        assert torch.equal(a, b), name
    else:
        assert ((a - b).abs() <= bound).all(), name


def _inputs(seed: int, out_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens whose features span 6 decades, gradients that span 6 more: per-row and per-tensor
    scales give different bits on them."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 16, 64, generator=gen) * torch.logspace(-3, 3, 64)
    g = torch.randn(4, 16, out_features, generator=gen) * torch.logspace(-4, 2, out_features)
    return x, g


@pytest.mark.parametrize(("precision", "recipe"), RECIPES)
def test_each_recipe_emulates_torchaos_float8_linear_bit_for_bit(precision, recipe):
    """Output, input gradient, weight and bias gradients of an emulated recipe equal torchao's
    (0.0 difference: same casts, the same fp32 GEMM as CPU ``_scaled_mm``, and the bf16 result
    torchao's rowwise GEMMs write). Where this CPU's ``_scaled_mm`` is oneDNN's fp8 kernel the
    casts are still the same but the sums run in another order: within fp32 summation error."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32))
    ref = _torchao(model, recipe)
    x, g = _inputs(1, 32)
    want = _step(ref, x, g)
    with apply_policy(model, {"0": precision}, mode="emulate") as handle:
        got = _step(model, x, g)
        stats = handle.stats()["0"]
    w = model[0].weight.detach()
    bounds = (  # per GEMM: K * 2**-23 * |A| @ |B| with 10% for the casts' rounding
        64 * 2**-23 * 1.1 * (x.abs() @ w.abs().t()),
        32 * 2**-23 * 1.1 * (g.abs() @ w.abs()),
        64 * 2**-23 * 1.1 * (g.abs().reshape(-1, 32).t() @ x.abs().reshape(-1, 64)),
        torch.zeros(32),  # the bias gradient is a sum of g, no fp8 GEMM
    )
    names = ("output", "grad_input", "grad_w", "grad_b")
    for name, a, b, bound in zip(names, got, want, bounds, strict=True):
        assert a.dtype == b.dtype == torch.float32
        _assert_same_gemm(a, b, bound, name)
    assert stats.precision == precision and stats.calls == 1
    assert stats.underflows > 0  # values 6 decades below their tensor's (or row's) amax


def test_the_recipes_differ_where_per_row_scaling_matters():
    """The three recipes are not one program under three names: with tokens whose magnitudes
    span 6 decades, tensorwise scaling flushes the small tokens' outputs where rowwise keeps
    each token's own scale, and only gw_hp's weight gradient is exact (no casts in its GEMM)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32, bias=False))
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(64, 64, generator=gen) * torch.logspace(-3, 3, 64)[:, None]
    g = torch.randn(64, 32, generator=gen)
    exact = _step(model, x, g)

    def worst_row(a: torch.Tensor, b: torch.Tensor) -> float:
        return float(((a - b).abs().amax(1) / b.abs().amax(1)).max())

    errors = {}
    for precision, _ in RECIPES:
        with apply_policy(model, {"0": precision}, mode="emulate"):
            got = _step(model, x, g)
        errors[precision] = [worst_row(a, b) for a, b in zip(got, exact, strict=True)]
    assert errors["fp8"][0] > 0.5  # the smallest tokens' outputs are lost
    assert errors["fp8_rowwise"][0] < 0.1 and errors["fp8_rowwise_gw_hp"][0] < 0.1
    assert errors["fp8_rowwise_gw_hp"][2] < 1e-6 < errors["fp8_rowwise"][2]


@pytest.mark.parametrize(("precision", "recipe"), RECIPES)
def test_emulation_equals_native_inside_a_bf16_region(precision, recipe):
    """A bf16 layer opens the policy's bf16 region: the fp8 layer after it reads bf16 and writes
    bf16, natively (torchao's Float8Linear under the runtime's region) as emulated, bit for bit
    but for the bias gradient's summation order."""
    torch.manual_seed(0)
    # no bias on the bf16 layer: emulation rounds autocast's bias within its rounding, not
    # bit for bit (tests/runtime/test_emulate_native.py)
    model = nn.Sequential(nn.Linear(64, 64, bias=False), nn.ReLU(), nn.Linear(64, 32))
    policy = {"0": "bf16", "2": precision}
    x, g = _inputs(3, 32)
    with apply_policy(model, policy, mode="native"):
        want = _step(model, x, g)
    with apply_policy(model, policy, mode="emulate"):
        got = _step(model, x, g)
    *same, bias_grad = zip(got, want, strict=True)
    for a, b in same:  # output, input gradient, both weight gradients
        assert torch.equal(a, b)
    # the bias gradient sums bf16 gradients: CPU autograd's bf16 sum rounds partial sums, the
    # emulation rounds the fp32 sum once (tensorwise fp8 did so before the recipes: 0.5% here)
    a, b = bias_grad
    assert float((a - b).abs().max() / b.abs().max()) <= 2.0**-7


def test_axiswise_cast_is_torchaos_bit_for_bit():
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_utils import tensor_to_scale, to_fp8_saturated

    x = torch.randn(32, 48) * torch.logspace(-4, 4, 48)
    for dim in (0, 1):
        want_scale = tensor_to_scale(
            x,
            torch.float8_e4m3fn,
            scaling_granularity=ScalingGranularity.AXISWISE,
            axiswise_dim=dim,
            round_scales_to_power_of_2=True,
        )
        got = DynamicScaledCast("fp8_e4m3", power_of_two=True, axis=dim)(x)
        assert torch.equal(got.scale, want_scale)
        want = to_fp8_saturated(x * want_scale, torch.float8_e4m3fn)
        assert torch.equal(got.data.float(), want.float())


def test_the_swap_is_undone_and_parameters_are_shared():
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
    original, weight = model[1], model[1].weight
    with apply_policy(model, {"1": "fp8_rowwise"}, mode="emulate"):
        assert isinstance(model[1], EmulatedFloat8Linear)
        assert model[1].weight is weight
        model(torch.randn(2, 16)).sum().backward()
    assert model[1] is original and weight.grad is not None


def test_recipes_are_linear_only_even_in_emulate_mode():
    for mode in ("native", "emulate"):
        verdict = runnability("conv", Precision.FP8_ROWWISE, ("fp32", "fp8"), mode=mode)
        assert not verdict.runnable and "Linear" in verdict.reason
    assert runnability("conv", "fp8", ("fp32", "fp8"), mode="emulate").runnable
    assert runnability("linear", "fp8_rowwise_gw_hp", ("fp32", "fp8"), features=(64, 32)).runnable
    assert not runnability("linear", "fp8_rowwise", ("fp32", "bf16")).runnable


def test_precision_facts_of_the_recipes():
    rowwise = Precision("fp8_rowwise")
    assert rowwise.hardware == "fp8" and rowwise.bits == 8 and rowwise.scaled
    assert rowwise.backward_format == "fp8_e4m3" and Precision.FP8.backward_format == "fp8_e5m2"
    assert rowwise.wider() is Precision.FP16 and Precision.FP8.width < rowwise.width
    with pytest.raises(ValueError, match="not an fp8 recipe"):
        _ = Precision.BF16.recipe


# --- mxfp8 (torchao's MXFP8 training, emulated kernel on this CPU) -----------------------------


@pytest.mark.parametrize("region", [False, True])
def test_mxfp8_emulation_equals_torchaos_mxfp8_linear_bit_for_bit(region):
    """Native mxfp8 is torchao's MXFP8Linear (its emulated kernel here); emulate mode's
    EmulatedMXLinear (autoprec.kernels.mx_linear) gives the same output and gradients, inside
    a bf16 region too (where the layer reads and writes bf16, its weight cast to bf16), and MX
    rounding shows."""
    pytest.importorskip("torchao.prototype.moe_training")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64, bias=False), nn.ReLU(), nn.Linear(64, 32))
    policy = {"2": "mxfp8", **({"0": "bf16"} if region else {})}
    x, g = _inputs(4, 32)
    exact = _step(model, x, g)
    with apply_policy(model, policy, mode="native"):
        assert type(model[2]).__name__ == "MXFP8Linear"
        want = _step(model, x, g)
    with apply_policy(model, policy, mode="emulate"):
        assert type(model[2]).__name__ == "EmulatedMXLinear"
        got = _step(model, x, g)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(got[0], exact[0])
    bias = got[-1]  # unrounded; in bf16 (its gradient too) inside the region
    assert torch.equal(bias, bias.bfloat16().float()) if region else torch.equal(bias, exact[-1])


def test_mxfp8_runs_on_blackwell_linears_with_blocks_of_32():
    from autoprec.hardware import get_device

    b200, h100 = get_device("b200"), get_device("h100-sxm")
    assert b200.supports("mxfp8") and not h100.supports("mxfp8")
    assert runnability("linear", "mxfp8", b200, features=(64, 32)).runnable
    blocks = runnability("linear", "mxfp8", b200, features=(64, 48))
    assert not blocks.runnable and "32" in blocks.reason
    assert not runnability("conv", "mxfp8", b200, mode="emulate").runnable
    assert not runnability("linear", "mxfp8", h100, features=(64, 32)).runnable
    assert Precision.MXFP8.hardware == "mxfp8" and Precision.MXFP8.wider() is Precision.FP16
