"""``--train-tokens`` (the accuracy weight from the production run's length, by Chinchilla's fit
for the production model's parameters) and ``--max-samples`` (the fine-tuning data's size):
checked in one line, applied, said, and recorded in the export (issue 36)."""

from __future__ import annotations

import pytest
from search_helpers import Lines

from autoprec.cli import main
from autoprec.evaluate.reward import DEFAULT_WEIGHTS, chinchilla_accuracy_weight
from autoprec.evaluate.workload import (
    Workload,
    production_parameters,
    production_spec,
    workload_data,
)
from autoprec.models import load_model
from autoprec.pipeline import SearchConfig, SearchSetupError, run_search
from autoprec.policy.io import load_policy


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"train_tokens": 1e12, "w_accuracy": 5.0}, "give it or w_accuracy (--w-accuracy), not"),
        ({"train_tokens": 0.5}, "train_tokens must be a number >= 1"),
        ({"train_tokens": "many"}, "train_tokens: expected a number"),
        ({"max_samples": 1}, "max_samples must be an integer between 2 and"),
        ({"max_samples": 10.5}, "max_samples: expected an integer"),
    ],
)
def test_bad_length_and_size_are_refused_in_one_line(fields, needle):
    with pytest.raises(SearchSetupError, match=None) as err:
        SearchConfig(model="mlp", **fields)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_the_command_line_refuses_both_weights(capsys):
    argv = ["search", "--model", "mlp", "--no-mlflow", "--train-tokens", "1e12"]
    assert main([*argv, "--w-accuracy", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("autoprec: error: train_tokens (--train-tokens) sets the accuracy")
    assert len(err.splitlines()) == 1


def test_production_parameters_count_the_named_model_at_its_own_depth():
    spec = load_model("llama-small")
    at_shape = Workload("llama-small", train_shape="llama3-8b")
    cost = production_spec(spec, "llama-small", None, "llama3-8b")
    assert round(production_parameters(at_shape, cost) / 1e9, 2) == 8.03  # Meta's model card
    sliced = sum(p.numel() for p in cost.module.parameters())  # 8 of the 32 blocks
    assert sliced < 3e9
    # without a named shape: the model that is costed, as it is
    mlp = load_model("mlp")
    own = sum(p.numel() for p in mlp.module.parameters())
    assert production_parameters(Workload("mlp"), mlp) == own


def test_the_search_prices_loss_by_the_run_length_and_records_it(tmp_path):
    told = Lines()
    config = SearchConfig(
        model="mlp", agent="random", budget=1, mlflow=False, out="p.yaml",
        train_tokens=1e9, max_samples=64,
    )  # fmt: skip
    report = run_search(config, told)
    params = sum(p.numel() for p in load_model("mlp").module.parameters())
    weight = chinchilla_accuracy_weight(params, 1e9)
    assert weight != DEFAULT_WEIGHTS["accuracy"]
    assert report.config.w_accuracy == pytest.approx(weight)
    said = [line for line in told.lines if line.startswith("accuracy weight")]
    assert said == [
        f"accuracy weight {weight:.1f}: a relative loss increase priced as the tokens that "
        f"recover it, by Chinchilla's fit for {params / 1e9:.2f}B parameters trained on 1e+09 "
        "tokens"
    ]
    provenance = load_policy(tmp_path / "p.yaml").provenance
    assert provenance["w_accuracy"] == pytest.approx(weight, rel=1e-5)
    assert provenance["train_tokens"] == 1e9 and provenance["max_samples"] == 64
    assert provenance["w_speedup"] == DEFAULT_WEIGHTS["speedup"]


def test_max_samples_sizes_the_fine_tuning_data():
    spec = load_model("llama-small")
    whole = workload_data(spec, Workload("llama-small", "python-text"))
    kept = workload_data(spec, Workload("llama-small", "python-text", max_samples=512))
    assert len(kept.train) + len(kept.val) == 512 < len(whole.train) + len(whole.val)
    assert kept.key != whole.key  # another evaluation, not a cached one of the whole set
