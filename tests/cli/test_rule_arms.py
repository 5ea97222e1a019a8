"""The hand rules as policy files (``search --pareto-dir`` writes ``rules/``), and ``autoprec
verify --arms`` training them beside the export: the export against the rules over whole runs."""

from __future__ import annotations

import pytest
import torch

from autoprec.cli import main
from autoprec.policy.io import load_policy

FAST = ["--model", "mlp", "--target", "h100-sxm", "--steps", "2", "--train-batch-size", "32"]


@pytest.fixture(autouse=True)
def _private(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOPREC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_the_rules_a_search_wrote_are_arms_of_a_verification(tmp_path, capsys):
    out, pareto = tmp_path / "best.yaml", tmp_path / "pareto"
    args = ["search", *FAST, "--agent", "random", "--budget", "1", "--no-mlflow"]
    assert main([*args, "--out", str(out), "--pareto-dir", str(pareto)]) == 0
    written = capsys.readouterr().err
    rules = sorted((pareto / "rules").glob("*.yaml"))
    assert rules and "hand-rule policies ->" in written
    rule = load_policy(rules[0])
    assert rule.model is not None and rule.model.name == "mlp"
    assert any(p.value == "fp8" for p in rule.layers.values())  # a rule lowers some layer
    arms = f"fp32,{rules[0]}"
    verify = ["verify", str(out), "--model", "mlp", "--steps", "3", "--seeds", "1", "--no-mlflow"]
    assert main([*verify, "--arms", arms, "--out", str(tmp_path / "v.yaml")]) == 0
    table = capsys.readouterr().out
    assert str(rules[0]) in table  # the rule's arm has its row


def test_an_arm_that_is_neither_a_precision_nor_a_policy_file_is_one_line(tmp_path, capsys):
    policy = tmp_path / "p.yaml"
    policy.write_text("autoprec_policy: 1\ndefault: fp32\n")
    verify = ["verify", str(policy), "--model", "mlp", "--steps", "1", "--no-mlflow"]
    assert main([*verify, "--arms", "fp32,missing.yaml"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "unknown arm 'missing.yaml'" in err
