"""Calibration and `autoprec hardware` from the command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from autoprec.cli import main
from autoprec.graph import analyze
from autoprec.graph.cache import entry_path, named_key, read_entry
from autoprec.hardware import CostModel
from autoprec.hardware.calibration import calibrate, calibration_path, load_calibration


def test_calibration_measures_and_is_stored(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOPREC_CACHE_DIR", str(tmp_path))
    result = calibrate("cpu", size=256, repeats=1)
    assert result.achieved_tflops["fp32"] > 0 and result.bandwidth_gbs > 0
    assert result.compute_efficiency["fp32"] > 0
    assert calibration_path("cpu").exists()
    assert load_calibration("cpu") == result


def test_cost_model_uses_the_calibration(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOPREC_CACHE_DIR", str(tmp_path))
    from autoprec.hardware import CostModel
    from autoprec.hardware.calibration import load_efficiency

    assert load_efficiency("cpu") is None
    result = calibrate("cpu", size=256, repeats=1)
    efficiency = load_efficiency("cpu")
    assert efficiency.compute["fp32"] == result.compute_efficiency["fp32"]
    assert efficiency.bandwidth == result.bandwidth_efficiency
    assert CostModel("cpu").efficiency == efficiency


def test_list_show_detect(capsys):
    assert main(["hardware", "list", "--json"]) == 0
    names = [d["name"] for d in json.loads(capsys.readouterr().out)]
    assert "h100-sxm" in names and "cpu" in names and len(names) >= 21
    assert main(["hardware", "show", "a100-40gb-sxm"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["peak_tflops"]["bf16"] == pytest.approx(312, rel=0.02) and doc["sources"]
    assert main(["hardware", "detect"]) == 0
    assert capsys.readouterr().out.startswith("cpu:")


def test_show_b200_lists_nvfp4_and_fp8_block_among_the_per_layer_choices(capsys):
    """`autoprec hardware show b200`: NVFP4 is a tensor-core format with its datasheet rate,
    and a Linear may take it or block-scaled fp8 (the backend named, not a refusal); an H100
    refuses NVFP4 for want of FP4 tensor cores."""
    assert main(["hardware", "show", "b200"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert "nvfp4" in doc["supported_precisions"] and doc["peak_tflops"]["nvfp4"] == 9000
    assert "FP4 Tensor Core" in doc["sources"]["peak_tflops.nvfp4"]
    linear = doc["runnable"]["linear"]
    assert {"nvfp4", "fp8_block", "mxfp8"} <= set(linear)
    assert not linear["nvfp4"].startswith("no:") and not linear["fp8_block"].startswith("no:")
    assert main(["hardware", "show", "h100-sxm"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert "nvfp4" not in doc["supported_precisions"]
    assert doc["runnable"]["linear"]["nvfp4"].startswith("no:")
    assert main(["hardware", "list"]) == 0
    (b200,) = [line for line in capsys.readouterr().out.splitlines() if " b200 " in line]
    assert "9000" in b200  # the nvfp4 column


def load_model_resnet50():
    from autoprec.models import load_model

    return load_model("resnet50", num_classes=1000)


ESTIMATE = ["hardware", "estimate", "--model", "resnet50", "--device", "h100-sxm"]
ESTIMATE += ["--batch-size", "256", "--precision", "bf16", "--json"]


def test_estimate_json_keys(capsys):
    assert main(ESTIMATE) == 0
    doc = json.loads(capsys.readouterr().out)
    assert {"step_time_s", "throughput", "memory_bytes"} <= set(doc)
    assert doc["throughput"] == pytest.approx(256 / doc["step_time_s"])


def test_estimate_is_the_cost_model_on_the_analysis_at_that_batch(tmp_path, monkeypatch, capsys):
    """Empty cache (the model is built and analysed), then a fresh process on the cached
    table: bit-identical output, and the second never imports torch."""
    monkeypatch.setenv("AUTOPREC_CACHE_DIR", str(tmp_path))
    assert main(ESTIMATE) == 0
    slow = capsys.readouterr().out
    table = analyze(load_model_resnet50(), 256)
    oracle = CostModel("h100-sxm").step(table, "bf16", batch_size=256)
    assert slow == json.dumps(oracle.to_dict(), indent=2) + "\n"
    code = (
        "import sys\nfrom autoprec.cli import main\n"
        f"status = main({ESTIMATE!r})\n"
        "sys.exit(3 if 'torch' in sys.modules else status)\n"
    )
    env = {**os.environ, "AUTOPREC_CACHE_DIR": str(tmp_path)}
    fast = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert fast.returncode == 0, f"status {fast.returncode} (3: torch imported) {fast.stderr}"
    assert fast.stdout == slow


def test_estimate_falls_back_on_a_damaged_or_stale_entry(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("AUTOPREC_CACHE_DIR", str(tmp_path))
    assert main(ESTIMATE) == 0
    expected = capsys.readouterr().out
    key = named_key("resnet50", 256, 1000, None)
    path = entry_path(key)
    doc = json.loads(path.read_text())
    for row in doc["table"]["layers"]:  # a table that would change the estimate
        row["forward_flops"] *= 3
    changed = json.dumps(doc)
    stale = json.dumps({**doc, "key": [*key[:-1], "sources of another autoprec"]})
    for entry, hit in ((changed, True), (stale, False), ("{cut short", False)):
        path.write_text(entry)
        assert main(ESTIMATE) == 0
        assert (capsys.readouterr().out != expected) is hit
        if not hit:  # recomputed and stored again
            assert read_entry(key) == analyze(load_model_resnet50(), 256)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["hardware", "show", "h100"], "did you mean"),
        (
            [
                "hardware",
                "estimate",
                "--model",
                "resnet50",
                "--device",
                "h100-sxm",
                "--batch-size",
                "8",
            ],
            "exactly one of --precision and --policy",
        ),
        (
            [
                "hardware",
                "estimate",
                "--model",
                "resnet50",
                "--device",
                "v100-sxm2-32gb",
                "--batch-size",
                "8",
                "--precision",
                "bf16",
            ],
            "bf16",
        ),
    ],
)
def test_bad_input_exits_2_in_one_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def _estimate(capsys, device: str, precision: str, memory_format: str) -> dict:
    argv = [*ESTIMATE[:4], "--device", device, *ESTIMATE[6:9], precision]
    assert main([*argv, "--json", "--memory-format", memory_format]) == 0
    return json.loads(capsys.readouterr().out)


def test_estimate_memory_format(capsys):
    nchw, nhwc = (_estimate(capsys, "h100-sxm", "bf16", f) for f in ("contiguous", "channels_last"))
    assert nhwc["layout_s"] == 0 < nchw["layout_s"]
    # small convolutions fall back to CUDA-core kernels on NCHW data: slower, no transposes
    assert nchw["step_time_s"] >= nhwc["step_time_s"] + nchw["layout_s"]
    fp32 = [_estimate(capsys, "v100-sxm2-32gb", "fp32", f) for f in ("contiguous", "channels_last")]
    assert fp32[0] == fp32[1]  # CUDA-core convolutions read NCHW as they are
