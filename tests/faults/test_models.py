"""The fault sweep's models people bring (issue 34): the user's model through
``--model package.module:factory``, as the README's "Your own model" documents it.

- a tensor made by ``torch.tensor(...)`` inside ``forward`` (``lift_fresh``, an op that returns
  its argument) once became a view of itself in the recorded data flow, and the cost model's walk
  to a view's base never ended: analyze and a small search now finish;
- every call into the user's model (its factory, its forward, its training step) fails in one
  line that names the model, the input's shape and the model's own message, in every command;
- a forward that needs a second input (diffusers' UNet) and an encoder-decoder (T5) are refused
  in one line that says what to do;
- Mixtral's experts (3-d parameters multiplied by ``torch._grouped_mm``) are one tunable layer
  with their FLOPs (issue 36; they were reported as left out of the tunable layers before).
"""

from __future__ import annotations

import sys
import textwrap
import threading
from dataclasses import replace

import pytest
from faults.sweep import one_line_error, run_cli

from autoprec.graph.analyze import analyze
from autoprec.hardware.program import Flow, program, view_root
from autoprec.models import load_model

MODULE = "ap_fault_models"

FACTORIES = """
    import torch
    from torch import nn


    class Constant(nn.Module):  # the hang of issue 34, at its smallest
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(64, 9)

        def forward(self, x):
            made_here = torch.tensor([[0.5]]).expand(x.shape[0], 1)
            return torch.cat([self.fc(x), made_here], dim=1)


    class Raises(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(64, 9)

        def forward(self, x):
            raise RuntimeError("boom in forward\\nand a second line")


    class RaisesInTraining(Raises):
        def forward(self, x):
            if self.training:
                raise RuntimeError("only in training")
            return self.fc(x)


    class TwoInputs(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(64, 9)

        def forward(self, x, t):
            return self.fc(x) + t


    def _vector(net):
        net.autoprec_input_shape = (64,)
        return net


    def constant():
        return _vector(Constant())


    def raises():
        return _vector(Raises())


    def raises_in_training():
        return _vector(RaisesInTraining())


    def mismatch():
        return _vector(nn.Sequential(nn.Linear(32, 9)))


    def generator_exit():
        raise GeneratorExit


    def two_inputs():  # autoprec_num_classes, as the UNet's old message advised
        net = _vector(TwoInputs())
        net.autoprec_num_classes = 9
        return net


    def _tokens(net):
        net.autoprec_input_shape = (8,)
        net.autoprec_vocab_size = 64
        return net


    def t5():
        import transformers as tf

        config = tf.T5Config(
            vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_decoder_layers=1,
            num_heads=2,
        )
        return _tokens(tf.T5ForConditionalGeneration(config))


    def mixtral(num_classes=10, experts="grouped_mm"):
        import transformers as tf

        config = tf.MixtralConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=1, num_local_experts=4,
            num_experts_per_tok=2, max_position_embeddings=32, num_labels=num_classes,
            pad_token_id=0,
        )
        config._experts_implementation = experts
        return _tokens(tf.MixtralForSequenceClassification(config))


    def mixtral_eager(num_classes=10):  # a loop over the experts, each a slice of the weight
        return mixtral(num_classes, "eager")


    def mixtral_batched(num_classes=10):  # each token's experts gathered, then bmm
        return mixtral(num_classes, "batched_mm")


    def unet():
        import diffusers

        net = diffusers.UNet2DModel(
            sample_size=8, in_channels=3, out_channels=3, block_out_channels=(8, 16),
            down_block_types=("DownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "UpBlock2D"), layers_per_block=1, norm_num_groups=4,
        )
        net.autoprec_input_shape = (3, 8, 8)
        return net
"""


@pytest.fixture
def models(tmp_path, monkeypatch):
    """The factories above as a module on sys.path; commands run in ``tmp_path``."""
    (tmp_path / f"{MODULE}.py").write_text(textwrap.dedent(FACTORIES))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, MODULE, raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    yield tmp_path
    sys.modules.pop(MODULE, None)


def _model(factory: str) -> list[str]:
    return ["--model", f"{MODULE}:{factory}"]


# --- 0: the hang ------------------------------------------------------------------------------
def test_a_tensor_made_inside_forward_is_no_view_of_itself(models):
    flow = analyze(load_model(f"{MODULE}:constant"), 4).flow
    assert all(t.base != i for i, t in enumerate(flow.tensors)), flow.tensors
    lifted = [op for op in flow.ops if op.name == "lift_fresh"]
    assert lifted and lifted[0].outs == lifted[0].args  # the op returns its argument


def test_the_replay_ends_on_a_flow_whose_tensor_is_its_own_base(models):
    # an analysis cached before the fix holds such a flow: the walk must stop on the cycle
    flow = analyze(load_model(f"{MODULE}:constant"), 4).flow
    lifted = next(op for op in flow.ops if op.name == "lift_fresh").outs[0]
    tensors = list(flow.tensors)
    tensors[lifted] = replace(tensors[lifted], base=lifted)
    damaged = Flow(tuple(tensors), flow.ops, flow.inputs, flow.outputs)
    assert view_root(damaged.tensors, lifted) == lifted
    done: list[object] = []
    worker = threading.Thread(target=lambda: done.append(program(damaged, {"fc": "bf16"})))
    worker.daemon = True  # a hang fails this test, and does not keep pytest from ending
    worker.start()
    worker.join(120)
    assert done, "program() did not finish on a flow with a tensor that is its own base"


def test_analyze_and_a_small_search_finish_on_a_tensor_made_inside_forward(models, capsys):
    outcome = run_cli(capsys, ["analyze", *_model("constant"), "--no-sensitivity"])
    assert outcome.status == 0, outcome.err
    assert "fc" in outcome.out
    out = models / "best.yaml"
    args = ["search", *_model("constant"), "--steps", "2", "--train-batch-size", "32"]
    args += ["--agent", "random", "--budget", "1", "--workers", "0", "--no-mlflow"]
    outcome = run_cli(capsys, [*args, "--out", out])
    assert outcome.status == 0, outcome.err
    assert "layers:" in out.read_text()


# --- 15: one guard around the user's model ----------------------------------------------------
POLICY = "autoprec_policy: 1\ndefault: fp32\nlayers:\n  fc: bf16\n"
COMMANDS = {
    "analyze": ["analyze", "--no-sensitivity"],
    "search": ["search", "--steps", "2", "--budget", "1", "--agent", "random", "--no-mlflow"]
    + ["--target", "h100-sxm"],
    "train": ["train", "--policy", "policy.yaml", "--steps", "2", "--no-mlflow"],
    "verify": ["verify", "policy.yaml", "--steps", "2", "--seeds", "1"],
}
FORWARD = "failed on input of shape (2, 64): its forward raised"


@pytest.mark.parametrize(
    ("factory", "command", "needles"),
    [
        ("raises", "analyze", [FORWARD, "RuntimeError: boom in forward", "autoprec_input_shape"]),
        ("raises", "search", [FORWARD, "RuntimeError: boom in forward"]),
        ("raises", "train", [FORWARD, "RuntimeError: boom in forward"]),
        ("raises", "verify", [FORWARD, "RuntimeError: boom in forward"]),
        ("mismatch", "analyze", [FORWARD, "mat1 and mat2 shapes cannot be multiplied"]),
        ("mismatch", "train", [FORWARD, "mat1 and mat2 shapes cannot be multiplied"]),
        ("raises_in_training", "train", ["its training step", "RuntimeError: only in training"]),
        ("raises_in_training", "search", ["its training step", "RuntimeError: only in training"]),
        ("generator_exit", "analyze", ["the factory raised GeneratorExit"]),
        ("generator_exit", "search", ["the factory raised GeneratorExit"]),
        ("two_inputs", "analyze", ["takes more than one input (x, t)", "one input tensor"]),
        ("two_inputs", "search", ["takes more than one input (x, t)", "wrap it in an nn.Module"]),
    ],
)
def test_a_failing_user_model_is_one_line_in_every_command(
    models, capsys, factory, command, needles
):
    (models / "policy.yaml").write_text(POLICY)
    outcome = run_cli(capsys, [*COMMANDS[command], *_model(factory)])
    line = one_line_error(outcome, f"model '{MODULE}:{factory}'", *needles)
    assert "second line" not in line
    assert "autoprec_num_classes" not in line  # the advice that did not help the UNet


def _imported(package: str, *classes: str) -> None:
    """Import ``package``'s ``classes`` now (or skip), so that the warnings its first import
    logs (torchao's, through transformers) are not the command's stderr."""
    module = pytest.importorskip(package)
    for name in classes:
        getattr(module, name)


def test_t5_is_refused_as_an_encoder_decoder(models, capsys):
    _imported("transformers", "T5Config", "T5ForConditionalGeneration")
    outcome = run_cli(capsys, ["analyze", *_model("t5"), "--no-sensitivity"])
    one_line_error(outcome, "T5ForConditionalGeneration is an encoder-decoder", "decoder-only")
    assert "input_ids or inputs_embeds" not in outcome.err


def test_the_unet_is_refused_for_its_timestep(models, capsys):
    _imported("diffusers", "UNet2DModel")
    outcome = run_cli(capsys, ["analyze", *_model("unet"), "--no-sensitivity"])
    one_line_error(outcome, "more than one input (sample, timestep)", "wrap it in an nn.Module")


# --- Mixtral: the experts are counted ---------------------------------------------------------
def test_mixtrals_experts_are_one_tunable_layer_with_their_flops(models, capsys):
    # issue 36: fused experts (3-d weights run as grouped GEMMs) are a tunable layer
    _imported("transformers", "MixtralConfig", "MixtralForSequenceClassification")
    table = analyze(load_model(f"{MODULE}:mixtral"), 2)
    rows = 2 * 8 * 2  # batch x tokens x experts per token: each a row of the grouped GEMMs
    experts = table["model.layers.0.mlp.experts"]
    assert experts.type == "MixtralExperts"
    assert experts.forward_flops == 2 * rows * 32 * 128 + 2 * rows * 64 * 32
    assert experts.backward_flops == 2 * experts.forward_flops
    left_out = {reason.split("(")[-1].rstrip(")"): flops for reason, flops in table.uncovered}
    assert "MixtralTopKRouter.weight" in left_out
    assert not any(what.startswith("MixtralExperts") for what in left_out)
    outcome = run_cli(capsys, ["analyze", *_model("mixtral"), "--no-sensitivity"])
    assert outcome.status == 0, outcome.err
    assert "model.layers.0.mlp.experts" in outcome.out


@pytest.mark.parametrize("experts", ["mixtral_eager", "mixtral_batched"])
def test_every_experts_implementation_is_counted_alike(models, experts):
    # grouped_mm runs on the meta device (the analysis gives _grouped_mm's result shape there,
    # as torch's meta kernel takes bf16 only); batched_mm runs on meta; eager indexes one
    # expert at a time (nonzero: on the CPU, its fused attention counted too)
    _imported("transformers", "MixtralConfig", "MixtralForSequenceClassification")
    grouped = analyze(load_model(f"{MODULE}:mixtral"), 2)
    assert grouped.meta_failure == ""
    other = analyze(load_model(f"{MODULE}:{experts}"), 2)
    assert dict(other.uncovered) == dict(grouped.uncovered)
    assert other.total_forward_flops == grouped.total_forward_flops
    assert any("two activations" in reason for reason, _ in grouped.uncovered)  # attention
