"""The per-layer table (issue 37): each unique layer of the production model timed alone with
its casts on this CPU, once per device and software version, kept on disk."""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch
from torch import nn

from autoprec.cache import CacheNote
from autoprec.models import ModelSpec, load_model
from autoprec.timing import LayerTimings, TimingStore, software, unique_layers


class Twins(nn.Module):
    """Two Linears of one shape (one site), a third of another, and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(32, 32)
        self.b = nn.Linear(32, 32)
        self.c = nn.Linear(32, 48)
        self.head = nn.Linear(48, 4)

    def forward(self, x):
        return self.head(torch.relu(self.c(self.b(torch.relu(self.a(x))))))


@pytest.fixture
def twins():
    return ModelSpec("twins", Twins(), (32,), "image-classification", 4)


def test_unique_layers_are_shared_by_shape_at_the_production_batch(twins):
    sites = unique_layers(twins, batch_size=64)
    assert [s.names for s in sites] == [("a", "b"), ("c",), ("head",)]
    assert sites[0].inputs == (((64, 32), "float32"),) and sites[0].output == (64, 32)
    assert sites[2].output == (64, 4)
    # shapes come from the meta device: the spec's module is still on the CPU, untouched
    assert next(twins.module.parameters()).device.type == "cpu"


def test_convolutions_get_their_input_shapes_at_the_batch():
    spec = load_model("tinycnn", num_classes=10)
    sites = unique_layers(spec, batch_size=5)
    assert [s.names[0] for s in sites] == ["conv1", "conv2", "fc1", "fc2"]
    assert sites[1].inputs[0][0] == (5, 16, 8, 8)


def test_each_layer_is_timed_once_and_kept(twins, tmp_path):
    table = LayerTimings(twins, 16, "cpu", store=TimingStore("cpu", folder=tmp_path))
    taken = table.measure({n: ["bf16"] for n in ("a", "b", "c", "head")})
    assert taken == 6  # 3 sites x (fp32, bf16): a and b are one
    for name in ("a", "b", "c", "head"):
        assert table.alone(name, "fp32") > 0 and table.alone(name, "bf16") > 0
        assert table.cast_in(name, "fp32") == 0 and table.cast_out(name, "fp32") == 0
        assert table.cast_in(name, "bf16") > 0 and table.cast_out(name, "bf16") > 0
    assert table.entry("b", "bf16") == table.entry("a", "bf16")
    # a second table on the same machine measures nothing: the store has every one
    again = LayerTimings(twins, 16, "cpu", store=TimingStore("cpu", folder=tmp_path))
    assert again.measure({n: ["bf16"] for n in ("a", "c", "head")}) == 0
    assert again.alone("c", "bf16") == table.alone("c", "bf16")
    # another batch is another shape: measured anew
    other = LayerTimings(twins, 8, "cpu", store=TimingStore("cpu", folder=tmp_path))
    assert other.measure({"a": ["bf16"]}) == 2


def test_a_layer_that_cannot_run_alone_is_kept_as_an_error(twins, tmp_path):
    table = LayerTimings(twins, 16, "cpu", store=TimingStore("cpu", folder=tmp_path))
    table.measure({"head": ["nvfp4"]})  # torchao's NVFP4 kernels need CUDA
    entry = table.entry("head", "nvfp4")
    assert "error" in entry and "\n" not in entry["error"]
    assert math.isnan(table.alone("head", "nvfp4")) and table.alone("head", "fp32") > 0


def test_the_store_is_per_software_and_survives_damage(tmp_path):
    store = TimingStore("cpu", folder=tmp_path)
    assert store.software == software("cpu")
    assert store.software["torch"] == str(torch.__version__)
    store.put("k", {"alone_s": 1.0})
    assert TimingStore("cpu", folder=tmp_path).get("k") == {"alone_s": 1.0}
    data = json.loads(store.path.read_text())
    assert data["software"]["threads"] == torch.get_num_threads()
    # another thread count is another software: another file
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(max(1, threads - 1) if threads > 1 else 2)
        assert TimingStore("cpu", folder=tmp_path).path != store.path
    finally:
        torch.set_num_threads(threads)
    store.path.write_text("{not json")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        damaged = TimingStore("cpu", folder=tmp_path)
        assert damaged.get("k") is None  # discarded with a note, measured again
    assert any(issubclass(w.category, CacheNote) and "damaged" in str(w.message) for w in caught)
    damaged.put("k", {"alone_s": 2.0})
    assert TimingStore("cpu", folder=tmp_path).get("k") == {"alone_s": 2.0}


@pytest.mark.slow
def test_a_compiled_table_times_the_layer_under_torch_compile(twins, tmp_path):
    table = LayerTimings(twins, 16, "cpu", execution="compiled",
                         store=TimingStore("cpu", folder=tmp_path))  # fmt: skip
    assert table.measure({"head": ["bf16"]}) == 2
    assert table.alone("head", "bf16") > 0 and table.cast_in("head", "bf16") > 0
    eager = LayerTimings(twins, 16, "cpu", store=TimingStore("cpu", folder=tmp_path))
    assert eager.entry("head", "bf16") is None  # another program: its own entries
