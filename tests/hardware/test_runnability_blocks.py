"""nvfp4 and fp8_block in the precision table and the runnability table: their facts, which
targets run them natively through which backend, their shape rules, and what the exported file
says to run them with."""

from __future__ import annotations

import pytest

from autoprec.hardware import get_device
from autoprec.hardware.runnability import Backend, describe, runnability
from autoprec.precision import (
    FP8_NAMES,
    HARDWARE_PRECISIONS,
    Precision,
    block_io_format,
    parse_precision,
)


def test_the_new_precisions_facts():
    nvfp4, block = Precision.NVFP4, Precision.FP8_BLOCK
    assert parse_precision("NVFP4") is nvfp4 and parse_precision("fp8_block") is block
    assert (nvfp4.forward_format, nvfp4.backward_format, nvfp4.bits) == ("fp4_e2m1", "fp4_e2m1", 4)
    assert (block.forward_format, block.backward_format, block.bits) == ("fp8_e4m3", "fp8_e4m3", 8)
    assert nvfp4.bytes_ratio == 0.125 and block.bytes_ratio == 0.25
    assert (nvfp4.hardware, block.hardware) == ("nvfp4", "fp8") and "nvfp4" in HARDWARE_PRECISIONS
    assert (nvfp4.block_size, block.block_size, Precision.MXFP8.block_size) == (16, 128, 32)
    for p in (nvfp4, block, Precision.MXFP8):
        assert p.is_block and p.swapped and p.scaled and not p.is_fp8
    assert block.value not in FP8_NAMES and not Precision.BF16.is_block
    with pytest.raises(ValueError, match="not an fp8 recipe"):
        _ = block.recipe


def test_width_puts_nvfp4_narrowest_and_widens_it_to_bf16():
    order = sorted(Precision, key=lambda p: p.width)
    assert order[0] is Precision.NVFP4 and order[-1] is Precision.FP32
    rank = [p.value for p in order]
    assert rank.index("fp8_rowwise") < rank.index("fp8_block") < rank.index("fp8_rowwise_gw_hp")
    assert Precision.NVFP4.wider() is Precision.BF16
    assert Precision.FP8_BLOCK.wider() is Precision.FP16


def test_block_io_format():
    assert block_io_format(Precision.NVFP4, None) == "bf16"
    assert block_io_format(Precision.FP8_BLOCK, "fp16") == "bf16"
    assert block_io_format(Precision.MXFP8, None) == "fp32"
    with pytest.raises(ValueError, match="not block-scaled"):
        block_io_format(Precision.BF16, None)


def test_nvfp4_runs_on_blackwell_linears_through_transformer_engine():
    b200, h100 = get_device("b200"), get_device("h100-sxm")
    assert runnability("linear", "nvfp4", b200, features=(64, 32)).backend is Backend.TE
    odd = runnability("linear", "nvfp4", b200, features=(64, 40))
    assert not odd.runnable and "16" in odd.reason
    assert not runnability("conv", "nvfp4", b200).runnable
    no = runnability("linear", "nvfp4", h100, features=(64, 32))
    assert not no.runnable and "nvfp4 tensor cores" in no.reason
    assert runnability("linear", "nvfp4", b200, features=(64, 32), mode="emulate").runnable
    assert not runnability("linear", "nvfp4", b200, features=(64, 8), mode="emulate").runnable


@pytest.mark.parametrize("device", ["h100-sxm", "b200"])
def test_fp8_block_runs_on_fp8_targets_with_k_and_n_multiples_of_128(device):
    spec = get_device(device)
    ok = runnability("linear", "fp8_block", spec, features=(256, 128))
    assert ok.backend is Backend.BLOCKWISE
    odd = runnability("linear", "fp8_block", spec, features=(256, 64))
    assert not odd.runnable and "128" in odd.reason
    # emulated, a partial tile is zero-padded (autoprec.kernels.block_fp8_linear)
    assert runnability("linear", "fp8_block", spec, features=(256, 64), mode="emulate").runnable
    assert not runnability("matmul", "fp8_block", spec).runnable
    assert not runnability("linear", "fp8_block", get_device("a100-80gb-sxm")).runnable


def test_hardware_show_lists_the_new_formats_on_b200():
    table = describe(get_device("b200"))
    assert table["linear"]["nvfp4"] == "transformer_engine"
    assert table["linear"]["fp8_block"] == "torchao.blockwise_fp8"
    assert table["conv"]["nvfp4"].startswith("no: ")


def test_run_with_names_a_backend_and_recipe_for_every_precision():
    assert Precision.NVFP4.run_with == ("transformer_engine", "NVFP4BlockScaling")
    assert Precision.FP8_BLOCK.run_with == ("torchao", "Float8BlockwiseLinear")
    assert Precision.FP8_ROWWISE.run_with == ("torchao", "Float8LinearConfig rowwise")
    assert Precision.BF16.run_with == ("torch.autocast", "bf16")
    assert all(all(p.run_with) for p in Precision)


def test_a_search_offers_fp8_block_where_the_target_runs_fp8_and_nvfp4_on_blackwell():
    from autoprec.hardware.defaults import search_precisions

    b200, h100, a100 = (get_device(n) for n in ("b200", "h100-sxm", "a100-80gb-sxm"))
    assert search_precisions(b200) == (
        "fp32", "tf32", "bf16", "fp16", "fp8", "fp8_block", "mxfp8", "nvfp4",
    )  # fmt: skip
    assert search_precisions(h100) == ("fp32", "tf32", "bf16", "fp16", "fp8", "fp8_block")
    assert "fp8_block" not in search_precisions(a100)
