"""Calibration and `autoprec hardware` from the command line."""

from __future__ import annotations

import json

import pytest

from autoprec.cli import main
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


def test_estimate_json_keys(capsys):
    argv = [
        "hardware",
        "estimate",
        "--model",
        "resnet50",
        "--device",
        "h100-sxm",
        "--batch-size",
        "256",
        "--precision",
        "bf16",
        "--json",
    ]
    assert main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    assert {"step_time_s", "throughput", "memory_bytes"} <= set(doc)
    assert doc["throughput"] == pytest.approx(256 / doc["step_time_s"])


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
