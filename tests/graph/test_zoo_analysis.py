"""The analysis on real zoo models and data, and `autoprec analyze` from the command line."""

from __future__ import annotations

import json

import numpy as np
import pytest

from autoprec.cli import main
from autoprec.data import load_dataset_for
from autoprec.graph import analyze
from autoprec.models import load_model
from autoprec.sensitivities import sensitivity


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
        (["analyze", "--model", "tinycnn", "--time-budget", "abc"], "--time-budget 'abc'"),
        (["analyze", "--model", "tinycnn", "--time-budget", "-5"], "positive number of seconds"),
        (["analyze", "--model", "tinycnn", "--time-budget", "nan"], "positive number of seconds"),
        (["analyze", "--model", "tinycnn", "--time-budget", "0"], "positive number of seconds"),
        (["analyze", "--model", "tinycnn", "--time-budget", "9" * 400], "(400 characters)"),
    ],
)
def test_cli_bad_input_is_one_line_exit_2(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and err.count("\n") == 1


def test_cli_focused_marks_the_interpolated_entries(tmp_path, monkeypatch, capsys):
    """A budget too small for the sweep: two layers swept, the other two interpolated, and the
    table says which (``~``), as the JSON does (``measured``)."""
    monkeypatch.setenv("AUTOPREC_CACHE_DIR", str(tmp_path))
    out = tmp_path / "a.json"
    argv = ["analyze", "--model", "tinycnn", "--image-size", "8", "--json", str(out)]
    assert main([*argv, "--method", "focused", "--time-budget", "0.001", "--batches", "1"]) == 0
    captured = capsys.readouterr()
    sens = json.loads(out.read_text())["sensitivity"]
    # one layer of each role (conv#, fc#), the larger role first: fc1, then conv1
    assert sens["method"] == "focused" and sens["measured"] == [True, False, True, False]
    rows = {
        n: next(ln for ln in captured.out.splitlines() if f" {n} " in ln)
        for n in ("conv1", "conv2")
    }
    assert "~" not in rows["conv1"] and "~" in rows["conv2"]
    assert "focused (2 of 4 layers swept" in captured.out
    assert "focused sweep of 2 of 4 layers" in captured.err  # the plan, in one line


def test_cli_unknown_method_lists_the_methods(capsys):
    assert main(["analyze", "--model", "tinycnn", "--method", "exact"]) == 2
    err = capsys.readouterr().err  # click's usage error, as for every choice option
    assert "'auto', 'sweep', 'focused', 'taylor'" in err and "Traceback" not in err
