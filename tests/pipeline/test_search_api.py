"""The search as a library call (issue 35): ``autoprec.search(autoprec.SearchConfig(...))``
runs what ``autoprec search`` runs and writes the same export; the config checks its fields in
one line and holds the command's defaults; the recipe flags reach ``SearchConfig.recipe``."""

from __future__ import annotations

import contextlib

import pytest
from search_helpers import Lines

import autoprec
from autoprec.cli import main
from autoprec.pipeline import SearchConfig, SearchReport, SearchSetupError
from autoprec.pipeline.config import DEFAULTS
from autoprec.policy.io import load_policy
from autoprec.training.recipe import TrainingRecipe

#: Provenance that differs between two runs of the same search (the time it was written).
VARYING = {"created"}


def _comparable(path) -> dict:
    policy = load_policy(path).to_dict()
    policy["provenance"] = {k: v for k, v in policy["provenance"].items() if k not in VARYING}
    return policy


def test_the_library_search_writes_the_same_export_as_the_command(tmp_path, monkeypatch):
    told = Lines()
    report = autoprec.search(
        autoprec.SearchConfig(model="mlp", agent="random", budget=1, mlflow=False, out="p.yaml"),
        told,
    )
    assert isinstance(report, SearchReport) and not report.interrupted
    assert report.policy_path is not None and report.policy_path.name == "p.yaml"
    assert report.written["policy"] == report.policy_path and report.written["trials"].exists()
    assert report.config.target == "h100-sxm" and report.config.dataset == "teacher"
    assert list(report.phase_times)[:3] == [
        "model and data", "warm start and fp32 reference", "sensitivity",
    ]  # fmt: skip
    assert {"search", "AMP comparison", "export", "total"} <= set(report.phase_times)
    assert report.amp is not None and report.amp.verdict in told.lines
    assert any(line.startswith("best policy -> p.yaml") for line in told.lines)
    assert told.phases[0] == "model and data" and report.phases_line().startswith("phases: ")

    monkeypatch.setenv("AUTOPREC_CACHE_DIR", str(tmp_path / "cli-cache"))  # computed again
    argv = ["search", "--model", "mlp", "--agent", "random", "--budget", "1", "--no-mlflow"]
    assert main([*argv, "--out", "c.yaml"]) == 0
    library, command = _comparable(tmp_path / "p.yaml"), _comparable(tmp_path / "c.yaml")
    assert library == command
    assert library["layers"] and library["metrics"]["speedup"] > 0


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"agent": "bogus"}, "agent: 'bogus' is not one of ppo"),
        ({"budget": 0}, "budget must be an integer between 1 and 10,000"),
        ({"budget": True}, "budget: expected an integer; got True (bool)"),
        ({"precisions": "fp32,bf8"}, "precisions: unknown precision 'bf8'"),
        ({"precisions": ["fp32", "bf8"]}, "precisions: unknown precision 'bf8'"),
        ({"out": 5}, "out: expected a string (quote it); got 5 (int)"),
        ({"recipe": {"optimizer": "adam"}}, "recipe: optimizer must be one of sgd, adamw"),
    ],
)
def test_a_bad_field_is_one_line_naming_it(fields, needle):
    with pytest.raises(SearchSetupError) as caught:
        SearchConfig(model="mlp", **fields)
    message = str(caught.value)
    assert needle in message and "\n" not in message
    assert isinstance(caught.value, ValueError)


def test_the_defaults_are_the_commands():
    from autoprec.cli.search import search
    from autoprec.cli.search_config import config_from, merge_config

    ctx = search.make_context("search", ["--model", "mlp"])
    assert config_from(merge_config(ctx, dict(ctx.params))) == SearchConfig(model="mlp")
    flags = {p.name: p.default for p in search.params}
    for name, default in DEFAULTS.items():
        flag = {"model": "model_name", "mlflow": "no_mlflow"}.get(name, name)
        if flag in flags:
            assert flags[flag] == (not default if name == "mlflow" else default), name
    assert SearchConfig(model="mlp").recipe == TrainingRecipe()


def test_the_recipe_flags_reach_the_config(tmp_path):
    from autoprec.cli.search import search
    from autoprec.cli.search_config import config_from, merge_config

    path = tmp_path / "search.yaml"
    path.write_text("model: mlp\nrecipe:\n  optimizer: adamw\n  weight_decay: 0.1\n  lr: 0.01\n")
    argv = ["--config", str(path), "--lr", "3e-4", "--warmup-steps", "5", "--schedule", "cosine"]
    ctx = search.make_context("search", argv)
    config = config_from(merge_config(ctx, dict(ctx.params)))
    assert config.recipe == TrainingRecipe(
        optimizer="adamw", lr=3e-4, weight_decay=0.1, warmup_steps=5, schedule="cosine"
    )  # the file's recipe, each flag over it
    assert SearchConfig.from_yaml(path).recipe.lr == 0.01
    assert SearchConfig.from_dict({"model": "mlp", "no_mlflow": True}).mlflow is False
    ctx = search.make_context("search", ["--model", "mlp", "--lr", "-1"])
    with pytest.raises(ValueError, match="--lr must be"):
        config_from(merge_config(ctx, dict(ctx.params)))


def test_a_config_file_key_is_checked_by_the_library(tmp_path):
    path = tmp_path / "search.yaml"
    path.write_text("model: mlp\nbudjet: 3\n")
    needle = r"line 2: unknown key 'budjet'; valid keys: .*budget"
    with pytest.raises(SearchSetupError, match=needle):
        SearchConfig.from_yaml(path)
    with pytest.raises(SearchSetupError, match="unknown key 'budjet'"):
        SearchConfig.from_dict({"model": "mlp", "budjet": 3})


def test_the_search_trains_with_the_configs_recipe(monkeypatch):
    """``run_search`` builds its evaluator with the config's recipe (stopped right there)."""
    import autoprec.pipeline.run as run

    seen = {}

    def capture(workload, device, config):
        seen["recipe"] = config.recipe
        raise KeyboardInterrupt  # an interrupt before any evaluation: nothing to export

    monkeypatch.setattr(run, "build_evaluator", capture)
    recipe = TrainingRecipe(optimizer="adamw", lr=3e-4)
    told = Lines()
    report = run.run_search(SearchConfig(model="mlp", mlflow=False, recipe=recipe), told)
    assert seen["recipe"] == recipe
    assert report.interrupted and report.policy_path is None and report.result is None
    assert "no evaluation finished; nothing to export" in told.lines


class _StopAtFirstTrial(Lines):
    """Ctrl-C as the first evaluation finishes."""

    @contextlib.contextmanager
    def search_progress(self, budget, evaluation_s, at_once):
        class Stop:
            def on_trial(self, trial, result):
                if trial.real:
                    raise KeyboardInterrupt

        yield [Stop()]


def test_an_interrupted_library_search_exports_what_it_found(tmp_path):
    config = SearchConfig(model="mlp", agent="random", budget=3, mlflow=False, out="i.yaml")
    told = _StopAtFirstTrial()
    report = autoprec.search(config, told)
    assert report.interrupted and report.amp is None and "total" not in report.phase_times
    assert report.policy_path is not None and report.policy_path.name == "i.yaml"
    assert load_policy(tmp_path / "i.yaml").provenance["interrupted"] == "true"
    assert "[yellow]interrupted: exporting what was found so far[/]" in told.lines


def test_a_library_search_with_verify_writes_the_verdict_into_the_policy(tmp_path):
    config = SearchConfig(
        model="mlp", agent="random", budget=1, mlflow=False, out="v.yaml", verify=True
    )
    report = autoprec.search(config)
    assert report.verify_status == 0 and "verification" in report.phase_times
    verification = load_policy(tmp_path / "v.yaml").verification
    assert verification is not None and verification.verdict
