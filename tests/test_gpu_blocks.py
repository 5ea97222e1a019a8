"""experiments/gpu_blocks.py, the prepared GPU script for issue 36's block formats: its CPU dry
run (the same code path as on a GPU) writes both tables, with emulate numbers for every format
and, where this CPU cannot run a format natively, the runtime's one-line refusal instead of a
crash; and the native check a GPU run meets (``PrecisionPolicy.validate`` against the target)
lets fp8_block and the fp8 recipes through where the target runs fp8.
"""

from __future__ import annotations

import math

import pytest
from test_experiments import _num, _provenance_ok, _run, _section, _tables

from autoprec.hardware import get_device
from autoprec.models import load_model
from autoprec.policy import PrecisionPolicy
from autoprec.precision import Precision

FORMATS = ("fp8_block", "mxfp8", "nvfp4")
REFUSED = {  # on a CPU: refuse_block's one line, naming the backends and the target
    "fp8_block": "fp8_block runs natively with torchao (Float8BlockwiseLinear) or Transformer "
    "Engine (Float8BlockScaling) on Hopper or Blackwell (sm90+); on this machine use --mode "
    "emulate",
    "nvfp4": "nvfp4 runs natively with Transformer Engine (NVFP4BlockScaling) or torchao "
    "(NVFP4TrainingConfig) on Blackwell (sm100); on this machine use --mode emulate",
}


@pytest.mark.slow  # an experiment's dry run in a subprocess (about 25 s)
def test_gpu_blocks_dry_run(tmp_path):
    section = _section(_run("gpu_blocks.py", tmp_path, "--dry-run"), "gpu_blocks_dry_run")
    _provenance_ok(section)
    assert "predictions for the database entry **b200**" in section
    small, timings = _tables(section)
    assert [r["precision"] for r in small] == [v for f in FORMATS for v in (f, f"{f} + bf16")]
    for r in small:
        fmt = r["precision"].split()[0]
        assert r["layers"].endswith(f"{fmt} 41")  # every Linear but the 128->64 k/v projections
        for col in ("logits: emulate vs fp32", "trained loss: emulate vs fp32"):
            assert 0.0 < _num(r[col]) < 1.0 and math.isfinite(_num(r[col]))
        if fmt in REFUSED:
            assert r["native"].startswith(f"refused: {REFUSED[fmt]}")
            assert r["logits: emulate vs native"] == "-"
        else:  # torchao's MXFP8Linear runs on a CPU (its emulated kernel)
            assert r["native"] == "ran" and _num(r["logits: emulate vs native"]) < 0.1
    assert _num(small[2]["logits: emulate vs native"]) == 0.0  # mxfp8, fp32 around: same bits
    rows = {r["policy"]: r for r in timings}
    assert list(rows) == [
        "AMP-bf16",
        "all-nvfp4",
        "nvfp4-bf16-tail",
        "nvfp4-first-last-bf16",
        "deepseek-v3",
        "mxfp8-everywhere",
        "fp8_block-everywhere",
    ]
    for name in ("AMP-bf16", "mxfp8-everywhere"):  # timed natively on this CPU
        assert _num(rows[name]["tokens/s"]) > 0 and _num(rows[name]["step ms"]) > 0
    assert "29 MXFP8Linear" in rows["mxfp8-everywhere"]["note"]
    refused = dict.fromkeys(["all-nvfp4", "nvfp4-bf16-tail", "nvfp4-first-last-bf16"], "nvfp4")
    refused.update(dict.fromkeys(["deepseek-v3", "fp8_block-everywhere"], "fp8_block"))
    for name, fmt in refused.items():  # not built, not timed: the refusal instead
        assert rows[name]["step ms"].startswith(f"not run: {REFUSED[fmt]}"), rows[name]


@pytest.mark.parametrize("target", ["h100-sxm", "b200"])
def test_validate_runs_fp8_recipes_and_fp8_block_where_fp8_runs(target):
    """autoprec train's native check (training.checks.check_policy) reads validate's verdict:
    an fp8 recipe or fp8_block needs the target's fp8 tensor cores, as apply_policy's check and
    DeviceSpec.supports say; nvfp4 needs Blackwell's FP4 ones."""
    spec = load_model("llama-small")
    device = get_device(target)
    for p in ("fp8_rowwise", "fp8_block", "nvfp4"):
        report = PrecisionPolicy(default="bf16", layers={"output": p}).validate(spec.module, device)
        expected = {} if device.supports(p) else {"output": Precision(p)}
        assert report.unsupported == expected
    assert not get_device("h100-sxm").supports("nvfp4")  # the refused case is exercised
