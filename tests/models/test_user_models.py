"""The user's own models (``package.module:factory``) and text models, as a new user meets them:
what may be a factory, the data picked from the model's task, the analysis's defaults, progress
where there is no terminal, and the README's example."""

from __future__ import annotations

import re
import sys
import textwrap
from pathlib import Path

import pytest

from autoprec.cli import main, sensitivity_progress
from autoprec.data import DatasetError, default_dataset, load_dataset, load_dataset_for
from autoprec.data.registry import TASK_DATASETS
from autoprec.defaults import DEFAULT_DATASET
from autoprec.models import ModelError, Task, load_model, model_task

README = Path(__file__).resolve().parents[2] / "README.md"

FACTORIES = """
    import functools
    import sys

    from torch import nn


    def small(num_classes=10, image_size=4):
        return nn.Sequential(nn.Flatten(), nn.Linear(3 * image_size**2, num_classes))


    class Net(nn.Module):
        autoprec_input_shape = (3, 4, 4)

        def __init__(self, num_classes=10):
            super().__init__()
            self.flatten = nn.Flatten()
            self.fc = nn.Linear(48, num_classes)

        def forward(self, x):
            return self.fc(self.flatten(x))


    class Maker:
        def __call__(self, num_classes=10):
            return Net(num_classes)

        @classmethod
        def build(cls, num_classes=10):
            return Net(num_classes)


    MAKER = Maker()
    PARTIAL = functools.partial(small, image_size=4)
    INSTANCE = Net()


    def tokens(num_classes=10, seq_len=6):
        net = nn.Sequential(nn.Embedding(11, 4), nn.Flatten(), nn.Linear(4 * seq_len, num_classes))
        net.autoprec_input_shape = (seq_len,)
        net.autoprec_vocab_size = 11
        return net


    def exits():
        sys.exit(3)


    def returns_nothing():
        pass
    """


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A module ``ap_factories`` on sys.path."""
    (tmp_path / "ap_factories.py").write_text(textwrap.dedent(FACTORIES))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "ap_factories", raising=False)
    yield "ap_factories"
    sys.modules.pop("ap_factories", None)


# --- what may be a factory --------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("os:system", "'system' is a built-in function"),
        ("sys:exit", "'exit' is a built-in function"),
        ("builtins:print", "'print' is a built-in function"),
        ("collections:OrderedDict", "'OrderedDict' is a class but not an nn.Module subclass"),
        ("{m}:INSTANCE", "'INSTANCE' is an nn.Module instance (Net); name a function"),
    ],
)
def test_what_cannot_be_a_factory_is_refused_before_it_is_called(user_module, name, why):
    with pytest.raises(ModelError) as info:  # sys.exit would raise SystemExit, not this
        load_model(name.format(m=user_module), image_size=4)
    message = str(info.value)
    assert why in message and "a model factory is a Python function" in message
    assert "\n" not in message


def test_a_builtin_is_not_called(capsys):
    with pytest.raises(ModelError):
        load_model("builtins:print")
    assert capsys.readouterr().out == ""  # print() would have written a newline


@pytest.mark.parametrize("attr", ["small", "Net", "MAKER", "Maker.build", "PARTIAL"])
def test_functions_classes_callables_and_partials_are_factories(user_module, attr):
    spec = load_model(f"{user_module}:{attr}", num_classes=3, image_size=4)
    assert spec.family == "user" and spec.num_classes == 3 and spec.input_shape == (3, 4, 4)
    x, _ = spec.example_batch(2)
    assert spec.module(x).shape == (2, 3)


@pytest.mark.parametrize(
    ("attr", "message"),
    [
        ("exits", "the factory called exit(3) instead of returning a model"),
        ("returns_nothing", "the factory returned None; expected an nn.Module"),
    ],
)
def test_a_factory_that_exits_or_returns_nothing_is_one_line(user_module, attr, message):
    with pytest.raises(ModelError) as info:
        load_model(f"{user_module}:{attr}")
    assert message in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("name", ["sys:exit", "os:system"])
def test_cli_refuses_a_builtin_factory_with_exit_2(name, capsys):
    assert main(["analyze", "--model", name, "--no-sensitivity"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("autoprec: error: model ") and err.count("\n") == 1


# --- the data follows the model's task --------------------------------------------------------
def test_the_default_dataset_follows_the_task():
    assert TASK_DATASETS == {
        "image-classification": DEFAULT_DATASET,
        "sequence-classification": "tokens",
        "token-classification": "tokens",
    }
    assert default_dataset(Task.SEQUENCE_CLASSIFICATION) == "tokens"
    assert default_dataset("image-classification") == DEFAULT_DATASET
    with pytest.raises(DatasetError, match="unknown task 'regression'"):
        default_dataset("regression")
    text = load_model("tinytransformer")
    assert load_dataset_for(text).name == "tokens"
    assert load_dataset_for(load_model("tinycnn"), max_samples=64).name == DEFAULT_DATASET


@pytest.mark.parametrize("dataset", ["teacher", "digits"])
def test_an_image_dataset_for_a_text_model_names_the_task_not_the_enum(dataset):
    with pytest.raises(DatasetError) as info:
        load_dataset(dataset, input_shape=(16,), task=Task.SEQUENCE_CLASSIFICATION, vocab_size=64)
    message = str(info.value)
    assert "the model's task is sequence-classification (use 'tokens'" in message
    assert "Task." not in message and "<" not in message


def _evaluator_options(model: str, image_size: int | None = None) -> dict:
    """The shared command options build_evaluator reads, as the commands pass them."""
    return {
        "model_name": model,
        "num_classes": 10,
        "image_size": image_size,
        "train_image_size": None,
        "seed": 0,
        "data_dir": None,
        "dataset": None,
        "steps": 2,
        "train_batch_size": 8,
    }


def test_build_evaluator_picks_and_records_the_tasks_dataset():
    from autoprec.cli._setup import build_evaluator

    for model, expected in (("tinytransformer", "tokens"), ("tinycnn", DEFAULT_DATASET)):
        o = _evaluator_options(model)
        evaluator = build_evaluator(o, "h100-sxm")
        assert evaluator.data.name == expected and o["dataset"] == expected


@pytest.mark.parametrize(("image_size", "built"), [(None, 32), (8, 8)])
def test_build_evaluator_gives_a_factory_that_needs_it_an_image_size(
    user_module, image_size, built
):
    """A factory whose model has no autoprec_input_shape is built at --image-size, else at the
    32 that analyze offers it (it used to fail even with --image-size: the model was first
    built without one, for the cost shape)."""
    from autoprec.cli._setup import build_evaluator

    o = _evaluator_options(f"{user_module}:small", image_size)
    evaluator = build_evaluator(o, "h100-sxm")
    assert tuple(evaluator.spec.input_shape) == (3, built, built)


@pytest.mark.parametrize("command", ["search", "migrate", "analyze"])
def test_dataset_help_names_the_defaults_of_the_registry(command, capsys):
    assert main([command, "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert f"default: {TASK_DATASETS['image-classification']}; " in text
    assert f"{TASK_DATASETS['sequence-classification']} for token models" in text


# --- analyze: image size only for image models, progress without a terminal ------------------
def test_model_task_is_known_without_building():
    assert model_task("bert-tiny") == "sequence-classification"
    assert model_task("resnet18") == model_task("tinycnn") == "image-classification"
    assert model_task("pkg.mod:factory") is None and model_task("no-such-model") is None


def test_analyze_a_text_model_with_the_default_flags(user_module, capsys):
    """A text user model: no image size forced on it, sensitivities on tokens."""
    args = ["analyze", "--model", f"{user_module}:tokens", "--batches", "1"]
    assert main([*args, "--precisions", "fp32,bf16"]) == 0
    out = capsys.readouterr().out
    assert "sensitivity: sweep on tokens" in out and "input (6,)" in out


def test_analyze_bert_tiny_with_its_default_flags(capsys):
    pytest.importorskip("transformers")
    assert main(["analyze", "--model", "bert-tiny", "--no-sensitivity"]) == 0
    assert "input (128,)" in capsys.readouterr().out


def test_analyze_image_models_default_to_32(capsys):
    assert main(["analyze", "--model", "tinycnn", "--no-sensitivity"]) == 0
    assert "input (1, 32, 32)" in capsys.readouterr().out


def test_analyze_prints_progress_lines_without_a_terminal(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("AUTOPREC_CACHE_DIR", str(tmp_path))  # not cached: really measured
    monkeypatch.setattr(sensitivity_progress, "PROGRESS_EVERY_S", 0.0)
    args = ["analyze", "--model", "mlp", "--image-size", "8", "--dataset", "synthetic"]
    assert (
        main([*args, "--batches", "1", "--precisions", "fp32,bf16,fp16", "--method", "taylor"]) == 0
    )
    captured = capsys.readouterr()
    head = "sensitivity on synthetic: Taylor estimate (3 layers x 2)"
    progress = [ln for ln in captured.err.splitlines() if ln.startswith(head)]
    counts = [re.search(r": (\d+)/6", ln).group(1) for ln in progress]
    assert counts == [str(i) for i in range(7)]  # 0/6 at the start, then every measurement
    assert "sensitivity on synthetic: Taylor estimate (one pass" in captured.err  # the plan
    assert head not in captured.out  # the table's stdout stays clean


def test_progress_lines_are_throttled(monkeypatch, capsys):
    from rich.console import Console

    monkeypatch.setattr(sensitivity_progress, "PROGRESS_EVERY_S", 3600.0)
    with sensitivity_progress.sensitivity_progress(Console(stderr=True), "work") as (advance, _):
        for done in range(6):
            advance("stage", done, 5)
    assert capsys.readouterr().err.splitlines() == [
        "work: stage: 0/5 (0 s)",
        "work: stage: 5/5 (0 s)",
    ]


# --- the README's section ---------------------------------------------------------------------
def test_readme_user_model_example_loads_as_a_text_model(tmp_path, monkeypatch):
    section = README.read_text().split("## Your own model", 1)[1].split("\n## ", 1)[0]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    (tmp_path / "ap_readme_models.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    command = re.search(r"`PYTHONPATH=\. autoprec analyze --model mymodels:(\w+)`", section)
    spec = load_model(f"ap_readme_models:{command.group(1)}")
    assert spec.task == "sequence-classification" and spec.input_shape == (32,)
    assert load_dataset_for(spec).name == TASK_DATASETS["sequence-classification"]
    for attr in re.findall(r"autoprec_\w+", section):  # every attribute it documents is read
        assert attr in Path(sys.modules["autoprec.models.user"].__file__).read_text()
    sys.modules.pop("ap_readme_models", None)
