"""The roofline cost model and the hardware default policy."""

from __future__ import annotations

import dataclasses
import json
import pickle
import sys
import time
import types

import pytest

from autoprec.graph import LayerRow, analyze
from autoprec.hardware import (
    CostModel,
    Efficiency,
    StepEstimate,
    default_policy,
    get_device,
    list_devices,
)
from autoprec.hardware.cost import STORAGE_BYTES, CostModelError
from autoprec.hardware.defaults import amp_policy
from autoprec.models import load_model
from autoprec.policy import LossScalingConfig, PrecisionPolicy
from autoprec.precision import Precision

V100 = "v100-sxm2-32gb"
A100 = "a100-40gb-sxm"
H100 = "h100-sxm"


@pytest.fixture(scope="module")
def resnet50():
    return analyze(load_model("resnet50", num_classes=1000, image_size=224), 1)


@pytest.fixture(scope="module")
def mlp():
    return analyze(load_model("mlp"), 4)


def big_linear(batch: int = 8192, features: int = 8192) -> LayerRow:
    """A Linear(features, features) at ``batch`` rows: 2*b*f*f FLOPs forward, twice backward."""
    flops = 2 * batch * features * features
    return LayerRow(
        name="fc",
        type="Linear",
        index=0,
        first=True,
        last=True,
        params=features * features,
        forward_flops=flops,
        backward_flops=2 * flops,
        input_bytes=4 * batch * features,
        weight_bytes=4 * features * features,
        output_bytes=4 * batch * features,
        fan_in=features,
        fan_out=features,
        kernel_size=(),
        stride=(),
        calls=1,
        default_precision="bf16",
        position=0.0,
    )


@pytest.mark.parametrize(
    ("device", "order"),
    [(H100, ["fp8", "bf16", "fp16", "tf32", "fp32"]), (A100, ["bf16", "fp16", "tf32", "fp32"])],
)
def test_lower_precision_never_slower_on_compute_bound_layer(device, order):
    model = CostModel(device, Efficiency())
    costs = [model.layer_cost(big_linear(), p) for p in order]
    assert all(c.bound == "compute" for c in costs)
    totals = [c.forward_s + c.backward_s for c in costs]
    assert totals == sorted(totals)
    # Compute-bound: the time is the FLOPs over the achieved rate (plus 3 kernel launches).
    fp32 = costs[-1]
    expected = 3 * 2 * 8192**3 / (get_device(device).peak_flops("fp32") * 0.7) + 3 * 5e-6
    assert fp32.forward_s + fp32.backward_s == pytest.approx(expected, rel=1e-9)


def test_monotone_even_where_datasheet_rates_tie():
    # a10g lists tf32 = fp32 = 35 TFLOP/s; tf32's lower default efficiency must not make it slower.
    model = CostModel("a10g", Efficiency())
    assert model.rate("tf32") >= model.rate("fp32")
    assert model.rate("bf16") >= model.rate("tf32")


def test_unsupported_precision_raises_naming_device_and_supported(resnet50):
    model = CostModel(A100)
    assert issubclass(CostModelError, ValueError)
    with pytest.raises(ValueError, match=r"a100-40gb-sxm.*fp8.*fp32, tf32, bf16, fp16"):
        model.rate("fp8")
    with pytest.raises(ValueError, match="layer 'conv1'"):
        model.step(resnet50, "fp8")
    with pytest.raises(ValueError, match="unknown precision"):
        model.rate("bf8")


def test_tiny_layer_is_memory_bound(mlp):
    cost = CostModel(H100).layer_cost(mlp.rows[0], "bf16")
    assert cost.bound == "memory"


def test_batch_scaling_is_roughly_linear(resnet50):
    model = CostModel(H100)
    small, large = (model.step(resnet50, "bf16", batch_size=b) for b in (1024, 2048))
    assert 1.9 < large.step_time_s / small.step_time_s < 2.0 + 1e-9
    assert large.memory["activations"] == pytest.approx(2 * small.memory["activations"], rel=1e-6)
    assert large.memory["master_weights"] == small.memory["master_weights"]


def test_resnet50_step_is_fast_and_plausible(resnet50):
    model = CostModel(H100)
    start = time.perf_counter()
    estimate = model.step(resnet50, "bf16", batch_size=256)
    elapsed = time.perf_counter() - start
    assert elapsed < 1.0
    assert isinstance(estimate, StepEstimate)
    assert 300 < estimate.throughput < 20000
    assert estimate.throughput == pytest.approx(256 / estimate.step_time_s)
    parts = ("forward_s", "backward_s", "optimizer_s", "cast_s", "other_s", "layout_s")
    assert estimate.step_time_s == pytest.approx(sum(getattr(estimate, k) for k in parts))
    assert len(estimate.layers) == len(resnet50)


def test_memory_breakdown_sums_and_adam_needs_more(resnet50):
    model = CostModel(A100)
    sgd = model.step(resnet50, "bf16", optimizer="sgd", batch_size=64)
    adam = model.step(resnet50, "bf16", optimizer="adam", batch_size=64)
    for est in (sgd, adam):
        assert sum(est.memory.values()) == est.memory_bytes
        assert set(est.memory) == {
            "master_weights",
            "low_precision_weights",
            "gradients",
            "optimizer_state",
            "activations",
        }
    params = sum(r.params for r in resnet50)
    assert sgd.memory["master_weights"] == 4 * params
    assert adam.memory["optimizer_state"] == 2 * sgd.memory["optimizer_state"] == 8 * params
    assert sgd.memory["low_precision_weights"] == 2 * params
    assert adam.memory_bytes > sgd.memory_bytes
    assert adam.optimizer_s > sgd.optimizer_s
    fp32 = model.step(resnet50, "fp32", batch_size=64)
    assert fp32.memory["low_precision_weights"] == 0
    assert fp32.memory["activations"] > sgd.memory["activations"]


def test_bf16_faster_than_fp32_on_a100(resnet50):
    model = CostModel(A100)
    times = {p: model.step(resnet50, p, batch_size=256).step_time_s for p in ("bf16", "fp32")}
    assert times["bf16"] < times["fp32"]
    fp32 = model.step(resnet50, "fp32", batch_size=256)
    assert fp32.cast_s == 0


def test_policy_forms_agree(resnet50):
    model = CostModel(H100)
    by_name = model.step(resnet50, "bf16")
    by_policy = model.step(resnet50, PrecisionPolicy.uniform("bf16"))
    by_map = model.step(resnet50, {name: Precision.BF16 for name in resnet50.names})
    assert by_name == by_policy == by_map
    only_fc = model.step(resnet50, {"fc": "bf16"})  # unnamed layers are fp32
    assert [c.precision for c in only_fc.layers].count("bf16") == 1


def test_bad_arguments_raise(resnet50):
    model = CostModel(H100)
    with pytest.raises(ValueError, match="unknown optimizer 'lion'"):
        model.step(resnet50, "bf16", optimizer="lion")
    with pytest.raises(ValueError, match="batch_size"):
        model.step(resnet50, "bf16", batch_size=0)
    with pytest.raises(ValueError, match="bandwidth"):
        Efficiency(bandwidth=0)
    with pytest.raises(ValueError, match="kernel_overhead_s"):
        Efficiency(kernel_overhead_s=-1.0)
    with pytest.raises(ValueError, match="no known memory bandwidth"):
        CostModel(dataclasses.replace(get_device(A100), memory_bandwidth_gbs=float("nan")))


def test_to_dict_is_json_ready(resnet50):
    doc = CostModel(H100).step(resnet50, "bf16", batch_size=32).to_dict()
    assert {"step_time_s", "throughput", "memory_bytes", "memory", "layers", "device"} <= set(doc)
    assert json.loads(json.dumps(doc)) == doc
    assert doc["layers"][0]["name"] == "conv1"
    estimate = CostModel(H100).step(resnet50, "bf16", batch_size=32)
    assert pickle.loads(pickle.dumps(estimate)) == estimate


def test_efficiency_defaults_and_calibration_hook(monkeypatch):
    eff = Efficiency(compute={"bf16": 0.9})
    assert eff.compute["bf16"] == 0.9 and eff.compute["fp32"] == 0.7
    assert Efficiency.from_dict(eff.to_dict()) == eff
    assert pickle.loads(pickle.dumps(eff)) == eff and hash(eff) == hash(Efficiency(eff.compute))
    calibrated = Efficiency(bandwidth=0.5)
    fake = types.ModuleType("autoprec.hardware.calibration")
    fake.load_efficiency = lambda name: calibrated if name == H100 else None
    monkeypatch.setitem(sys.modules, "autoprec.hardware.calibration", fake)
    assert CostModel(H100).efficiency == calibrated
    assert CostModel(A100).efficiency == Efficiency()
    assert CostModel(H100, Efficiency()).efficiency == Efficiency()


def test_default_policy_a100(resnet50):
    policy = default_policy(resnet50, A100)
    resolved = {name: policy.precision_for(name) for name in resnet50.names}
    assert resolved.pop("conv1") == resolved.pop("fc") == Precision.TF32
    assert set(resolved.values()) == {Precision.BF16}
    assert policy.default == Precision.TF32
    assert policy.loss_scaling is None
    assert policy.target.device == A100 and policy.target.mode == "auto"
    assert policy.provenance["agent"] == "hardware-default"


def test_default_policy_v100(resnet50):
    policy = default_policy(resnet50, V100)
    assert policy.precision_for("conv1") == policy.precision_for("fc") == Precision.FP32
    assert policy.precision_for("layer1.0.conv1") == Precision.FP16
    assert policy.loss_scaling == LossScalingConfig()
    assert CostModel(V100).step(resnet50, policy).step_time_s > 0


def test_amp_policy():
    assert amp_policy(H100).default == Precision.BF16
    assert amp_policy(V100).loss_scaling == LossScalingConfig()
    with pytest.raises(ValueError, match="cannot run fp8"):
        amp_policy(A100, "fp8")


def test_storage_bytes_match_the_format_registry():
    from autoprec.kernels import get_format

    formats = {f for p in Precision for f in (p.forward_format, p.backward_format)}
    assert formats == set(STORAGE_BYTES)
    assert {f: get_format(f).storage_bytes for f in formats} == dict(STORAGE_BYTES)


def conv_row(channels_per_group: int = 256, batch: int = 256, groups: int = 1) -> LayerRow:
    """A 3x3 convolution, 256 -> 256 channels, on 56x56 maps: compute-bound at tensor-core
    rates unless depthwise (one input channel per group)."""
    maps = 4 * batch * 256 * 56 * 56  # fp32 bytes of the input, and of the output
    flops = 2 * batch * 56 * 56 * 256 * channels_per_group * 9
    return LayerRow(
        name="conv",
        type="Conv2d",
        index=0,
        first=True,
        last=True,
        params=256 * channels_per_group * 9,
        forward_flops=flops,
        backward_flops=2 * flops,
        input_bytes=maps,
        weight_bytes=4 * 256 * channels_per_group * 9,
        output_bytes=maps,
        fan_in=channels_per_group * 9,
        fan_out=256 * 9 // groups,
        kernel_size=(3, 3),
        stride=(1, 1),
        calls=1,
        default_precision="bf16",
        position=0.0,
    )


def one_layer(row: LayerRow, batch: int = 256):
    from autoprec.graph import LayerTable

    return LayerTable("one", "sha256:0", batch, (256, 56, 56), (row,), row.forward_flops)


def test_nchw_tensor_core_convolutions_pay_layout_transposes():
    model, row = CostModel(A100, Efficiency()), conv_row()
    nchw = model.step(one_layer(row), "bf16", memory_format="contiguous")
    nhwc = model.step(one_layer(row), "bf16", memory_format="channels_last")
    # input and output read and written twice (forward input, both gradients) at 2 bytes
    moved = 2 * 2 * (row.input_bytes + row.output_bytes) * 0.5
    bandwidth = get_device(A100).memory_bandwidth * 0.8
    assert nhwc.layout_s == 0
    assert nchw.layout_s == pytest.approx(moved / bandwidth + 4 * 5e-6, rel=1e-12)
    assert nchw.step_time_s - nhwc.step_time_s == pytest.approx(nchw.layout_s, rel=1e-9)
    assert nchw.to_dict()["layout_s"] == nchw.layout_s


@pytest.mark.parametrize(
    ("device", "precision", "row"),
    [
        (A100, "fp32", conv_row()),  # CUDA cores read NCHW
        (A100, "bf16", conv_row(channels_per_group=1, groups=256)),  # depthwise
        (A100, "bf16", big_linear()),  # no convolution
        ("mi300x", "bf16", conv_row()),  # the rule is cuDNN's
    ],
)
def test_no_transposes_without_a_tensor_core_convolution_on_nvidia(device, precision, row):
    est = CostModel(device, Efficiency()).step(one_layer(row), precision)
    assert est.layout_s == 0


def test_nchw_falls_back_to_cuda_cores_when_transposes_cost_more():
    # a memory-bound convolution: transposes would cost more than fp32 arithmetic saves
    row = dataclasses.replace(conv_row(), forward_flops=10**9, backward_flops=2 * 10**9)
    model = CostModel(A100, Efficiency())
    est = model.step(one_layer(row), "bf16")
    native = model.layer_cost(row, "bf16", rate=model.rate("fp32"))
    assert est.layout_s == 0 and est.layers[0] == native


def test_unknown_memory_format_raises():
    with pytest.raises(CostModelError, match="unknown memory format 'nhwc'.*channels_last"):
        CostModel(A100).step(one_layer(conv_row()), "bf16", memory_format="nhwc")


def test_published_matmul_rates_set_the_default_efficiency():
    v100, h100 = get_device(V100), get_device(H100)
    eff = CostModel(V100).efficiency.compute
    assert eff["fp32"] == pytest.approx(13.85 / 15.7) and eff["fp16"] == pytest.approx(95.73 / 125)
    assert eff["fp32"] == v100.matmul_tflops["fp32"] / v100.peak_tflops["fp32"]
    # fp8 is not measured: its default, scaled as the nearest wider measured format (fp16) is
    fp16 = h100.matmul_tflops["fp16"] / h100.peak_tflops["fp16"]
    assert CostModel(H100).efficiency.compute["fp8"] == pytest.approx(0.5 * fp16 / 0.6)
    assert CostModel("a100-80gb-sxm").efficiency == Efficiency()  # nothing published


@pytest.mark.parametrize("device", [d.name for d in list_devices() if d.peak_tflops])
def test_every_device_is_monotone_with_its_default_efficiency(device):
    spec, model = get_device(device), CostModel(device)
    order = [p for p in ("fp8", "fp16", "bf16", "tf32", "fp32") if p in spec.peak_tflops]
    totals = [sum(dataclasses.astuple(model.layer_cost(big_linear(), p))[2:4]) for p in order]
    assert totals == sorted(totals)
    # whole steps: an fp8 layer's activations stay in the dtype around it (fp32 without a
    # 16-bit region), so a step of fp8 layers alone is not monotone with the 16-bit formats
    # (policies without loss scaling: its cost is fp16's, not the format's; next test)
    table = one_layer(conv_row())
    uniform = [PrecisionPolicy.uniform(p) for p in order if p != "fp8"]
    steps = [model.step(table, p).step_time_s for p in uniform]
    assert steps == sorted(steps)


def test_loss_scaling_costs_one_pass_over_the_gradients():
    # GradScaler's unscale_: each fp32 gradient read and written once more (8 B/param), priced
    # from the policy's loss_scaling section, or for a layer map when a layer is fp16 (as the
    # search's policies and amp_policy have it): so bf16 wins an fp16/bf16 tie, as measured
    model, table = CostModel(H100), one_layer(big_linear())
    params = table.rows[0].params
    plain = model.step(table, PrecisionPolicy.uniform("fp16")).optimizer_s
    unscale = model.step(table, "fp16").optimizer_s - plain
    assert unscale == pytest.approx(model._memory_s(8 * params, 1))
    assert model.step(table, {"fc": "fp16"}).optimizer_s == pytest.approx(plain + unscale)
    assert model.step(table, amp_policy(H100, "fp16")).optimizer_s == pytest.approx(plain + unscale)
    assert model.step(table, "bf16").optimizer_s == pytest.approx(plain)
    scaled = PrecisionPolicy.uniform("bf16", loss_scaling=LossScalingConfig(kind="static"))
    assert model.step(table, scaled).optimizer_s == pytest.approx(plain + unscale)
    off = PrecisionPolicy.uniform("fp16", loss_scaling=LossScalingConfig(kind="none"))
    assert model.step(table, off).optimizer_s == pytest.approx(plain)
    assert model.step(table, "fp16").step_time_s > model.step(table, "bf16").step_time_s
