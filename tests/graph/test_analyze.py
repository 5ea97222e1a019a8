"""Layer analysis: counts, FLOPs against torchvision's documented figure, JSON export."""

from __future__ import annotations

import json

import pytest
import torch
import torchvision
from torch import nn

from autoprec.graph import FLOP_UNIT, analyze


class Spec:
    """The part of a ModelSpec that analyze uses."""

    def __init__(self, name: str, module: nn.Module, input_shape: tuple[int, ...]) -> None:
        self.name, self.module, self.input_shape = name, module, input_shape

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(output, target)

    def example_batch(self, n: int, generator=None):
        return torch.randn(n, *self.input_shape), torch.randint(0, 10, (n,))


def test_resnet50_layers_and_flops_match_torchvision():
    model = torchvision.models.resnet50(weights=None)
    table = analyze(Spec("resnet50", model, (3, 224, 224)), 1)
    convs_and_linears = sum(isinstance(m, (nn.Conv2d, nn.Linear)) for m in model.modules())
    assert len(table) == convs_and_linears == 54
    # torchvision documents 4.09 GMACs for resnet50 at 224x224: 8.18 GFLOPs at 2 per MAC
    assert table.total_forward_flops == pytest.approx(8.18e9, rel=0.03)
    assert "2 per multiply-add" in table.flop_unit == FLOP_UNIT
    assert table.rows[0].name == "conv1" and table.rows[0].first
    assert table.rows[-1].name == "fc" and table.rows[-1].last
    assert [r.index for r in table] == list(range(54))


def test_row_contents_for_a_small_model():
    model = nn.Sequential(
        nn.Conv2d(1, 4, 3, stride=2),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 3 * 3, 10),
    )
    table = analyze(Spec("small", model, (1, 8, 8)), 5)
    conv, fc = table["0"], table["4"]
    assert (conv.type, conv.kernel_size, conv.stride, conv.fan_in, conv.params) == (
        "Conv2d",
        (3, 3),
        (2, 2),
        9,
        4 * 9 + 4,
    )
    # conv: 5 images x 4 channels x 3x3 outputs x 9 MACs x 2
    assert conv.forward_flops == 5 * 4 * 9 * 9 * 2
    assert conv.backward_flops == conv.forward_flops  # weight gradient only: input needs none
    assert fc.forward_flops == 5 * 36 * 10 * 2 and fc.backward_flops == 2 * fc.forward_flops
    assert conv.input_bytes == 5 * 64 * 4 and conv.output_bytes == 5 * 4 * 9 * 4
    assert fc.weight_bytes == 36 * 10 * 4
    assert {r.default_precision for r in table} == {"bf16"}
    assert table.batch_size == 5 and table.input_shape == (1, 8, 8)
    # the user's model is left alone (the analysis runs on a meta-device copy)
    assert next(model.parameters()).device.type == "cpu"


def test_attention_counts_as_one_layer_and_json_round_trips(tmp_path):
    layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, batch_first=True)

    class Tokens(Spec):
        def loss(self, output, target):
            return output.mean()

    table = analyze(Tokens("enc", layer, (5, 16)), 2)
    assert table.names == ["self_attn", "linear1", "linear2"]
    assert table["self_attn"].forward_flops > 0 and table["self_attn"].backward_flops > 0
    path = tmp_path / "layers.json"
    table.to_json(path)
    doc = json.loads(path.read_text())
    assert [d["name"] for d in doc["layers"]] == table.names
    assert doc["flop_unit"] == FLOP_UNIT


def test_grouped_convolution_backward_flops():
    """torch's flop counter ignores groups in convolution_backward; analyze corrects it."""
    model = nn.Sequential(
        nn.Conv2d(8, 8, 3, padding=1),
        nn.Conv2d(8, 8, 3, padding=1, groups=8),  # depthwise
        nn.Conv2d(8, 8, 3, padding=1, groups=2),
    )

    class Images(Spec):
        def loss(self, output, target):
            return output.mean()

    table = analyze(Images("grouped", model, (8, 6, 6)), 2)
    for name in ("1", "2"):
        row = table[name]
        assert row.forward_flops == 2 * 36 * 8 * 9 * (8 // model[int(name)].groups) * 2
        assert row.backward_flops == 2 * row.forward_flops


def test_traffic_of_the_work_between_layers():
    """Bytes read + written by non-matmul ops, charged to the tunable layer running."""
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    table = analyze(Spec("mlp", model, (8,)), 2)
    first, last = table["0"], table["2"]
    assert (first.other_bytes_forward, first.other_ops_forward) == (2 * 2 * 8 * 4, 1)  # relu
    assert last.other_ops_forward >= 1  # the loss
    assert first.other_bytes_backward > 0 and last.other_bytes_backward > 0


def test_work_before_the_first_tunable_layer_counts_towards_it():
    model = nn.Sequential(nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    table = analyze(Spec("mlp", model, (8,)), 2)
    relu = 2 * 2 * 8 * 4  # read and write a 2x8 fp32 tensor
    assert (table["1"].other_bytes_forward, table["1"].other_ops_forward) == (2 * relu, 2)
    without = analyze(Spec("mlp", model[1:], (8,)), 2)  # slicing keeps the names
    assert table["3"].other_ops_forward == without["3"].other_ops_forward  # the loss only


def test_cached_table_is_the_same_and_keyed_by_shape(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOPREC_CACHE_DIR", str(tmp_path))
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 10))
    spec = Spec("small", model, (1, 8, 8))
    fresh = analyze(spec, 4, cache=True)
    files = list((tmp_path / "analysis").glob("*.json"))
    assert len(files) == 1
    assert analyze(spec, 4, cache=True) == fresh == analyze(spec, 4)
    assert analyze(spec, 8, cache=True).batch_size == 8  # another batch: another entry
    assert len(list((tmp_path / "analysis").glob("*.json"))) == 2
    files[0].write_text("{not json")  # a damaged entry is recomputed and replaced
    assert analyze(spec, 4, cache=True) == fresh
    assert json.loads(files[0].read_text())["table"]["batch_size"] == 4
