"""The measured search end to end on this CPU (issue 37): ``--target cpu`` makes the local
device the target, so the per-layer table is timed (and kept), the finalists are timed as whole
steps side by side, the choice is the best of them so measured, and the export says what was
measured, where and with what."""

from __future__ import annotations

import pytest
import torch
from search_helpers import Lines

from autoprec.cli import main
from autoprec.pipeline import SearchConfig, run_search
from autoprec.policy.io import load_policy


def _config(**fields):
    base = {"model": "tinycnn", "dataset": "digits", "target": "cpu", "agent": "random",
            "budget": 4, "steps": 2, "mlflow": False, "out": "p.yaml", "workers": 0}  # fmt: skip
    return SearchConfig(**{**base, **fields})


def test_the_search_measures_on_the_target_and_the_export_says_so(tmp_path):
    told = Lines()
    report = run_search(_config(), told)
    assert {"per-layer timings", "measured finalists"} <= set(told.phases)
    phases = told.phases
    assert phases.index("per-layer timings") < phases.index("warm start and fp32 reference")
    said = "\n".join(told.lines)
    assert "measuring on this cpu" in said and "4 unique layers, eager, channels_last" in said
    assert "8 layer timings measured now" in said
    assert "finalists timed as whole steps" in said
    result = report.result
    best = result.best
    assert result.chosen == best.number and best.attrs["measured"] == "whole step"
    assert best.metrics.source == "measured"
    finalists = [t for t in result.real_trials if t.attrs.get("measured")]
    assert 1 <= len(finalists) <= 3 and best.reward == max(t.reward for t in finalists)
    assert report.amp.metrics.source == "measured"
    policy = load_policy(tmp_path / "p.yaml")
    assert policy.target.device == "cpu" and policy.target.execution == "eager"
    prov = policy.provenance
    assert prov["measured_device"] == "cpu" and prov["measured_execution"] == "eager"
    assert prov["measured_torch"] == str(torch.__version__)
    assert prov["measured_layers"] == 4 and prov["measured_finalists"] == len(finalists)
    assert prov["measured_fp32_step_s"] > 0 and prov["measured_amp_step_s"] > 0
    assert policy.metrics["speedup"] == pytest.approx(best.metrics.speedup, rel=1e-5)
    # the whole steps join this device's measurement file, which calibration fits to
    from autoprec.cache import cache_dir
    from autoprec.hardware.measurements import read_measurements

    steps = cache_dir() / "timing" / "cpu-steps.json"
    device, rows = read_measurements(steps)
    assert device == "cpu" and [r.label for r in rows[:2]] == ["tinycnn / fp32", "tinycnn / AMP"]
    assert len(rows) == 2 + len(finalists) and rows[0].build == {"num_classes": 10, "image_size": 8}
    assert all(r.execution == "eager" and r.memory_format == "channels_last" for r in rows)
    assert f"autoprec hardware calibrate --from {steps}" in said
    # a second search on this machine times no layer again: the table is kept
    again = Lines()
    run_search(_config(out="q.yaml", seed=1, budget=1), again)
    assert "0 layer timings all stored from an earlier search" in "\n".join(again.lines)
    assert len(read_measurements(steps)[1]) > len(rows)  # added to, not replaced
    assert main(["hardware", "calibrate", "--from", str(steps), "--output", "cal.json"]) == 0
    assert (tmp_path / "cal.json").exists()


def test_the_cost_model_prices_when_asked(tmp_path):
    told = Lines()
    run_search(_config(pricing="model", budget=1), told)
    assert "per-layer timings" not in told.phases and "measured finalists" not in told.phases
    policy = load_policy(tmp_path / "p.yaml")
    assert policy.target.execution is None
    assert not any(k.startswith("measured_") for k in policy.provenance)


def test_the_command_line_names_the_program_and_the_pricing(tmp_path, capsys):
    argv = ["search", "--model", "tinycnn", "--dataset", "digits", "--no-mlflow", "--budget", "1"]
    assert main([*argv, "--target", "h100-sxm", "--pricing", "measured"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("autoprec: error: pricing 'measured' times this machine's device")
    assert len(err.splitlines()) == 1
    assert main([*argv, "--execution", "jit"]) == 2
    assert "'jit' is not one of 'eager', 'compiled'" in capsys.readouterr().err
    out = tmp_path / "c.yaml"
    code = main([*argv, "--target", "h100-sxm", "--execution", "compiled", "--out", str(out)])
    assert code == 0
    assert load_policy(out).target.execution == "compiled"
