"""quantize against torch's casts (bit for bit) and against a float64 reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_helpers import (
    LOW_FORMATS,
    TORCH_FORMATS,
    assert_same_bits,
    edge_values,
    exponent_sweep,
    random_bits,
    reference_quantize,
)

from autoprec.kernels import get_format, quantize, quantize_with_counts


def sample(name: str, n_sweep: int = 1_000_000, n_bits: int = 250_000) -> torch.Tensor:
    fmt = get_format(name)
    return torch.cat(
        [exponent_sweep(fmt, n_sweep, seed=1), random_bits(n_bits, seed=2), edge_values(fmt)]
    )


@pytest.mark.parametrize("name", TORCH_FORMATS)
def test_nearest_is_bit_exact_with_torch_cast(name, backend):
    x = sample(name)
    assert x.numel() >= 1_000_000
    want = x.to(get_format(name).torch_dtype).float()
    assert_same_bits(quantize(x, name, backend=backend), want, x)


@pytest.mark.parametrize("name", LOW_FORMATS)
@pytest.mark.parametrize("saturate", [False, True])
def test_nearest_matches_float64_reference(name, saturate, backend):
    fmt = get_format(name)
    x = sample(name, n_sweep=1_000_000 if name == "tf32" else 200_000, n_bits=50_000)
    want = reference_quantize(x, fmt, saturate=saturate)
    assert_same_bits(quantize(x, name, saturate=saturate, backend=backend), want, x)


@pytest.mark.parametrize("name", TORCH_FORMATS)
def test_saturate_equals_cast_of_clamped_values(name, backend):
    fmt = get_format(name)
    x = sample(name, n_sweep=200_000, n_bits=50_000)
    clamped = torch.where(torch.isinf(x), x, x.clamp(-fmt.max_finite, fmt.max_finite))
    want = clamped.to(fmt.torch_dtype).float()
    assert_same_bits(quantize(x, name, saturate=True, backend=backend), want, x)


@pytest.mark.parametrize("source", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", TORCH_FORMATS)
def test_every_half_precision_input(source, name, backend):
    """All 65536 fp16 / bf16 bit patterns as inputs."""
    x = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(source)
    want = x.float().to(get_format(name).torch_dtype).float()
    assert_same_bits(quantize(x, name, backend=backend), want, x.float())


def test_specials_by_hand():
    x = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-30, -1e-30, 1e6])
    bf = quantize(x, "bf16")
    assert torch.equal(torch.signbit(bf[:2]), torch.tensor([False, True]))
    assert bf[2] == float("inf") and bf[3] == -float("inf") and torch.isnan(bf[4])
    fp16 = quantize(x, "fp16")
    assert fp16[5].item() == 0.0 and torch.signbit(fp16[6])  # underflow keeps the sign
    assert fp16[7] == float("inf")
    assert quantize(x, "fp16", saturate=True)[7] == 65504.0
    e4m3 = quantize(x, "fp8_e4m3")
    assert e4m3[2] == 448.0 and e4m3[3] == -448.0 and e4m3[7] == 448.0
    # TF32: 1 + 2**-11 is a tie between 1 and 1 + 2**-10: to even
    tf = quantize(torch.tensor([1 + 2**-11, 1 + 3 * 2**-11]), "tf32")
    assert tf.tolist() == [1.0, 1 + 2 * 2**-10]


def test_shapes_devices_and_copies(backend):
    x = torch.randn(3, 4, 5).transpose(0, 2)  # non-contiguous
    q = quantize(x, "bf16", backend=backend)
    assert q.shape == x.shape and q.dtype == torch.float32 and q.device == x.device
    assert torch.equal(q, x.contiguous().to(torch.bfloat16).float())
    assert quantize(torch.tensor(1.0 + 2**-9), "bf16").shape == ()
    assert quantize(torch.empty(0, 3), "fp16", backend=backend).shape == (0, 3)
    y = torch.randn(10)
    out = quantize(y, "fp32")
    assert torch.equal(out, y) and out.data_ptr() != y.data_ptr()


@pytest.mark.parametrize(
    "bad", [torch.arange(4), torch.zeros(2, dtype=torch.bool), torch.zeros(2, dtype=torch.float64)]
)
def test_non_float32_inputs_raise_type_error(bad):
    with pytest.raises(TypeError, match="float32"):
        quantize(bad, "bf16")


def test_bad_arguments():
    with pytest.raises(TypeError):
        quantize([1.0, 2.0], "bf16")
    with pytest.raises(ValueError, match="unknown number format 'fp4'"):
        quantize(torch.zeros(2), "fp4")
    with pytest.raises(ValueError, match="stochastic"):
        quantize(torch.zeros(2), "bf16", rounding="down")
    with pytest.raises(ValueError, match="backend"):
        quantize(torch.zeros(2), "bf16", backend="cuda")


# --- stochastic rounding ---------------------------------------------------------------------


def neighbours(x: torch.Tensor, name: str) -> tuple[np.ndarray, np.ndarray]:
    """The grid points just below and above each (in-range) value, in float64."""
    fmt = get_format(name)
    v = x.double().numpy()
    _, exp = np.frexp(v)
    q = np.ldexp(1.0, np.maximum(exp - 1, fmt.min_exponent) - fmt.mantissa_bits)
    return np.floor(v / q) * q, np.ceil(v / q) * q


def in_range_values(name: str, n: int, seed: int) -> torch.Tensor:
    fmt = get_format(name)
    x = exponent_sweep(fmt, 4 * n, seed)
    x = x[torch.isfinite(x) & (x.abs() <= fmt.max_finite)]
    return x[:n]


@pytest.mark.parametrize("name", LOW_FORMATS)
def test_stochastic_lands_on_a_neighbour(name, backend):
    x = in_range_values(name, 200_000, seed=3)
    q = quantize(
        x, name, rounding="stochastic", backend=backend, generator=torch.Generator().manual_seed(0)
    )
    down, up = neighbours(x, name)
    got = q.double().numpy()
    assert np.all((got == down) | (got == up))


@pytest.mark.parametrize("name", LOW_FORMATS)
def test_stochastic_is_unbiased(name, backend):
    """The mean of N roundings stays within 6 standard errors of x, for every x."""
    n_values, repeats = 256, 4096
    x = in_range_values(name, n_values, seed=4)
    x[:4] = torch.tensor([1.0, -1.0, 3.0, 0.0])  # exactly representable: never moved
    g = torch.Generator().manual_seed(5)
    q = quantize(x.repeat(repeats, 1), name, rounding="stochastic", generator=g, backend=backend)
    mean = q.double().mean(0).numpy()
    down, up = neighbours(x, name)
    v = x.double().numpy()
    spacing = up - down
    p = np.divide(v - down, spacing, out=np.zeros_like(v), where=spacing > 0)
    stderr = spacing * np.sqrt(p * (1 - p) / repeats)
    # the subnormal range compares against 24 random bits: allow that resolution on top
    slack = 6 * stderr + spacing * 2.0**-23
    assert np.all(np.abs(mean - v) <= slack)
    assert np.array_equal(mean[:4], v[:4])


def test_stochastic_is_reproducible_and_backend_independent():
    x = torch.randn(100_000) * 1e-5
    a = quantize(
        x, "fp16", "stochastic", generator=torch.Generator().manual_seed(7), backend="eager"
    )
    b = quantize(
        x, "fp16", "stochastic", generator=torch.Generator().manual_seed(7), backend="compiled"
    )
    c = quantize(
        x, "fp16", "stochastic", generator=torch.Generator().manual_seed(8), backend="eager"
    )
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_stochastic_overflow_and_saturation():
    fmt = get_format("fp16")
    x = torch.full((10_000,), fmt.max_finite + 16.0)  # between max and the next binade
    q = quantize(x, "fp16", "stochastic", generator=torch.Generator().manual_seed(0))
    assert set(q.unique().tolist()) == {fmt.max_finite, float("inf")}
    q = quantize(x, "fp16", "stochastic", saturate=True, generator=torch.Generator().manual_seed(0))
    assert set(q.unique().tolist()) == {fmt.max_finite}


# --- properties --------------------------------------------------------------------------------

float32s = st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=True)


@pytest.mark.parametrize("name", LOW_FORMATS)
@pytest.mark.parametrize("compiled", [False, True])
@settings(max_examples=150, deadline=None)
@given(values=st.lists(float32s, min_size=2, max_size=64))
def test_idempotent_and_odd(name, compiled, values):
    backend = "compiled" if compiled else "eager"
    x = torch.tensor(values, dtype=torch.float32)
    once = quantize(x, name, backend=backend)
    assert_same_bits(quantize(once, name, backend=backend), once, x)
    assert_same_bits(quantize(-x, name, backend=backend), -once, x)


@pytest.mark.parametrize("name", LOW_FORMATS)
@pytest.mark.parametrize("saturate", [False, True])
@settings(max_examples=150, deadline=None)
@given(values=st.lists(st.floats(width=32, allow_nan=False), min_size=2, max_size=64))
def test_monotonic(name, saturate, values):
    x = torch.tensor(sorted(values), dtype=torch.float32)
    q = quantize(x, name, saturate=saturate)
    assert torch.all(q[1:] >= q[:-1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", TORCH_FORMATS)
def test_cuda_is_bit_exact_with_cuda_cast(name):
    x = sample(name, n_sweep=1_000_000, n_bits=250_000).cuda()
    want = x.to(get_format(name).torch_dtype).float()
    for backend in ("eager", "compiled"):
        assert_same_bits(quantize(x, name, backend=backend).cpu(), want.cpu(), x.cpu())


@pytest.mark.parametrize("name", LOW_FORMATS)
@pytest.mark.parametrize("saturate", [False, True])
def test_quantize_with_counts(name, saturate, backend):
    fmt = get_format(name)
    x = sample(name, n_sweep=100_000, n_bits=20_000)
    rounded, overflows, underflows = quantize_with_counts(x, name, saturate, backend=backend)
    assert_same_bits(rounded, quantize(x, name, saturate=saturate), x)
    want_over = (~torch.isfinite(rounded) | (x.abs() > fmt.max_finite)).sum()
    want_under = ((rounded == 0) & (x != 0)).sum()
    assert overflows.item() == want_over.item() > 0
    assert underflows.item() == want_under.item() > 0
    tiny = torch.tensor([fmt.min_subnormal / 4, -fmt.min_subnormal / 4, 0.0, 1.0])
    _, over, under = quantize_with_counts(tiny, name, saturate, backend=backend)
    assert (over.item(), under.item()) == (0, 2)


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2", "fp16"])
def test_the_float_split_is_torchs_cast_on_every_value_of_whole_binades(name):
    """round_split against torch's cast on every fp32 value (ties included) of the binades
    where its rules meet: the largest (up to max_finite), the lowest normal, one between, the
    highest subnormal one, and both signs; plus random values down to fp32's subnormals."""
    from autoprec.kernels.quantize import round_split, splits

    fmt = get_format(name)
    assert splits(fmt) and not splits(get_format("bf16"))
    mantissas = torch.arange(1 << 23, dtype=torch.int32)
    low = fmt.min_exponent
    for exponent in (fmt.max_exponent, low, (low + fmt.max_exponent) // 2, low - 1):
        v = (((exponent + 127) << 23) | mantissas).view(torch.float32)
        v = v[v <= fmt.max_finite]
        for x in (v, -v):
            assert_same_bits(round_split(x, fmt), x.to(fmt.torch_dtype).float(), x)
    tiny = torch.randn(200_000) * torch.logspace(-45, 0, 200_000) * fmt.min_normal
    tiny = torch.cat([tiny, torch.tensor([0.0, -0.0, 1e-45, -1e-45])])
    assert_same_bits(round_split(tiny, fmt), tiny.to(fmt.torch_dtype).float(), tiny)
