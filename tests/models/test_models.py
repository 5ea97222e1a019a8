"""autoprec.models: names to models, their input specs, losses and the ``models`` command."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest
import torch
from torch import nn

from autoprec.cli import main
from autoprec.layers import tunable_layers
from autoprec.models import ModelError, ModelSpec, UnknownModelError, list_models, load_model
from autoprec.models.builtin import TinyTransformer
from autoprec.models.hf import conv1d_to_linear


def _train_step(spec: ModelSpec) -> torch.Tensor:
    x, y = spec.example_batch(4, generator=torch.Generator().manual_seed(0))
    loss = spec.loss(spec.module(x), y)
    loss.backward()
    return loss


# --- built-in models --------------------------------------------------------------------------
def test_tinycnn_has_exactly_four_tunable_layers():
    spec = load_model("tinycnn", num_classes=10)
    layers = [(name, type(m)) for name, m in tunable_layers(spec.module)]
    assert layers == [
        ("conv1", nn.Conv2d),
        ("conv2", nn.Conv2d),
        ("fc1", nn.Linear),
        ("fc2", nn.Linear),
    ]
    assert spec.input_shape == (1, 8, 8) and spec.family == "builtin"
    loss = _train_step(spec)
    assert torch.isfinite(loss)
    assert all(p.grad is not None for p in spec.module.parameters())


def test_tinycnn_honours_image_size_and_channels():
    spec = load_model("tinycnn", num_classes=3, image_size=28, in_channels=3)
    assert spec.input_shape == (3, 28, 28)
    x, _ = spec.example_batch(2)
    assert spec.module(x).shape == (2, 3)
    with pytest.raises(ModelError, match="image_size >= 4"):
        load_model("tinycnn", image_size=2)


@pytest.mark.parametrize("name", ["mlp", "tinytransformer"])
def test_builtin_forward_loss_backward(name):
    spec = load_model(name, num_classes=5)
    x, y = spec.example_batch(3)
    out = spec.module(x)
    assert out.shape == (3, 5)
    loss = spec.loss(out, y)
    # cross-entropy against a float64 reference
    ref = torch.nn.functional.cross_entropy(out.detach().double(), y)
    torch.testing.assert_close(loss.detach().double(), ref, rtol=1e-6, atol=1e-6)
    loss.backward()
    grads = [p.grad for p in spec.module.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


def test_mlp_has_three_linear_layers_over_the_flattened_input():
    spec = load_model("mlp", num_classes=10)
    layers = [m for _, m in tunable_layers(spec.module)]
    assert [(m.in_features, m.out_features) for m in layers] == [(64, 64), (64, 64), (64, 10)]


def test_tinytransformer_reads_token_ids():
    spec = load_model("tinytransformer", seq_len=12)
    assert spec.task == "sequence-classification"
    assert spec.input_dtype == torch.long and spec.vocab_size == 64 and spec.input_shape == (12,)
    x, y = spec.example_batch(64, generator=torch.Generator().manual_seed(1))
    assert x.dtype == torch.long and int(x.min()) >= 0 and int(x.max()) < 64
    assert y.shape == (64,) and int(y.max()) < spec.num_classes
    names = [n for n, _ in tunable_layers(spec.module)]
    assert names.count("layers.0.self_attn") == 1 and names[-1] == "head"


def test_example_batch_is_reproducible_from_a_generator():
    spec = load_model("mlp")
    a = spec.example_batch(4, generator=torch.Generator().manual_seed(3))
    b = spec.example_batch(4, generator=torch.Generator().manual_seed(3))
    assert all(torch.equal(u, v) for u, v in zip(a, b, strict=True))


def test_token_classification_loss_flattens_positions():
    module = TinyTransformer(vocab_size=20, seq_len=6, num_classes=4, pooling="none")
    spec = ModelSpec(
        "tagger", module, (6,), "token-classification", 4, input_dtype=torch.long, vocab_size=20
    )
    x, y = spec.example_batch(3)
    assert y.shape == (3, 6)
    out = spec.module(x)
    assert out.shape == (3, 6, 4)
    expected = torch.nn.functional.cross_entropy(out.reshape(18, 4), y.reshape(18))
    torch.testing.assert_close(spec.loss(out, y), expected)


def test_logits_unwraps_model_outputs():
    spec = load_model("mlp")
    t = torch.zeros(2, 10)

    class Output:
        logits = t

    assert spec.logits(t) is t
    assert spec.logits(Output()) is t
    assert spec.logits({"logits": t}) is t
    assert spec.logits((t, torch.ones(1))) is t
    with pytest.raises(ModelError, match="logits"):
        spec.logits("nope")


def test_model_spec_checks_its_fields():
    with pytest.raises(ModelError, match="unknown task 'detection'"):
        ModelSpec("m", nn.Linear(2, 2), (2,), "detection", 2)
    with pytest.raises(ModelError, match="vocab_size"):
        ModelSpec("m", nn.Linear(2, 2), (2,), "sequence-classification", 2, input_dtype=torch.long)
    with pytest.raises(ModelError, match="input_shape"):
        ModelSpec("m", nn.Linear(2, 2), (), "image-classification", 2)


# --- torchvision ------------------------------------------------------------------------------
def test_resnet18_small_images_forward():
    spec = load_model("resnet18", num_classes=10, image_size=32)
    assert spec.input_shape == (3, 32, 32) and spec.family == "torchvision"
    x, y = spec.example_batch(2)
    out = spec.module(x)
    assert out.shape == (2, 10)
    assert torch.isfinite(spec.loss(out, y))


def test_resnet50_has_54_tunable_layers():
    module = load_model("resnet50").module
    convs_and_linears = [m for m in module.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    assert len(list(tunable_layers(module))) == len(convs_and_linears) == 54


def test_vit_takes_image_size_divisible_by_its_patch():
    spec = load_model("vit_b_16", num_classes=10, image_size=32)
    assert spec.module.image_size == 32 and spec.input_shape == (3, 32, 32)
    x, _ = spec.example_batch(1)
    with torch.no_grad():
        assert spec.module.eval()(x).shape == (1, 10)
    with pytest.raises(ModelError, match="multiple of 16; got 40 \\(try 32 or 48\\)"):
        load_model("vit_b_16", image_size=40)


def test_too_small_images_are_refused_before_building():
    with pytest.raises(ModelError, match="alexnet needs image_size >= 63"):
        load_model("alexnet", image_size=32)
    with pytest.raises(ModelError, match="in_channels"):
        load_model("resnet18", in_channels=1)
    # the measured minimum is the true one
    spec = load_model("squeezenet1_1", num_classes=4, image_size=17)
    with torch.no_grad():
        assert spec.module.eval()(spec.example_batch(1)[0]).shape == (1, 4)
    with pytest.raises(ModelError, match=">= 17"):
        load_model("squeezenet1_1", image_size=16)


def test_inception_builds_without_auxiliary_heads():
    spec = load_model("inception_v3", num_classes=10, image_size=75)
    assert spec.module.AuxLogits is None
    out = spec.module(spec.example_batch(2)[0])  # train mode: plain logits, not a tuple
    assert isinstance(out, torch.Tensor) and out.shape == (2, 10)


# --- names ------------------------------------------------------------------------------------
def test_unknown_name_suggests_close_names():
    with pytest.raises(UnknownModelError) as info:
        load_model("resnet5")
    message = str(info.value)
    assert isinstance(info.value, ValueError)
    assert "resnet50" in message and "resnet18" in message and "autoprec models" in message
    assert "\n" not in message


def test_list_models_covers_every_family():
    rows = list_models()
    by_name = {r["name"]: r for r in rows}
    assert by_name["resnet50"] == {
        "name": "resnet50",
        "family": "torchvision",
        "task": "image-classification",
        "input_shape": [3, 224, 224],
        "available": True,
    }
    assert by_name["inception_v3"]["input_shape"] == [3, 299, 299]
    assert by_name["tinytransformer"]["input_shape"] == [16]
    assert {"bert-tiny", "gpt2-small", "mlp", "tinycnn", "vit_b_16"} <= set(by_name)
    assert {r["family"] for r in list_models("builtin")} == {"builtin"}
    with pytest.raises(ModelError, match="unknown family"):
        list_models("keras")


# --- Hugging Face -----------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["bert-tiny", "gpt2-small"])
def test_hf_without_transformers_says_which_extra(monkeypatch, name):
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` fails
    with pytest.raises(ValueError, match=r"pip install autoprec\[hf\]"):
        load_model(name)
    assert {r["name"]: r["available"] for r in list_models("hf")} == {
        "bert-tiny": False,
        "gpt2-small": False,
    }


def test_bert_tiny_when_transformers_is_installed():
    pytest.importorskip("transformers")
    spec = load_model("bert-tiny", num_classes=3, seq_len=16)
    x, y = spec.example_batch(2)
    out = spec.module(x)
    assert spec.logits(out).shape == (2, 3)
    assert torch.isfinite(spec.loss(out, y))


def test_gpt2_conv1d_becomes_an_equal_linear():
    class Conv1D(nn.Module):  # transformers.pytorch_utils.Conv1D, in miniature
        def __init__(self, nf: int, nx: int) -> None:
            super().__init__()
            self.nf = nf
            self.weight = nn.Parameter(torch.randn(nx, nf))
            self.bias = nn.Parameter(torch.randn(nf))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(
                *x.shape[:-1], self.nf
            )

    model = nn.Sequential(Conv1D(6, 4), nn.ReLU(), nn.Sequential(Conv1D(3, 6)))
    x = torch.randn(2, 5, 4)
    expected = model(x)
    assert conv1d_to_linear(model) == 2
    assert [n for n, _ in tunable_layers(model)] == ["0", "2.0"]
    torch.testing.assert_close(model(x), expected)


# --- the user's own factory -------------------------------------------------------------------
@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A module ``ap_user_models`` on sys.path with several factories."""
    source = """
        import torch
        from torch import nn
        from autoprec.models import ModelSpec

        def with_classes(num_classes=10):
            net = nn.Sequential(nn.Flatten(), nn.Linear(12, num_classes))
            net.autoprec_input_shape = (3, 2, 2)
            return net

        def plain():
            return nn.Sequential(nn.Flatten(), nn.Linear(3 * 4 * 4, 7))

        def as_spec(num_classes):
            net = nn.Sequential(nn.Flatten(), nn.Linear(5, num_classes))
            return ModelSpec("mine", net, (5,), "image-classification", num_classes)

        def tokens(num_classes):
            net = nn.Sequential(nn.Embedding(11, 4), nn.Flatten(), nn.Linear(4 * 6, num_classes))
            net.autoprec_input_shape = (6,)
            net.autoprec_vocab_size = 11
            return net

        def broken():
            raise RuntimeError("no GPU here")

        def not_a_model():
            return "resnet"

        NOT_CALLABLE = 3
        """
    (tmp_path / "ap_user_models.py").write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "ap_user_models", raising=False)
    yield "ap_user_models"
    sys.modules.pop("ap_user_models", None)


def test_user_factory_with_num_classes(user_module):
    spec = load_model(f"{user_module}:with_classes", num_classes=4)
    assert spec.family == "user" and spec.input_shape == (3, 2, 2) and spec.num_classes == 4
    assert spec.module(spec.example_batch(2)[0]).shape == (2, 4)
    _train_step(spec)


def test_user_factory_without_num_classes_takes_image_size(user_module):
    spec = load_model(f"{user_module}:plain", num_classes=4, image_size=4)
    assert spec.input_shape == (3, 4, 4)
    assert spec.num_classes == 7  # read off the module's output
    assert spec.module.training


def test_user_factory_returning_a_spec_and_token_models(user_module):
    spec = load_model(f"{user_module}:as_spec", num_classes=2)
    assert spec.name == "mine" and spec.family == "user" and spec.num_classes == 2
    tokens = load_model(f"{user_module}:tokens", num_classes=3)
    assert tokens.task == "sequence-classification" and tokens.input_dtype == torch.long
    _train_step(tokens)


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("no_such_module_xyz:make", "cannot import module 'no_such_module_xyz'"),
        ("{m}:missing", "has no attribute 'missing'"),
        ("{m}:NOT_CALLABLE", "not a callable factory"),
        (
            "{m}:not_a_model",
            "returned a str ('resnet'); expected an nn.Module or an autoprec ModelSpec",
        ),
        ("{m}:broken", "the factory raised RuntimeError: no GPU here"),
        ("{m}:plain", "input shape is unknown; pass image_size"),
        ("{m}:", "expected 'package.module:factory'"),
    ],
)
def test_user_factory_errors_are_one_line(user_module, name, message):
    with pytest.raises(ModelError) as info:
        load_model(name.format(m=user_module))
    assert message in str(info.value) and "\n" not in str(info.value)


# --- command line -----------------------------------------------------------------------------
def test_models_command_json(capsys):
    assert main(["models", "--json"]) == 0
    names = {r["name"] for r in json.loads(capsys.readouterr().out)}
    assert {"resnet50", "tinycnn", "tinytransformer", "bert-tiny"} <= names


def test_models_command_table(capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "tinycnn" in out and "resnet50" in out and "(3, 224, 224)" in out
    assert main(["models", "--family", "builtin"]) == 0
    out = capsys.readouterr().out
    assert "tinytransformer" in out and "resnet50" not in out
    assert main(["models", "--family", "keras"]) == 2


def test_same_seed_same_weights_and_the_global_rng_untouched():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    a = load_model("tinycnn")
    assert torch.equal(torch.rand(3), expected)  # construction did not consume the global RNG
    b, c = load_model("tinycnn"), load_model("tinycnn", seed=1)
    sa, sb, sc = (m.module.state_dict() for m in (a, b, c))
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)
