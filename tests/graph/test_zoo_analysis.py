"""The analysis on real zoo models and data, and `autoprec analyze` from the command line."""

from __future__ import annotations

import json

import numpy as np
import pytest

from autoprec.cli import main
from autoprec.data import load_dataset_for
from autoprec.graph import analyze, sensitivity
from autoprec.models import load_model


def test_tinycnn_and_resnet18_tables():
    assert len(analyze(load_model("tinycnn"), 4)) == 4
    table = analyze(load_model("resnet18", image_size=224), 1)
    assert len(table) == 21
    # torchvision documents 1.81 GMACs for resnet18 at 224x224
    assert table.total_forward_flops == pytest.approx(2 * 1.81e9, rel=0.03)


def test_tinycnn_sensitivity_on_digits(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOPREC_CACHE_DIR", str(tmp_path))
    spec = load_model("tinycnn")
    data = load_dataset_for(spec, "digits")
    table = sensitivity(spec, data, train_steps=20)
    d = np.array(table.matrix())
    assert d.shape == (4, 5) and np.all(d[:, 0] == 0)
    assert np.all(d[:, 4] > d[:, 2]) and np.all(d[:, 2] > d[:, 1])  # fp8 > bf16 > tf32


def test_cli_writes_json_and_heatmap(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("AUTOPREC_CACHE_DIR", str(tmp_path))
    out, png = tmp_path / "a.json", tmp_path / "a.png"
    argv = ["analyze", "--model", "tinycnn", "--image-size", "8", "--json", str(out)]
    assert main([*argv, "--heatmap", str(png)]) == 0
    doc = json.loads(out.read_text())
    assert [row["name"] for row in doc["layers"]] == ["conv1", "conv2", "fc1", "fc2"]
    assert len(doc["sensitivity"]["grad_cosine"]) == 4
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert "GFLOP (2 per multiply-add)" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["analyze", "--model", "resnt50"], "did you mean resnet50"),
        (
            ["analyze", "--model", "tinycnn", "--dataset", "cifar10", "--data-dir", "/nope"],
            "--data-dir",
        ),
    ],
)
def test_cli_bad_input_is_one_line_exit_2(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and err.count("\n") == 1
