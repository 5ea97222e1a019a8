"""``autoprec train --mode native`` runs an exported policy natively, layer by layer, or refuses
it in one line: what production training on the target does with the search's file."""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch

from autoprec import PrecisionPolicy, load_model, model_fingerprint, save_policy
from autoprec.cli import main
from autoprec.graph import analyze
from autoprec.hardware import get_device
from autoprec.hardware.runnability import runnable_precisions
from autoprec.layers import tunable_layers
from autoprec.policy import ModelInfo, TargetInfo
from autoprec.runtime import apply_policy
from autoprec.runtime.record import OpRecorder

DTYPE = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16}
DTYPE |= {"fp16": torch.float16}


@pytest.fixture(autouse=True)
def _quiet(monkeypatch):
    monkeypatch.setenv("AUTOPREC_NO_MLFLOW", "1")
    monkeypatch.setenv("AUTOPREC_COMPILE", "0")


def _policy(layers: dict[str, str]) -> PrecisionPolicy:
    module = load_model("tinycnn").module
    info = ModelInfo(
        name="tinycnn",
        fingerprint=model_fingerprint(module),
        tunable_layers=len(list(tunable_layers(module))),
    )
    target = TargetInfo(device="h100-sxm", mode="native")
    return PrecisionPolicy(default="fp32", layers=layers, model=info, target=target)


def _train(path, capsys) -> tuple[int, str, str]:
    args = ["train", "--model", "tinycnn", "--dataset", "digits", "--policy", str(path)]
    rc = main([*args, "--mode", "native", "--steps", "2", "--batch-size", "16"])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_a_runnable_policy_trains_natively(tmp_path, capsys):
    # what the search may export for h100-sxm: fp8 only on fc1 (512 x 64), the rest 16-bit
    path = save_policy(
        _policy({"conv1": "bf16", "conv2": "fp16", "fc1": "fp8", "fc2": "tf32"}),
        tmp_path / "p.yaml",
    )
    rc, out, err = _train(path, capsys)
    assert rc == 0, err
    assert "mode native" in out and "done: 2 steps" in out


def test_an_unrunnable_policy_is_refused_in_one_line_naming_the_layers(tmp_path, capsys):
    path = save_policy(_policy({"conv1": "fp8", "fc2": "fp8"}), tmp_path / "p.yaml")
    rc, out, err = _train(path, capsys)
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err
    assert "conv1" in lines[0] and "fc2" in lines[0] and "cannot run natively" in lines[0]


def test_no_layer_of_a_runnable_policy_falls_back_to_emulation():
    """Every layer's matrix operations run in its own dtype (fp8 ones in torch._scaled_mm):
    the recorded native step has no fp32 GEMM where a layer is low, as an emulated layer
    (fp32 arithmetic on rounded operands) would have."""
    spec = load_model("tinycnn", num_classes=10)
    x, y = spec.example_batch(8)
    table = analyze(spec, (x, y))
    masks = runnable_precisions(table, get_device("h100-sxm"), ["bf16", "fp16", "fp8"])
    policy = {name: allowed[-1].value for name, allowed in masks.items()}  # narrowest allowed
    assert policy == {"conv1": "fp16", "conv2": "fp16", "fc1": "fp8", "fc2": "fp16"}
    model = copy.deepcopy(spec.module).train()
    with apply_policy(model, policy, mode="native"), OpRecorder() as rec:
        spec.loss(model(x), y).backward()
    kinds = Counter((op.name, op.dtypes[0]) for op in rec.matmuls() if op.name != "_scaled_mm")
    assert all(dtype == torch.float16 for _, dtype in kinds)  # no fp32 GEMM anywhere
    assert sum(op.name == "_scaled_mm" for op in rec.matmuls()) == 3  # fc1: forward + 2


def test_compiled_mode_refuses_a_policy_with_per_layer_rules_in_one_line(tmp_path, capsys):
    # --mode compiled runs one 16-bit format and fp8 layers (autoprec.runtime.compiled); an fp32
    # layer beside bf16 ones needs native mode's hooks: refused before training starts
    path = save_policy(
        _policy({"conv1": "bf16", "conv2": "bf16", "fc1": "fp32"}), tmp_path / "p.yaml"
    )
    args = ["train", "--model", "tinycnn", "--dataset", "digits", "--policy", str(path)]
    rc = main([*args, "--mode", "compiled", "--steps", "2", "--batch-size", "16"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert "mode compiled: a compiled program runs one 16-bit format (bf16)" in err
    assert "fc1 (fp32)" in err and len(err.strip().splitlines()) == 1
