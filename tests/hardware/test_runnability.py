"""The one check of whether precisions run on a target (``runnability.unrunnable``): the
evaluator's costing, ``check_runnable`` and the runtime's native mode all answer with it."""

from __future__ import annotations

import pytest
from torch import nn

from autoprec.graph import analyze
from autoprec.hardware import get_device
from autoprec.hardware.runnability import (
    LayerShape,
    NotRunnableError,
    check_runnable,
    shapes_of,
    unrunnable,
)
from autoprec.models import load_model
from autoprec.precision import Precision
from autoprec.runtime.native import check_native


@pytest.fixture(scope="module")
def shapes():
    return shapes_of(analyze(load_model("tinycnn"), 2))


def test_a_conv_at_fp8_is_unrunnable_natively_but_not_in_emulate_mode(shapes):
    h100 = get_device("h100-sxm")
    precisions = {"conv1": "fp8", "fc1": "bf16", "fc2": "bf16"}
    bad = unrunnable(precisions, h100, shapes)
    assert list(bad) == ["conv1"] and "convolution" in bad["conv1"].reason
    assert unrunnable(precisions, h100, shapes, mode="emulate") == {}


def test_a_layer_without_a_shape_is_judged_by_the_targets_formats(shapes):
    a100 = get_device("a100-80gb-sxm")  # no fp8 tensor cores
    bad = unrunnable({"elsewhere": "fp8", "other": "bf16"}, a100, shapes)
    assert list(bad) == ["elsewhere"]
    assert bad["elsewhere"].reason == f"{a100.name} has no fp8 tensor cores"


def test_check_runnable_and_native_mode_give_the_same_answer():
    h100 = get_device("h100-sxm")
    table = analyze(load_model("tinycnn"), 2)
    with pytest.raises(NotRunnableError) as by_table:  # a layer not in the table: unchecked
        check_runnable(table, {"conv1": "fp8", "not-a-layer": "fp8"}, h100)
    reason = unrunnable({"conv1": "fp8"}, h100, shapes_of(table))["conv1"].reason
    assert by_table.value.layers == {"conv1": f"fp8: {reason}"}
    conv = nn.Conv2d(1, 16, 3)
    with pytest.raises(NotRunnableError) as by_module:
        check_native({"conv1": (conv, Precision.FP8)}, h100)
    assert by_module.value.layers == by_table.value.layers
    assert LayerShape.of_module(conv) == LayerShape("conv")
    assert LayerShape.of_module(nn.Linear(32, 16)) == LayerShape("linear", (32, 16))
