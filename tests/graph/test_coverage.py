"""Coverage and counting: layers found by their parameters, backward FLOPs per layer, producers.

Oracles: FLOPs of a GEMM are 2*M*K*N; each gradient of a GEMM (input, weight) costs what the
forward costs; ``torch.utils.flop_counter.FlopCounterMode``'s whole-model totals.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from autoprec.cli import main
from autoprec.graph import AnalysisError, LayerTable, analyze
from autoprec.layers import geometry, tunable_layers
from autoprec.models import load_model
from autoprec.models.hf import hf_available


class Spec:
    """The part of a ModelSpec that analyze uses; the loss is the mean of the output."""

    def __init__(self, name: str, module: nn.Module, input_shape: tuple[int, ...]) -> None:
        self.name, self.module, self.input_shape = name, module, input_shape

    def loss(self, output, target):
        output = getattr(output, "logits", output)
        return output.float().mean()

    def example_batch(self, n: int, generator=None):
        return torch.randn(n, *self.input_shape), torch.zeros(n, dtype=torch.long)


def _global_flops(spec: Spec, batch: int) -> tuple[int, int]:
    """(forward, backward) FLOPs of the whole model by FlopCounterMode, on the meta device."""
    model = copy.deepcopy(spec.module).to("meta")
    x, y = (t.to("meta") for t in spec.example_batch(batch))
    with FlopCounterMode(display=False) as counter:
        loss = spec.loss(model(x), y)
        forward = counter.get_total_flops()
        loss.backward()
    return forward, counter.get_total_flops() - forward


class SharedInput(nn.Module):
    """Three identical Linears read the same input (BERT's query/key/value)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.query, self.key, self.value = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        h = self.embed(x)
        return self.query(h) * self.key(h) + self.value(h)


def test_layers_sharing_an_input_each_get_their_own_backward():
    spec = Spec("shared", SharedInput(), (5, 8))
    table = analyze(spec, 3)
    gemm = 2 * 3 * 5 * 16 * 16
    for name in ("query", "key", "value"):
        row = table[name]
        assert row.forward_flops == gemm
        assert row.backward_flops == 2 * gemm  # grad-input + grad-weight
    embed = table["embed"]
    assert embed.backward_flops == embed.forward_flops == 2 * 3 * 5 * 8 * 16  # weight grad only
    # nothing is lost or counted twice: the rows add up to FlopCounterMode's totals
    assert (table.total_forward_flops, sum(r.backward_flops for r in table)) == _global_flops(
        spec, 3
    )
    assert table.uncovered == () and table.uncovered_share == 0.0


@pytest.mark.skipif(
    not hf_available(), reason="transformers not installed (pip install autoprec[hf])"
)
def test_bert_tiny_query_key_value_backward_flops_are_equal():
    table = analyze(load_model("bert-tiny", seq_len=16), 2)
    block = "bert.encoder.layer.0.attention.self"
    rows = [table[f"{block}.{n}"] for n in ("query", "key", "value")]
    assert len({r.backward_flops for r in rows}) == 1  # were 2x, 4x and 6x their forward
    assert rows[0].backward_flops == 2 * rows[0].forward_flops == 2 * (2 * 2 * 16 * 128 * 128)
    # the attention scores and weighted values are matmuls of two activations: left out, named
    assert len(table.uncovered) == 1 and "two activations" in table.uncovered[0][0]
    assert table.uncovered_flops == 2 * 2 * (2 * 2 * 16 * 16 * 64) * 2  # 2 layers, QK^T and PV


class Functional(nn.Module):
    """Weights used outside their modules' forward, as torchvision's Swin does."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)
        self.proj = nn.Linear(8, 8, bias=False)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        q, k, v = F.linear(x, self.qkv.weight, self.qkv.bias).chunk(3, dim=-1)
        attn = (q @ k.transpose(-2, -1)).softmax(-1) @ v  # no weight: not a layer
        h = attn @ self.proj.weight.t()  # through a view of the weight
        return self.head(h + x)


def test_functionally_used_weights_are_layers_of_kind_matmul():
    spec = Spec("functional", Functional(), (6, 8))
    table = analyze(spec, 2)
    assert table.names == ["qkv", "proj", "head"]
    qkv, proj, head = table["qkv"], table["proj"], table["head"]
    assert (qkv.kind, proj.kind, head.kind) == ("matmul", "matmul", "linear")
    assert qkv.forward_flops == 2 * 2 * 6 * 8 * 24 and qkv.calls == 1
    assert qkv.backward_flops == qkv.forward_flops  # model input: weight gradient only
    assert proj.forward_flops == 2 * 2 * 6 * 8 * 8 and proj.backward_flops == 2 * proj.forward_flops
    assert qkv.input_bytes == 2 * 6 * 8 * 4 and qkv.output_bytes == 2 * 6 * 24 * 4
    assert table.uncovered == (
        (
            "matmuls of two activations (attention scores and values): no weight",
            2 * 2 * 6 * 6 * 8 * 2,
        ),
    )
    assert table.total_forward_flops == _global_flops(spec, 2)[0]
    assert table.uncovered_share == pytest.approx(table.uncovered_flops / table.total_forward_flops)
    # producers: proj reads attention over qkv's output; head reads proj and the model input
    assert qkv.sources == ("",) and proj.sources == ("qkv",)
    assert head.sources == ("", "proj")


class RawParameter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.projection = nn.Parameter(torch.randn(8, 4))  # CLIP-style: not a module

    def forward(self, x):
        return self.fc(x) @ self.projection


def test_parameter_of_a_non_tunable_module_is_named_as_left_out():
    table = analyze(Spec("raw", RawParameter(), (8,)), 2)
    assert table.names == ["fc"]
    ((reason, flops),) = table.uncovered
    assert "RawParameter.projection" in reason and flops == 2 * 2 * 8 * 4


class Conv1D(nn.Module):
    """transformers.pytorch_utils.Conv1D, copied: weight (in, out), forward = addmm."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.02)
        self.bias = nn.Parameter(torch.zeros(nf))

    def forward(self, x):
        size_out = x.size()[:-1] + (self.nf,)
        x = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return x.view(size_out)


def test_conv1d_is_a_tunable_matmul_layer():
    model = nn.Sequential(Conv1D(24, 8), nn.GELU(), Conv1D(8, 24))
    assert [name for name, _ in tunable_layers(model)] == ["0", "2"]
    assert geometry(model[0])[:2] == (8, 24)
    table = analyze(Spec("conv1d", model, (5, 8)), 2)
    first, second = table["0"], table["2"]
    assert (first.type, first.kind, first.fan_in, first.fan_out) == ("Conv1D", "matmul", 8, 24)
    assert first.forward_flops == 2 * 10 * 8 * 24 and first.backward_flops == first.forward_flops
    assert second.backward_flops == 2 * second.forward_flops
    assert first.default_precision == "bf16" and second.sources == ("0",)


@pytest.mark.skipif(
    not hf_available(), reason="transformers not installed (pip install autoprec[hf])"
)
def test_hugging_face_gpt2_with_conv1d_runs_on_the_cpu_when_meta_cannot():
    import transformers

    config = transformers.GPT2Config(
        vocab_size=100, n_positions=32, n_embd=64, n_layer=2, n_head=2, num_labels=3
    )
    config.pad_token_id = config.bos_token_id = config.eos_token_id = 0
    model = transformers.GPT2ForSequenceClassification(config)

    class Tokens(Spec):
        def example_batch(self, n, generator=None):
            return torch.randint(1, 100, (n, 16)), torch.zeros(n, dtype=torch.long)

    table = analyze(Tokens("gpt2", model, (16,)), 2)
    # GPT-2 asks Tensor.item() whether the ids hold padding: that op cannot run on meta
    assert "_local_scalar_dense" in table.meta_failure
    projections = [r for r in table if r.type == "Conv1D"]
    assert len(projections) == 8 and {r.kind for r in projections} == {"matmul"}
    assert table.names[-1] == "score" and table["score"].kind == "linear"
    c_attn = table["transformer.h.0.attn.c_attn"]
    assert (
        c_attn.forward_flops == 2 * 32 * 64 * 192 and c_attn.backward_flops == 2 * 2 * 32 * 64 * 192
    )
    assert c_attn.sources == ("",)
    assert table["transformer.h.0.attn.c_proj"].sources == ("transformer.h.0.attn.c_attn",)
    with torch.device("meta"):  # weights on meta too: nothing to run for real, say why
        meta_model = transformers.GPT2ForSequenceClassification(config)
    with pytest.raises(AnalysisError, match="_local_scalar_dense"):
        analyze(Tokens("gpt2", meta_model, (16,)), 2)


def test_resnet18_sources():
    table = analyze(load_model("resnet18", image_size=32), 2)
    sources = {r.name: r.sources for r in table}
    assert sources["conv1"] == ("",)
    assert sources["layer1.0.conv1"] == ("conv1",)
    assert sources["layer1.0.conv2"] == ("layer1.0.conv1",)
    assert sources["layer1.1.conv1"] == ("conv1", "layer1.0.conv2")  # the residual add
    stage1 = ("conv1", "layer1.0.conv2", "layer1.1.conv2")
    assert sources["layer2.0.conv1"] == sources["layer2.0.downsample.0"] == stage1
    assert sources["layer2.1.conv1"] == ("layer2.0.conv2", "layer2.0.downsample.0")
    assert sources["fc"] == ("layer4.0.conv2", "layer4.0.downsample.0", "layer4.1.conv2")
    assert {r.kind for r in table} == {"conv", "linear"} and table["fc"].kind == "linear"


def test_tinytransformer_rows():
    table = analyze(load_model("tinytransformer"), 4)
    rows = {r.name: r for r in table}
    assert [r.kind for r in table] == ["attention", "linear", "linear"] * 2 + ["linear"]
    assert rows["layers.0.self_attn"].sources == ("",)  # token + position embeddings
    assert rows["layers.0.linear1"].sources == ("", "layers.0.self_attn")  # x + attn(x)
    assert rows["layers.0.linear2"].sources == ("layers.0.linear1",)
    assert rows["layers.1.self_attn"].sources == ("", "layers.0.self_attn", "layers.0.linear2")
    for row in table:  # attention scores belong to nn.MultiheadAttention: nothing left out
        assert row.backward_flops == 2 * row.forward_flops
    assert table.uncovered == ()


def test_swin_t_lists_all_53_layers(capsys):
    spec = load_model("swin_t", image_size=32)
    convs_and_linears = sum(isinstance(m, (nn.Conv2d, nn.Linear)) for m in spec.module.modules())
    assert convs_and_linears == 53
    assert main(["analyze", "--model", "swin_t", "--image-size", "32", "--no-sensitivity"]) == 0
    out = capsys.readouterr().out
    assert "swin_t: 53 tunable layers" in out
    assert "left out of the tunable layers:" in out and "two activations" in out
    table = analyze(spec, 1)
    assert len(table) == 53
    assert sum(r.kind == "matmul" for r in table) == 24  # qkv and proj of 12 blocks
    assert 0 < table.uncovered_share < 0.1


def test_new_fields_round_trip_through_json():
    table = analyze(Spec("functional", Functional(), (6, 8)), 2)
    doc = json.loads(table.to_json())
    assert doc["uncovered_flops"] == table.uncovered_flops
    assert LayerTable.from_dict(doc) == table
    old = dict(doc, layers=[{k: v for k, v in d.items() if k != "sources"} for d in doc["layers"]])
    del old["uncovered"]  # a table written before these fields reads with their defaults
    assert (
        LayerTable.from_dict(old).rows[0].sources == ()
        and LayerTable.from_dict(old).uncovered == ()
    )


class ReadsAValue(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        scale = float(x.abs().max().item()) or 1.0  # data-dependent: no meta kernel
        return self.fc(x / scale)


def test_a_forward_that_reads_values_runs_on_the_cpu():
    table = analyze(Spec("reads", ReadsAValue(), (4,)), 3)
    assert table.names == ["fc"] and table["fc"].forward_flops == 2 * 3 * 4 * 4
    assert table.meta_failure.startswith("aten._local_scalar_dense")
