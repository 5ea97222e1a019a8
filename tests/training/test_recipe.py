"""The user's training recipe: its checks, its optimizer and schedule, the one trainer's
divergence rule, and the recipe reaching every phase that trains (warm start, fine-tunes,
``autoprec train``, ``autoprec verify``)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from autoprec.cli.recipe_options import recipe_from
from autoprec.evaluate.config import EvaluatorConfig
from autoprec.training.recipe import (
    DEFAULT_RECIPE,
    RecipeError,
    TrainingRecipe,
    from_provenance,
    to_provenance,
)
from autoprec.training.trainer import (
    NONFINITE_LOSS,
    NONFINITE_WEIGHTS,
    SKIPPED_IN_A_ROW,
    DivergenceRule,
)
from autoprec.verify import VerifyConfig

ADAMW = TrainingRecipe(optimizer="adamw", lr=3e-4, weight_decay=0.1, beta2=0.95)


def _params() -> list[torch.nn.Parameter]:
    return list(torch.nn.Linear(3, 2).parameters())


# --- the recipe ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"optimizer": "adam"}, "optimizer must be one of sgd, adamw; got 'adam'"),
        ({"schedule": "step"}, "schedule must be one of constant, cosine, linear"),
        ({"lr": 0.0}, "lr must be a number > 0"),
        ({"lr": math.nan}, "lr must be a number > 0"),
        ({"momentum": 1.0}, "momentum must be a number >= 0 and < 1"),
        ({"warmup_steps": 1.5}, "warmup_steps must be an integer"),
        ({"batch_size": True}, "batch_size must be an integer"),
    ],
)
def test_a_bad_recipe_field_is_one_line_naming_it(fields, expected):
    with pytest.raises(RecipeError, match=expected) as err:
        TrainingRecipe(**fields)
    assert "\n" not in str(err.value)


def test_a_recipe_section_refuses_an_unknown_key_and_names_where():
    with pytest.raises(RecipeError, match=r"recipe: unknown key 'betas'"):
        TrainingRecipe.from_dict({"optimizer": "adamw", "betas": [0.9, 0.95]})
    assert TrainingRecipe.from_dict(ADAMW.to_dict()) == ADAMW


def test_the_default_optimizer_is_the_sgd_autoprec_always_trained_with():
    opt = DEFAULT_RECIPE.make_optimizer(_params())
    assert type(opt) is torch.optim.SGD
    group = opt.param_groups[0]
    assert (group["lr"], group["momentum"], group["weight_decay"]) == (0.05, 0.9, 0.0)
    assert DEFAULT_RECIPE.make_optimizer(_params(), lr=0.01).param_groups[0]["lr"] == 0.01


def test_adamw_is_really_used_with_its_betas_and_decoupled_decay():
    params = _params()
    opt = ADAMW.make_optimizer(params)
    assert type(opt) is torch.optim.AdamW
    group = opt.param_groups[0]
    assert (group["lr"], group["betas"], group["weight_decay"]) == (3e-4, (0.9, 0.95), 0.1)
    sum(p.sum() for p in params).backward()
    opt.step()
    state = opt.state[params[0]]
    assert "exp_avg" in state and "exp_avg_sq" in state  # Adam's moments, not SGD's buffer


def _rates(recipe: TrainingRecipe, total: int) -> list[float]:
    params = _params()
    opt = recipe.make_optimizer(params)
    schedule = recipe.make_schedule(opt, total)
    rates = []
    for _ in range(total):
        rates.append(opt.param_groups[0]["lr"])
        opt.step()
        schedule.step()
    return rates


def test_the_schedule_warms_up_linearly_then_decays_to_zero_after_the_last_step():
    warm = TrainingRecipe(lr=1.0, warmup_steps=4, schedule="linear")
    assert _rates(warm, 8) == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0, 0.75, 0.5, 0.25])
    cosine = _rates(TrainingRecipe(lr=1.0, schedule="cosine"), 4)
    assert cosine == pytest.approx([1.0, 0.853553, 0.5, 0.146447], abs=1e-6)
    assert _rates(TrainingRecipe(lr=0.5), 3) == [0.5, 0.5, 0.5]  # constant: the rate as made


def test_a_resumed_schedule_continues_where_the_run_stopped():
    recipe = TrainingRecipe(lr=1.0, warmup_steps=2, schedule="cosine")
    whole = _rates(recipe, 6)
    opt = recipe.make_optimizer(_params())
    opt.param_groups[0]["initial_lr"] = 1.0  # as a checkpoint of a scheduled run holds it
    schedule = recipe.make_schedule(opt, 6, done=3)
    resumed = []
    for _ in range(3):
        resumed.append(opt.param_groups[0]["lr"])
        opt.step()
        schedule.step()
    assert resumed == pytest.approx(whole[3:])


def test_the_recipe_rides_in_a_policys_provenance():
    entries = to_provenance(ADAMW)
    assert entries["recipe_optimizer"] == "adamw" and entries["recipe_lr"] == 3e-4
    assert from_provenance({"agent": "random", **entries}) == ADAMW
    assert from_provenance({"agent": "random"}) is None
    assert to_provenance(DEFAULT_RECIPE) == {}  # a default search's file: as before recipes
    with pytest.raises(RecipeError, match="provenance.recipe_"):
        from_provenance({"recipe_optimizer": "lamb"})


# --- the command-line options ------------------------------------------------------------------
def test_recipe_options_replace_the_commands_default_and_name_the_flag():
    given = {"optimizer": "adamw", "lr": 3e-4, "momentum": None, "weight_decay": 0.05}
    recipe = recipe_from(given, DEFAULT_RECIPE, 16)
    assert (recipe.optimizer, recipe.lr, recipe.weight_decay, recipe.batch_size) == (
        "adamw",
        3e-4,
        0.05,
        16,
    )
    assert recipe_from({}, DEFAULT_RECIPE) == DEFAULT_RECIPE
    with pytest.raises(RecipeError, match=r"^--weight-decay must be a number between 0 and 10"):
        recipe_from({"weight_decay": -1.0}, DEFAULT_RECIPE)
    with pytest.raises(RecipeError, match="--momentum is SGD's"):
        recipe_from({"optimizer": "adamw", "momentum": 0.9}, DEFAULT_RECIPE)


# --- the configs that embed it ------------------------------------------------------------------
def test_the_configs_old_keywords_are_aliases_of_the_recipe():
    config = EvaluatorConfig(lr=0.1, batch_size=16)
    assert (config.recipe.lr, config.recipe.batch_size) == (0.1, 16)
    assert dataclasses.replace(config, lr=0.2).recipe.lr == 0.2
    assert dataclasses.replace(config, recipe=ADAMW).recipe == ADAMW  # whole, not re-aliased
    verify = VerifyConfig(lr=0.02, momentum=0.5, batch_size=8)
    assert verify.recipe == TrainingRecipe(lr=0.02, momentum=0.5, batch_size=8)
    assert dataclasses.replace(verify, recipe=ADAMW).recipe == ADAMW
    with pytest.raises(RecipeError, match="lr must be"):
        EvaluatorConfig(lr=-1.0)


def test_the_default_recipe_keeps_the_cache_keys_and_another_changes_them():
    default = EvaluatorConfig().canonical()
    assert default == {  # as before recipes existed: the caches made then stay valid
        "steps": {"short": 10, "full": 30},
        "lr": 0.05,
        "batch_size": 32,
        "backoff": [4.0, 3, 3.0, 10],
        "seed": 0,
        "finetune": [0.01, 0.0],
        "replicates": {"short": 1, "full": 3},
        "batch_seed": 0,
        "cost_batch_size": 32,
        "target_mode": "native",
    }
    adamw = EvaluatorConfig(recipe=ADAMW)
    assert adamw.canonical()["recipe"] == ADAMW.to_dict()
    assert adamw.warm_start_settings()["recipe"] == ADAMW.to_dict()
    assert "recipe" in EvaluatorConfig(recipe=TrainingRecipe(schedule="cosine")).canonical()


def test_fine_tunes_use_the_recipes_optimizer_at_a_fifth_of_its_rate():
    sgd = EvaluatorConfig().finetune_recipe()
    assert (sgd.optimizer, sgd.lr, sgd.momentum) == ("sgd", 0.01, 0.0)  # as before recipes
    adamw = EvaluatorConfig(recipe=ADAMW).finetune_recipe(lr_scale=0.25)
    assert (adamw.optimizer, adamw.beta2) == ("adamw", 0.95)
    assert adamw.lr == pytest.approx(3e-4 / 5 * 0.25)


# --- the divergence rule -----------------------------------------------------------------------
def test_the_divergence_rule_is_one_rule_with_a_number_of_skips():
    nan, fine = math.nan, lambda: True
    no_skip = DivergenceRule(skips=0)
    assert no_skip.checks_before_backward
    assert no_skip.verdict(1.0, scaled=True, in_a_row=0, weights_finite=fine) is None
    assert no_skip.verdict(nan, scaled=True, in_a_row=1, weights_finite=fine) == NONFINITE_LOSS
    train = DivergenceRule(skips=3)
    assert train.verdict(nan, scaled=False, in_a_row=1, weights_finite=fine) == NONFINITE_LOSS
    assert train.verdict(nan, scaled=True, in_a_row=2, weights_finite=fine) is None
    assert train.verdict(nan, scaled=True, in_a_row=3, weights_finite=fine) == SKIPPED_IN_A_ROW
    broken = train.verdict(nan, scaled=True, in_a_row=1, weights_finite=lambda: False)
    assert broken == NONFINITE_WEIGHTS


# --- the recipe reaches every phase ------------------------------------------------------------
def test_the_evaluator_warm_starts_and_fine_tunes_with_the_recipe(optimizers_made, tmp_path):
    from autoprec.data import load_dataset_for
    from autoprec.evaluate import Evaluator
    from autoprec.models import load_model

    made = optimizers_made
    spec = load_model("mlp")
    data = load_dataset_for(spec, "digits")
    config = EvaluatorConfig(recipe=TrainingRecipe(optimizer="adamw", lr=3e-3), steps=2)
    config = dataclasses.replace(config, warm_start_steps=4)
    evaluator = Evaluator(spec, data, "a100-40gb-sxm", config=config, cache_dir=tmp_path)
    assert not evaluator.evaluate("bf16").diverged
    assert made[0] == ("training/pretrain", "AdamW", 3e-3)  # the warm start, at the recipe's
    fine_tunes = made[1:]  # the fp32 reference and bf16
    assert fine_tunes and all(m[:2] == ("evaluate/finetune", "AdamW") for m in fine_tunes)
    assert [m[2] for m in fine_tunes] == pytest.approx([3e-3 / 5] * len(fine_tunes))


def _policy_file(tmp_path: Path) -> Path:
    path = tmp_path / "bf16.yaml"
    path.write_text("autoprec_policy: 1\ndefault: bf16\n")
    return path


def test_train_and_verify_train_with_the_recipe_of_the_command_line(
    optimizers_made, monkeypatch, tmp_path
):
    from autoprec.cli import main

    monkeypatch.setenv("AUTOPREC_CACHE_DIR", str(tmp_path / "cache"))
    made = optimizers_made
    common = ["--model", "mlp", "--dataset", "digits", "--steps", "4", "--no-mlflow"]
    recipe = ["--optimizer", "adamw", "--lr", "3e-3", "--warmup-steps", "1"]
    policy = _policy_file(tmp_path)
    assert main(["train", "--policy", str(policy), *common, *recipe, "--device", "cpu"]) == 0
    assert made == [("training/run", "AdamW", 3e-3)]
    made.clear()
    verify = ["verify", str(policy), *common, *recipe, "--seeds", "1", "--arms", "fp32"]
    assert main([*verify, "--device", "cpu", "--out", str(tmp_path / "out.yaml")]) == 0
    assert made == [("training/run", "AdamW", 3e-3)] * 2  # fp32, then the policy


def test_a_bad_recipe_option_is_one_line_and_exit_2(tmp_path, capsys):
    from autoprec.cli import main

    args = ["train", "--policy", str(_policy_file(tmp_path)), "--model", "mlp", "--lr", "-1"]
    assert main([*args, "--no-mlflow"]) == 2
    err = capsys.readouterr().err
    assert "--lr must be a number > 0" in err and "Traceback" not in err


def test_verify_trains_with_the_recipe_a_policy_was_searched_with(
    optimizers_made, monkeypatch, tmp_path
):
    """No recipe option: the file's ``recipe_*`` provenance, at its warm start's rate; an
    option given replaces its field."""
    from autoprec.cli import main
    from autoprec.policy import PrecisionPolicy
    from autoprec.policy.io import save_policy

    monkeypatch.setenv("AUTOPREC_CACHE_DIR", str(tmp_path / "cache"))
    searched = to_provenance(TrainingRecipe(optimizer="adamw", lr=3e-3, beta2=0.95))
    policy = tmp_path / "searched.yaml"  # as a search exports it
    provenance = {**searched, "warm_start_lr": 2e-3}
    save_policy(PrecisionPolicy(default="bf16", provenance=provenance), policy)
    args = ["verify", str(policy), "--model", "mlp", "--dataset", "digits", "--steps", "4"]
    args += ["--seeds", "1", "--arms", "fp32", "--device", "cpu", "--no-mlflow"]
    assert main([*args, "--out", str(tmp_path / "a.yaml")]) == 0
    assert optimizers_made == [("training/run", "AdamW", 2e-3)] * 2
    optimizers_made.clear()
    assert main([*args, "--lr", "1e-3", "--out", str(tmp_path / "b.yaml")]) == 0
    assert optimizers_made == [("training/run", "AdamW", 1e-3)] * 2


def test_a_resumed_scheduled_adamw_run_ends_as_an_uninterrupted_one(tmp_path):
    """The schedule's place and AdamW's moments survive a checkpoint: stopped after step 3 of
    8 and resumed, the losses and weights are those of the run that never stopped."""
    from autoprec.data import load_dataset_for
    from autoprec.models import load_model
    from autoprec.policy import PrecisionPolicy
    from autoprec.training.run import train

    recipe = TrainingRecipe(optimizer="adamw", lr=3e-3, warmup_steps=2, schedule="cosine")

    def run(folder: str, **extra):
        spec = load_model("mlp", seed=0)
        data = load_dataset_for(spec, "digits", seed=0)
        settings = dict(steps=8, recipe=recipe, device="cpu", checkpoint_dir=tmp_path / folder)
        return spec, train(spec, data, PrecisionPolicy(), **settings, **extra)

    spec, whole = run("whole")

    steps: list[int] = []  # the steps done, told by the log
    with pytest.raises(KeyboardInterrupt):  # TrainInterrupted, at the boundary after step 3
        run("split", stop=lambda: len(steps) >= 3, log=lambda step, m: steps.append(step))
    resumed_spec, resumed = run("split")
    assert resumed.resumed_from == 3
    assert resumed.train_loss == whole.train_loss
    for key, value in spec.module.state_dict().items():
        assert torch.equal(value, resumed_spec.module.state_dict()[key]), key
