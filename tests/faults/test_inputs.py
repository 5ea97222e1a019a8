"""Bad numbers, sizes, config fields and policy fields through the command line (issue 34).

Each case once ended in a traceback, was silently taken for something else (``budget: true``
as 1) or was refused only after minutes of work; each must now be one line, exit status 2,
naming the field (and the file and line) before any work. Sizes are checked against a machine
of :data:`MEMORY` bytes, so that the cases hold on any machine and none allocates.
"""

from __future__ import annotations

import textwrap

import pytest
import torch
from faults.sweep import one_line_error, run_cli
from torch import nn

import autoprec
from autoprec import _memory
from autoprec.layers import model_fingerprint
from autoprec.policy import PolicyMismatchError, PrecisionPolicy
from autoprec.policy.io import format_policy, load_policy

MEMORY = 16 * 2**30  # the machine every size case is checked against
SEARCH = ["search", "--model", "tinycnn", "--target", "h100-sxm", "--no-mlflow", "--steps", "2",
          "--train-batch-size", "32"]  # fmt: skip
TRAIN = ["train", "--model", "tinycnn", "--steps", "2"]  # and --policy
HEAD = "autoprec_policy: 1\ndefault: fp16\n"


@pytest.fixture(autouse=True)
def small_machine(monkeypatch, tmp_path):
    """A machine of :data:`MEMORY` bytes, and a working folder of this test's own."""
    monkeypatch.setattr(_memory, "machine_memory", lambda: MEMORY)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("AUTOPREC_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "fp32.yaml").write_text("autoprec_policy: 1\ndefault: fp32\n")


# (case, config file text, needles of the one error line after "config <path>, line N")
CONFIG_CASES = [
    ("budget_bool", "budget: true\n", ["line 1: budget: expected an integer; got True (bool)"]),
    ("out_int", "out: 5\n", ["line 1: out: expected a string (quote it); got 5 (int)"]),
    ("steps_float", "steps: 2.5\n", ["line 1: steps: expected an integer; got 2.5 (float)"]),
    ("verify_int", "verify: 1\n", ["line 1: verify: expected true or false"]),
    ("budget_list", "budget: [1, 2]\n", ["line 1: budget: expected a single value"]),
    (
        "budget_10e400",
        "budget: 1" + "0" * 400 + "\n",
        ["line 1: budget must be an integer between 1 and 10,000", "about 401 digits"],
    ),
    ("budget_huge", "budget: 1000000\n", ["budget must be an integer between 1 and 10,000"]),
    ("seed_10e30", "seed: 1" + "0" * 30 + "\n", ["line 1: seed must be an integer between 0"]),
    ("seed_negative", "model: tinycnn\nseed: -5\n", ["line 2: seed must be", "got -5 (int)"]),
    ("image_size_huge", "image_size: 100000\n", ["image_size must be", "65,536"]),
    ("train_batch_1e24", "train_batch_size: 1" + "0" * 24 + "\n", ["train_batch_size must"]),
    ("weight_negative", "w_memory: -1.0\n", ["w_memory must be a number >= 0"]),
    ("weight_nan", "w_speedup: .nan\n", ["w_speedup must be a number >= 0", "nan"]),
    ("precisions", "precisions: fp32,bf8\n", ["precisions: unknown precision 'bf8'"]),
    ("storage", "storage: 'foo://x'\n", ["storage: 'foo://x' is not a database URL"]),
]


@pytest.mark.parametrize(("content", "needles"), [c[1:] for c in CONFIG_CASES],
                         ids=[c[0] for c in CONFIG_CASES])  # fmt: skip
def test_a_bad_config_value_is_one_line_naming_the_file_and_field(capsys, tmp_path, content,
                                                                   needles):  # fmt: skip
    path = tmp_path / "search.yaml"
    path.write_text(content)
    args = ["search", "--model", "tinycnn", "--no-mlflow", "--config", path]
    line = one_line_error(run_cli(capsys, args), f"config {path}", *needles)
    assert len(line) < 400, line


# (case, extra arguments, needles): the same checks on the command line, before any work
OPTION_CASES = [
    ("seed_negative", ["--seed", "-1"], ["--seed must be an integer between 0 and 4,294,967,295"]),
    ("seed_10e30", ["--seed", "1" + "0" * 30], ["--seed must be"]),
    ("budget_zero", ["--budget", "0"], ["--budget must be an integer between 1 and 10,000"]),
    ("budget_10e400", ["--budget", "1" + "0" * 400], ["--budget must be", "401 digits"]),
    ("precisions_empty", ["--precisions", ","], ["--precisions names no precision"]),
    ("precisions_bad", ["--precisions", "fp32,xx"], ["unknown precision 'xx'"]),
    ("storage", ["--agent", "tpe", "--storage", "nonsense"], ["--storage: 'nonsense' is not"]),
    ("tolerance", ["--accuracy-tolerance", "-0.1"], ["--accuracy-tolerance must be"]),
]


@pytest.mark.parametrize(("extra", "needles"), [c[1:] for c in OPTION_CASES],
                         ids=[c[0] for c in OPTION_CASES])  # fmt: skip
def test_a_bad_search_option_is_one_line_before_any_work(capsys, tmp_path, extra, needles):
    outcome = run_cli(capsys, [*SEARCH, *extra])
    one_line_error(outcome, *needles)
    assert "fine-tuning at" not in outcome.out + outcome.err  # refused before the model is built
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").rglob("*.pt"))


# (case, arguments, needles): the same ranges in the commands that share search's options
COMMAND_CASES = [
    ("migrate_seed", ["migrate", "--model", "tinycnn", "--seed", "-3"], ["--seed must be"]),
    ("migrate_steps", ["migrate", "--model", "tinycnn", "--steps", "0"], ["--steps must be"]),
    (
        "migrate_batch",
        ["migrate", "--model", "tinycnn", "--train-batch-size", "1" + "0" * 24],
        ["--train-batch-size must be an integer between 1 and 16,777,216"],
    ),
    ("calibrate_repeats_0", ["hardware", "calibrate", "--repeats", "0"],
     ["repeats must be an integer between 1"]),
    (
        "estimate_batch_1e24",
        ["hardware", "estimate", "--model", "tinycnn", "--device", "h100-sxm", "--batch-size",
         "1" + "0" * 24, "--precision", "bf16"],
        ["--batch-size must be an integer between 1 and 16,777,216"],
    ),
]  # fmt: skip


@pytest.mark.parametrize(("args", "needles"), [c[1:] for c in COMMAND_CASES],
                         ids=[c[0] for c in COMMAND_CASES])  # fmt: skip
def test_a_bad_option_of_another_command_is_one_line(capsys, args, needles):
    outcome = run_cli(capsys, args)
    one_line_error(outcome, *needles)
    assert "migrating" not in outcome.out


def _user_model(tmp_path, monkeypatch) -> str:
    """A user's factory declaring an input of 3 x 100000 x 100000 (120 GB a batch of one)."""
    (tmp_path / "bigin.py").write_text(
        textwrap.dedent(
            """
            from torch import nn

            def make(num_classes=10):
                model = nn.Sequential(nn.Flatten(), nn.LazyLinear(num_classes))
                model.autoprec_input_shape = (3, 100000, 100000)
                return model
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return "bigin:make"


# (case, arguments, needles): sizes beyond the machine, named before they are allocated
SIZE_CASES = [
    (
        "search_num_classes",
        [*SEARCH, "--num-classes", "1000000000"],
        [
            "model 'tinycnn' with 65,000,037,680 parameters",
            "more than this machine's 16.0 GiB",
            "lower num_classes (1,000,000,000",
        ],
    ),
    (
        "search_image_size",
        [*SEARCH, "--image-size", "65536"],
        ["one input of shape (1, 65536, 65536)", "lower image_size"],
    ),
    (
        "train_num_classes",
        [*TRAIN, "--policy", "fp32.yaml", "--num-classes", "1000000000"],
        ["lower num_classes"],
    ),
    (
        "analyze_num_classes",
        ["analyze", "--model", "mlp", "--num-classes", "1000000000", "--no-sensitivity"],
        ["lower num_classes"],
    ),
    ("user_input_shape", "USER", ["shape (3, 100000, 100000)", "autoprec_input_shape"]),
]


@pytest.mark.parametrize(("args", "needles"), [c[1:] for c in SIZE_CASES],
                         ids=[c[0] for c in SIZE_CASES])  # fmt: skip
def test_a_size_beyond_the_machine_is_one_line_naming_the_setting(capsys, tmp_path, monkeypatch,
                                                                  args, needles):  # fmt: skip
    if args == "USER":
        args = ["analyze", "--model", _user_model(tmp_path, monkeypatch), "--no-sensitivity"]
    one_line_error(run_cli(capsys, args), *needles)


def test_a_batch_beyond_the_machine_is_refused_before_it_is_drawn(capsys, monkeypatch):
    """One input fits, a batch of 32 does not: the data loader says so before drawing it (on a
    machine of 16 MiB, so that the model and its probe stay small here)."""
    monkeypatch.setattr(_memory, "machine_memory", lambda: 16 * 2**20)
    args = [*TRAIN, "--policy", "fp32.yaml", "--image-size", "512", "--batch-size", "32"]
    one_line_error(
        run_cli(capsys, args),
        "teacher: a batch of 32 inputs of shape (1, 512, 512) would take 32.0 MiB",
        "more than this machine's 16.0 MiB",
        "or the batch size",
    )


# (case, policy file text, needles): policy fields through `train --policy`
POLICY_CASES = [
    (
        "init_scale_1e300",
        HEAD + "loss_scaling: {init_scale: 1.0e+300}\n",
        ["line 3: loss_scaling.init_scale must be a number between 1.18e-38 and 3.4e+38", "1e+300"],
    ),
    (
        "growth_interval_10e400",
        HEAD + "loss_scaling: {growth_interval: 1" + "0" * 400 + "}\n",
        ["line 3: loss_scaling.growth_interval must be an integer between 1 and 2,147,483,647"],
    ),
    (
        "growth_interval_bool",
        HEAD + "loss_scaling:\n  growth_interval: true\n",
        ["line 4: loss_scaling.growth_interval must be an integer", "True (bool)"],
    ),
    (
        "tunable_layers_10e30",
        HEAD + "model: {tunable_layers: 1" + "0" * 30 + "}\n",
        ["model.tunable_layers must be an integer between 0"],
    ),
    (
        "unknown_layers",
        HEAD + "layers:\n" + "".join(f"  block{i}.conv_long_name: bf16\n" for i in range(20_000)),
        ["layer 'block0.conv_long_name' matches no", "and 19,997 more of the policy's 20,000"],
    ),
]


@pytest.mark.parametrize(("content", "needles"), [c[1:] for c in POLICY_CASES],
                         ids=[c[0] for c in POLICY_CASES])  # fmt: skip
def test_a_bad_policy_field_is_one_short_line(capsys, tmp_path, content, needles):
    path = tmp_path / "policy.yaml"
    path.write_text(content)
    line = one_line_error(run_cli(capsys, [*TRAIN, "--policy", path]), *needles)
    assert len(line) < 1000, line[:2000]


def test_rich_prints_an_install_hint_whole(capsys, monkeypatch):
    """'pip install "autoprec[fp8]"' is data: rich must not take [fp8] for markup."""
    import autoprec.hardware.runnability as runnability

    monkeypatch.setattr(runnability, "float8_available", lambda: False)
    args = ["analyze", "--model", "mlp", "--no-sensitivity", "--target", "h100-sxm"]
    outcome = run_cli(capsys, args)
    assert outcome.status == 0, outcome.err
    assert 'torchao is not installed (pip install "autoprec[fp8]")' in outcome.out


def test_an_exported_policy_keeps_numbers_as_numbers_and_rounds_metrics(tmp_path):
    policy = PrecisionPolicy(
        default="bf16",
        model={"name": "resnet50", "fingerprint": "sha256:abc"},
        metrics={"speedup": 2.134571298123456, "loss_delta": 1.0387612345e-05},
        provenance={"agent": "ppo", "budget": 12, "seed": 0, "warm_start_lr": 0.05},
    )
    text = format_policy(policy)
    assert "model: {name: resnet50," in text
    assert "speedup: 2.13457," in text and "loss_delta: 1.03876e-05" in text
    assert "budget: 12," in text and "seed: 0," in text and "'12'" not in text
    path = tmp_path / "p.yaml"
    path.write_text(text)
    assert load_policy(path).provenance["budget"] == 12


class _Small(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, width, 3)
        self.fc = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.conv(x).mean((2, 3)))


class _Big(_Small):
    def __init__(self) -> None:
        super().__init__(width=16)
        self.extra = nn.Linear(10, 10)


def test_apply_policy_refuses_a_policy_made_for_another_model():
    """resnet50's policy on resnet18 was silently taken (its own layers ignored): a loaded
    policy is checked as a mapping is, and its fingerprint as `autoprec train` checks it."""
    big, small = _Big(), _Small()
    made = PrecisionPolicy(
        default="bf16",
        layers={"extra": "fp16", "fc": "fp32"},
        model={"name": "big", "fingerprint": model_fingerprint(big)},
    )
    autoprec.apply_policy(big, made, mode="emulate").remove()
    with pytest.raises(PolicyMismatchError, match=r"made for model 'big'.*layer 'extra' matches"):
        autoprec.apply_policy(small, made, mode="emulate")
    named_only = made.replace(model={"name": "big"})  # no fingerprint: the layer still counts
    with pytest.raises(PolicyMismatchError, match="layer 'extra' matches no"):
        autoprec.apply_policy(small, named_only, mode="emulate")
    same_layers = made.replace(layers={"fc": "fp32"})  # the fingerprint alone
    with pytest.raises(PolicyMismatchError, match="model fingerprint is sha256:.*made for"):
        autoprec.apply_policy(small, same_layers, mode="emulate")
    with pytest.raises(ValueError, match="the model does not have: extra"):
        autoprec.apply_policy(small, {"extra": "fp16"}, mode="emulate")  # the mapping, as before
    pattern = PrecisionPolicy(default="bf16", layers={"re:nothing.*": "fp16"})
    autoprec.apply_policy(small, pattern, mode="emulate").remove()  # as a mapping's pattern


def test_a_mapping_of_many_unknown_layers_is_a_short_error():
    """A plain dict naming 100,000 layers the model lacks: the error quotes three and counts
    the rest, as a policy file's report does (it listed every name)."""
    model = nn.Sequential(nn.Linear(4, 4))
    layers = {f"block{i}.proj": "bf16" for i in range(100_000)}
    with pytest.raises(
        ValueError, match=r"does not have: block0\.proj, .* and 99,997 more$"
    ) as err:
        autoprec.apply_policy(model, layers, mode="emulate")
    assert len(str(err.value)) < 200


@pytest.mark.parametrize("command", ["search", "train"])
def test_activations_beyond_the_machine_are_refused_before_training(capsys, monkeypatch,
                                                                     command):  # fmt: skip
    """Inputs and logits fit, the activations a training step keeps (measured on the meta
    device) do not: one line before any step, on a machine of 32 MiB (tinycnn at 64x64 keeps
    about 2.5 MB an example, 80 MB for a batch of 32)."""
    monkeypatch.setattr(_memory, "machine_memory", lambda: 32 * 2**20)
    args = [*SEARCH] if command == "search" else [*TRAIN, "--policy", "fp32.yaml"]
    one_line_error(
        run_cli(capsys, [*args, "--image-size", "64"]),
        "a batch of 32 inputs of shape (1, 64, 64)",
        "the activations a training step keeps for its backward",
        "more than this machine's 32.0 MiB",
        "lower image_size or the batch size (32)",
    )


def test_activation_bytes_grow_with_the_input_and_are_none_off_the_meta_device():
    from autoprec.models import load_model

    small = load_model("tinycnn", num_classes=10, image_size=16).activation_bytes()
    large = load_model("tinycnn", num_classes=10, image_size=32).activation_bytes()
    assert small and large and 3.5 * small < large < 4.5 * small  # 4x the pixels

    class Routed(nn.Module):  # data-dependent: cannot run on the meta device
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x[x.sum(dim=1) > 0].nonzero().float().repeat(1, 2))

    from autoprec.models.spec import ModelSpec

    assert ModelSpec("routed", Routed(), (4,), "image-classification", 4).activation_bytes() is None
