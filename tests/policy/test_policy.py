"""PrecisionPolicy: precedence, resolution over a model, validation, digests."""

from __future__ import annotations

import pickle
from types import SimpleNamespace

import pytest
from torch import nn

from autoprec.layers import model_fingerprint
from autoprec.policy import (
    LossScalingConfig,
    ModelInfo,
    PolicyError,
    PolicyReport,
    PrecisionPolicy,
    TargetInfo,
)
from autoprec.precision import Precision


class Net(nn.Module):
    """Tunable: conv1, attn, fc, head.0. Norms: bn1, head.1. attn.out_proj is part of attn."""

    def __init__(self, width: int = 8, fc_name: str = "fc") -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3)
        self.bn1 = nn.BatchNorm2d(width)
        self.attn = nn.MultiheadAttention(width, 2)
        setattr(self, fc_name, nn.Linear(width, 4))
        self.head = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))


def test_exact_name_beats_pattern_first_pattern_wins_default_otherwise():
    policy = PrecisionPolicy(
        default="bf16",
        layers={
            "re:layer1\\..*": "fp16",
            "layer1.conv": "fp32",  # exact, listed after a matching pattern: still wins
            "re:layer.*": "fp8",  # also matches layer1.*, but comes second
        },
    )
    assert policy.precision_for("layer1.conv") is Precision.FP32
    assert policy.precision_for("layer1.other") is Precision.FP16
    assert policy.precision_for("layer2.conv") is Precision.FP8
    assert policy.precision_for("fc") is Precision.BF16
    # fullmatch, not search: the pattern must cover the whole name
    assert policy.precision_for("xlayer1.conv") is Precision.BF16
    assert PrecisionPolicy(layers={"re:conv": "fp16"}).precision_for("conv1") is Precision.FP32


def test_constructor_accepts_strings_and_keeps_layers_read_only_and_ordered():
    policy = PrecisionPolicy(default="BF16", layers={"b": "fp16", "a": Precision.FP32})
    assert policy.default is Precision.BF16
    assert list(policy.layers.items()) == [("b", Precision.FP16), ("a", Precision.FP32)]
    with pytest.raises(TypeError):
        policy.layers["c"] = Precision.FP8  # type: ignore[index]
    assert hash(policy) == hash(PrecisionPolicy(default="bf16", layers={"b": "fp16", "a": "fp32"}))
    # order is part of a policy: patterns are tried in order
    assert policy != PrecisionPolicy(default="bf16", layers={"a": "fp32", "b": "fp16"})
    assert pickle.loads(pickle.dumps(policy)) == policy


def test_constructor_rejects_unknown_precision_and_bad_regex():
    with pytest.raises(PolicyError, match=r"unknown precision 'bf8' for layer 'fc'; expected one"):
        PrecisionPolicy(layers={"fc": "bf8"})
    with pytest.raises(PolicyError, match=r"fp32, tf32, bf16, fp16, fp8"):
        PrecisionPolicy(default="int4")
    with pytest.raises(PolicyError, match=r"pattern 're:conv\(' is not a valid regular") as info:
        PrecisionPolicy(layers={"re:conv(": "fp16"})
    assert "missing ), unterminated subpattern" in str(info.value)
    assert info.value.field == ("layers", "re:conv(")


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"kind": "sometimes"}, "kind"),
        ({"init_scale": 0}, "init_scale"),
        ({"init_scale": "big"}, "init_scale"),
        ({"growth_factor": 1.0}, "growth_factor"),
        ({"backoff_factor": 1.0}, "backoff_factor"),
        ({"growth_interval": 0}, "growth_interval"),
        ({"growth_interval": 2.5}, "growth_interval"),
    ],
)
def test_loss_scaling_config_rejects_bad_values(kwargs, field):
    with pytest.raises(PolicyError, match=rf"loss_scaling\.{field} must be") as info:
        LossScalingConfig(**kwargs)
    assert info.value.field == ("loss_scaling", field)


def test_loss_scaling_config_stores_floats():
    config = LossScalingConfig(kind="static", init_scale=1024)
    assert config.init_scale == 1024.0 and isinstance(config.init_scale, float)


def test_sections_from_mappings_and_unknown_section_keys():
    policy = PrecisionPolicy(target={"device": "h100-sxm"}, model={"name": "net"})
    assert policy.target == TargetInfo(device="h100-sxm", mode="auto")
    assert policy.model == ModelInfo(name="net")
    assert PrecisionPolicy(model=ModelInfo()).model is None  # an empty section is no section
    with pytest.raises(PolicyError, match=r"unknown key 'init_scal' .*did you mean 'init_scale'"):
        PrecisionPolicy(loss_scaling={"init_scal": 8.0})
    with pytest.raises(PolicyError, match=r"target\.mode must be one of auto, emulate, native"):
        PrecisionPolicy(target={"mode": "fast"})


def test_resolve_lists_tunable_layers_in_order_and_norms_only_when_named():
    model = Net()
    resolved = PrecisionPolicy(default="bf16", layers={"fc": "fp32"}).resolve(model)
    assert resolved == {
        "conv1": Precision.BF16,
        "attn": Precision.BF16,
        "fc": Precision.FP32,
        "head.0": Precision.BF16,
    }
    assert list(resolved) == ["conv1", "attn", "fc", "head.0"]

    named = PrecisionPolicy(default="fp16", layers={"bn1": "bf16", "re:head\\..*": "fp32"})
    assert list(named.resolve(model).items()) == [
        ("conv1", Precision.FP16),
        ("bn1", Precision.BF16),
        ("attn", Precision.FP16),
        ("fc", Precision.FP16),
        ("head.0", Precision.FP32),
        ("head.1", Precision.FP32),
    ]


def test_model_fingerprint_follows_architecture_not_weights():
    a, b = Net(), Net()
    nn.init.constant_(b.fc.weight, 3.0)
    assert model_fingerprint(a) == model_fingerprint(b)
    assert model_fingerprint(a).startswith("sha256:")
    assert model_fingerprint(Net(width=16)) != model_fingerprint(a)  # reshaped
    assert model_fingerprint(Net(fc_name="out")) != model_fingerprint(a)  # renamed


def test_validate_reports_unmatched_names_with_suggestions():
    policy = PrecisionPolicy(
        layers={"fcc": "fp32", "re:conv[0-9]": "fp16", "re:decoder\\..*": "fp16", "head": "fp8"}
    )
    report = policy.validate(Net())
    assert report.unmatched == [
        ("fcc", ["fc"]),
        ("re:decoder\\..*", []),
        ("head", ["head.1", "head.0"]),
    ]
    assert not report.ok
    assert report.problems[0] == "layer 'fcc' matches no tunable or normalisation layer; " + (
        "did you mean 'fc'?"
    )
    assert report.problems[1].startswith("pattern 're:decoder\\\\..*' matches no")
    assert len(report.problems) == 3


def test_validate_reports_fingerprint_mismatch_only_when_set_and_different():
    model = Net()
    actual = model_fingerprint(model)
    assert PrecisionPolicy(model={"fingerprint": actual}).validate(model) == PolicyReport()
    assert PrecisionPolicy(model={"name": "net"}).validate(model).ok
    report = PrecisionPolicy(model={"fingerprint": "sha256:old"}).validate(model)
    assert report.fingerprint == ("sha256:old", actual)
    assert report.problems == [
        f"model fingerprint is {actual}, the policy was made for sha256:old; the architecture "
        "changed: search again, or remove model.fingerprint to accept it"
    ]


@pytest.mark.parametrize(
    "device",
    [
        ["fp32", "tf32", "bf16", "fp16", "int8"],
        SimpleNamespace(supported_precisions=("fp32", "tf32", "bf16", "fp16")),
    ],
    ids=["list", "object"],
)
def test_validate_reports_unsupported_precisions(device):
    policy = PrecisionPolicy(default="bf16", layers={"fc": "fp8", "bn1": "fp8"})
    report = policy.validate(Net(), device=device)
    assert report.unsupported == {"bn1": Precision.FP8, "fc": Precision.FP8}
    assert report.unmatched == [] and report.fingerprint is None
    assert "layer 'fc' is fp8, which the device cannot run" in report.problems[1]
    assert PrecisionPolicy(default="bf16").validate(Net(), device=device).ok


def test_validate_rejects_a_device_given_as_a_string():
    with pytest.raises(TypeError, match="iterable of precision names"):
        PrecisionPolicy().validate(Net(), device="h100-sxm")


def test_digest_covers_what_changes_training_only():
    base = PrecisionPolicy(default="bf16", layers={"fc": "fp32"})
    assert base.digest() == PrecisionPolicy(default="bf16", layers={"fc": "fp32"}).digest()
    assert base.digest().startswith("sha256:") and len(base.digest()) == 7 + 64
    same = base.replace(metrics={"speedup": 2.0}, provenance={"agent": "tpe"}, target={})
    assert same.digest() == base.digest()
    different = [
        base.replace(default="fp16"),
        base.with_layers({"fc": "fp16"}),
        base.with_layers({"conv1": "fp32"}),
        base.replace(loss_scaling=LossScalingConfig()),
        base.replace(loss_scaling=LossScalingConfig(init_scale=1024.0)),
    ]
    assert len({p.digest() for p in different} | {base.digest()}) == len(different) + 1


def test_uniform_and_with_layers():
    policy = PrecisionPolicy.uniform("fp16", loss_scaling=LossScalingConfig())
    assert policy.default is Precision.FP16 and not policy.layers
    assert policy.resolve(Net()) == dict.fromkeys(["conv1", "attn", "fc", "head.0"], Precision.FP16)
    more = PrecisionPolicy(layers={"a": "fp16", "b": "bf16"}).with_layers({"a": "fp8", "c": "fp32"})
    assert list(more.layers.items()) == [
        ("a", Precision.FP8),
        ("b", Precision.BF16),
        ("c", Precision.FP32),
    ]
