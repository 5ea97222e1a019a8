"""Policy files: the written format, round trips, atomic writes and every load error."""

from __future__ import annotations

import json
import os
import re

import pytest
import yaml

from autoprec.policy import LossScalingConfig, PolicyError, PrecisionPolicy
from autoprec.policy.io import format_policy, load_policy, save_policy
from autoprec.precision import Precision

FULL = PrecisionPolicy(
    default="bf16",
    layers={"conv1": "fp32", "re:.*downsample.*": "bf16", "0": "fp16"},
    loss_scaling=LossScalingConfig(init_scale=32768),
    model={"name": "resnet50", "fingerprint": "sha256:abc", "tunable_layers": 54},
    target={"device": "h100-sxm", "mode": "native"},
    metrics={"accuracy_delta": -0.002, "speedup": 2.1},
    provenance={"agent": "ppo", "created": "2024-05-01T10:00:00"},
    verification={
        "verdict": "within",
        "loss_delta": 0.001,
        "accuracy_delta": -0.002,
        "tolerance": 0.05,
        "arms": {
            "policy": {"loss_mean": 0.5, "loss_sd": 0.01, "accuracy_mean": 0.8, "accuracy_sd": 0.0},
            "fp32": {
                "loss_mean": 0.4995,
                "loss_sd": 0.02,
                "accuracy_mean": 0.802,
                "accuracy_sd": 0.01,
            },
        },
        "seeds": [0, 1, 2],
        "steps": 200,
        "batch_size": 32,
        "lr": 0.05,
        "dataset": "teacher",
        "date": "2026-12-01T22:40:00+00:00",
        "autoprec_version": "0.1.0",
    },
)

FULL_YAML = """\
autoprec_policy: 1
model: {name: resnet50, fingerprint: 'sha256:abc', tunable_layers: 54}
target: {device: h100-sxm, mode: native}
default: bf16
layers:
  conv1: fp32
  "re:.*downsample.*": bf16
  '0': fp16
loss_scaling: {kind: dynamic, init_scale: 32768.0, growth_interval: 2000, backoff_factor: 0.5, \
growth_factor: 2.0}
metrics: {accuracy_delta: -0.002, speedup: 2.1}
provenance: {agent: ppo, created: '2024-05-01T10:00:00'}
verification:
  verdict: within
  loss_delta: 0.001
  accuracy_delta: -0.002
  tolerance: 0.05
  arms:
    policy: {loss_mean: 0.5, loss_sd: 0.01, accuracy_mean: 0.8, accuracy_sd: 0.0}
    fp32: {loss_mean: 0.4995, loss_sd: 0.02, accuracy_mean: 0.802, accuracy_sd: 0.01}
  seeds: [0, 1, 2]
  steps: 200
  batch_size: 32
  lr: 0.05
  momentum: 0.9
  dataset: teacher
  date: '2026-12-01T22:40:00+00:00'
  autoprec_version: 0.1.0
"""


def write(tmp_path, text: str, name: str = "policy.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_yaml_written_is_the_documented_format(tmp_path):
    path = save_policy(FULL, tmp_path / "policy.yaml")
    assert path.read_text() == FULL_YAML
    keys = list(yaml.safe_load(FULL_YAML))
    assert (
        keys
        == "autoprec_policy model target default layers loss_scaling metrics provenance "
        "verification".split()
    )


def test_empty_sections_are_left_out():
    assert format_policy(PrecisionPolicy()) == "autoprec_policy: 1\ndefault: fp32\n"


@pytest.mark.parametrize("name", ["policy.yaml", "policy.yml", "policy.json"])
def test_round_trip(tmp_path, name):
    loaded = load_policy(save_policy(FULL, tmp_path / name))
    assert loaded == FULL
    assert loaded.digest() == FULL.digest()
    assert loaded.layers["0"] is Precision.FP16


def test_json_written_is_the_same_data_in_the_same_order(tmp_path):
    path = save_policy(FULL, tmp_path / "policy.json")
    data = json.loads(path.read_text())
    assert data == FULL.to_dict()
    assert list(data) == list(yaml.safe_load(FULL_YAML))


def test_two_line_file_loads(tmp_path):
    policy = load_policy(write(tmp_path, "autoprec_policy: 1\ndefault: bf16\n"))
    assert policy == PrecisionPolicy(default="bf16")
    assert policy.loss_scaling is None and policy.target is None and policy.model is None


def test_unknown_suffix_is_read_as_yaml_and_json_content_too(tmp_path):
    text = '{"autoprec_policy": 1, "default": "fp16", "layers": {"fc": "fp32"}}'
    policy = load_policy(write(tmp_path, text, "policy.txt"))
    assert policy == PrecisionPolicy(default="fp16", layers={"fc": "fp32"})


def test_save_rejects_unknown_suffix(tmp_path):
    with pytest.raises(PolicyError, match=r"policy\.txt: unknown policy file suffix '\.txt'"):
        save_policy(FULL, tmp_path / "policy.txt")
    assert list(tmp_path.iterdir()) == []


def test_provenance_dates_become_strings_and_numbers_stay_numbers(tmp_path):
    text = "autoprec_policy: 1\ndefault: fp32\nprovenance: {created: 2024-05-01, run: 12}\n"
    policy = load_policy(write(tmp_path, text))
    assert dict(policy.provenance) == {"created": "2024-05-01", "run": 12}


@pytest.mark.parametrize("failing", ["os.replace", "yaml.dump"])
def test_failed_save_keeps_the_old_file_and_leaves_no_temp(tmp_path, monkeypatch, failing):
    path = save_policy(PrecisionPolicy(default="fp16"), tmp_path / "policy.yaml")
    before = path.read_bytes()

    def boom(*args, **kwargs):
        raise OSError("disk full")

    module, name = failing.split(".")
    monkeypatch.setattr({"os": os, "yaml": yaml}[module], name, boom)
    with pytest.raises(OSError, match="disk full"):
        save_policy(FULL, path)
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["policy.yaml"]


def test_save_replaces_and_keeps_the_file_mode(tmp_path):
    path = save_policy(PrecisionPolicy(default="fp16"), tmp_path / "policy.yaml")
    path.chmod(0o640)
    save_policy(FULL, path)
    assert load_policy(path) == FULL
    assert path.stat().st_mode & 0o777 == 0o640


# ---- one test per load error: file name, field and (where the parser knows it) line N ----


def test_error_missing_file(tmp_path):
    with pytest.raises(PolicyError, match=r"nope\.yaml: no such file; check the path"):
        load_policy(tmp_path / "nope.yaml")


@pytest.mark.parametrize("text", ["", "  \n", "# only a comment\n"])
def test_error_empty_file(tmp_path, text):
    with pytest.raises(PolicyError, match=r"policy\.yaml: the file is empty; a policy needs"):
        load_policy(write(tmp_path, text))


def test_error_malformed_yaml_names_the_line(tmp_path):
    text = "autoprec_policy: 1\ndefault: bf16\nlayers:\n  fc: fp32\n conv1: fp16\n"
    with pytest.raises(PolicyError) as info:
        load_policy(write(tmp_path, text))
    message = str(info.value)
    assert message.startswith(f"{tmp_path / 'policy.yaml'}, line 5, column 2: malformed YAML:")


def test_error_malformed_json_names_the_line(tmp_path):
    text = '{\n  "autoprec_policy": 1,\n  "default": "bf16",\n}\n'
    with pytest.raises(PolicyError, match=r"policy\.json, line 4, column 1: malformed JSON"):
        load_policy(write(tmp_path, text, "policy.json"))


def test_error_top_level_not_a_mapping(tmp_path):
    with pytest.raises(PolicyError, match=r"policy\.yaml: expected a mapping .* got \['bf16'\]"):
        load_policy(write(tmp_path, "- bf16\n"))


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("default: bf16\n", "missing required key 'autoprec_policy'"),
        ("autoprec_policy: 1\nlayers: {fc: fp32}\n", "missing required key 'default'"),
    ],
    ids=["autoprec_policy", "default"],
)
def test_error_missing_required_key(tmp_path, text, expected):
    with pytest.raises(PolicyError, match=rf"policy\.yaml: {expected}"):
        load_policy(write(tmp_path, text))


def test_error_duplicate_key(tmp_path):
    text = "autoprec_policy: 1\ndefault: bf16\nlayers:\n  fc: fp32\n  fc: fp16\n"
    with pytest.raises(PolicyError, match=r"line 5: duplicate key 'fc' \(first at line 4\)"):
        load_policy(write(tmp_path, text))


HEAD = "autoprec_policy: 1\ndefault: bf16\n"

# (case, file text, line, what the message must say)
FIELD_ERRORS = [
    (
        "unknown_schema_version",
        "autoprec_policy: 2\ndefault: bf16\n",
        1,
        "unsupported autoprec_policy (schema version) 2 (int); this autoprec reads version 1",
    ),
    (
        "unknown_precision",
        HEAD + "layers:\n  fc: bf8\n",
        4,
        "unknown precision 'bf8' for layer 'fc'; expected one of fp32, tf32, bf16, fp16, fp8",
    ),
    (
        "unknown_default_precision",
        "autoprec_policy: 1\n\ndefault: half\n",
        3,
        "unknown precision 'half' for default; expected one of fp32, tf32, bf16, fp16, fp8",
    ),
    ("layers_not_a_mapping", HEAD + "layers: [fc, bf16]\n", 3, "layers must be a mapping"),
    (
        "layer_name_not_a_string",
        HEAD + "layers:\n  fc: fp32\n  0: fp16\n",
        5,
        "layer name 0 (int) is not a non-empty string; quote it in YAML (e.g. '0': bf16)",
    ),
    (
        "init_scale_not_a_number",
        HEAD + "loss_scaling:\n  kind: static\n  init_scale: big\n",
        5,
        "loss_scaling.init_scale must be a number between 1.18e-38 and 3.4e+38, e.g. 32768; "
        "got 'big' (str)",
    ),
    (
        "init_scale_yaml_exponent",
        HEAD + "loss_scaling: {init_scale: 1e5}\n",
        3,
        "loss_scaling.init_scale must be a number between 1.18e-38 and 3.4e+38, e.g. 32768; "
        "got '1e5' (str); it is a string (YAML 1.1 needs a dot and a signed exponent: 1.0e+5)",
    ),
    (
        "metric_not_a_number",
        HEAD + "metrics:\n  speedup: fast\n",
        4,
        "metrics.speedup must be a finite number; got 'fast' (str)",
    ),
    (
        "unknown_top_level_key",
        HEAD + "layer:\n  fc: fp32\n",
        3,
        "unknown key 'layer' in the policy (top level); did you mean 'layers'?",
    ),
    (
        "unknown_section_key",
        HEAD + "target: {device: h100, mdoe: native}\n",
        3,
        "unknown key 'mdoe' in target; did you mean 'mode'?",
    ),
    (
        "bad_regex",
        HEAD + "layers:\n  fc: fp32\n  're:conv[0-9': fp16\n",
        5,
        "pattern 're:conv[0-9' is not a valid regular expression: unterminated character set",
    ),
]


@pytest.mark.parametrize(
    ("text", "line", "expected"), [c[1:] for c in FIELD_ERRORS], ids=[c[0] for c in FIELD_ERRORS]
)
def test_error_field(tmp_path, text, line, expected):
    path = write(tmp_path, text)
    with pytest.raises(PolicyError) as info:
        load_policy(path)
    assert str(info.value).startswith(f"{path}, line {line}: {expected}")


def test_error_field_in_json_names_the_file_and_field(tmp_path):
    text = json.dumps({"autoprec_policy": 1, "default": "bf16", "layers": {"fc": "bf8"}})
    path = write(tmp_path, text, "policy.json")
    with pytest.raises(PolicyError, match=re.escape(f"{path}: unknown precision 'bf8' for layer")):
        load_policy(path)


def test_from_dict_names_its_source():
    with pytest.raises(PolicyError, match=r"^<dict>: unknown precision 'bf8' for default"):
        PrecisionPolicy.from_dict({"autoprec_policy": 1, "default": "bf8"})
    assert PrecisionPolicy.from_dict(FULL.to_dict()) == FULL
