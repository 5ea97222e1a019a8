"""Per-layer sensitivity: both methods, their agreement on a small model, the disk cache."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sensitivity_helpers import Data, Spec
from torch import nn

from autoprec.sensitivities import grade, measure, sensitivity


def make_spec() -> Spec:
    torch.manual_seed(0)
    return Spec(nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10)))


@pytest.mark.parametrize("method", ["sweep", "taylor"])
def test_formats_are_ordered_by_damage(method):
    table = sensitivity(make_spec(), Data(), method=method, cache=False, train_steps=10)
    assert table.layers == ("1", "3") and table.precisions == (
        "fp32",
        "tf32",
        "bf16",
        "fp16",
        "fp8",
    )
    d = np.array(table.matrix())
    assert np.all(d[:, 0] == 0)  # fp32 is the reference
    for row in d:  # tf32 ~ fp16 (10 mantissa bits) << bf16 (7) << fp8
        assert row[1] < row[2] < row[4] and row[3] < row[2]
    assert table.method == method and table.reference_loss > 0


def test_the_user_model_is_not_trained():
    spec = make_spec()
    before = [p.clone() for p in spec.module.parameters()]
    sensitivity(spec, Data(), method="taylor", cache=False, train_steps=5)
    assert all(torch.equal(a, b) for a, b in zip(before, spec.module.parameters(), strict=True))


def test_results_are_cached_on_disk(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOPREC_CACHE_DIR", str(tmp_path))
    first = sensitivity(make_spec(), Data(), method="taylor", train_steps=5)
    assert len(list((tmp_path / "sensitivity").glob("*.json"))) == 1

    def fail(*args, **kwargs):
        raise AssertionError("recomputed instead of reading the cache")

    monkeypatch.setattr(measure, "loss_and_grad", fail)
    again = sensitivity(make_spec(), Data(), method="taylor", train_steps=5)
    assert again == first
    with pytest.raises(AssertionError, match="recomputed"):  # other settings: a new entry
        sensitivity(make_spec(), Data(), method="taylor", train_steps=6)


def test_unknown_method():
    with pytest.raises(ValueError, match="sweep"):
        sensitivity(make_spec(), Data(), method="exact")


def test_distance_clamps_rounding_noise_at_zero():
    """A float64 cosine a hair above 1 is no distance (it printed as -6.7e-16 in analyze)."""
    one_up = float(np.nextafter(1.0, 2.0))
    assert 1.0 - one_up < 0 and grade.grad_distance(one_up) == 0.0
    assert grade.grad_distance(0.75) == 0.25 and np.isnan(grade.grad_distance(float("nan")))
    table = sensitivity(make_spec(), Data(), ["fp32", "bf16"], batches=1, train_steps=0)
    noisy = grade.SensitivityTable.from_dict(
        {**table.to_dict(), "grad_cosine": [[1.0, one_up] for _ in table.layers]}
    )
    assert all(noisy.distance(layer, "bf16") == 0.0 for layer in noisy.layers)
    assert noisy.matrix("grad_distance") == [[0.0, 0.0] for _ in noisy.layers]


def test_entry_is_the_typed_accessor_of_one_layer_at_one_precision():
    from autoprec.sensitivities.grade import Sensitivity, SensitivityTable

    table = SensitivityTable(
        method="sweep", model="m", fingerprint="f", data_key="d", layers=("a", "b"),
        precisions=("fp32", "bf16"), loss_delta=((0.0, 0.25), (0.0, float("nan"))),
        grad_cosine=((1.0, 0.5), (1.0, 0.75)), reference_loss=1.0, wall_time_s=0.0, settings={},
    )  # fmt: skip
    assert table.entry("a", "bf16") == Sensitivity(0.25, 0.5)
    assert table.entry("a", "bf16").grad_distance == 0.5
    assert table.entry("b", "fp8") is None and table.entry("c", "bf16") is None
    assert table.distance("b", "bf16") == 0.25
    with pytest.raises(KeyError, match="'c' at bf16"):
        table.distance("c", "bf16")
    assert SensitivityTable.from_dict(table.to_dict()) == table


def make_deep_spec() -> Spec:
    torch.manual_seed(0)
    layers = [nn.Flatten(), nn.Linear(64, 32)]
    for _ in range(3):
        layers += [nn.ReLU(), nn.Linear(32, 32)]
    return Spec(nn.Sequential(*layers, nn.ReLU(), nn.Linear(32, 10)))  # 5 tunable layers


def test_auto_with_room_for_the_sweep_is_the_sweep():
    """The default results of a small model do not change: auto sweeps when the sweep fits."""
    plans = []
    args = (make_spec(), Data(), ["fp32", "bf16", "fp8"])
    auto = sensitivity(*args, method="auto", time_budget_s=1e6, on_plan=plans.append, cache=False)
    sweep = sensitivity(*args, method="sweep", cache=False)
    assert auto.method == "sweep" and auto.grad_cosine == sweep.grad_cosine
    assert auto.loss_delta == sweep.loss_delta and all(map(auto.is_measured, auto.layers))
    assert [p.method for p in plans] == ["sweep"] and "budget" in auto.note


def test_a_tiny_budget_takes_the_estimate():
    stages = []
    table = sensitivity(
        make_spec(), Data(), method="auto", time_budget_s=1e-6, cache=False,
        progress=lambda stage, done, total: stages.append((stage.split(" (")[0], done, total)),
    )  # fmt: skip
    taylor = sensitivity(make_spec(), Data(), method="taylor", cache=False, train_steps=1)
    assert table.method == "taylor" and table.grad_cosine == taylor.grad_cosine
    assert "warm-up (1 of 30 steps, to fit the budget)" in table.note  # the warm-up is cut too
    assert not any(map(table.is_measured, table.layers)) and table.measured == ()
    assert stages[0][0] == "fp32 warm-up" and stages[-1] == ("Taylor estimate", 8, 8)


def test_focused_sweeps_some_layers_and_interpolates_the_others():
    spec, data = make_deep_spec(), Data()
    formats = ["fp32", "bf16", "fp8"]
    focused = sensitivity(spec, data, formats, method="focused", time_budget_s=1e-6, cache=False)
    sweep = sensitivity(spec, data, formats, method="sweep", cache=False, train_steps=1)
    assert focused.method == "focused" and focused.measured == (True, False, False, False, True)
    assert [focused.is_measured(n) for n in focused.layers] == list(focused.measured)
    for i in (0, 4):  # the swept rows are the sweep's
        assert focused.grad_cosine[i] == sweep.grad_cosine[i]
    d = np.array(focused.matrix())
    for j in (1, 2):  # the others lie between them, geometrically
        assert np.allclose(np.log(d[:, j]), np.linspace(np.log(d[0, j]), np.log(d[4, j]), 5))
    assert "focused sweep of 2 of 5 layers" in focused.note
    assert grade.SensitivityTable.from_dict(focused.to_dict()) == focused


def test_auto_reads_a_cached_sweep(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOPREC_CACHE_DIR", str(tmp_path))
    sweep = sensitivity(make_spec(), Data(), method="sweep", train_steps=5)
    monkeypatch.setattr(measure, "loss_and_grad", lambda *a: pytest.fail("recomputed"))
    assert sensitivity(make_spec(), Data(), method="auto", train_steps=5) == sweep


@pytest.mark.parametrize("budget", [0, -1.0, float("nan")])
def test_a_budget_must_be_positive(budget):
    with pytest.raises(ValueError, match="positive number of seconds"):
        sensitivity(make_spec(), Data(), method="auto", time_budget_s=budget)
