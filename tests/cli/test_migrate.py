"""`autoprec migrate` (autoprec.agents.migrate): stages, blocks, the policy and plan, errors."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import yaml
from tinycnn_fixtures import made_up_metrics
from torch import nn

from autoprec.agents.migrate import MigrationError, check_precision, layer_blocks, migrate
from autoprec.cli import main
from autoprec.evaluate.metrics import Metrics
from autoprec.hardware import get_device
from autoprec.layers import tunable_layers
from autoprec.models import load_model
from autoprec.policy import LossScalingConfig
from autoprec.policy.io import load_policy
from autoprec.sensitivities.grade import SensitivityTable

FAST = ["--steps", "4", "--train-batch-size", "32"]


@pytest.fixture(autouse=True)
def _private(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOPREC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.chdir(tmp_path)


def _plan(path) -> dict:
    return yaml.safe_load(path.read_text())


# --- the command -----------------------------------------------------------------------------
def test_bf16_on_h100_migrates_and_writes_a_valid_policy_and_plan(tmp_path, capsys):
    rc = main(["migrate", "--model", "tinycnn", "--target", "h100-sxm", *FAST])
    out = capsys.readouterr().out
    assert rc == 0, out
    policy = load_policy(tmp_path / "migrated_policy.yaml")  # the default --out
    model = load_model("tinycnn", num_classes=10).module
    report = policy.validate(model, get_device("h100-sxm"))
    assert report.ok, report.problems
    plan = _plan(tmp_path / "migration_plan.yaml")  # the default --plan
    assert plan["precision"] == "bf16" and plan["target"] == "h100-sxm"  # h100's preferred low
    steps = plan["steps"]
    assert steps[0]["stage"] == "model" and len(steps[0]["layers"]) == 4
    assert {"loss_delta", "accuracy_delta", "speedup", "memory_ratio", "accepted"} <= set(steps[0])
    assert policy.provenance["agent"] == "migrate"
    assert policy.metrics["loss_delta"] <= 0.05
    if plan["migrated_without_intervention"]:
        assert len(steps) == 1 and policy.default == "bf16" and not policy.layers
        assert "migrated without intervention" in out
    else:  # bf16 broke the tolerance for this seed: the blocks stage must have run
        assert "blocks" in {s["stage"] for s in steps}
    assert out.count("step ") == len(steps)  # one line per step


@pytest.mark.parametrize(
    ("model", "dataset"), [("tinycnn", "digits"), ("tinytransformer", "tokens")]
)
def test_tiny_tolerance_goes_through_blocks_and_layers(tmp_path, capsys, model, dataset):
    tolerance = 0.0001
    out, plan_path = tmp_path / "p.yaml", tmp_path / "plan.yaml"
    rc = main(
        ["migrate", "--model", model, "--dataset", dataset, "--target", "h100-sxm", *FAST]
        + ["--precision", "fp8", "--accuracy-tolerance", str(tolerance)]
        + ["--out", str(out), "--plan", str(plan_path)]
    )
    printed = capsys.readouterr().out
    assert rc == 0, printed
    plan = _plan(plan_path)
    steps = plan["steps"]
    assert steps[0]["stage"] == "model" and not steps[0]["accepted"]
    assert not plan["migrated_without_intervention"]
    stages = [s["stage"] for s in steps]
    assert stages == sorted(stages, key=["model", "blocks", "layers"].index)
    blocks = plan["blocks"]
    block_steps = [s for s in steps if s["stage"] == "blocks"]
    assert sorted(s["item"] for s in block_steps) == sorted(blocks)  # each block tried once
    reverted = [s["item"] for s in block_steps if not s["accepted"]]
    expected = [layer for b in reverted if len(blocks[b]) > 1 for layer in blocks[b]]
    assert sorted(s["item"] for s in steps if s["stage"] == "layers") == sorted(expected)
    if model == "tinytransformer":  # blocks of several layers: fp8 breaks layers.0 (+0.0016)
        assert any(len(layers) > 1 for layers in blocks.values())
        assert "layers" in stages
    policy = load_policy(out)
    module = load_model(model, num_classes=10).module
    assert policy.validate(module).ok
    precisions = set(policy.resolve(module).values())
    assert policy.metrics["loss_delta"] <= tolerance or precisions == {"fp32"}
    lowered = [n for n, p in policy.resolve(module).items() if p == "fp8"]
    assert plan["lowered_layers"] == len(lowered)
    assert ("nothing could be lowered" in printed) == (not lowered)


def test_a_precision_the_target_cannot_run_is_one_line_and_status_2(capsys):
    rc = main(["migrate", "--model", "tinycnn", "--target", "a100-40gb-sxm", "--precision", "fp8"])
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "a100-40gb-sxm cannot run fp8" in err[0]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "nosuchmodel"], "nosuchmodel"),
        (["--model", "tinycnn", "--target", "h900"], "h900"),
        (["--model", "tinycnn", "--out", "/proc/forbidden/p.yaml"], "cannot write"),
        (["--model", "tinycnn", "--out", "policy.txt"], "suffix"),
        (["--model", "tinycnn", "--accuracy-tolerance", "-1"], "tolerance"),
    ],
)
def test_bad_input_is_status_2(args, message, capsys):
    assert main(["migrate", "--target", "h100-sxm", *args]) == 2  # the last --target wins
    assert message in capsys.readouterr().err


# --- the library -----------------------------------------------------------------------------
def test_resnet18_blocks_are_its_stages_with_conv1_and_fc_alone():
    names = [n for n, _ in tunable_layers(load_model("resnet18", num_classes=10).module)]
    blocks = layer_blocks(names)
    assert list(blocks) == ["conv1", "layer1", "layer2", "layer3", "layer4", "fc"]
    assert blocks["conv1"] == ["conv1"] and blocks["fc"] == ["fc"]
    assert blocks["layer1"] == [n for n in names if n.startswith("layer1.")]
    assert "layer2.0.downsample.0" in blocks["layer2"]
    assert [n for b in blocks.values() for n in b] == names  # every layer once, in order


@pytest.mark.parametrize(
    ("names", "expected"),
    [
        (["conv1", "conv2", "fc1", "fc2"], ["conv1", "conv2", "fc1", "fc2"]),  # flat
        (  # VGG: features holds most layers, so each of its modules is a block
            ["features.0", "features.3", "features.6", "features.8", "features.11"]
            + ["classifier.0", "classifier.3"],
            ["features.0", "features.3", "features.6", "features.8", "features.11"]
            + ["classifier", "classifier.3"],
        ),
        (
            ["a.0.x", "a.0.y", "a.0.z", "a.1.x", "a.1.y", "a.1.z", "head"],
            ["a.0.x", "a.0", "a.1", "head"],
        ),
        (["only"], ["only"]),
    ],
)
def test_layer_blocks_split_the_dominant_container(names, expected):
    assert list(layer_blocks(names)) == expected


class _FakeEvaluator:
    """Deterministic metrics: each low layer adds 0.001 to the loss delta, ``bad`` adds 1."""

    def __init__(self, module: nn.Module, distances: dict[str, float], bad: str) -> None:
        self.spec = type("Spec", (), {"module": module, "name": "nested"})()
        self.device = get_device("h100-sxm")
        self.fidelity = "short"
        self.bad = bad
        names = [n for n, _ in tunable_layers(module)]
        precisions = ("fp32", "tf32", "bf16", "fp16", "fp8")
        self.table = SensitivityTable(
            method="sweep",
            model="nested",
            fingerprint="",
            data_key="",
            layers=tuple(names),
            precisions=precisions,
            loss_delta=tuple((0.0,) * 5 for _ in names),
            grad_cosine=tuple((1.0, 1.0, 1.0, 1.0 - distances[n], 1.0) for n in names),
            reference_loss=1.0,
            wall_time_s=0.0,
            settings={},
        )
        self.evaluated: list = []

    def surrogate(self):
        return type("Surrogate", (), {"table": self.table})()

    def reference(self, fidelity=None) -> Metrics:
        return self._metrics(0.0)

    def evaluate(self, policy, fidelity=None) -> Metrics:
        self.evaluated.append(policy)
        low = [n for n, p in policy.resolve(self.spec.module).items() if p != "fp32"]
        return self._metrics(0.001 * len(low) + (1.0 if self.bad in low else 0.0))

    @staticmethod
    def _metrics(delta: float) -> Metrics:
        return made_up_metrics(loss=1.0 + delta, loss_delta=delta, speedup=1.0 + 10 * delta)


def _nested() -> nn.Module:
    def pair() -> nn.Sequential:
        return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))

    body = nn.Sequential(OrderedDict(a=pair(), b=pair()))
    return nn.Sequential(OrderedDict(stem=nn.Linear(4, 4), body=body, head=nn.Linear(4, 2)))


def test_blocks_then_layers_keep_all_but_the_layer_that_breaks_the_tolerance():
    distances = {
        "stem": 0.1,
        "body.a.0": 0.01,
        "body.a.1": 0.005,
        "body.b.0": 0.02,
        "body.b.1": 0.02,
        "head": 0.5,
    }
    evaluator = _FakeEvaluator(_nested(), distances, bad="body.a.1")
    seen = []
    result = migrate(evaluator, "fp16", tolerance=0.01, on_step=seen.append)
    assert result.blocks == {
        "stem": ["stem"],
        "body.a": ["body.a.0", "body.a.1"],
        "body.b": ["body.b.0", "body.b.1"],
        "head": ["head"],
    }
    steps = [(s.stage, s.item, s.accepted) for s in result.steps]
    assert steps == [
        ("model", "model", False),
        ("blocks", "body.a", False),  # least sensitive block first
        ("blocks", "body.b", True),
        ("blocks", "stem", True),
        ("blocks", "head", True),
        ("layers", "body.a.1", False),  # least sensitive layer of the reverted block first
        ("layers", "body.a.0", True),
    ]
    assert seen == result.steps and len(evaluator.evaluated) == len(steps)
    assert not result.migrated_without_intervention
    assert result.lowered == ["stem", "body.a.0", "body.b.0", "body.b.1", "head"]
    assert result.lowered_share == pytest.approx(5 / 6)
    assert result.metrics.loss_delta == pytest.approx(0.005)
    policy = result.policy
    assert policy.precision_for("body.a.1") == "fp32" and policy.precision_for("head") == "fp16"
    assert policy.loss_scaling == LossScalingConfig()  # fp16 needs dynamic loss scaling
    assert all(p.loss_scaling == LossScalingConfig() for p in evaluator.evaluated)
    assert policy.model.tunable_layers == 6 and policy.target.device == "h100-sxm"
    assert policy.metrics["loss_delta"] == pytest.approx(0.005)
    plan = result.to_plan()
    assert [s["stage"] for s in plan["steps"]].count("layers") == 2
    yaml.safe_dump(plan)  # plain data


def test_whole_model_within_tolerance_is_one_step_and_a_uniform_policy():
    evaluator = _FakeEvaluator(_nested(), _zero(), bad="none")
    result = migrate(evaluator, "bf16", tolerance=0.05)
    assert result.migrated_without_intervention and len(result.steps) == 1
    assert result.policy.default == "bf16" and not result.policy.layers
    assert result.policy.loss_scaling is None and result.lowered_share == 1.0


def _zero() -> dict[str, float]:
    return {n: 0.0 for n, _ in tunable_layers(_nested())}


def test_check_precision_and_tolerance_errors():
    assert check_precision("h100-sxm") == "bf16"
    with pytest.raises(MigrationError, match="cannot run fp8"):
        check_precision("a100-40gb-sxm", "fp8")
    with pytest.raises(MigrationError, match="nothing to migrate"):
        check_precision("h100-sxm", "fp32")
    evaluator = _FakeEvaluator(_nested(), _zero(), bad="none")
    with pytest.raises(MigrationError, match="tolerance"):
        migrate(evaluator, "bf16", tolerance=-0.1)
