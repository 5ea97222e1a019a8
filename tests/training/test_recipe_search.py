"""The recipe of ``autoprec search`` reaches every phase that trains: the warm start, the
fine-tunes and the verification."""

from __future__ import annotations

from autoprec.training.recipe import TrainingRecipe, from_provenance


def test_a_search_warm_starts_fine_tunes_and_verifies_with_its_recipe(
    optimizers_made, monkeypatch, tmp_path
):
    """`autoprec search --optimizer adamw --lr 3e-4 --verify`: every phase trains with AdamW,
    the warm start and the verification at 3e-4, the fine-tunes at a fifth of it."""
    from autoprec.cli import main
    from autoprec.policy.io import load_policy

    monkeypatch.setenv("AUTOPREC_CACHE_DIR", str(tmp_path / "cache"))
    made = optimizers_made
    out = tmp_path / "p.yaml"
    args = ["search", "--model", "mlp", "--optimizer", "adamw", "--lr", "3e-4", "--agent"]
    args += ["random", "--budget", "1", "--no-mlflow", "--verify", "--out", str(out)]
    assert main(args) == 0
    phases = {}
    for where, optimizer, rate in made:
        phases.setdefault(where, set()).add((optimizer, round(rate, 12)))
    assert phases == {
        "training/pretrain": {("AdamW", 3e-4)},  # the warm start
        "evaluate/finetune": {("AdamW", 6e-5)},  # every fine-tune
        "training/run": {("AdamW", 3e-4)},  # every run of the verification
    }
    policy = load_policy(out)
    assert policy.verification is not None
    assert from_provenance(policy.provenance) == TrainingRecipe(optimizer="adamw", lr=3e-4)
