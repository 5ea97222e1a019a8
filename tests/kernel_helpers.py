"""Helpers for the kernel tests: value generators and a float64 reference rounding."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from autoprec.kernels import Format

TORCH_FORMATS = ["bf16", "fp16", "fp8_e4m3", "fp8_e5m2"]
LOW_FORMATS = ["tf32", *TORCH_FORMATS]


def representable(fmt: Format) -> torch.Tensor:
    """Every finite value of a torch-backed format, as float32 (sorted, unique)."""
    dtype = fmt.torch_dtype
    if dtype.itemsize == 1:
        raw = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype)
    else:
        raw = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(dtype)
    values = raw.float()
    return torch.unique(values[torch.isfinite(values)])


def exponent_sweep(fmt: Format, n: int, seed: int) -> torch.Tensor:
    """``n`` fp32 values with random sign and mantissa, exponents spread uniformly from below the
    format's smallest subnormal to above its largest value (clamped to fp32's range)."""
    g = torch.Generator().manual_seed(seed)
    lo = max(fmt.min_exponent - fmt.mantissa_bits - 4, -149)
    hi = min(fmt.max_exponent + 2, 127)
    exponent = torch.randint(lo, hi + 1, (n,), generator=g)
    biased = torch.clamp(exponent + 127, 0, 254)  # 0 = fp32 subnormals
    mantissa = torch.randint(0, 1 << 23, (n,), generator=g)
    sign = torch.randint(0, 2, (n,), generator=g)
    bits = (sign << 31) | (biased << 23) | mantissa
    return bits.to(torch.int64).to(torch.uint32).view(torch.int32).view(torch.float32)


def random_bits(n: int, seed: int) -> torch.Tensor:
    """Uniformly random fp32 bit patterns: every class of value, NaN payloads included."""
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randint(-(1 << 31), 1 << 31, (n,), generator=g, dtype=torch.int64)
        .to(torch.int32)
        .view(torch.float32)
    )


def edge_values(fmt: Format) -> torch.Tensor:
    """Specials, limits, and ties: midpoints between neighbouring values and one fp32 ulp
    either side of them."""
    specials = [0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1.0, -1.0]
    limits = [
        fmt.max_finite,
        fmt.min_normal,
        fmt.min_subnormal,
        fmt.min_subnormal / 2,
        fmt.min_subnormal / 4,
        fmt.min_subnormal * 0.75,
        fmt.overflow_threshold,
        3.4028234663852886e38,
        1.1754943508222875e-38,
        1.401298464324817e-45,
    ]
    values = torch.tensor(specials + limits + [-v for v in limits], dtype=torch.float32)
    if fmt.torch_dtype is not None:
        grid = representable(fmt).double()
        mids = ((grid[1:] + grid[:-1]) / 2).float()
        up = torch.nextafter(mids, torch.full_like(mids, float("inf")))
        down = torch.nextafter(mids, torch.full_like(mids, -float("inf")))
        values = torch.cat([values, grid.float(), mids, up, down])
    return values


def reference_quantize(x: torch.Tensor, fmt: Format, saturate: bool = False) -> torch.Tensor:
    """Round-to-nearest-even in float64 with numpy: an oracle independent of the kernel."""
    v = x.double().numpy()
    out = np.empty_like(v)
    finite = np.isfinite(v)
    _, exp = np.frexp(v[finite])
    e = np.maximum(exp - 1, fmt.min_exponent)
    q = np.ldexp(1.0, e - fmt.mantissa_bits)
    y = np.rint(v[finite] / q) * q
    over = np.abs(y) > fmt.max_finite
    clamp = saturate or fmt.overflow == "saturate"
    y[over] = np.copysign(fmt.max_finite if clamp else np.inf, y[over])
    out[finite] = y
    out[np.isnan(v)] = np.nan
    inf = np.isinf(v)
    out[inf] = v[inf] if fmt.has_inf else np.copysign(fmt.max_finite, v[inf])
    return torch.from_numpy(out).float()


def assert_same_bits(got: torch.Tensor, want: torch.Tensor, x: torch.Tensor | None = None) -> None:
    """Equal bit patterns; NaN only needs to be NaN where the reference is NaN. ``x``, the
    input, is only used to make a failure readable."""
    assert got.dtype == torch.float32 and got.shape == want.shape
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan), "NaN positions differ"
    g, w = got[~nan].view(torch.int32), want[~nan].view(torch.int32)
    bad = (g != w).nonzero().flatten()
    if bad.numel():
        i = bad[:5]
        inputs = [] if x is None else x.reshape(-1)[(~nan).reshape(-1)][i].tolist()
        pytest.fail(
            f"{bad.numel()} values differ; inputs {inputs}: got {got[~nan][i].tolist()}, "
            f"want {want[~nan][i].tolist()}"
        )
