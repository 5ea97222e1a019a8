"""`autoprec search`: export, Pareto files, config, clear errors, SIGTERM and resume."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest

from autoprec.cli import main
from autoprec.models import load_model
from autoprec.policy.io import load_policy


def validate(policy, model) -> None:
    report = policy.validate(model)
    assert report.ok, report.problems


CLI = [sys.executable, "-c", "import sys; from autoprec.cli import main; sys.exit(main())"]
FAST = ["--model", "tinycnn", "--steps", "4", "--train-batch-size", "32"]


@pytest.fixture(autouse=True)
def _private(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOPREC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.chdir(tmp_path)  # the default Optuna storage lands here


def test_random_search_exports_a_valid_best_policy_and_pareto_files(tmp_path, capsys):
    out, pareto = tmp_path / "out" / "best.yaml", tmp_path / "pareto"
    rc = main(
        ["search", *FAST, "--agent", "random", "--budget", "3"]
        + ["--out", str(out), "--pareto-dir", str(pareto)]
    )
    assert rc == 0, capsys.readouterr().err
    policy = load_policy(out)
    model = load_model("tinycnn", num_classes=10).module
    validate(policy, model)  # names and fingerprint match the model
    assert policy.provenance["agent"] == "random" and policy.provenance["interrupted"] == "false"
    # numbers stay numbers, and the model is named (issue 34's messages)
    assert policy.provenance["budget"] == 3 and isinstance(policy.provenance["trial"], int)
    assert policy.model.name == "tinycnn"
    assert {"speedup", "loss_delta"} <= set(policy.metrics)
    rows = (pareto / "pareto.csv").read_text().splitlines()
    assert rows[0].startswith("file,") and len(rows) >= 2
    for line in rows[1:]:
        validate(load_policy(pareto / line.split(",")[0]), model)
    trials = (pareto / "trials.csv").read_text().splitlines()
    assert len(trials) >= 4  # header + 3 real trials
    err = capsys.readouterr().err
    assert "optimising for h100-sxm" in err and "best policy" in err and "phases:" in err
    assert "sensitivity: sweep of all 4 layers" in err  # the method chosen, and why
    # off a terminal, plain progress lines (no rich bar drawn once, cut off, at the end)
    assert "search: 1/3 evaluations (" in err and "search: 3/3 evaluations" in err
    assert "ETA" not in err


def test_config_file_with_flags_overriding(tmp_path, capsys):
    cfg = tmp_path / "search.yaml"
    cfg.write_text("model: tinycnn\nagent: baseline\nbudget: 9\nsteps: 4\ntrain-batch-size: 32\n")
    rc = main(["search", "--config", str(cfg), "--budget", "2", "--out", str(tmp_path / "b.yaml")])
    assert rc == 0
    text = (tmp_path / "b.trials.csv").read_text().splitlines()
    assert len(text) == 3  # the flag's budget (2), not the file's (9)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--agent", "nosuch"], "nosuch"),
        (["--target", "h900"], "h900"),
        (["--target", "a100-40gb-sxm", "--precisions", "fp32,fp8"], "cannot run fp8"),
        (["--out", "/proc/forbidden/best.yaml"], "cannot write"),
        (["--budget", "0"], "--budget"),
    ],
)
def test_bad_input_is_one_line_and_status_2(args, message):
    proc = subprocess.run(
        [*CLI, "search", *FAST, *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


def test_bad_config_key_is_status_2(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: tinycnn\nbudgett: 3\n")
    assert main(["search", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "unknown key 'budgett'" in err and "budget" in err


def _complete(storage: str, name: str) -> int:
    try:
        study = optuna.load_study(study_name=name, storage=storage)
    except KeyError:
        return 0
    states = (optuna.trial.TrialState.COMPLETE,)
    return len(study.get_trials(deepcopy=False, states=states))


def _tpe_search(storage: str, study: str) -> list[str]:
    """An `autoprec search --agent tpe` process of budget 6 on ``storage``/``study``."""
    return [*CLI, "search", *FAST, "--agent", "tpe", "--budget", "6"] + [
        "--storage",
        storage,
        "--study-name",
        study,
    ]


@pytest.mark.slow
def test_sigterm_exports_then_resume_finishes_the_budget(tmp_path):
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    out = tmp_path / "best.yaml"
    # long enough trials (click keeps the last --steps) that the signal lands mid-search even
    # on a loaded machine, where reading the study back here can take seconds
    cmd = [*_tpe_search(storage, "killed"), "--out", str(out), "--steps", "500"]
    env = {**os.environ}
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while _complete(storage, "killed") < 2 and time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read()
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "interrupted" in err
    done = _complete(storage, "killed")
    assert 2 <= done < 6
    assert load_policy(out).provenance["interrupted"] == "true"

    resumed = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert _complete(storage, "killed") == 6  # the finished trials were kept, none repeated
    assert load_policy(out).provenance["interrupted"] == "false"
    study = optuna.load_study(study_name="killed", storage=storage)
    complete = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    keys = [tuple(sorted(t.params.items())) for t in complete]
    assert len(set(keys)) == len(keys)  # no policy evaluated twice
    assert Path(out).exists()


@pytest.mark.slow
def test_two_workers_share_one_study(tmp_path):
    storage = f"sqlite:///{tmp_path / 'shared.db'}"
    cmd = _tpe_search(storage, "shared")
    workers = [
        subprocess.Popen(
            [*cmd, "--out", str(tmp_path / f"w{i}.yaml")],
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    for w in workers:
        _, err = w.communicate(timeout=300)
        assert w.returncode == 0, err
    study = optuna.load_study(study_name="shared", storage=storage)
    complete = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(complete) == 6  # none lost, none beyond the budget
    keys = [tuple(sorted(t.params.items())) for t in complete]
    assert len(set(keys)) == len(keys)  # none duplicated
    assert (tmp_path / "w0.yaml").exists() and (tmp_path / "w1.yaml").exists()


def test_search_reports_the_best_hand_written_fp8_rule(tmp_path, capsys):
    """Where fp8 runs on the model's Linears, the searched policy is set beside the best of the
    hand-written fp8 rules (torchao's auto filter, fp8 except the head, first/last in bf16)."""
    pytest.importorskip("torchao.float8")
    args = ["search", "--model", "tinytransformer", "--dataset", "synthetic", "--steps", "2"]
    rc = main([*args, "--agent", "random", "--budget", "2", "--out", str(tmp_path / "b.yaml")])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert "hand rules:" in err  # the phase: the rules were evaluated
    text = " ".join(err.split())  # the console wraps long lines
    line = text[text.index("the best of") :]
    assert "hand-written rules" in line and "reward" in line
    # at these tiny shapes fp8's casts cost more than its GEMMs save: the rule is slower than
    # fp32, and a search with any sense beats it
    assert "better than the best of" in text and "not better than" not in text


@pytest.mark.slow
def test_workers_evaluate_side_by_side_and_the_search_ends_as_usual(tmp_path, capsys):
    out = tmp_path / "best.yaml"
    args = ["search", *FAST, "--budget", "3", "--workers", "2", "--out", str(out), "--no-mlflow"]
    rc = main(args)
    err = capsys.readouterr().err
    assert rc == 0, err
    assert "evaluating 2 policies at a time" in " ".join(err.split())
    assert "Traceback" not in err
    policy = load_policy(out)
    validate(policy, load_model("tinycnn", num_classes=10).module)
    assert policy.provenance["agent"] == "ppo"
