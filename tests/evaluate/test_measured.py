"""Measured pricing (issue 37): where the target is this machine's device, the per-layer table
ranks policies by the documented sum, and the evaluator measures instead of modelling."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from autoprec.data import load_dataset_for
from autoprec.evaluate import Evaluator, EvaluatorConfig
from autoprec.evaluate.costing import CostEstimator
from autoprec.evaluate.measured import MeasuredCosts
from autoprec.hardware import get_device
from autoprec.models import ModelSpec, load_model
from autoprec.precision import Precision
from autoprec.timing import StepTiming, TimingStore

B = Precision.BF16
F = Precision.FP32


class Chain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 24)
        self.c = nn.Linear(24, 32)
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        return self.head(torch.relu(self.c(torch.relu(self.b(torch.relu(self.a(x)))))))


@pytest.fixture
def costs(tmp_path, monkeypatch):
    """Measured costs of a chain of four Linears whose table holds chosen numbers: every layer
    10 ms alone in fp32 and 6 ms in bf16, its input cast 1 ms and its output cast 0.5 ms; fp32's
    whole step 100 ms."""
    monkeypatch.setenv("AUTOPREC_CACHE_DIR", str(tmp_path))
    spec = ModelSpec("chain", Chain(), (16,), "image-classification", 4)
    model = CostEstimator(get_device("cpu"), spec, 8, "native", spec.module)
    measured = MeasuredCosts(model, "eager", torch_device="cpu", store=TimingStore("cpu"))
    for name in ("a", "b", "c", "head"):
        for p, alone, cin, cout in ((F, 0.010, 0.0, 0.0), (B, 0.006, 0.001, 0.0005)):
            entry = {"alone_s": alone, "cast_in_s": cin, "cast_out_s": cout}
            measured.store.put(measured.layers.key(name, p), entry)
    measured.__dict__["fp32_step"] = StepTiming(0.100)
    return measured


def test_a_policy_is_fp32s_step_plus_its_layers_deltas_less_the_casts_its_neighbours_share(costs):
    every = dict.fromkeys(("a", "b", "c", "head"), B)
    # 100 - 4 x 4 ms; casts saved: a's output (b takes bf16), b's and c's input and output,
    # head's input (its output is the model's: cast); a's input is the model's (fp32)
    assert costs.estimate(every)[0] == pytest.approx(0.100 - 0.016 - (0.0005 + 2 * 0.0015 + 0.001))
    alone = {"a": F, "b": B, "c": F, "head": F}
    assert costs.estimate(alone)[0] == pytest.approx(0.096)  # no neighbour shares its dtype
    pair = {"a": F, "b": B, "c": B, "head": F}
    assert costs.estimate(pair)[0] == pytest.approx(0.092 - 0.0005 - 0.001)
    assert costs.fp32[0] == pytest.approx(0.100)
    assert costs.amp[0] == costs.estimate(every)[0]  # the CPU's AMP: bf16 on every layer


def test_memory_is_the_cost_models_on_the_cpu(costs):
    every = dict.fromkeys(("a", "b", "c", "head"), B)
    assert costs.estimate(every)[1] == costs.model.estimate(every)[1]


def test_a_layer_not_timed_alone_is_priced_as_fp32_and_said_once(costs):
    costs.store.put(costs.layers.key("b", B), {"error": "RuntimeError: no kernel"})
    policy = {"a": F, "b": B, "c": F, "head": F}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert costs.estimate(policy)[0] == pytest.approx(0.100)
        costs.estimate(policy)
    said = [w for w in caught if "could not be timed alone" in str(w.message)]
    assert len(said) == 1 and "'b'" in str(said[0].message)


def test_the_identity_names_the_software_and_the_program(costs):
    identity = costs.identity()
    assert identity["measured"]["execution"] == "eager"
    assert identity["measured"]["software"]["torch"] == str(torch.__version__)
    assert identity["device"] == "cpu"


@pytest.fixture
def tinycnn():
    spec = load_model("tinycnn", num_classes=10)
    return spec, load_dataset_for(spec, "digits")


def test_the_evaluator_measures_when_the_target_is_this_machine(tinycnn, tmp_path):
    spec, data = tinycnn
    here = Evaluator(spec, data, target="cpu", cache_dir=tmp_path)
    assert here.measured and isinstance(here.costs, MeasuredCosts)
    assert here.execution == "eager"  # on the CPU, by default
    assert here.mode == "emulate"  # the fine-tunes stay emulated off the GPU
    modelled = Evaluator(spec, data, target="cpu", cache_dir=tmp_path,
                         config=EvaluatorConfig(pricing="model"))  # fmt: skip
    assert not modelled.measured and modelled.execution is None
    elsewhere = Evaluator(spec, data, target="h100-sxm", cache_dir=tmp_path)
    assert not elsewhere.measured
    # the program and the pricing are parts of the evaluation's key
    assert len({e.settings_key for e in (here, modelled, elsewhere)}) == 3
    compiled = Evaluator(spec, data, target="h100-sxm", cache_dir=tmp_path,
                         config=EvaluatorConfig(execution="compiled"))  # fmt: skip
    assert compiled.execution == "compiled" and compiled.settings_key != elsewhere.settings_key


def test_measured_pricing_of_another_device_is_one_line(tinycnn, tmp_path):
    spec, data = tinycnn
    with pytest.raises(ValueError, match="pricing 'measured' times this machine's device") as e:
        Evaluator(spec, data, target="h100-sxm", cache_dir=tmp_path,
                  config=EvaluatorConfig(pricing="measured"))  # fmt: skip
    assert "\n" not in str(e.value)
    for bad in ({"pricing": "guess"}, {"execution": "jit"}):
        with pytest.raises(ValueError, match="must be"):
            EvaluatorConfig(**bad)


def test_a_measured_evaluation_is_priced_from_the_table(tinycnn, tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOPREC_CACHE_DIR", str(tmp_path / "timing"))
    spec, data = tinycnn
    ev = Evaluator(spec, data, target="cpu", cache_dir=tmp_path,
                   config=EvaluatorConfig(warm_start_steps=5, steps=2))  # fmt: skip
    names = ["conv1", "conv2", "fc1", "fc2"]
    assert ev.measure_costs(dict.fromkeys(names, ["bf16"])) == 8
    assert ev.measure_costs(dict.fromkeys(names, ["bf16"])) == 0  # kept
    m = ev.evaluate({"fc1": "bf16"})
    assert m.source == "measured"
    step, _ = ev.costs.estimate({n: (B if n == "fc1" else F) for n in names})
    assert m.step_time_s == pytest.approx(step)
    assert m.speedup == pytest.approx(ev.costs.fp32_step.step_s / step)
    fp32, bf16 = ev.time_steps(["fp32", "bf16"])
    assert fp32.ok and bf16.ok and fp32.execution == "eager"
