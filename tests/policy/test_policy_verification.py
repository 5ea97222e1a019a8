"""The ``verification`` section: round trips, the digest, and one-line errors with the field."""

from __future__ import annotations

import copy

import pytest
import yaml

from autoprec.policy import PolicyError, PrecisionPolicy, VerificationInfo
from autoprec.policy.io import format_policy, load_policy, save_policy

SECTION = {
    "verdict": "outside",
    "loss_delta": 0.2,
    "accuracy_delta": -0.05,
    "tolerance": 0.05,
    "arms": {
        "policy": {"loss_mean": 0.6, "loss_sd": 0.01, "accuracy_mean": 0.75, "accuracy_sd": 0.02},
        "fp32": {"loss_mean": 0.5, "loss_sd": 0.02, "accuracy_mean": 0.8, "accuracy_sd": 0.01},
    },
    "seeds": [0, 1],
    "epochs": 2,
    "batch_size": 16,
    "lr": 0.1,
    "date": "2026-12-01T22:40:00+00:00",
    "autoprec_version": "0.1.0",
}


def policy(**changes):
    section = copy.deepcopy(SECTION)
    section.update(changes)
    return {"autoprec_policy": 1, "default": "bf16", "verification": section}


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_the_section_round_trips_and_keeps_the_digest(tmp_path, suffix):
    verified = PrecisionPolicy.from_dict(policy())
    assert isinstance(verified.verification, VerificationInfo)
    assert not verified.verification.within
    assert [a.name for a in verified.verification.arms] == ["policy", "fp32"]
    path = save_policy(verified, tmp_path / f"p{suffix}")
    assert load_policy(path) == verified
    assert hash(load_policy(path)) == hash(verified)
    # a measurement of the policy, not a part of it: the identity stays
    assert verified.digest() == PrecisionPolicy(default="bf16").digest()


def test_the_yaml_section_is_a_block_with_one_line_per_arm():
    text = format_policy(PrecisionPolicy.from_dict(policy()))
    section = text.split("verification:\n", 1)[1].splitlines()
    assert section[0] == "  verdict: outside"
    assert "  arms:" in section and "  seeds: [0, 1]" in section and "  epochs: 2" in section
    keys = "verdict loss_delta accuracy_delta tolerance arms seeds epochs batch_size lr"
    written = list(yaml.safe_load(text)["verification"])
    assert written == [*keys.split(), "momentum", "date", "autoprec_version"]


def test_an_unquoted_date_is_read_as_its_text(tmp_path):
    path = tmp_path / "p.yaml"
    text = format_policy(PrecisionPolicy.from_dict(policy()))
    path.write_text(text.replace("'2026-12-01T22:40:00+00:00'", "2026-12-01"))
    assert load_policy(path).verification.date == "2026-12-01"


@pytest.mark.parametrize(
    ("changes", "field", "says"),
    [
        ({"verdict": "fine"}, ("verification", "verdict"), "one of within, outside"),
        ({"loss_delta": "1e-3"}, ("verification", "loss_delta"), "YAML 1.1"),
        ({"tolerance": -1}, ("verification", "tolerance"), ">= 0"),
        ({"seeds": []}, ("verification", "seeds"), "non-empty list"),
        ({"steps": 10}, ("verification", "steps"), "exactly one of 'steps' and 'epochs'"),
        ({"batch_size": 0}, ("verification", "batch_size"), "integer >= 1"),
        ({"arms": {}}, ("verification", "arms"), "non-empty mapping"),
        (
            {
                "arms": {
                    "fp32": {"loss_mean": 1, "loss_sd": -1, "accuracy_mean": 0, "accuracy_sd": 0}
                }
            },
            ("verification", "arms", "fp32", "loss_sd"),
            ">= 0",
        ),
        (
            {"arms": {"fp32": {"loss_mean": 1, "loss_sdev": 0}}},
            ("verification", "arms", "fp32", "loss_sdev"),
            "did you mean 'loss_sd'",
        ),
        ({"arms": {"fp32": {"loss_mean": 1}}}, ("verification", "arms", "fp32"), "lacks"),
        ({"verdikt": "within"}, ("verification", "verdikt"), "did you mean 'verdict'"),
        (
            {"arms": {"policy": {**SECTION["arms"]["policy"], "diverged": -1}}},
            ("verification", "arms", "policy", "diverged"),
            "integer >= 0",
        ),
        (
            {"arms": {"policy": {**SECTION["arms"]["policy"], "diverged": 3}}},
            ("verification", "arms", "policy", "diverged"),
            "at most the number of seeds (2)",
        ),
    ],
)
def test_a_bad_section_is_one_line_naming_the_field(changes, field, says):
    with pytest.raises(PolicyError) as err:
        PrecisionPolicy.from_dict(policy(**changes))
    assert err.value.field == field
    assert says in str(err.value) and "\n" not in str(err.value)


def test_a_missing_key_says_who_writes_the_section():
    data = policy()
    del data["verification"]["verdict"]
    with pytest.raises(PolicyError, match="lacks verdict; it is written by `autoprec verify`"):
        PrecisionPolicy.from_dict(data)


def test_the_error_names_the_line(tmp_path):
    path = tmp_path / "p.yaml"
    text = format_policy(PrecisionPolicy.from_dict(policy()))
    path.write_text(text.replace("batch_size: 16", "batch_size: many"))
    line = text.splitlines().index("  batch_size: 16") + 1
    with pytest.raises(PolicyError, match=rf"line {line}: verification.batch_size must be"):
        load_policy(path)


def test_an_arm_that_diverged_keeps_its_count_and_only_then():
    arms = copy.deepcopy(SECTION["arms"])
    arms["policy"]["diverged"] = 2
    verified = PrecisionPolicy.from_dict(policy(arms=arms))
    mine, fp32 = verified.verification.arms
    assert (mine.diverged, fp32.diverged) == (2, 0)
    written = yaml.safe_load(format_policy(verified))["verification"]["arms"]
    assert written["policy"]["diverged"] == 2 and "diverged" not in written["fp32"]
    assert PrecisionPolicy.from_dict(yaml.safe_load(format_policy(verified))) == verified
