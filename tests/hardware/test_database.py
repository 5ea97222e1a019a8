"""The accelerator database: figures, sources, lookups, detection and a broken file."""

from __future__ import annotations

import math
import types
import warnings

import pytest
import torch
import yaml

from autoprec.hardware import (
    DeviceDatabaseError,
    DeviceSpec,
    PreferredMode,
    UnknownDeviceError,
    database,
    detect,
    get_device,
    list_devices,
    supported_precisions,
)
from autoprec.precision import PRECISION_NAMES, Precision


@pytest.fixture
def fresh_database():
    """Drop the cached database before and after the test (so patched loaders do not leak)."""
    database._database.cache_clear()
    yield
    database._database.cache_clear()


def test_database_loads_with_twenty_gpus_and_cpu():
    devices = list_devices()
    names = [d.name for d in devices]
    assert len(set(names)) == len(names)
    assert "cpu" in names
    assert len([d for d in devices if d.name != "cpu"]) >= 20
    for name in ["v100-sxm2-32gb", "a100-40gb-sxm", "h100-sxm", "h200", "b200", "mi250x"]:
        assert name in names


def test_every_figure_has_a_non_empty_source():
    for spec in list_devices():
        figures = ["memory_bandwidth_gbs", "memory_gb"]
        figures += [f"peak_tflops.{p}" for p in spec.peak_tflops]
        figures += [f"matmul_tflops.{p}" for p in spec.matmul_tflops]
        for key in figures:
            assert spec.sources[key].strip(), f"{spec.name}: {key} has no source"
        assert spec.memory_bandwidth_gbs > 0 and spec.memory_gb > 0
        assert all(rate > 0 for rate in spec.peak_tflops.values())


@pytest.mark.parametrize(
    ("device", "precision", "tflops"),
    [
        ("h100-sxm", "bf16", 989.0),
        ("h100-sxm", "fp8", 1979.0),
        ("a100-40gb-sxm", "fp32", 19.5),
        ("a100-40gb-sxm", "tf32", 156.0),
        ("a100-40gb-sxm", "bf16", 312.0),
        ("a100-80gb-sxm", "bf16", 312.0),
    ],
)
def test_dense_anchor_rates_within_two_percent(device, precision, tflops):
    assert get_device(device).peak_flops(precision) == pytest.approx(tflops * 1e12, rel=0.02)


def test_sparse_figures_were_halved():
    # Hopper/Ada datasheets print sparse tensor rates; the database holds half of them.
    h100 = get_device("h100-sxm")
    assert h100.peak_tflops["fp8"] == pytest.approx(2 * h100.peak_tflops["bf16"], rel=0.01)
    assert "sparse/2" in h100.sources["peak_tflops.bf16"]
    assert get_device("l4").peak_tflops["fp8"] == pytest.approx(485 / 2)


@pytest.mark.parametrize("name", ["v100-sxm2-32gb", "t4"])
def test_volta_and_turing_have_no_bf16_tf32_or_fp8(name):
    spec = get_device(name)
    assert not spec.supports("bf16") and not spec.supports("tf32") and not spec.supports("fp8")
    assert spec.preferred == PreferredMode(low="fp16", wide="fp32", loss_scaling=True)
    with pytest.raises(ValueError, match="does not support bf16"):
        spec.peak_flops("bf16")


def test_supported_precisions_are_consistent():
    for spec in list_devices():
        assert spec.supports("fp32") and spec.supports(Precision.FP32)
        assert set(spec.supported_precisions) <= set(PRECISION_NAMES)
        assert set(spec.peak_tflops) <= set(spec.supported_precisions)
        assert spec.supported_precisions == tuple(
            p for p in PRECISION_NAMES if p in spec.supported_precisions
        )
        assert spec.preferred.low in spec.supported_precisions
        assert spec.preferred.wide in spec.supported_precisions
    fp8 = {d.name for d in list_devices() if d.supports("fp8")}
    assert {"h100-sxm", "h200", "l4", "l40s", "b200", "mi300x", "gaudi2"} <= fp8
    assert not fp8 & {"a100-80gb-sxm", "a10g", "mi250x", "mi100", "v100-sxm2-32gb"}


def test_preferred_modes():
    assert get_device("a100-40gb-pcie").preferred == PreferredMode("bf16", "tf32", False)
    assert get_device("h100-sxm").preferred == PreferredMode("bf16", "tf32", False)
    assert get_device("mi250x").preferred == PreferredMode("fp16", "fp32", True)


def test_lookup_by_alias_full_name_and_slug_ignores_case_and_punctuation():
    assert get_device("NVIDIA A100-SXM4-80GB").name == "a100-80gb-sxm"
    assert get_device("nvidia a100 sxm4 80gb").name == "a100-80gb-sxm"
    assert get_device("NVIDIA A100 80GB PCIe").name == "a100-80gb-pcie"
    assert get_device("Tesla V100-SXM2-32GB").name == "v100-sxm2-32gb"
    assert get_device("NVIDIA H200").name == "h200"
    assert get_device("AMD Instinct MI250X").name == "mi250x"
    assert get_device("H100_SXM").name == "h100-sxm"
    assert get_device("NVIDIA H100 SXM5 80GB").name == "h100-sxm"
    spec = get_device("l40s")
    assert get_device(spec) is spec
    assert supported_precisions("V100-SXM2-32GB") == ("fp32", "fp16")
    assert supported_precisions(get_device("a100-80gb-sxm")) == ("fp32", "tf32", "bf16", "fp16")


def test_unknown_names_get_suggestions():
    with pytest.raises(UnknownDeviceError, match="did you mean") as info:
        get_device("h100")
    assert info.value.suggestions[:2] == ("h100-sxm", "h100-pcie")
    assert isinstance(info.value, ValueError)
    with pytest.raises(UnknownDeviceError) as info:
        get_device("a100 40gb sxm4x")
    assert "a100-40gb-sxm" in info.value.suggestions
    with pytest.raises(UnknownDeviceError, match="list_devices"):
        get_device("zzzz-qqqq")


def test_unrated_precision_raises_a_clear_error():
    gaudi = get_device("gaudi2")
    assert gaudi.supports("fp32")
    with pytest.raises(ValueError, match="no published dense rate for fp32"):
        gaudi.peak_flops("fp32")
    with pytest.raises(ValueError, match="unknown precision"):
        gaudi.peak_flops("bf8")


def test_specs_are_frozen_and_hashable():
    spec = get_device("t4")
    with pytest.raises(AttributeError):
        spec.memory_gb = 1.0
    with pytest.raises(TypeError):
        spec.peak_tflops["fp32"] = 1.0
    assert {spec: 1}[get_device("Tesla T4")] == 1


def test_cpu_figures_are_estimated_locally():
    cpu = get_device("cpu")
    assert cpu.peak_tflops["fp32"] > 0 and cpu.memory_gb > 0
    for key in ("peak_tflops.fp32", "memory_gb", "memory_bandwidth_gbs"):
        assert cpu.sources[key].startswith("estimated")


def test_detect_without_cuda_is_the_cpu_entry(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert detect().name == "cpu"


def test_detect_matches_the_reported_gpu_name(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert detect().name == "h100-sxm"


def _detect_unknown_gpu(monkeypatch, name: str, major: int, minor: int):
    """detect() on a CUDA GPU the database lacks, of this compute capability (it warns)."""
    props = types.SimpleNamespace(total_memory=48 * 10**9, major=major, minor=minor)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: name)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: props)
    monkeypatch.setattr(torch.version, "hip", None)
    with pytest.warns(UserWarning, match="not in autoprec's device database"):
        return detect()


def test_detect_unknown_gpu_warns_and_builds_a_generic_entry(monkeypatch):
    spec = _detect_unknown_gpu(monkeypatch, "NVIDIA RTX A6000", 8, 6)
    assert spec.name == "unknown-gpu" and spec.full_name == "NVIDIA RTX A6000"
    assert spec.memory_gb == pytest.approx(48.0)
    assert spec.supported_precisions == ("fp32", "tf32", "bf16", "fp16")
    assert math.isnan(spec.memory_bandwidth_gbs) and dict(spec.peak_tflops) == {}
    with pytest.raises(ValueError, match="no published dense rate"):
        spec.peak_flops("bf16")


@pytest.mark.parametrize(("major", "blackwell"), [(9, False), (10, True), (12, True)])
def test_an_unknown_gpu_derives_block_formats_from_its_capability(monkeypatch, major, blackwell):
    """Blackwell (10.0 on) reads MX block scales and has FP4 tensor cores: mxfp8 and nvfp4;
    block-scaled fp8 is an fp8 GEMM (8.9 on)."""
    spec = _detect_unknown_gpu(monkeypatch, "NVIDIA Future GPU", major, 0)
    assert spec.supports("nvfp4") is blackwell and spec.supports("mxfp8") is blackwell
    assert spec.supports("fp8_block")


def _entry(**changes):
    entry = {
        "name": "test-gpu",
        "vendor": "nvidia",
        "full_name": "Test GPU",
        "aliases": ["Test GPU 1"],
        "supported_precisions": ["fp32", "bf16"],
        "peak_tflops": {"fp32": 10.0, "bf16": 100.0},
        "memory_bandwidth_gbs": 1000.0,
        "memory_gb": 16.0,
        "preferred": {"low": "bf16", "wide": "fp32", "loss_scaling": False},
        "sources": {
            "peak_tflops.fp32": "datasheet",
            "peak_tflops.bf16": "datasheet, dense = sparse/2",
            "memory_bandwidth_gbs": "datasheet",
            "memory_gb": "datasheet",
        },
    }
    entry.update(changes)
    return entry


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        (_entry(peak_tflops={"fp32": 10.0, "fp8": 1.0}), "fp8, not in supported_precisions"),
        (_entry(supported_precisions=["fp32", "bf8"]), "unknown precision 'bf8'"),
        (_entry(supported_precisions=["bf16"]), "must hold fp32"),
        (_entry(sources={"memory_gb": "x"}), "has no source"),
        (_entry(memory_gb=-1), "memory_gb must be > 0"),
        (_entry(memory_bandwidth_gbs="fast"), "memory_bandwidth_gbs must be > 0"),
        (_entry(preferred={"low": "fp8", "wide": "fp32", "loss_scaling": False}), "bf16 or fp16"),
        (_entry(name="Test GPU"), "bad slug"),
        (_entry(colour="green"), "unknown fields \\['colour'\\]"),
        (_entry(matmul_tflops={"bf16": 90.0}), "matmul_tflops.bf16 has no source"),
        (_entry(matmul_tflops={"bf16": 120.0}), "exceeds peak_tflops.bf16 = 100"),
        (_entry(matmul_tflops={"fp16": 50.0}), "fp16, which has no peak_tflops"),
        (_entry(matmul_tflops=[1.0]), "matmul_tflops must be a mapping"),
    ],
)
def test_broken_yaml_names_the_entry_and_the_problem(
    monkeypatch, tmp_path, fresh_database, entry, message
):
    path = tmp_path / "devices.yaml"
    path.write_text(yaml.safe_dump({"version": 1, "devices": [_entry(name="ok-gpu"), entry]}))
    monkeypatch.setattr(database, "_database_text", path.read_text)
    with pytest.raises(DeviceDatabaseError, match=message) as info:
        list_devices()
    assert "entry 1" in str(info.value)
    assert isinstance(info.value, ValueError)


def test_broken_yaml_duplicate_names_and_bad_top_level(monkeypatch, fresh_database):
    data = {"devices": [_entry(), _entry(name="other-gpu")]}  # both claim "Test GPU"
    monkeypatch.setattr(database, "_database_text", lambda: yaml.safe_dump(data))
    with pytest.raises(DeviceDatabaseError, match="also matches 'test-gpu'"):
        get_device("test-gpu")
    database._database.cache_clear()
    monkeypatch.setattr(database, "_database_text", lambda: "devices: [unclosed")
    with pytest.raises(DeviceDatabaseError, match="not valid YAML"):
        list_devices()
    database._database.cache_clear()
    monkeypatch.setattr(database, "_database_text", lambda: "- just a list")
    with pytest.raises(DeviceDatabaseError, match="'devices' list"):
        list_devices()


def test_a_valid_custom_database_loads(monkeypatch, fresh_database):
    data = {"devices": [_entry()]}
    monkeypatch.setattr(database, "_database_text", lambda: yaml.safe_dump(data))
    spec = get_device("TEST GPU 1")
    assert isinstance(spec, DeviceSpec) and spec.peak_flops("bf16") == 100e12


def test_published_matmul_rates_are_below_peak_and_quoted_in_their_source():
    measured = [d for d in list_devices() if d.matmul_tflops]
    assert {"v100-sxm2-32gb", "h100-sxm"} <= {d.name for d in measured}
    for spec in measured:
        for p, tflops in spec.matmul_tflops.items():
            assert 0 < tflops <= spec.peak_tflops[p]
            assert f"{tflops:g} TFLOPS" in spec.sources[f"matmul_tflops.{p}"]
