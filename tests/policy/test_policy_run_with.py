"""The exported policy file's ``run_with`` section: per layer the backend and recipe to run it
with, written from the precisions; files without it (every file before it) still load."""

from __future__ import annotations

import pytest
import yaml
from torch import nn

from autoprec.agents.export import export_policy, layer_policy
from autoprec.policy import PolicyError, PrecisionPolicy, TargetInfo
from autoprec.policy.io import format_policy, load_policy, save_policy

OLD_FILE = """\
autoprec_policy: 1
target: {device: b200, mode: native}
default: bf16
layers:
  fc1: fp8_rowwise
  "re:.*head.*": fp32
"""


def test_a_file_without_run_with_loads_and_saves_as_it_was(tmp_path):
    path = tmp_path / "old.yaml"
    path.write_text(OLD_FILE)
    policy = load_policy(path)
    assert not policy.state_backends and policy.layers["fc1"] == "fp8_rowwise"
    assert format_policy(policy) == OLD_FILE


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_an_exported_policy_states_each_layers_backend_and_round_trips(tmp_path, suffix):
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.Linear(32, 16))
    policy = export_policy(
        layer_policy({"0": "nvfp4", "2": "fp8_block", "3": "bf16"}),
        model,
        target=TargetInfo(device="b200", mode="native"),
        metrics={"speedup": 1.5},
        provenance={"agent": "baseline"},
    )
    path = save_policy(policy, tmp_path / f"p{suffix}")
    text = path.read_text()
    data = yaml.safe_load(text)  # JSON is YAML
    assert data["run_with"] == {
        "default": {"backend": "torch", "recipe": "fp32 (TF32 off)"},
        "layers": {
            "0": {"backend": "transformer_engine", "recipe": "NVFP4BlockScaling"},
            "2": {"backend": "torchao", "recipe": "Float8BlockwiseLinear"},
            "3": {"backend": "torch.autocast", "recipe": "bf16"},
        },
    }
    loaded = load_policy(path)
    assert loaded == policy and loaded.state_backends
    assert save_policy(loaded, tmp_path / f"again{suffix}").read_text() == text
    assert loaded.digest() == policy.replace(state_backends=False).digest()


def test_run_with_is_rewritten_from_the_precisions(tmp_path):
    path = tmp_path / "edited.yaml"
    path.write_text(
        OLD_FILE + "run_with:\n  default: {backend: stale, recipe: stale}\n"
    )  # a user changed a precision and left the section
    policy = load_policy(path)
    assert policy.state_backends
    written = yaml.safe_load(format_policy(policy))["run_with"]
    assert written["default"] == {"backend": "torch.autocast", "recipe": "bf16"}
    rowwise = {"backend": "torchao", "recipe": "Float8LinearConfig rowwise"}
    assert written["layers"]["fc1"] == rowwise
    assert written["layers"]["re:.*head.*"]["backend"] == "torch"


def test_a_malformed_run_with_is_refused_in_one_line_with_its_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(OLD_FILE + "run_with: [torchao]\n")
    with pytest.raises(PolicyError) as err:
        load_policy(path)
    message = str(err.value)
    assert "line 7" in message and "run_with must be a mapping" in message and "\n" not in message


def test_state_backends_must_be_a_bool():
    with pytest.raises(TypeError, match="state_backends"):
        PrecisionPolicy(state_backends="yes")
