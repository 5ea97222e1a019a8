from __future__ import annotations

import pytest
import torch

from autoprec.kernels import FORMATS, Format, format_names, get_format

TORCH_BACKED = ["fp32", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2"]


def test_registry_names():
    assert format_names() == ["fp32", "tf32", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "fp4_e2m1"]


def test_fp4_e2m1_limits():
    """OCP E2M1: no inf, no NaN, so the top binade is full: 0, 0.5, 1, 1.5, 2, 3, 4, 6."""
    fp4 = get_format("fp4_e2m1")
    assert (fp4.max_finite, fp4.min_normal, fp4.min_subnormal) == (6.0, 1.0, 0.5)
    assert fp4.bits == 4 and fp4.storage_bytes == 0.5 and fp4.torch_dtype is None


@pytest.mark.parametrize("name", TORCH_BACKED)
def test_limits_match_torch_finfo(name):
    fmt = get_format(name)
    info = torch.finfo(fmt.torch_dtype)
    assert fmt.max_finite == info.max
    assert fmt.min_normal == info.smallest_normal
    assert fmt.eps == info.eps
    assert fmt.bits == info.bits
    assert fmt.storage_bytes == fmt.torch_dtype.itemsize
    # the smallest subnormal is the value of the bit pattern 1
    one = torch.tensor([1], dtype=torch.int32)
    raw = one.to(
        torch.uint8
        if fmt.storage_bytes == 1
        else torch.int16
        if fmt.storage_bytes == 2
        else torch.int32
    )
    assert raw.view(fmt.torch_dtype).float().item() == fmt.min_subnormal


@pytest.mark.parametrize("name", TORCH_BACKED)
def test_has_inf_matches_torch(name):
    fmt = get_format(name)
    cast = torch.tensor([float("inf")]).to(fmt.torch_dtype).float()
    assert bool(torch.isinf(cast)) == fmt.has_inf


def test_tf32_layout():
    tf32 = get_format("tf32")
    assert (tf32.exponent_bits, tf32.mantissa_bits, tf32.bias) == (8, 10, 127)
    assert tf32.max_finite == (2 - 2**-10) * 2.0**127
    assert tf32.min_normal == 2.0**-126 and tf32.min_subnormal == 2.0**-136
    assert tf32.storage_bytes == 4 and tf32.has_inf and tf32.torch_dtype is None


def test_fp8_limits():
    assert get_format("fp8_e4m3").max_finite == 448.0
    assert get_format("fp8_e4m3").min_subnormal == 2.0**-9
    assert get_format("fp8_e5m2").max_finite == 57344.0
    assert get_format("fp8_e4m3").overflow_threshold == 464.0
    assert get_format("fp16").overflow_threshold == 65520.0


def test_unknown_format_lists_valid_names():
    with pytest.raises(ValueError) as err:
        get_format("bf8")
    message = str(err.value)
    assert "'bf8'" in message
    for name in FORMATS:
        assert name in message


def test_get_format_passes_format_through():
    fmt = get_format("fp16")
    assert get_format(fmt) is fmt


def test_format_rejects_inconsistent_overflow_rule():
    with pytest.raises(ValueError, match="overflow"):
        Format("bad", 4, 3, 7, 1, has_inf=True, overflow="saturate")
    with pytest.raises(ValueError, match="exponent_bits"):
        Format("bad", 9, 3, 7, 1)
